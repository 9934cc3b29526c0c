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

impl RdmaPort {
    /// Finds the port whose GID table has `gid` as a RoCE v2 entry, under `sysfs`
    /// (normally `/sys`).
    pub fn find(sysfs: &Path, gid: Gid) -> Result<RdmaPort, PortError> {
        let addr = gid_addr(gid).ok_or(PortError::NotIp(gid))?;
        let ib = sysfs.join("class/infiniband");
        let not_found = || PortError::NotFound {
            root: ib.display().to_string(),
            gid,
            addr: addr.to_string(),
        };
        let mut devices: Vec<PathBuf> = fs::read_dir(&ib)
            .map_err(|_| not_found())?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        devices.sort();
        for dev in devices {
            let Some(name) = dev.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            let Ok(ports) = fs::read_dir(dev.join("ports")) else {
                continue;
            };
            let mut ports: Vec<PathBuf> = ports.filter_map(|e| e.ok().map(|e| e.path())).collect();
            ports.sort();
            for port in ports {
                let Some(port_num) = port
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.parse::<u8>().ok())
                else {
                    continue;
                };
                if let Some(p) = Self::match_port(&dev, &name, &port, port_num, gid, addr, sysfs) {
                    return Ok(p);
                }
            }
        }
        Err(not_found())
    }

    fn match_port(
        dev: &Path,
        name: &str,
        port: &Path,
        port_num: u8,
        gid: Gid,
        addr: IpAddr,
        sysfs: &Path,
    ) -> Option<RdmaPort> {
        let gids = fs::read_dir(port.join("gids")).ok()?;
        let mut idx: Vec<u16> = gids
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        idx.sort_unstable();
        for i in idx {
            let g = read_trim(&port.join(format!("gids/{i}"))).and_then(|s| parse_sysfs_gid(&s));
            if g != Some(gid) {
                continue;
            }
            let ty = read_trim(&port.join(format!("gid_attrs/types/{i}"))).unwrap_or_default();
            if !ty.eq_ignore_ascii_case("RoCE v2") {
                continue;
            }
            let netdev = read_trim(&port.join(format!("gid_attrs/ndevs/{i}"))).unwrap_or_default();
            let netdev_mtu = read_trim(&sysfs.join(format!("class/net/{netdev}/mtu")))
                .and_then(|s| s.parse::<u32>().ok())
                .unwrap_or(1500);
            let pkey_index = (0..u16::MAX)
                .map_while(|k| {
                    let p = read_trim(&port.join(format!("pkeys/{k}")))?;
                    Some((k, u16::from_str_radix(p.trim_start_matches("0x"), 16).ok()?))
                })
                .find(|&(_, p)| p & 0x7FFF == 0x7FFF)
                .map_or(0, |(k, _)| k);
            return Some(RdmaPort {
                device: name.to_string(),
                port_num,
                node_guid: read_trim(&dev.join("node_guid"))
                    .and_then(|s| parse_guid(&s))
                    .unwrap_or(0),
                ibdev_index: NO_DEVICE_INDEX,
                gid,
                gid_index: u8::try_from(i).ok()?,
                addr,
                netdev,
                path_mtu: iboe_mtu(netdev_mtu),
                default_roce_tos: 0,
                pkey: 0xFFFF,
                pkey_index,
            });
        }
        None
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
        let p = RdmaPort::find(&root, gid).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.device.as_str(), p.port_num, p.gid_index), ("rxe0", 1, 2));
        assert_eq!(p.node_guid, 0x5054_00ff_fe99_000b);
        assert_eq!(p.node_guid_wire().to_le_bytes(), p.node_guid.to_be_bytes());
        assert_eq!(p.netdev, "eth0");
        assert_eq!(p.path_mtu, mtu::MTU_4096);
        assert_eq!(p.addr, IpAddr::V4([10, 99, 0, 11].into()));
        let other = Gid::from_ipv4([10, 99, 0, 12].into());
        let e = RdmaPort::find(&root, other).expect_err("not there");
        assert!(e.to_string().contains("10.99.0.12"), "{e}");
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
