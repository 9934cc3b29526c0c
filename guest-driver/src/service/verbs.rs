//! The VM's own RDMA device, as rdma_cm reports it: the verbs device and port whose
//! RoCE v2 GID table holds the pvcm device's GID (rdma_rxe on the VM's NIC in tests, a
//! passed-through VF in production).
//!
//! librdmacm opens the verbs device that QUERY_ROUTE names (node GUID, device index),
//! takes `port_num` as its port, and puts the GID table index of the bound address into
//! its address handles; so the service must name the device whose GID *is* the VM's
//! pvcm GID. [`RdmaPort::find`] reads it from sysfs:
//! `class/infiniband/DEV/node_guid`, `ports/N/gids/I`, `ports/N/gid_attrs/types/I`
//! (`RoCE v2`), `ports/N/gid_attrs/ndevs/I` (the netdev), and the netdev's `mtu`.
//!
//! The device, its GID table and the netdev's MTU change while the service runs (rxe
//! removed and added again, a VF hot-plugged around a migration, an address taken off
//! and put back): [`PortView::read`] reads them again, among the devices the kernel
//! has registered (`nldev.rs`), with the VM's other RoCE v2 addresses and the netdev's
//! link, for the rdma_cm layer to follow (`Cma::update_port`).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use pvcm_wire::Gid;

/// librdmacm's "no device index" (`UCMA_INVALID_IB_INDEX`): it then matches the device
/// by its GUID alone.
pub const NO_DEVICE_INDEX: u32 = u32::MAX;

/// IBTA MTU codes.
pub mod mtu {
    pub use pvcm_wire::abi::{MTU_256, MTU_512, MTU_1024, MTU_2048, MTU_4096};
}

/// The IBTA path MTU for a RoCE netdev MTU, as Linux's `iboe_get_mtu()`; 0 below 256.
pub fn iboe_mtu(netdev_mtu: u32) -> u8 {
    pvcm_wire::abi::iboe_mtu(netdev_mtu).unwrap_or(0)
}

/// The VM's RDMA port for its pvcm GID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaPort {
    /// Device name (`rxe0`).
    pub device: String,
    /// Port number (1-based).
    pub port_num: u8,
    /// The node GUID.
    pub node_guid: u64,
    /// The device's index (the kernel's; [`NO_DEVICE_INDEX`] when not known).
    pub ibdev_index: u32,
    /// The GID (the pvcm device's).
    pub gid: Gid,
    /// Its index in the port's GID table.
    pub gid_index: u8,
    /// The address the GID stands for.
    pub addr: IpAddr,
    /// The netdev the GID belongs to.
    pub netdev: String,
    /// Path MTU for routes over it (IBTA code, from the netdev's MTU).
    pub path_mtu: u8,
    /// The TOS of ids that set none (the kernel's per-port `default_roce_tos`, set in
    /// configfs there; `pvcm-guestd --default-roce-tos` here).
    pub default_roce_tos: u8,
    /// The default P_Key and its index.
    pub pkey: u16,
    /// The default P_Key's index.
    pub pkey_index: u16,
    /// The VM's further GIDs the backend serves (PORT_INFO's), those this port's GID
    /// table holds as RoCE v2, with their indices; a further GID elsewhere (another
    /// device or port) is not served here and stays one of the VM's other addresses.
    pub more: Vec<ServedGid>,
}

/// A further GID of the VM the backend serves, in the port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedGid {
    /// The GID.
    pub gid: Gid,
    /// Its index in the port's GID table.
    pub gid_index: u8,
    /// The address it stands for.
    pub addr: IpAddr,
}

impl RdmaPort {
    /// The primary GID (the pvcm device's) as a served one.
    pub fn primary(&self) -> ServedGid {
        ServedGid {
            gid: self.gid,
            gid_index: self.gid_index,
            addr: self.addr,
        }
    }

    /// Every GID the port serves for the VM, the primary first.
    pub fn served(&self) -> impl Iterator<Item = ServedGid> + '_ {
        std::iter::once(self.primary()).chain(self.more.iter().copied())
    }

    /// The served GID whose address is `ip` (an IPv4-mapped IPv6 address matches its
    /// IPv4 one).
    pub fn served_addr(&self, ip: IpAddr) -> Option<ServedGid> {
        let ip = match ip {
            IpAddr::V6(v) => v.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.served().find(|s| s.addr == ip)
    }

    /// The table index of `gid` if the port serves it, else the primary's.
    pub fn index_of(&self, gid: Gid) -> u8 {
        self.served()
            .find(|s| s.gid == gid)
            .map_or(self.gid_index, |s| s.gid_index)
    }
}

