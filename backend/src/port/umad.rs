//! The umad port: CM MADs through a real RDMA device's QP1, via the kernel's user MAD
//! interface (`ib_umad`, `/dev/infiniband/umadN`), as a real HCA carries them.
//!
//! At startup the port opens the umad file of `DEVICE` port `PORT`, switches it to the
//! header with a P_Key index (`IB_USER_MAD_ENABLE_PKEY`) and registers one agent for the
//! CM class (0x07, version 2) on QP1 for the SEND method, the only one CM uses. The
//! kernel's own retries and response matching stay off: every MAD is written with
//! timeout 0 and 0 retries, so the VMs' agents do the retries as on the soft port.
//! When the kernel CM (`ib_cm`) is loaded it owns the class and registration fails:
//! the error says so and how to unload it.
//!
//! Addressing is by GID table index. A VM's GID must be a "RoCE v2" entry of the port's
//! GID table (`/sys/class/infiniband/DEV/ports/N/gids/*`, `gid_attrs/types/*`); the
//! kernel adds one for every IP address of the device's netdev, so a VM's address is
//! added there (docs/umad.md). The index is looked up at startup and again when the VM
//! attaches; a VM whose GID is not in the table is refused at attach. Each MAD goes out
//! with a GRH from the VM's GID index to the remote GID, with the default P_Key's index.
//! On receive the kernel reports the local GID index the frame was addressed to and the
//! sender's GID (from the GRH); the index picks the VM.
//!
//! Bad input is a counted drop, never a panic: a short read (`wire_bad_length`), a MAD
//! of another class (`wire_not_cm`), no GRH (`wire_bad_source`), a MAD for a GID index
//! no VM owns (`wire_unknown_gid`, on the host's counters), a send the kernel refuses
//! (`wire_send_error`).
//!
//! The ABI is `include/uapi/rdma/ib_user_mad.h` (ABI version 5); the layouts below are
//! written from its field list, little-endian hosts.

use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use pvcm_wire::Gid;
use pvcm_wire::mad::{self, MAD_LEN, MGMT_CLASS_CM};
use pvcm_wire::roce::{FRAME_LEN, FrameRepr, GSI_QKEY, GSI_QPN, IpRepr, UDP_PORT, UdpRepr};

use crate::config::gid_addr;

use crate::port::Error;
use crate::port::{Arrivals, InMad, OutMad, PortCtx, PortError, WirePort};
use crate::stats::{DevDrop, Io};

/// `struct ib_user_mad_hdr` with the P_Key index (after `IB_USER_MAD_ENABLE_PKEY`).
pub const HDR_LEN: usize = 64;
/// One CM MAD as read or written: header + 256 bytes.
pub const MSG_LEN: usize = HDR_LEN + MAD_LEN;
/// The CM class version.
pub const CM_CLASS_VERSION: u8 = 2;
/// The SEND method, the only one CM uses.
const METHOD_SEND: u8 = 0x03;
/// Hop limit of the GRH (the IPv4 TTL on RoCEv2), as the kernel CM's paths.
const HOP_LIMIT: u8 = 64;
/// Reads per readiness event before the host loop looks at its other descriptors.
const RX_READS: usize = 1024;
/// MADs per batch handed to the mux.
const RX_BATCH: usize = 64;

/// `struct ib_user_mad_reg_req`: 28 bytes (the method mask is four 4-aligned words).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RegReq {
    id: u32,
    method_mask: [u32; 4],
    qpn: u8,
    mgmt_class: u8,
    mgmt_class_version: u8,
    oui: [u8; 3],
    rmpp_version: u8,
    _pad: u8,
}

const _: () = assert!(std::mem::size_of::<RegReq>() == 28);

const IOC_MAGIC: u64 = 0x1b;
/// `_IOWR(0x1b, 1, struct ib_user_mad_reg_req)`.
const IOCTL_REGISTER_AGENT: u64 = (3 << 30) | (28 << 16) | (IOC_MAGIC << 8) | 1;
/// `_IO(0x1b, 3)`.
const IOCTL_ENABLE_PKEY: u64 = (IOC_MAGIC << 8) | 3;

/// The header of one MAD read from or written to the umad file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UmadHdr {
    /// The agent ID.
    pub id: u32,
    /// Status (non-zero: a send completion in error).
    pub status: u32,
    /// Response timeout (0: no response expected, no kernel retries).
    pub timeout_ms: u32,
    /// Kernel retries.
    pub retries: u32,
    /// Length of the MAD (receive).
    pub length: u32,
    /// Remote QP.
    pub qpn: u32,
    /// Q_Key.
    pub qkey: u32,
    /// Remote LID (unused on RoCE).
    pub lid: u16,
    /// A GRH is present / to be sent.
    pub grh_present: bool,
    /// Local GID index (send: source; receive: the one the frame was addressed to).
    pub gid_index: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
    /// GRH traffic class.
    pub traffic_class: u8,
    /// Remote GID (send: destination; receive: the sender's).
    pub gid: [u8; 16],
    /// GRH flow label.
    pub flow_label: u32,
    /// P_Key index.
    pub pkey_index: u16,
}