/// Why no port was found.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// No RoCE v2 entry with the GID.
    #[error(
        "no RDMA device under {root} has {gid} as a RoCE v2 GID: give the VM's NIC the \
         address {addr} and an RDMA device on it (rdma link add rxe0 type rxe netdev \
         eth0, or a passed-through VF)"
    )]
    NotFound {
        /// sysfs root searched.
        root: String,
        /// The GID.
        gid: Gid,
        /// The address it stands for.
        addr: String,
    },
    /// The GID is not an IP address's (RoCE v2 GIDs are).
    #[error("GID {0} is not an IPv4-mapped or IPv6 address")]
    NotIp(Gid),
}

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// Parses sysfs's `xxxx:xxxx:xxxx:xxxx` node GUID.
pub fn parse_guid(s: &str) -> Option<u64> {
    let hex: String = s.trim().split(':').collect();
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(&hex, 16).ok()
}

/// Parses sysfs's GID form (eight colon-separated 16-bit groups).
pub fn parse_sysfs_gid(s: &str) -> Option<Gid> {
    let hex: String = s.trim().split(':').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(Gid(g))
}

/// The address a RoCE v2 GID stands for.
pub fn gid_addr(gid: Gid) -> Option<IpAddr> {
    match gid.to_ipv4() {
        Some(a) => Some(IpAddr::V4(a)),
        None if gid.0 != [0; 16] => Some(IpAddr::V6(std::net::Ipv6Addr::from(gid.0))),
        None => None,
    }
}

/// The RDMA devices under `sysfs` (path and name), sorted, limited to `only` when given.
fn sysfs_devices(sysfs: &Path, only: Option<&BTreeSet<String>>) -> Vec<(PathBuf, String)> {
    let Ok(rd) = fs::read_dir(sysfs.join("class/infiniband")) else {
        return Vec::new();
    };
    let mut v: Vec<(PathBuf, String)> = rd
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_str()?.to_string();
            Some((e.path(), name))
        })
        .filter(|(_, n)| only.is_none_or(|o| o.contains(n)))
        .collect();
    v.sort();
    v
}

/// A device's ports (path and number), sorted.
fn ports(dev: &Path) -> Vec<(PathBuf, u8)> {
    let Ok(rd) = fs::read_dir(dev.join("ports")) else {
        return Vec::new();
    };
    let mut v: Vec<(PathBuf, u8)> = rd
        .filter_map(|e| {
            let e = e.ok()?;
            let n = e.file_name().to_str()?.parse::<u8>().ok()?;
            Some((e.path(), n))
        })
        .collect();
    v.sort_by_key(|p| p.1);
    v
}

/// One RoCE v2 entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GidEntry {
    index: u16,
    gid: Gid,
    netdev: String,
}

/// Unused entries in a row after which a GID table is read no further. The kernel
/// gives a new GID the lowest free index (`find_gid()`'s first empty entry), so the
/// used entries sit at the start with the holes deletions left; rxe's table has 1024
/// entries, a file each, which all read would cost about a second of CPU in a TCG VM.
pub const GID_SCAN_GAP: usize = 64;

/// The RoCE v2 entries of a port's GID table, by index, up to [`GID_SCAN_GAP`] unused
/// entries in a row.
fn roce_v2_entries(port: &Path) -> Vec<GidEntry> {
    let Ok(gids) = fs::read_dir(port.join("gids")) else {
        return Vec::new();
    };
    let mut idx: Vec<u16> = gids
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    idx.sort_unstable();
    let mut unused = 0;
    idx.into_iter()
        .map_while(|i| {
            let gid = read_trim(&port.join(format!("gids/{i}"))).and_then(|s| parse_sysfs_gid(&s));
            match gid {
                Some(g) if g.0 != [0; 16] => unused = 0,
                _ => unused += 1,
            }
            (unused <= GID_SCAN_GAP).then_some((i, gid))
        })
        .filter_map(|(i, gid)| {
            let gid = gid.filter(|g| g.0 != [0; 16])?;
            let ty = read_trim(&port.join(format!("gid_attrs/types/{i}")))?;
            if !ty.eq_ignore_ascii_case("RoCE v2") {
                return None;
            }
            let netdev = read_trim(&port.join(format!("gid_attrs/ndevs/{i}"))).unwrap_or_default();
            Some(GidEntry {
                index: i,
                gid,
                netdev,
            })
        })
        .collect()
}

/// A netdev's link layer: its hardware address and whether it is a bond (the kernel's
/// rdma_cm reports a bond's failover to the ids bound to it, `ADDR_CHANGE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// The hardware address (`class/net/NETDEV/address`).
    pub hw_addr: String,
    /// A bond master (`class/net/NETDEV/bonding` exists).
    pub bond: bool,
}

impl Link {
    /// The link of `netdev` under `sysfs`; `None` when the netdev is not there.
    pub fn read(sysfs: &Path, netdev: &str) -> Option<Link> {
        if netdev.is_empty() {
            return None;
        }
        let dir = sysfs.join("class/net").join(netdev);
        Some(Link {
            hw_addr: read_trim(&dir.join("address"))?,
            bond: dir.join("bonding").is_dir(),
        })
    }
}

/// The VM's RDMA side as it is now, for the pvcm GID: what the service re-reads while
/// it runs ([`PortView::read`]) and hands to the rdma_cm layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortView {
    /// The registered RDMA devices.
    pub devices: BTreeSet<String>,
    /// The kernel's index of the port's device, when RDMA netlink gave it: a device
    /// deleted and added again between two looks has another.
    pub index: Option<u32>,
    /// The port whose GID table holds the pvcm GID as RoCE v2, among them (with the
    /// further GIDs it holds).
    pub port: Option<RdmaPort>,
    /// The link of that port's netdev.
    pub link: Option<Link>,
    /// The addresses of the other RoCE v2 GIDs of those devices: the VM's other
    /// addresses, which the pvcm device does not serve.
    pub other_addrs: BTreeSet<IpAddr>,
}

impl PortView {
    /// Reads the view under `sysfs` for `gid` and the further GIDs `more`; `devices`
    /// are the registered devices (RDMA netlink), or `None` to take every device sysfs
    /// lists.
    pub fn read(
        sysfs: &Path,
        gid: Gid,
        more: &[Gid],
        registered: Option<&BTreeMap<String, u32>>,
    ) -> PortView {
        let devices: Option<BTreeSet<String>> = registered.map(|r| r.keys().cloned().collect());
        let listed = sysfs_devices(sysfs, devices.as_ref());
        let port = RdmaPort::find_among(sysfs, gid, more, devices.as_ref()).ok();
        let link = port.as_ref().and_then(|p| Link::read(sysfs, &p.netdev));
        let served: Vec<Gid> = port
            .as_ref()
            .map_or_else(|| vec![gid], |p| p.served().map(|s| s.gid).collect());
        let other_addrs = listed
            .iter()
            .flat_map(|(dev, _)| ports(dev))
            .flat_map(|(p, _)| roce_v2_entries(&p))
            .filter(|e| !served.contains(&e.gid))
            .filter_map(|e| gid_addr(e.gid))
            .collect();
        let index = port
            .as_ref()
            .and_then(|p| registered.and_then(|r| r.get(&p.device)).copied());
        PortView {
            devices: devices.unwrap_or_else(|| listed.into_iter().map(|(_, n)| n).collect()),
            index,
            port,
            link,
            other_addrs,
        }
    }
}

/// What the service watches while it runs: the VM's RDMA side for the pvcm GID.
///
/// A GID table is long (rxe's has 1024 entries, a file each), so it is read again only
/// when a cheap look says something moved: the registered devices (RDMA netlink), the
/// VM's interface addresses and hardware addresses (`getifaddrs`), the port's
/// netdev's MTU. The kernel fills a GID table a moment after an address changes, so
/// after a move the table is read again for [`SETTLE`] more looks.
#[derive(Debug, Clone)]
pub struct PortWatch {
    /// Where sysfs is.
    pub sysfs: PathBuf,
    /// The pvcm GID.
    pub gid: Gid,
    /// The VM's further GIDs the backend serves (PORT_INFO's).
    pub more_gids: Vec<Gid>,
    /// How often to look.
    pub every: std::time::Duration,
    last: Option<Fingerprint>,
    settle: u32,
    netdev: String,
    /// Ask RDMA netlink for the registered devices (sysfs is the system's own).
    netlink: bool,
    /// Looks taken.
    pub looks: u64,
    /// Looks that read the GID tables.
    pub reads: u64,
}