impl UmadHdr {
    /// Writes the header's 64 bytes.
    pub fn emit(&self, b: &mut [u8; HDR_LEN]) {
        *b = [0; HDR_LEN];
        b[0..4].copy_from_slice(&self.id.to_ne_bytes());
        b[4..8].copy_from_slice(&self.status.to_ne_bytes());
        b[8..12].copy_from_slice(&self.timeout_ms.to_ne_bytes());
        b[12..16].copy_from_slice(&self.retries.to_ne_bytes());
        b[16..20].copy_from_slice(&self.length.to_ne_bytes());
        b[20..24].copy_from_slice(&self.qpn.to_be_bytes());
        b[24..28].copy_from_slice(&self.qkey.to_be_bytes());
        b[28..30].copy_from_slice(&self.lid.to_be_bytes());
        b[32] = u8::from(self.grh_present);
        b[33] = self.gid_index;
        b[34] = self.hop_limit;
        b[35] = self.traffic_class;
        b[36..52].copy_from_slice(&self.gid);
        b[52..56].copy_from_slice(&self.flow_label.to_be_bytes());
        b[56..58].copy_from_slice(&self.pkey_index.to_ne_bytes());
    }

    /// Reads a header (None if shorter than 64 bytes).
    pub fn parse(b: &[u8]) -> Option<UmadHdr> {
        let b: &[u8; HDR_LEN] = b.get(..HDR_LEN)?.try_into().ok()?;
        let u32ne = |o: usize| u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u32be = |o: usize| u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[36..52]);
        Some(UmadHdr {
            id: u32ne(0),
            status: u32ne(4),
            timeout_ms: u32ne(8),
            retries: u32ne(12),
            length: u32ne(16),
            qpn: u32be(20),
            qkey: u32be(24),
            lid: u16::from_be_bytes([b[28], b[29]]),
            grh_present: b[32] != 0,
            gid_index: b[33],
            hop_limit: b[34],
            traffic_class: b[35],
            gid,
            flow_label: u32be(52),
            pkey_index: u16::from_ne_bytes([b[56], b[57]]),
        })
    }
}

/// One MAD received, checked: the local GID index it was addressed to and the MAD.
#[derive(Debug, Clone)]
pub struct Received {
    /// The local GID index (picks the VM).
    pub gid_index: u8,
    /// The P_Key index it came in on.
    pub pkey_index: u16,
    /// The MAD and its sender.
    pub mad: InMad,
}

/// Checks one read: its length, status, GRH and class. `pkeys` maps the P_Key index.
pub fn parse_read(msg: &[u8], pkeys: &[u16]) -> Result<Received, DevDrop> {
    let hdr = UmadHdr::parse(msg).ok_or(DevDrop::WireBadLength)?;
    if hdr.status != 0 {
        // A send reported back in error (only with a timeout, which pvcm never sets).
        return Err(DevDrop::WireSendError);
    }
    if msg.len() != MSG_LEN {
        return Err(DevDrop::WireBadLength);
    }
    let mut mad = [0u8; MAD_LEN];
    mad.copy_from_slice(&msg[HDR_LEN..]);
    let header = mad::Packet::new_unchecked(&mad[..]);
    if header.mgmt_class() != MGMT_CLASS_CM || header.class_version() != CM_CLASS_VERSION {
        return Err(DevDrop::WireNotCm);
    }
    if !hdr.grh_present {
        // RoCE always carries one; without it there is no sender GID to route by.
        return Err(DevDrop::WireBadSource);
    }
    if hdr.qpn != GSI_QPN {
        return Err(DevDrop::WireBadDeth);
    }
    let pkey = pkeys
        .get(usize::from(hdr.pkey_index))
        .copied()
        .unwrap_or(0xFFFF);
    Ok(Received {
        gid_index: hdr.gid_index,
        pkey_index: hdr.pkey_index,
        mad: InMad {
            src: Gid(hdr.gid),
            // The GID at `gid_index`: set when the port finds the VM that holds it.
            dst: Gid::ZERO,
            src_qp: hdr.qpn,
            qkey: GSI_QKEY,
            pkey,
            mad,
        },
    })
}

/// A port's GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index.
    pub index: u8,
    /// The GID.
    pub gid: Gid,
    /// Its type is "RoCE v2".
    pub roce_v2: bool,
}