/// Looks after a move during which the GID table is read again.
pub const SETTLE: u32 = 10;

/// The cheap look: what moves when the device, an address or the link changes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint {
    devices: Option<BTreeMap<String, u32>>,
    addrs: Vec<(String, String)>,
    mtu: Option<String>,
}

impl PortWatch {
    /// Watches the port of `gid` under `sysfs`, looking every `every`. RDMA netlink
    /// speaks for the system's own devices: a `sysfs` other than `/sys` (a test's tree)
    /// is read alone.
    pub fn new(sysfs: PathBuf, gid: Gid, every: std::time::Duration) -> PortWatch {
        PortWatch {
            netlink: sysfs == Path::new("/sys"),
            sysfs,
            gid,
            more_gids: Vec::new(),
            every,
            last: None,
            settle: 0,
            netdev: String::new(),
            looks: 0,
            reads: 0,
        }
    }

    /// The view now when something may have moved since the last look, or `always`
    /// (the port is missing: the kernel may fill the table any time); `None` when
    /// nothing did. The devices are those RDMA netlink lists as registered, or every
    /// device sysfs lists when netlink cannot be asked.
    pub fn view(&mut self, always: bool) -> Option<PortView> {
        let devices = match self.netlink.then(super::nldev::registered_devices) {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => {
                tracing::debug!(error = %e, "RDMA netlink: taking the devices sysfs lists");
                None
            }
        };
        self.looks += 1;
        let f = Fingerprint {
            devices: devices.clone(),
            addrs: interface_addrs(),
            mtu: read_trim(&self.sysfs.join(format!("class/net/{}/mtu", self.netdev))),
        };
        if self.last.as_ref() != Some(&f) {
            self.settle = SETTLE;
        } else if self.settle > 0 {
            self.settle -= 1;
        } else if !always {
            return None;
        }
        self.last = Some(f);
        self.reads += 1;
        let v = PortView::read(&self.sysfs, self.gid, &self.more_gids, devices.as_ref());
        if let Some(p) = &v.port {
            self.netdev.clone_from(&p.netdev);
        }
        Some(v)
    }
}

/// The VM's interfaces' addresses and hardware addresses (`getifaddrs`), as text, sorted.
fn interface_addrs() -> Vec<(String, String)> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head to the pointer it is given, or fails.
    if unsafe { libc::getifaddrs(&raw mut head) } != 0 {
        return Vec::new();
    }
    let mut v = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is an element of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: the name is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: `ifa_addr` is non-null and points at a sockaddr of the family it
        // names; each arm reads the structure of that family.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let a = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                    std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).to_string()
                }
                libc::AF_INET6 => {
                    let a = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                    std::net::Ipv6Addr::from(a.sin6_addr.s6_addr).to_string()
                }
                libc::AF_PACKET => {
                    let a = &*ifa.ifa_addr.cast::<libc::sockaddr_ll>();
                    let n = usize::from(a.sll_halen).min(a.sll_addr.len());
                    a.sll_addr[..n].iter().map(|b| format!("{b:02x}")).collect()
                }
                _ => continue,
            }
        };
        v.push((name, addr));
    }
    // SAFETY: `head` came from getifaddrs and is freed once, after the last use.
    unsafe { libc::freeifaddrs(head) };
    v.sort();
    v
}

impl RdmaPort {
    /// Finds the port whose GID table has `gid` as a RoCE v2 entry, under `sysfs`
    /// (normally `/sys`), among every device sysfs lists, with those of the further
    /// GIDs `more` its table holds too.
    pub fn find(sysfs: &Path, gid: Gid, more: &[Gid]) -> Result<RdmaPort, PortError> {
        Self::find_among(sysfs, gid, more, None)
    }