fn parse_sysfs_gid(s: &str) -> Option<Gid> {
    let groups: Vec<&str> = s.trim().split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut g = [0u8; 16];
    for (i, h) in groups.iter().enumerate() {
        let v = u16::from_str_radix(h, 16).ok()?;
        g[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(Gid(g))
}

/// Reads the port's GID table (`ports/N/gids/*` and `gid_attrs/types/*`): the non-zero
/// entries, with their types.
pub fn read_gid_table(port_dir: &Path) -> io::Result<Vec<GidEntry>> {
    let mut out = Vec::new();
    for e in fs::read_dir(port_dir.join("gids"))? {
        let e = e?;
        let Some(index) = e.file_name().to_str().and_then(|n| n.parse::<u8>().ok()) else {
            continue;
        };
        let Some(gid) = fs::read_to_string(e.path())
            .ok()
            .and_then(|s| parse_sysfs_gid(&s))
        else {
            continue;
        };
        if gid.0 == [0; 16] {
            continue;
        }
        // An entry being removed has no type any more (the read fails): not usable.
        let ty = fs::read_to_string(
            port_dir
                .join("gid_attrs")
                .join("types")
                .join(index.to_string()),
        )
        .unwrap_or_default();
        out.push(GidEntry {
            index,
            gid,
            roce_v2: ty.trim() == "RoCE v2",
        });
    }
    out.sort_by_key(|e| e.index);
    Ok(out)
}

/// The active MTU (IBTA code) of GID entry `index` of the port at `port_dir`
/// (`sysfs/class/infiniband/DEV/ports/N`): `iboe_get_mtu()` of its network device's
/// MTU (`gid_attrs/ndevs/INDEX`), as the RoCE device's port reports it and rdma_cm
/// takes it. The device's MTU from sysfs, else from the device in this namespace.
pub fn gid_mtu(port_dir: &Path, index: u8) -> Option<u8> {
    let ndev = fs::read_to_string(
        port_dir
            .join("gid_attrs")
            .join("ndevs")
            .join(index.to_string()),
    )
    .ok()?;
    let ndev = ndev.trim();
    let root = port_dir.ancestors().nth(5)?;
    let mtu = fs::read_to_string(root.join("class/net").join(ndev).join("mtu"))
        .ok()
        .and_then(|m| m.trim().parse().ok())
        .or_else(|| crate::port::if_mtu(ndev))?;
    crate::port::iboe_mtu(mtu)
}

/// Reads the P_Key table (`ports/N/pkeys/*`), index -> value (missing: 0xFFFF at 0).
pub fn read_pkeys(port_dir: &Path) -> Vec<u16> {
    let mut v: Vec<(usize, u16)> = Vec::new();
    if let Ok(rd) = fs::read_dir(port_dir.join("pkeys")) {
        for e in rd.flatten() {
            let Some(i) = e.file_name().to_str().and_then(|n| n.parse::<usize>().ok()) else {
                continue;
            };
            let Ok(s) = fs::read_to_string(e.path()) else {
                continue;
            };
            let s = s.trim();
            let s = s.strip_prefix("0x").unwrap_or(s);
            if let Ok(k) = u16::from_str_radix(s, 16) {
                v.push((i, k));
            }
        }
    }
    if v.is_empty() || v.len() > 1 << 16 {
        return vec![0xFFFF];
    }
    let len = v.iter().map(|(i, _)| *i + 1).max().unwrap_or(1);
    let mut t = vec![0u16; len];
    for (i, k) in v {
        t[i] = k;
    }
    t
}

/// The index of the default P_Key (full 0xFFFF first, else limited 0x7FFF).
pub fn default_pkey_index(pkeys: &[u16]) -> Option<u16> {
    pkeys
        .iter()
        .position(|&k| k == 0xFFFF)
        .or_else(|| pkeys.iter().position(|&k| k & 0x7FFF == 0x7FFF))
        .and_then(|i| u16::try_from(i).ok())
}

/// Finds the `umadN` of `device` port `port` under `sysfs/class/infiniband_mad`.
pub fn find_umad(sysfs: &Path, device: &str, port: u8) -> io::Result<String> {
    let dir = sysfs.join("class/infiniband_mad");
    for e in fs::read_dir(&dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("umad") {
            continue;
        }
        let dev = fs::read_to_string(e.path().join("ibdev")).unwrap_or_default();
        let p = fs::read_to_string(e.path().join("port")).unwrap_or_default();
        if dev.trim() == device && p.trim().parse::<u8>().ok() == Some(port) {
            return Ok(name);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "no umad device for {device} port {port} in {}",
            dir.display()
        ),
    ))
}

/// The port's VMs (their names and GIDs, the primary first, by VM index; `None`:
/// removed) and which VM has which GID index.
#[derive(Debug)]
struct Indices {
    vms: Vec<Option<(String, Vec<Gid>)>>,
    /// Per VM: the GID index of each of its GIDs, in the order of its GIDs (empty until
    /// they are all found).
    of_vm: Vec<Vec<u8>>,
    /// Per GID index: the VM that has it, and the GID.
    vm_of: [Option<(usize, Gid)>; 256],
}

impl Indices {
    /// Forgets VM `vm`'s GID indices.
    fn unmap(&mut self, vm: usize) {
        if let Some(old) = self.of_vm.get_mut(vm) {
            for i in old.drain(..) {
                self.vm_of[usize::from(i)] = None;
            }
        }
    }

    /// The GID index VM `vm` sends from to reach `src` (one of its GIDs), if found.
    fn index_of(&self, vm: usize, src: Gid) -> Option<u8> {
        let (_, gids) = self.vms.get(vm)?.as_ref()?;
        let at = gids.iter().position(|g| *g == src)?;
        self.of_vm.get(vm)?.get(at).copied()
    }
}

/// The umad port (see the module docs).
#[derive(Debug)]
pub struct UmadPort {
    name: String,
    fd: OwnedFd,
    agent: u32,
    port_dir: PathBuf,
    indices: Mutex<Indices>,
    pkeys: Vec<u16>,
    pkey_index: u16,
    /// The device's local CA ACK delay (`ibv_devinfo`), if it could be read.
    ca_ack_delay: Option<u8>,
}

/// The device's local CA ACK delay as rdma-core's `ibv_devinfo -v -d DEVICE` prints it
/// (`local_ca_ack_delay`). Verbs is the only interface that reports it: not sysfs, not
/// the umad ABI. `None` when the tool is missing, fails, or prints no such line.
fn device_ca_ack_delay(device: &str) -> Option<u8> {
    let out = std::process::Command::new("ibv_devinfo")
        .args(["-v", "-d", device])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_ca_ack_delay(&String::from_utf8_lossy(&out.stdout))
}

/// The `local_ca_ack_delay:` value of `ibv_devinfo -v` output (0 to 31).
fn parse_ca_ack_delay(text: &str) -> Option<u8> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix("local_ca_ack_delay:"))
        .and_then(|v| v.trim().parse::<u8>().ok())
        .filter(|d| *d <= 31)
}

fn ioctl(fd: RawFd, req: u64, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: `fd` is an open umad file; each caller passes a pointer to a live value of
    // the size the request encodes (or null for requests without an argument).
    let r = unsafe { libc::ioctl(fd, req as _, arg) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Registers a CM agent (the CM class, version 2, on QP1, for the Send method that
/// carries every CM message) on umad file `fd`. The error says why the kernel refused
/// it, the kernel CM named when it is loaded (its module in `sysfs`).
fn register_cm_agent(fd: &OwnedFd, sysfs: &Path) -> Result<RegReq, String> {
    let mut req = RegReq {
        qpn: GSI_QPN as u8,
        mgmt_class: MGMT_CLASS_CM,
        mgmt_class_version: CM_CLASS_VERSION,
        ..RegReq::default()
    };
    // The mask is a bitmap of unsigned longs; on a little-endian host bit n of the
    // whole is bit n%32 of word n/32.
    req.method_mask[usize::from(METHOD_SEND / 32)] |= 1 << (METHOD_SEND % 32);
    if let Err(e) = ioctl(
        fd.as_raw_fd(),
        IOCTL_REGISTER_AGENT,
        (&mut req as *mut RegReq).cast(),
    ) {
        let cm_loaded = sysfs.join("module/ib_cm").exists();
        let why = if cm_loaded {
            "the CM class (0x07 version 2) is already taken on this port: the kernel CM \
                 (ib_cm) is loaded and owns it. Unload the kernel CM and what uses it: \
                 `modprobe -r rdma_ucm rdma_cm ib_cm` (ib_ipoib, ib_srp, rpcrdma, nvme_rdma, \
                 ib_isert, iw_cm users also hold it: unload them first), and keep them \
                 unloaded (blacklist ib_cm; see docs/umad.md)"
        } else {
            "the kernel refused the CM agent (another user-space CM agent may hold the \
                 class on this port)"
        };
        return Err(format!("{e}: {why}"));
    }
    Ok(req)
}

impl UmadPort {
    /// Opens `device` port `port`, registers the CM agent and looks the VMs' GIDs up.
    pub fn open(
        sysfs: &Path,
        device: &str,
        port: u8,
        vms: &[(String, Vec<Gid>)],
    ) -> Result<UmadPort, Error> {
        let name = format!("umad:{device}:{port}");
        let fail = |reason: String| Error::Umad {
            port: name.clone(),
            reason,
        };
        let port_dir = sysfs
            .join("class/infiniband")
            .join(device)
            .join("ports")
            .join(port.to_string());
        if !port_dir.is_dir() {
            return Err(fail(format!(
                "no such RDMA device port ({} does not exist; `rdma link \
                 show` lists the devices)",
                port_dir.display()
            )));
        }
        let umad = find_umad(sysfs, device, port)
            .map_err(|e| fail(format!("{e}: is ib_umad loaded (`modprobe ib_umad`)?")))?;
        let path = Path::new("/dev/infiniband").join(&umad);
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| fail(format!("bad path {}", path.display())))?;
        // SAFETY: `c_path` is a NUL-terminated path that lives across the call.
        let fd = unsafe {
            libc::open(
                c_path.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            let hint = if e.kind() == io::ErrorKind::PermissionDenied {
                "; the umad files are root's by default: run as root, or give the daemon's \
                 user access with a udev rule (docs/umad.md)"
            } else {
                ""
            };
            return Err(fail(format!("open {}: {e}{hint}", path.display())));
        }
        // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        ioctl(fd.as_raw_fd(), IOCTL_ENABLE_PKEY, std::ptr::null_mut()).map_err(|e| {
            fail(format!(
                "IB_USER_MAD_ENABLE_PKEY on {}: {e} (kernel too old?)",
                path.display()
            ))
        })?;
        let req = register_cm_agent(&fd, sysfs)
            .map_err(|e| fail(format!("registering a CM agent on {}: {e}", path.display())))?;
        let pkeys = read_pkeys(&port_dir);
        let pkey_index = default_pkey_index(&pkeys).ok_or_else(|| {
            fail(format!(
                "no default P_Key (0xFFFF or 0x7FFF) in {}",
                port_dir.join("pkeys").display()
            ))
        })?;
        let p = UmadPort {
            name,
            fd,
            agent: req.id,
            port_dir,
            indices: Mutex::new(Indices {
                vms: vms.iter().cloned().map(Some).collect(),
                of_vm: vec![Vec::new(); vms.len()],
                vm_of: [None; 256],
            }),
            pkeys,
            pkey_index,
            ca_ack_delay: device_ca_ack_delay(device),
        };
        match p.ca_ack_delay {
            Some(d) => {
                tracing::info!(port = %p.name, ca_ack_delay = d, "the device's local CA ACK delay (ibv_devinfo)")
            }
            None => tracing::warn!(
                port = %p.name,
                "could not read the device's local CA ACK delay (`ibv_devinfo -v -d {device}`, \
                 ibverbs-utils): VMs report --ca-ack-delay"
            ),
        }
        let table = read_gid_table(&p.port_dir).map_err(|e| Error::Umad {
            port: p.name.clone(),
            reason: format!("GID table {}: {e}", p.port_dir.display()),
        })?;
        for vm in 0..vms.len() {
            if let Err(e) = p.resolve(vm, &table) {
                tracing::warn!("{e} (the VM will be refused until it is)");
            }
        }
        tracing::info!(port = %p.name, umad = %umad, agent = p.agent, pkey_index, "umad port open: CM agent registered");
        Ok(p)
    }

    fn lock(&self) -> MutexGuard<'_, Indices> {
        self.indices.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Finds each of VM `vm`'s GIDs in `table` and records their indices; an error
    /// names the first GID the table lacks (and nothing is recorded).
    fn resolve(&self, vm: usize, table: &[GidEntry]) -> Result<(), PortError> {
        let mut ix = self.lock();
        let Some((name, gids)) = ix.vms.get(vm).cloned().flatten() else {
            return Err(PortError::NoVm(vm));
        };
        let mut found = Vec::with_capacity(gids.len());
        for gid in &gids {
            let Some(e) = table.iter().find(|e| e.gid == *gid && e.roce_v2) else {
                return Err(PortError::GidNotInTable {
                    vm: name,
                    gid: *gid,
                    port: self.name.clone(),
                    table: self.port_dir.join("gids"),
                });
            };
            found.push(e.index);
        }
        ix.unmap(vm);
        for (&index, &gid) in found.iter().zip(&gids) {
            // An index another VM had (its entry went and came back elsewhere) is ours
            // now: that VM is unmapped until it resolves again.
            if let Some((other, _)) = ix.vm_of[usize::from(index)]
                && other != vm
            {
                ix.unmap(other);
            }
            ix.vm_of[usize::from(index)] = Some((vm, gid));
        }
        if let Some(o) = ix.of_vm.get_mut(vm) {
            *o = found;
        }
        Ok(())
    }

    fn write_mad(&self, msg: &[u8; MSG_LEN]) -> io::Result<()> {
        let mut tries = 0;
        loop {
            // SAFETY: `msg` is a live buffer of MSG_LEN bytes; the kernel only reads it.
            let r = unsafe { libc::write(self.fd.as_raw_fd(), msg.as_ptr().cast(), MSG_LEN) };
            if r == MSG_LEN as isize {
                return Ok(());
            }
            let e = if r < 0 {
                io::Error::last_os_error()
            } else {
                io::Error::other(format!("short write {r}"))
            };
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // EINVAL also means "a send with this TID and class is still in flight"
                // (ib_umad refuses duplicates until the first one completes, which is
                // microseconds); ENOMEM/EAGAIN are transient too.
                Some(libc::EINVAL | libc::ENOMEM | libc::EAGAIN) if tries < 20 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                _ => return Err(e),
            }
        }
    }

    /// Records the RoCEv2 frame a MAD between two GIDs would be (IPv4 or IPv6, as the
    /// GIDs are), with pvcm's own header and PSN: the device builds the real one.
    fn record(ctx: &PortCtx<'_>, src: Gid, dst: Gid, mad: &[u8; MAD_LEN]) {
        let (Some(c), Some(ip)) = (ctx.capture, IpRepr::from_gids(src, dst)) else {
            return;
        };
        let mut frame = [0u8; FRAME_LEN];
        let _ = FrameRepr::gsi(0, mad).emit(&mut frame, &ip, &UdpRepr::new(UDP_PORT));
        c.record(
            SocketAddr::new(gid_addr(src), UDP_PORT),
            SocketAddr::new(gid_addr(dst), UDP_PORT),
            &frame,
        );
    }

    fn deliver(&self, ctx: &PortCtx<'_>, mut r: Received, batches: &mut Vec<(usize, Vec<InMad>)>) {
        let owner = self.lock().vm_of[usize::from(r.gid_index)];
        let Some((vm, dst)) = owner else {
            ctx.host.add(Io::WireRxFrames, 1);
            ctx.host.drop(DevDrop::WireUnknownGid);
            tracing::debug!(port = %self.name, gid_index = r.gid_index, src = %r.mad.src, "MAD for a GID index no VM owns: dropped");
            return;
        };
        let Some(p) = ctx.vms.get(vm) else { return };
        p.counters.add(Io::WireRxFrames, 1);
        r.mad.dst = dst;
        Self::record(ctx, r.mad.src, dst, &r.mad.mad);
        match batches.iter_mut().find(|(q, _)| *q == vm) {
            Some((_, v)) => v.push(r.mad),
            None => batches.push((vm, vec![r.mad])),
        }
    }
}