    /// [`RdmaPort::find`] among the devices named in `devices` only (the registered
    /// ones), or every device sysfs lists when `None`.
    pub fn find_among(
        sysfs: &Path,
        gid: Gid,
        more: &[Gid],
        devices: Option<&BTreeSet<String>>,
    ) -> Result<RdmaPort, PortError> {
        let addr = gid_addr(gid).ok_or(PortError::NotIp(gid))?;
        let ib = sysfs.join("class/infiniband");
        let not_found = || PortError::NotFound {
            root: ib.display().to_string(),
            gid,
            addr: addr.to_string(),
        };
        for (dev, name) in sysfs_devices(sysfs, devices) {
            for (port, port_num) in ports(&dev) {
                let entries = roce_v2_entries(&port);
                let Some(e) = entries.iter().find(|e| e.gid == gid).cloned() else {
                    continue;
                };
                let served = more
                    .iter()
                    .filter_map(|g| {
                        let m = entries.iter().find(|e| e.gid == *g)?;
                        Some(ServedGid {
                            gid: *g,
                            gid_index: u8::try_from(m.index).ok()?,
                            addr: gid_addr(*g)?,
                        })
                    })
                    .collect();
                let netdev_mtu = read_trim(&sysfs.join(format!("class/net/{}/mtu", e.netdev)))
                    .and_then(|s| s.parse::<u32>().ok())
                    .unwrap_or(1500);
                let pkey_index = (0..u16::MAX)
                    .map_while(|k| {
                        let p = read_trim(&port.join(format!("pkeys/{k}")))?;
                        Some((k, u16::from_str_radix(p.trim_start_matches("0x"), 16).ok()?))
                    })
                    .find(|&(_, p)| p & 0x7FFF == 0x7FFF)
                    .map_or(0, |(k, _)| k);
                let Ok(gid_index) = u8::try_from(e.index) else {
                    continue;
                };
                return Ok(RdmaPort {
                    device: name,
                    port_num,
                    node_guid: read_trim(&dev.join("node_guid"))
                        .and_then(|s| parse_guid(&s))
                        .unwrap_or(0),
                    ibdev_index: NO_DEVICE_INDEX,
                    gid,
                    gid_index,
                    addr,
                    netdev: e.netdev,
                    path_mtu: iboe_mtu(netdev_mtu),
                    default_roce_tos: 0,
                    pkey: 0xFFFF,
                    pkey_index,
                    more: served,
                });
            }
        }
        Err(not_found())
    }

    /// The node GUID as the kernel hands it to user space: the big-endian GUID's bytes
    /// read as a host u64.
    pub fn node_guid_wire(&self) -> u64 {
        u64::from_le_bytes(self.node_guid.to_be_bytes())
    }
}

/// `rt_tos2priority()`: the packet priority Linux gives an IPv4 TOS (`ip_tos2prio`).
fn tos_priority(tos: u8) -> u8 {
    const PRIO: [u8; 16] = [0, 0, 0, 0, 2, 2, 2, 2, 6, 6, 6, 6, 4, 4, 4, 4];
    PRIO[usize::from((tos & 0x1E) >> 1)]
}

/// `iboe_tos_to_sl()`: a route's SL for `tos` over `netdev`. On a VLAN device the
/// 802.1p priority its egress map (`ip link ... egress-qos-map`, read from
/// `/proc/net/vlan/NETDEV`) gives the TOS's packet priority; 0 on any other device, as
/// the kernel's.
pub fn tos_to_sl(netdev: &str, tos: u8) -> u8 {
    fs::read_to_string(Path::new("/proc/net/vlan").join(netdev))
        .map(|t| sl_from_vlan_map(&t, tos))
        .unwrap_or(0)
}