impl WirePort for UmadPort {
    fn link(&self, vm: usize) -> crate::port::Link {
        let index = self.lock().of_vm.get(vm).and_then(|v| v.first().copied());
        crate::port::Link {
            mtu: index.and_then(|i| gid_mtu(&self.port_dir, i)),
            ca_ack_delay: self.ca_ack_delay,
        }
    }

    fn rx_mode(&self) -> String {
        format!("umad {}", self.name.trim_start_matches("umad:"))
    }

    fn poll_fds(&self) -> Vec<(RawFd, u64)> {
        vec![(self.fd.as_raw_fd(), 0)]
    }

    fn attach(&self, vm: usize) -> Result<(), PortError> {
        let table = read_gid_table(&self.port_dir).map_err(|source| PortError::GidTable {
            port: self.name.clone(),
            source,
        })?;
        self.resolve(vm, &table)
    }

    fn changes_vms(&self) -> bool {
        true
    }

    /// A VM added at runtime: nothing to bind (the device has the one CM agent for every
    /// GID); its GID index is looked up now if the GID is in the table already, and again
    /// when its session attaches (the address may be added to the netdev later).
    fn add_vm(
        &self,
        vm: usize,
        spec: &crate::config::VmSpec,
        _poll: &mut dyn FnMut(RawFd, u64) -> io::Result<()>,
    ) -> Result<(), PortError> {
        {
            let mut ix = self.lock();
            if ix.vms.len() <= vm {
                ix.vms.resize(vm + 1, None);
                ix.of_vm.resize(vm + 1, Vec::new());
            }
            ix.vms[vm] = Some((spec.vm.name.clone(), spec.vm.gids().collect()));
        }
        if let Ok(table) = read_gid_table(&self.port_dir) {
            if let Err(e) = self.resolve(vm, &table) {
                tracing::warn!("{e} (the VM will be refused until it is)");
            }
        }
        Ok(())
    }

    fn remove_vm(&self, vm: usize, _unpoll: &mut dyn FnMut(RawFd)) {
        let mut ix = self.lock();
        ix.unmap(vm);
        if let Some(v) = ix.vms.get_mut(vm) {
            *v = None;
        }
    }

    fn send(&self, ctx: &PortCtx<'_>, vm: usize, mads: &[OutMad<'_>]) {
        let Some(p) = ctx.vms.get(vm) else { return };
        // Each MAD leaves from the VM's GID for its destination; the indices are looked
        // up under one lock.
        let sources: Vec<(Gid, Option<u8>)> = {
            let ix = self.lock();
            mads.iter()
                .map(|(dst, _)| {
                    let src = p.spec.vm.source_for(*dst);
                    (src, ix.index_of(vm, src))
                })
                .collect()
        };
        let mut msg = [0u8; MSG_LEN];
        for ((dst, mad), &(src, index)) in mads.iter().zip(&sources) {
            let Some(gid_index) = index else {
                p.counters.drop(DevDrop::WireSendError);
                tracing::debug!(parent: &p.span, %src, "no GID index: MAD not sent");
                continue;
            };
            let hdr = UmadHdr {
                id: self.agent,
                qpn: GSI_QPN,
                qkey: GSI_QKEY,
                grh_present: true,
                gid_index,
                hop_limit: HOP_LIMIT,
                gid: dst.0,
                pkey_index: self.pkey_index,
                ..UmadHdr::default()
            };
            let mut h = [0u8; HDR_LEN];
            hdr.emit(&mut h);
            msg[..HDR_LEN].copy_from_slice(&h);
            msg[HDR_LEN..].copy_from_slice(&mad[..]);
            Self::record(ctx, src, *dst, mad);
            match self.write_mad(&msg) {
                Ok(()) => p.counters.add(Io::WireTxFrames, 1),
                Err(e) => {
                    tracing::debug!(parent: &p.span, error = %e, %dst, "umad send failed");
                    p.counters.drop(DevDrop::WireSendError);
                }
            }
        }
        if let Some(c) = ctx.capture {
            c.flush();
        }
    }

    fn receive(&self, ctx: &PortCtx<'_>, _token: u64, route: &mut dyn FnMut(Arrivals)) {
        let mut buf = [0u8; MSG_LEN];
        let mut batches: Vec<(usize, Vec<InMad>)> = Vec::new();
        let mut pending = 0;
        for _ in 0..RX_READS {
            // SAFETY: `buf` is a live, writable buffer of MSG_LEN bytes.
            let r = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), MSG_LEN) };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => break,
                    Some(libc::ENOSPC | libc::EINVAL) => {
                        // Larger than one MAD (RMPP): take it off the queue with a large
                        // buffer so it cannot block the queue, and count it.
                        let mut big = vec![0u8; 1 << 16];
                        // SAFETY: `big` is a live, writable buffer of its length.
                        let _ = unsafe {
                            libc::read(self.fd.as_raw_fd(), big.as_mut_ptr().cast(), big.len())
                        };
                        ctx.host.drop(DevDrop::WireBadLength);
                        continue;
                    }
                    _ => {
                        tracing::warn!(port = %self.name, error = %e, "umad read failed");
                        break;
                    }
                }
            }
            let n = r as usize;
            match parse_read(&buf[..n.min(MSG_LEN)], &self.pkeys) {
                Ok(m) => {
                    self.deliver(ctx, m, &mut batches);
                    pending += 1;
                }
                Err(reason) => {
                    tracing::debug!(port = %self.name, reason = reason.name(), len = n, "umad MAD dropped");
                    ctx.host.add(Io::WireRxFrames, 1);
                    ctx.host.drop(reason);
                }
            }
            if pending >= RX_BATCH {
                route(std::mem::take(&mut batches));
                pending = 0;
            }
        }
        if let Some(c) = ctx.capture {
            c.flush();
        }
        if !batches.is_empty() {
            route(batches);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn ioctl_numbers() {
        assert_eq!(IOCTL_REGISTER_AGENT, 0xC01C_1B01);
        assert_eq!(IOCTL_ENABLE_PKEY, 0x1B03);
    }

    #[test]
    fn header_round_trip_and_layout() {
        let h = UmadHdr {
            id: 7,
            qpn: 1,
            qkey: GSI_QKEY,
            grh_present: true,
            gid_index: 3,
            hop_limit: 64,
            gid: Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 3)).0,
            pkey_index: 2,
            ..UmadHdr::default()
        };
        let mut b = [0u8; HDR_LEN];
        h.emit(&mut b);
        assert_eq!(&b[20..24], &[0, 0, 0, 1]);
        assert_eq!(&b[24..28], &[0x80, 0x01, 0, 0]);
        assert_eq!(b[32], 1);
        assert_eq!(b[33], 3);
        assert_eq!(&b[46..52], &[0xff, 0xff, 10, 99, 0, 3]);
        assert_eq!(&b[56..58], &2u16.to_ne_bytes());
        assert_eq!(UmadHdr::parse(&b), Some(h));
        assert_eq!(UmadHdr::parse(&b[..63]), None);
    }

    fn msg(class: u8, version: u8, grh: bool, gid_index: u8) -> Vec<u8> {
        let h = UmadHdr {
            qpn: 1,
            grh_present: grh,
            gid_index,
            gid: Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 3)).0,
            pkey_index: 1,
            length: MAD_LEN as u32,
            ..UmadHdr::default()
        };
        let mut b = [0u8; HDR_LEN];
        h.emit(&mut b);
        let mut v = b.to_vec();
        let mut mad = [0u8; MAD_LEN];
        mad::field::BASE_VERSION.set(&mut mad, 1);
        mad::field::MGMT_CLASS.set(&mut mad, class.into());
        mad::field::CLASS_VERSION.set(&mut mad, version.into());
        mad::field::METHOD.set(&mut mad, METHOD_SEND.into());
        v.extend_from_slice(&mad);
        v
    }

    #[test]
    fn reads_are_checked() {
        let pkeys = [0x8001, 0xFFFF];
        let r = parse_read(&msg(7, 2, true, 4), &pkeys).unwrap();
        assert_eq!(r.gid_index, 4);
        assert_eq!(r.pkey_index, 1);
        assert_eq!(r.mad.pkey, 0xFFFF);
        assert_eq!(r.mad.src, Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 3)));
        assert_eq!(r.mad.src_qp, 1);
        let m = msg(7, 2, true, 4);
        assert_eq!(
            parse_read(&m[..100], &pkeys).unwrap_err(),
            DevDrop::WireBadLength
        );
        assert_eq!(
            parse_read(&m[..10], &pkeys).unwrap_err(),
            DevDrop::WireBadLength
        );
        assert_eq!(
            parse_read(&msg(4, 2, true, 4), &pkeys).unwrap_err(),
            DevDrop::WireNotCm
        );
        assert_eq!(
            parse_read(&msg(7, 1, true, 4), &pkeys).unwrap_err(),
            DevDrop::WireNotCm
        );
        assert_eq!(
            parse_read(&msg(7, 2, false, 4), &pkeys).unwrap_err(),
            DevDrop::WireBadSource
        );
        let mut bad = msg(7, 2, true, 4);
        bad[4] = 110; // status ETIMEDOUT
        assert_eq!(
            parse_read(&bad, &pkeys).unwrap_err(),
            DevDrop::WireSendError
        );
    }

    fn fake_port(root: &Path) -> PathBuf {
        let p = root.join("class/infiniband/rxe0/ports/1");
        fs::create_dir_all(p.join("gids")).unwrap();
        fs::create_dir_all(p.join("gid_attrs/types")).unwrap();
        fs::create_dir_all(p.join("pkeys")).unwrap();
        let entries = [
            (
                0,
                "fe80:0000:0000:0000:5054:00ff:fe99:0002",
                Some("RoCE v2"),
            ),
            (
                1,
                "0000:0000:0000:0000:0000:ffff:0a63:0002",
                Some("IB/RoCE v1"),
            ),
            (
                2,
                "0000:0000:0000:0000:0000:ffff:0a63:0002",
                Some("RoCE v2"),
            ),
            (3, "0000:0000:0000:0000:0000:0000:0000:0000", None),
            (
                4,
                "0000:0000:0000:0000:0000:ffff:0a63:0011",
                Some("RoCE v2"),
            ),
            (
                5,
                "fd99:0000:0000:0000:0000:0000:0000:0002",
                Some("IB/RoCE v1"),
            ),
            (
                6,
                "fd99:0000:0000:0000:0000:0000:0000:0002",
                Some("RoCE v2"),
            ),
        ];
        for (i, g, t) in entries {
            fs::write(p.join("gids").join(i.to_string()), format!("{g}\n")).unwrap();
            if let Some(t) = t {
                fs::write(
                    p.join("gid_attrs/types").join(i.to_string()),
                    format!("{t}\n"),
                )
                .unwrap();
            }
        }
        fs::write(p.join("pkeys/0"), "0xffff\n").unwrap();
        fs::write(p.join("pkeys/1"), "0x0000\n").unwrap();
        let m = root.join("class/infiniband_mad/umad0");
        fs::create_dir_all(&m).unwrap();
        fs::write(m.join("ibdev"), "rxe0\n").unwrap();
        fs::write(m.join("port"), "1\n").unwrap();
        p
    }

    #[test]
    fn a_gid_entrys_mtu_is_its_network_devices() {
        let d = tempfile::tempdir().unwrap();
        let p = fake_port(d.path());
        fs::create_dir_all(p.join("gid_attrs/ndevs")).unwrap();
        fs::write(p.join("gid_attrs/ndevs/2"), "eth9\n").unwrap();
        fs::write(p.join("gid_attrs/ndevs/4"), "eth1\n").unwrap();
        for (dev, mtu) in [("eth9", "9000\n"), ("eth1", "1500\n")] {
            let n = d.path().join("class/net").join(dev);
            fs::create_dir_all(&n).unwrap();
            fs::write(n.join("mtu"), mtu).unwrap();
        }
        assert_eq!(gid_mtu(&p, 2), Some(5), "a jumbo device: 4096");
        assert_eq!(gid_mtu(&p, 4), Some(3), "1500: 1024");
        assert_eq!(gid_mtu(&p, 6), None, "no device named");
    }

    #[test]
    fn the_ack_delay_is_read_from_ibv_devinfo_output() {
        let out = "hca_id:\trxe0\n\ttransport:\t\t\tInfiniBand (0)\n\tmax_pkeys:\t\t\t64\n\
                   \tlocal_ca_ack_delay:\t\t15\n\tgeneral_odp_caps:\n";
        assert_eq!(parse_ca_ack_delay(out), Some(15));
        assert_eq!(
            parse_ca_ack_delay("\tlocal_ca_ack_delay:\t\t16\n"),
            Some(16)
        );
        assert_eq!(parse_ca_ack_delay("\tlocal_ca_ack_delay:\t\t40\n"), None);
        assert_eq!(parse_ca_ack_delay("hca_id:\tmlx5_0\n"), None);
        assert_eq!(device_ca_ack_delay("no-such-device-0"), None);
    }

    #[test]
    fn sysfs_tables() {
        let d = tempfile::tempdir().unwrap();
        let p = fake_port(d.path());
        let t = read_gid_table(&p).unwrap();
        assert_eq!(t.len(), 6);
        // IPv6 entries: the link-local one the kernel derives from the MAC, and an
        // address of the netdev, each as RoCE v2 (and v1).
        let ll: Gid = "fe80::5054:ff:fe99:2".parse().unwrap();
        let v6: Gid = "fd99::2".parse().unwrap();
        assert_eq!(
            t.iter().find(|e| e.gid == ll && e.roce_v2).map(|e| e.index),
            Some(0)
        );
        assert_eq!(
            t.iter().find(|e| e.gid == v6 && e.roce_v2).map(|e| e.index),
            Some(6)
        );
        assert!(t.iter().any(|e| e.gid == v6 && !e.roce_v2 && e.index == 5));
        let a = Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 2));
        let e = t.iter().find(|e| e.gid == a && e.roce_v2).unwrap();
        assert_eq!(e.index, 2);
        assert!(!t[1].roce_v2);
        let pk = read_pkeys(&p);
        assert_eq!(pk, vec![0xFFFF, 0]);
        assert_eq!(default_pkey_index(&pk), Some(0));
        assert_eq!(default_pkey_index(&[0, 0x7FFF]), Some(1));
        assert_eq!(default_pkey_index(&[0]), None);
        assert_eq!(find_umad(d.path(), "rxe0", 1).unwrap(), "umad0");
        assert!(find_umad(d.path(), "rxe0", 2).is_err());
        assert!(find_umad(d.path(), "mlx4_0", 1).is_err());
    }

    /// An IPv6 GID goes into the GRH as it is (the kernel builds an IPv6 header for a
    /// GID that is not IPv4-mapped); a MAD from an IPv6 sender is routed by the index
    /// it came in on, with the sender's GID; the capture records the frame as IPv6.
    #[test]
    fn ipv6_grh_receive_and_capture() {
        let dst: Gid = "fd99::3".parse().unwrap();
        let h = UmadHdr {
            grh_present: true,
            gid_index: 6,
            gid: dst.0,
            ..UmadHdr::default()
        };
        let mut b = [0u8; HDR_LEN];
        h.emit(&mut b);
        assert_eq!(&b[36..52], &dst.0);
        assert_eq!(UmadHdr::parse(&b).unwrap().gid, dst.0);
        let mut m = msg(7, 2, true, 6);
        m[36..52].copy_from_slice(&dst.0);
        let r = parse_read(&m, &[0xFFFF, 0xFFFF]).unwrap();
        assert_eq!((r.gid_index, r.mad.src), (6, dst));

        let dir = tempfile::tempdir().unwrap();
        let cap = crate::pcap::Capture::create(&dir.path().join("u.pcap")).unwrap();
        let host = crate::stats::DevCounters::default();
        let ctx = PortCtx {
            vms: &crate::vm_port::VmSet::default(),
            host: &host,
            capture: Some(&cap),
        };
        let own: Gid = "fd99::2".parse().unwrap();
        let mad = [0u8; MAD_LEN];
        UmadPort::record(&ctx, own, dst, &mad);
        // Mixed families: no datagram can carry it, nothing recorded.
        UmadPort::record(&ctx, Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 2)), dst, &mad);
        cap.flush();
        let mut rd = pcap_file::pcap::PcapReader::new(
            std::fs::File::open(dir.path().join("u.pcap")).unwrap(),
        )
        .unwrap();
        let p = rd.next_packet().unwrap().unwrap();
        let (ip, udp, f) = pvcm_wire::roce::parse_datagram6(&p.data).unwrap();
        assert_eq!((Gid::from(ip.src), Gid::from(ip.dst)), (own, dst));
        assert_eq!(udp.dst_port, UDP_PORT);
        pvcm_wire::roce::check_datagram_icrc(&p.data).unwrap();
        assert_eq!(f.mad(), &mad[..]);
        assert!(rd.next_packet().is_none());
    }

    #[test]
    fn open_errors_are_clear() {
        let d = tempfile::tempdir().unwrap();
        let e = UmadPort::open(d.path(), "rxe9", 1, &[]).unwrap_err();
        assert!(e.to_string().contains("no such RDMA device port"), "{e}");
        let p = fake_port(d.path());
        fs::remove_dir_all(d.path().join("class/infiniband_mad")).unwrap();
        let e = UmadPort::open(d.path(), "rxe0", 1, &[]).unwrap_err();
        assert!(e.to_string().contains("ib_umad"), "{e}");
        let _ = p;
    }
}