/// The SL of `tos` from a `/proc/net/vlan/NETDEV` text: the egress map's 802.1p
/// priority (`PRIORITY:QOS` pairs) for the TOS's packet priority; 0 when it maps none.
pub fn sl_from_vlan_map(text: &str, tos: u8) -> u8 {
    let prio = tos_priority(tos);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("EGRESS priority mappings:"))
        .and_then(|m| {
            m.split_whitespace().find_map(|pair| {
                let (p, q) = pair.split_once(':')?;
                (p.parse::<u32>().ok()? == u32::from(prio)).then(|| q.parse::<u8>().ok())?
            })
        })
        .map_or(0, |q| q & 7)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tos_maps_to_the_vlan_egress_priority() {
        let vlan = "eth0.100  VID: 100\t REORDER_HDR: 1  dev->priv_flags: 1001\n\
                    Device: eth0\n\
                    INGRESS priority mappings: 0:0  1:0  2:0  3:0  4:0  5:0  6:0 7:0\n\
                    \x20EGRESS priority mappings: 2:5 6:7 \n";
        // IPTOS_LOWDELAY (0x10): priority 6 (interactive), mapped to 7.
        assert_eq!(sl_from_vlan_map(vlan, 0x10), 7);
        // IPTOS_THROUGHPUT (0x08): priority 2 (bulk), mapped to 5.
        assert_eq!(sl_from_vlan_map(vlan, 0x08), 5);
        // TOS 0: priority 0, not mapped.
        assert_eq!(sl_from_vlan_map(vlan, 0), 0);
        // Only the TOS field counts (rt_tos2priority masks 0x1E): precedence bits above
        // it do not; EF (0xB8) is priority 4, which this map does not name.
        assert_eq!(sl_from_vlan_map(vlan, 0xE0 | 0x10), 7);
        assert_eq!(sl_from_vlan_map(vlan, 0xB8), 0);
        assert_eq!(sl_from_vlan_map("no map here", 0x10), 0);
        assert_eq!(
            sl_from_vlan_map(" EGRESS priority mappings: 6:x 6", 0x10),
            0
        );
        // Not a VLAN device: 0.
        assert_eq!(tos_to_sl("pvcm-no-such-netdev", 0x10), 0);
    }

    fn write(p: &Path, s: &str) {
        if let Some(d) = p.parent() {
            fs::create_dir_all(d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
        }
        fs::write(p, s).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }

    #[test]
    fn finds_the_roce_v2_entry_of_the_gid() {
        let root = std::env::temp_dir().join(format!("pvcm-verbs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let dev = root.join("class/infiniband/rxe0");
        write(&dev.join("node_guid"), "5054:00ff:fe99:000b\n");
        let port = dev.join("ports/1");
        // Index 0: link-local; 1: the address as RoCE v1; 2: as RoCE v2.
        write(
            &port.join("gids/0"),
            "fe80:0000:0000:0000:5054:00ff:fe99:000b",
        );
        write(&port.join("gid_attrs/types/0"), "RoCE v2");
        write(
            &port.join("gids/1"),
            "0000:0000:0000:0000:0000:ffff:0a63:000b",
        );
        write(&port.join("gid_attrs/types/1"), "IB/RoCE v1");
        write(
            &port.join("gids/2"),
            "0000:0000:0000:0000:0000:ffff:0a63:000b",
        );
        write(&port.join("gid_attrs/types/2"), "RoCE v2");
        write(&port.join("gid_attrs/ndevs/2"), "eth0");
        write(&port.join("pkeys/0"), "0xffff");
        write(&root.join("class/net/eth0/mtu"), "9000");
        let gid = Gid::from_ipv4([10, 99, 0, 11].into());
        let p = RdmaPort::find(&root, gid, &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.device.as_str(), p.port_num, p.gid_index), ("rxe0", 1, 2));
        assert_eq!(p.node_guid, 0x5054_00ff_fe99_000b);
        assert_eq!(p.node_guid_wire().to_le_bytes(), p.node_guid.to_be_bytes());
        assert_eq!(p.netdev, "eth0");
        assert_eq!(p.path_mtu, mtu::MTU_4096);
        assert_eq!(p.addr, IpAddr::V4([10, 99, 0, 11].into()));
        let other = Gid::from_ipv4([10, 99, 0, 12].into());
        let e = RdmaPort::find(&root, other, &[]).expect_err("not there");
        assert!(e.to_string().contains("10.99.0.12"), "{e}");
        let _ = fs::remove_dir_all(&root);
    }

    /// A device `rxe0` on `eth0` with `addrs` as RoCE v2 GIDs (index 1, 2, ...) and the
    /// netdev's MTU and hardware address.
    fn fixture(root: &Path, addrs: &[[u8; 4]], mtu: u32, mac: &str) {
        let _ = fs::remove_dir_all(root);
        let port = root.join("class/infiniband/rxe0/ports/1");
        write(
            &root.join("class/infiniband/rxe0/node_guid"),
            "5054:00ff:fe99:000b",
        );
        write(
            &port.join("gids/0"),
            "fe80:0000:0000:0000:5054:00ff:fe99:000b",
        );
        write(&port.join("gid_attrs/types/0"), "RoCE v2");
        write(&port.join("gid_attrs/ndevs/0"), "eth0");
        for (i, a) in addrs.iter().enumerate() {
            let g = Gid::from_ipv4((*a).into()).0;
            let text: Vec<String> = g
                .chunks(2)
                .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
                .collect();
            write(&port.join(format!("gids/{}", i + 1)), &text.join(":"));
            write(&port.join(format!("gid_attrs/types/{}", i + 1)), "RoCE v2");
            write(&port.join(format!("gid_attrs/ndevs/{}", i + 1)), "eth0");
        }
        write(&root.join("class/net/eth0/mtu"), &mtu.to_string());
        write(&root.join("class/net/eth0/address"), mac);
    }

    #[test]
    fn further_gids_in_the_ports_table_are_served_the_others_are_not() {
        let root = std::env::temp_dir().join(format!("pvcm-view-more-{}", std::process::id()));
        let gid = Gid::from_ipv4([10, 99, 0, 11].into());
        let second = Gid::from_ipv4([10, 99, 0, 21].into());
        let absent = Gid::from_ipv4([10, 99, 0, 31].into());
        fixture(
            &root,
            &[[10, 99, 0, 11], [10, 99, 0, 21]],
            1500,
            "52:54:00:99:00:0b",
        );
        let v = PortView::read(&root, gid, &[second, absent], None);
        let p = v.port.clone().unwrap_or_else(|| panic!("no port"));
        assert_eq!(
            p.more,
            vec![ServedGid {
                gid: second,
                gid_index: 2,
                addr: "10.99.0.21".parse().unwrap_or_else(|e| panic!("{e}")),
            }]
        );
        let served: Vec<u8> = p.served().map(|s| s.gid_index).collect();
        assert_eq!(served, [1, 2]);
        assert_eq!(p.index_of(second), 2);
        assert_eq!(
            p.served_addr(
                "::ffff:10.99.0.21"
                    .parse()
                    .unwrap_or_else(|e| panic!("{e}"))
            ),
            Some(p.more[0])
        );
        // The served address is not one of the VM's other addresses any more.
        let other: Vec<String> = v.other_addrs.iter().map(|a| a.to_string()).collect();
        assert_eq!(other, ["fe80::5054:ff:fe99:b"]);
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn the_view_follows_the_gid_table_the_mtu_and_the_registered_devices() {
        let root = std::env::temp_dir().join(format!("pvcm-view-{}", std::process::id()));
        let gid = Gid::from_ipv4([10, 99, 0, 11].into());
        fixture(
            &root,
            &[[10, 99, 0, 11], [10, 99, 0, 21]],
            1500,
            "52:54:00:99:00:0b",
        );
        let v = PortView::read(&root, gid, &[], None);
        let p = v.port.clone().unwrap_or_else(|| panic!("no port"));
        assert_eq!((p.gid_index, p.path_mtu), (1, mtu::MTU_1024));
        assert_eq!(v.devices.iter().collect::<Vec<_>>(), ["rxe0"]);
        // The link-local entry and the second address are the VM's other addresses.
        let other: Vec<String> = v.other_addrs.iter().map(|a| a.to_string()).collect();
        assert_eq!(other, ["10.99.0.21", "fe80::5054:ff:fe99:b"]);
        assert_eq!(
            v.link,
            Some(Link {
                hw_addr: "52:54:00:99:00:0b".into(),
                bond: false
            })
        );
        // The address moved in the table and the MTU changed: the view says so.
        fixture(
            &root,
            &[[10, 99, 0, 21], [10, 99, 0, 11]],
            9000,
            "52:54:00:99:00:0b",
        );
        let p = PortView::read(&root, gid, &[], None)
            .port
            .unwrap_or_else(|| panic!("no port"));
        assert_eq!((p.gid_index, p.path_mtu), (2, mtu::MTU_4096));
        // The address is gone from the table: the device is there, the port is not.
        fixture(&root, &[[10, 99, 0, 21]], 9000, "52:54:00:99:00:0b");
        let v = PortView::read(&root, gid, &[], None);
        assert!(v.port.is_none() && v.devices.contains("rxe0"));
        // A device sysfs still shows but netlink no longer lists (being unregistered)
        // holds nothing.
        fixture(&root, &[[10, 99, 0, 11]], 9000, "52:54:00:99:00:0b");
        let v = PortView::read(&root, gid, &[], Some(&BTreeMap::new()));
        assert!(v.port.is_none() && v.devices.is_empty() && v.other_addrs.is_empty());
        let v = PortView::read(
            &root,
            gid,
            &[],
            Some(&BTreeMap::from([("rxe0".to_string(), 7)])),
        );
        assert!(v.port.is_some());
        assert_eq!(v.index, Some(7));
        // A bond master says so.
        fs::create_dir_all(root.join("class/net/eth0/bonding")).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            PortView::read(&root, gid, &[], None)
                .link
                .is_some_and(|l| l.bond)
        );
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn a_table_is_read_up_to_a_gap_of_unused_entries() {
        let root = std::env::temp_dir().join(format!("pvcm-gap-{}", std::process::id()));
        let gid = Gid::from_ipv4([10, 99, 0, 11].into());
        fixture(&root, &[[10, 99, 0, 21]], 1500, "52:54:00:99:00:0b");
        let port = root.join("class/infiniband/rxe0/ports/1");
        let put = |i: usize, g: &str| {
            write(&port.join(format!("gids/{i}")), g);
            write(&port.join(format!("gid_attrs/types/{i}")), "RoCE v2");
        };
        let zero = "0000:0000:0000:0000:0000:0000:0000:0000";
        let pvcm = "0000:0000:0000:0000:0000:ffff:0a63:000b";
        // A hole of GID_SCAN_GAP unused entries, then the GID: found.
        for i in 2..2 + GID_SCAN_GAP {
            put(i, zero);
        }
        put(2 + GID_SCAN_GAP, pvcm);
        assert!(RdmaPort::find(&root, gid, &[]).is_ok());
        // One more unused entry in the hole: the table is read no further.
        put(2 + GID_SCAN_GAP, zero);
        put(3 + GID_SCAN_GAP, pvcm);
        assert!(RdmaPort::find(&root, gid, &[]).is_err());
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn the_watch_reads_the_table_again_only_after_a_move() {
        let root = std::env::temp_dir().join(format!("pvcm-watch-{}", std::process::id()));
        let gid = Gid::from_ipv4([10, 99, 0, 11].into());
        fixture(&root, &[[10, 99, 0, 11]], 1500, "52:54:00:99:00:0b");
        let mut w = PortWatch::new(root.clone(), gid, std::time::Duration::from_millis(500));
        let first = w
            .view(false)
            .unwrap_or_else(|| panic!("the first look reads"));
        assert!(first.port.is_some());
        // Nothing moves here (but the netdev's MTU, first read once the port names the
        // netdev): the table is read for SETTLE more looks, then no more.
        let reads = (0..3 * SETTLE)
            .take_while(|_| w.view(false).is_some())
            .count();
        assert!(reads <= SETTLE as usize + 1, "{reads}");
        assert!(w.view(false).is_none());
        assert!(
            w.view(true).is_some(),
            "a missing port is looked for at each look"
        );
        // The netdev's MTU moves: the table is read again, with the new MTU.
        write(&root.join("class/net/eth0/mtu"), "9000");
        let v = w.view(false).unwrap_or_else(|| panic!("the MTU moved"));
        assert_eq!(v.port.map(|p| p.path_mtu), Some(mtu::MTU_4096));
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn mtu_and_parsers() {
        assert_eq!(iboe_mtu(1500), mtu::MTU_1024);
        assert_eq!(iboe_mtu(9000), mtu::MTU_4096);
        assert_eq!(iboe_mtu(4200), mtu::MTU_4096);
        assert_eq!(iboe_mtu(4000), mtu::MTU_2048);
        assert_eq!(iboe_mtu(100), 0);
        assert_eq!(
            parse_guid("0002:c903:00aa:0001"),
            Some(0x0002_c903_00aa_0001)
        );
        assert_eq!(parse_guid("zz"), None);
        assert_eq!(parse_sysfs_gid("1:2"), None);
    }
}
