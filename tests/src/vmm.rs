//! A minimal VMM for the lab: memfd guest memory, a vhost-user frontend (the `vhost`
//! crate's), and the guest side of the pvcm device on pvcm-guest's driver-side split
//! virtqueues over that memory. What QEMU plus a guest driver would do, in one process.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pvcm_guest::transport::pci::QueueSetup;
use pvcm_guest::virtq::{
    DmaMemory, DmaRegion, LinearDma, MsgQueue, Notify, Segment, Virtq, VirtqConfig, features,
};
use pvcm_wire::Gid;
use pvcm_wire::abi::{
    self, HEADER_LEN, MsgHeader, MsgType, PORT_INFO_MAX_LEN, PORT_INFO_MIN_LEN, PortInfo,
    RX_BUFFER_LEN, RX_QUEUE, TX_QUEUE,
};
use pvcm_wire::mad::MAD_LEN;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags,
    VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// Where guest memory starts in guest-physical space (not 0: rust-vmm notes item 6).
pub const GUEST_BASE: u64 = 0x4000_0000;
/// `VHOST_USER_F_PROTOCOL_FEATURES`.
pub const PROTOCOL_FEATURES: u64 = 1 << 30;

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// A memfd mapped shared into this process: the guest's RAM.
#[derive(Debug)]
pub struct GuestMem {
    fd: OwnedFd,
    host: NonNull<u8>,
    len: usize,
    base: u64,
}

// SAFETY: the mapping is plain shared memory owned by this object; access to it is
// coordinated by the virtqueue protocol (and the DMA regions handed out from it).
unsafe impl Send for GuestMem {}
// SAFETY: as above; `&GuestMem` only exposes addresses and bounds-checked raw accessors
// documented as racing with the device like guest RAM does.
unsafe impl Sync for GuestMem {}

/// A fresh memfd of `len` bytes named `name`, mapped shared read-write (the caller
/// unmaps it).
fn shared_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<(OwnedFd, NonNull<u8>)> {
    // SAFETY: the name is a NUL-terminated C string; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let size = libc::off_t::try_from(len).map_err(|_| other("memory size too large"))?;
    // SAFETY: ftruncate on our own memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh shared mapping of the whole memfd; the result is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| other("mmap returned null"))?;
    Ok((fd, ptr))
}

impl GuestMem {
    /// `len` bytes of memfd-backed memory at guest-physical `base`.
    pub fn new(len: usize, base: u64) -> io::Result<Arc<GuestMem>> {
        let (fd, host) = shared_memfd(c"pvcm-lab-guest", len)?;
        Ok(Arc::new(GuestMem {
            fd,
            host,
            len,
            base,
        }))
    }

    /// The memory table entry a frontend gives the backend.
    pub fn region_info(&self) -> VhostUserMemoryRegionInfo {
        VhostUserMemoryRegionInfo {
            guest_phys_addr: self.base,
            memory_size: self.len as u64,
            userspace_addr: self.host.as_ptr() as u64,
            mmap_offset: 0,
            mmap_handle: self.fd.as_raw_fd(),
        }
    }

    /// The host (VMM) address of guest-physical `gpa`.
    pub fn host_addr(&self, gpa: u64) -> Option<u64> {
        let off = gpa.checked_sub(self.base)?;
        (off < self.len as u64).then(|| self.host.as_ptr() as u64 + off)
    }

    /// A DMA allocator over the whole memory (device address = guest-physical).
    pub fn dma(self: &Arc<GuestMem>) -> LinearDma {
        // SAFETY: the mapping stays valid while the keepalive (this Arc) lives, the
        // allocator is the only driver-side user of it, and the device (the backend,
        // through the memory table) sees it at `base`.
        unsafe { LinearDma::new(self.host, self.base, self.len, Some(self.clone())) }
    }

    /// Reads a u16 of guest memory (little-endian) at `gpa`.
    pub fn read_u16(&self, gpa: u64) -> Option<u16> {
        let a = self.host_addr(gpa)?;
        if gpa - self.base + 2 > self.len as u64 {
            return None;
        }
        // SAFETY: in bounds (checked); an unaligned read of plain memory the device may
        // write concurrently, like any driver reading guest RAM.
        Some(u16::from_le(unsafe {
            std::ptr::read_volatile(a as *const u16)
        }))
    }

    /// Writes bytes of guest memory at `gpa` (for crafting bad descriptors).
    pub fn write(&self, gpa: u64, b: &[u8]) -> Option<()> {
        let a = self.host_addr(gpa)?;
        if gpa - self.base + b.len() as u64 > self.len as u64 {
            return None;
        }
        // SAFETY: in bounds (checked); test-only pokes into guest RAM, as a (buggy or
        // hostile) guest would do.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), a as *mut u8, b.len()) };
        Some(())
    }
}

impl Drop for GuestMem {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; nothing uses it any more
        // (every DMA region holds this object alive).
        unsafe { libc::munmap(self.host.as_ptr().cast(), self.len) };
    }
}

/// Kicks a queue by writing its kick eventfd.
#[derive(Debug)]
pub struct Kicks(pub [EventFd; 2]);

impl Notify for Kicks {
    fn notify(&self, queue: u16) {
        if let Some(e) = self.0.get(usize::from(queue)) {
            let _ = e.write(1);
        }
    }
}

/// How a lab VM sets up its device.
#[derive(Debug, Clone, Copy)]
pub struct VmOpts {
    /// Queue size (power of two, up to 1024).
    pub queue_size: u16,
    /// Negotiate EVENT_IDX.
    pub event_idx: bool,
    /// Negotiate INDIRECT_DESC (tx chains of 2..=8 buffers then go indirect).
    pub indirect: bool,
    /// Guest memory size.
    pub mem_len: usize,
    /// Post every rx buffer at connect (false: a stuck guest, until [`LabVm::post_rx`]).
    pub post_rx: bool,
}

impl Default for VmOpts {
    fn default() -> Self {
        VmOpts {
            queue_size: 256,
            event_idx: true,
            indirect: true,
            mem_len: 8 << 20,
            post_rx: true,
        }
    }
}

/// A message received on rx.
#[derive(Debug, Clone)]
pub struct RxMsg {
    /// The header.
    pub header: MsgHeader,
    /// The payload.
    pub payload: Vec<u8>,
}

impl RxMsg {
    /// The payload as a MAD (zero-padded).
    pub fn mad(&self) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        let n = self.payload.len().min(MAD_LEN);
        m[..n].copy_from_slice(&self.payload[..n]);
        m
    }
}

/// One VM as the backend sees it: guest memory, a vhost-user session, and the guest
/// driver's two queues.
pub struct LabVm {
    /// Guest memory.
    pub mem: Arc<GuestMem>,
    frontend: Frontend,
    dma: LinearDma,
    /// The tx queue (driver -> device), driven chain by chain.
    pub tx: Virtq,
    tx_buf: DmaRegion,
    tx_free: Vec<u16>,
    /// The rx queue (device -> driver).
    pub rx: MsgQueue,
    kicks: Kicks,
    calls: [EventFd; 2],
    /// Negotiated virtio features.
    pub features: u64,
    /// Negotiated protocol features.
    pub protocol: VhostUserProtocolFeatures,
    scratch: DmaRegion,
}

impl std::fmt::Debug for LabVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LabVm")
            .field("features", &format_args!("{:#x}", self.features))
            .finish_non_exhaustive()
    }
}

/// Bytes per tx slot (a whole message fits).
const TX_SLOT: usize = 320;

/// Bytes of scratch guest memory for crafted chains.
pub const SCRATCH_LEN: usize = 64 << 10;

/// The vhost-user steps a VMM takes before the rings, as QEMU does: SET_OWNER, feature
/// negotiation (`want` virtio features, plus `VHOST_USER_F_PROTOCOL_FEATURES`), protocol
/// features (those of `protocol_mask` the backend offers), and the memory table.
/// Returns the negotiated virtio features (with the protocol-features bit) and protocol
/// features.
pub fn negotiate(
    frontend: &mut Frontend,
    mem: &GuestMem,
    want: u64,
    protocol_mask: VhostUserProtocolFeatures,
) -> io::Result<(u64, VhostUserProtocolFeatures)> {
    frontend.set_owner().map_err(other)?;
    let offered = frontend.get_features().map_err(other)?;
    let features = offered & (want | PROTOCOL_FEATURES);
    if features & features::VERSION_1 == 0 || features & PROTOCOL_FEATURES == 0 {
        return Err(other(format!("the device offers features {offered:#x}")));
    }
    frontend.set_features(features).map_err(other)?;
    let protocol = frontend.get_protocol_features().map_err(other)? & protocol_mask;
    frontend.set_protocol_features(protocol).map_err(other)?;
    frontend
        .set_mem_table(&[mem.region_info()])
        .map_err(other)?;
    Ok((features, protocol))
}

/// A dirty-page log shared with the backend (memfd), as QEMU keeps one.
#[derive(Debug)]
pub struct DirtyLogMem {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

impl DirtyLogMem {
    fn new(len: usize) -> io::Result<DirtyLogMem> {
        let (fd, ptr) = shared_memfd(c"pvcm-lab-dirty-log", len)?;
        Ok(DirtyLogMem { fd, ptr, len })
    }

    /// Whether the page holding guest-physical address `gpa` is marked dirty.
    pub fn is_dirty(&self, gpa: u64) -> bool {
        let page = gpa / 0x1000;
        let Ok(byte) = usize::try_from(page / 8) else {
            return false;
        };
        if byte >= self.len {
            return false;
        }
        // SAFETY: `byte` is inside the mapping; the backend sets bits with atomic ORs,
        // and a byte read racing with them reads either value.
        let b = unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(byte)) };
        b & (1 << (page % 8)) != 0
    }

    /// Clears every mark (as QEMU does between its passes over guest RAM).
    pub fn clear(&self) {
        // SAFETY: the mapping holds `len` bytes; the backend only ORs bits into it, so
        // a mark racing with this is either kept or cleared, as with QEMU's sync.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) };
    }

    /// Pages marked dirty.
    pub fn dirty_pages(&self) -> u64 {
        (0..self.len)
            .map(|i| {
                // SAFETY: `i` is inside the mapping (see `is_dirty`).
                let b = unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(i)) };
                u64::from(b.count_ones())
            })
            .sum()
    }
}

impl Drop for DirtyLogMem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes, unmapped once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// One device-state transfer over a pipe: SAVE returns what the backend wrote, LOAD
/// writes `state`; then `CHECK_DEVICE_STATE`.
pub fn transfer_state(
    frontend: &Frontend,
    direction: VhostTransferStateDirection,
    state: &[u8],
) -> io::Result<Vec<u8>> {
    use std::io::{Read, Write};
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two new descriptors into `fds`, a valid [i32; 2].
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created by pipe2 and are owned here only.
    let (mut r, mut w) = unsafe {
        (
            std::fs::File::from(OwnedFd::from_raw_fd(fds[0])),
            std::fs::File::from(OwnedFd::from_raw_fd(fds[1])),
        )
    };
    let mut out = Vec::new();
    if direction == VhostTransferStateDirection::SAVE {
        frontend
            .set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, w.into())
            .map_err(other)?;
        r.read_to_end(&mut out)?;
    } else {
        frontend
            .set_device_state_fd(direction, VhostTransferStatePhase::STOPPED, r.into())
            .map_err(other)?;
        w.write_all(state)?;
        drop(w);
    }
    frontend.check_device_state().map_err(other)?;
    Ok(out)
}

/// Sets one vring up from the driver's ring addresses (guest-physical, translated to
/// this process's mapping as a VMM does), with base 0, its kick and call eventfds, and
/// enables it.
pub fn setup_vring(
    frontend: &mut Frontend,
    mem: &GuestMem,
    ring: &QueueSetup,
    kick: &EventFd,
    call: &EventFd,
) -> io::Result<()> {
    setup_vring_at(frontend, mem, ring, kick, call, 0)
}

/// [`setup_vring`] with the ring's next index `base` (a reconnect: QEMU gives the used
/// index it finds in guest memory, so what the old backend took but never returned is
/// offered again).
pub fn setup_vring_at(
    frontend: &mut Frontend,
    mem: &GuestMem,
    ring: &QueueSetup,
    kick: &EventFd,
    call: &EventFd,
    base: u16,
) -> io::Result<()> {
    let host = |gpa: u64| {
        mem.host_addr(gpa)
            .ok_or_else(|| other("a ring outside guest memory"))
    };
    let cfg = VringConfigData {
        queue_max_size: ring.size,
        queue_size: ring.size,
        flags: 0,
        desc_table_addr: host(ring.desc)?,
        used_ring_addr: host(ring.device)?,
        avail_ring_addr: host(ring.driver)?,
        log_addr: None,
    };
    let i = usize::from(ring.index);
    frontend.set_vring_num(i, cfg.queue_size).map_err(other)?;
    frontend.set_vring_base(i, base).map_err(other)?;
    frontend.set_vring_addr(i, &cfg).map_err(other)?;
    frontend.set_vring_kick(i, kick).map_err(other)?;
    frontend.set_vring_call(i, call).map_err(other)?;
    frontend.set_vring_enable(i, true).map_err(other)?;
    Ok(())
}

impl LabVm {
    /// Connects to a backend socket and sets the device up as QEMU would.
    pub fn connect(socket: &Path, opts: VmOpts) -> io::Result<LabVm> {
        let mem = GuestMem::new(opts.mem_len, GUEST_BASE)?;
        let dma = mem.dma();
        let mut frontend = Frontend::connect(socket, 2).map_err(other)?;
        let mut want = features::VERSION_1;
        if opts.event_idx {
            want |= features::EVENT_IDX;
        }
        if opts.indirect {
            want |= features::INDIRECT_DESC;
        }
        let (features, protocol) = negotiate(
            &mut frontend,
            &mem,
            want,
            VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::RESET_DEVICE
                | VhostUserProtocolFeatures::DEVICE_STATE
                | VhostUserProtocolFeatures::LOG_SHMFD,
        )?;
        let cfg = |q: u16| VirtqConfig::new(q, opts.queue_size).with_features(features);
        let tx = Virtq::new(&dma, cfg(TX_QUEUE)).map_err(other)?;
        let tx_buf = dma
            .alloc(usize::from(opts.queue_size) * TX_SLOT, 4096)
            .map_err(other)?;
        let tx_free = (0..opts.queue_size).rev().collect();
        let rx = MsgQueue::new(&dma, cfg(RX_QUEUE), RX_BUFFER_LEN).map_err(other)?;
        let scratch = dma.alloc(SCRATCH_LEN, 4096).map_err(other)?;
        let kicks = Kicks([EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?]);
        let calls = [EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?];
        let mut vm = LabVm {
            mem,
            frontend,
            dma,
            tx,
            tx_buf,
            tx_free,
            rx,
            kicks,
            calls,
            features,
            protocol,
            scratch,
        };
        for q in [TX_QUEUE, RX_QUEUE] {
            vm.setup_vring(q)?;
        }
        if opts.post_rx {
            vm.post_rx()?;
        }
        Ok(vm)
    }

    fn setup_vring(&mut self, q: u16) -> io::Result<()> {
        let vq = if q == TX_QUEUE {
            &self.tx
        } else {
            self.rx.virtq()
        };
        let i = usize::from(q);
        setup_vring(
            &mut self.frontend,
            &self.mem,
            &QueueSetup::from(vq),
            &self.kicks.0[i],
            &self.calls[i],
        )
    }

    /// Starts dirty-page logging as QEMU does when a migration begins: `SET_FEATURES`
    /// with `VHOST_F_LOG_ALL`, then `SET_LOG_BASE` with a shared log that covers guest
    /// memory (one bit per 4 KiB page of guest-physical addresses).
    pub fn start_dirty_log(&mut self) -> io::Result<DirtyLogMem> {
        const VHOST_F_LOG_ALL: u64 = 1 << 26;
        let pages = (self.mem.base + self.mem.len as u64).div_ceil(0x1000);
        let log = DirtyLogMem::new(usize::try_from(pages.div_ceil(8)).map_err(other)?)?;
        self.frontend
            .set_features(self.features | VHOST_F_LOG_ALL)
            .map_err(other)?;
        self.frontend
            .set_log_base(
                0,
                Some(VhostUserDirtyLogRegion {
                    mmap_size: log.len as u64,
                    mmap_offset: 0,
                    mmap_handle: log.fd.as_raw_fd(),
                }),
            )
            .map_err(other)?;
        Ok(log)
    }

    /// Live-migrates the device as QEMU does: stops both rings on the current backend
    /// (`GET_VRING_BASE`), saves its state (`SET_DEVICE_STATE_FD` SAVE, then
    /// `CHECK_DEVICE_STATE`), connects to the backend at `socket`, loads the state there
    /// before any ring runs, and starts the rings at the bases the old backend gave.
    /// Guest memory, the rings and the driver's state stay as they are. Returns the
    /// state's size in bytes.
    pub fn migrate_to(&mut self, socket: &Path) -> io::Result<usize> {
        let bases = [
            self.frontend
                .get_vring_base(usize::from(TX_QUEUE))
                .map_err(other)?,
            self.frontend
                .get_vring_base(usize::from(RX_QUEUE))
                .map_err(other)?,
        ];
        let state = transfer_state(&self.frontend, VhostTransferStateDirection::SAVE, &[])?;
        let mut f = Frontend::connect(socket, 2).map_err(other)?;
        let (features, protocol) = negotiate(
            &mut f,
            &self.mem,
            self.features & !PROTOCOL_FEATURES,
            self.protocol,
        )?;
        if features != self.features || !protocol.contains(VhostUserProtocolFeatures::DEVICE_STATE)
        {
            return Err(other(format!(
                "the destination offers features {features:#x} protocol {protocol:?}"
            )));
        }
        transfer_state(&f, VhostTransferStateDirection::LOAD, &state)?;
        for (q, base) in [TX_QUEUE, RX_QUEUE].into_iter().zip(bases) {
            let vq = if q == TX_QUEUE {
                &self.tx
            } else {
                self.rx.virtq()
            };
            let i = usize::from(q);
            setup_vring_at(
                &mut f,
                &self.mem,
                &QueueSetup::from(vq),
                &self.kicks.0[i],
                &self.calls[i],
                u16::try_from(base).map_err(|_| other("vring base above 16 bits"))?,
            )?;
        }
        self.frontend = f;
        Ok(state.len())
    }

    /// Posts every free rx buffer and kicks the rx queue.
    pub fn post_rx(&mut self) -> io::Result<()> {
        self.rx.post_all().map_err(other)?;
        self.rx.kick(&self.kicks);
        Ok(())
    }

    /// Reads the device's config space (`VHOST_USER_GET_CONFIG`).
    pub fn get_config(&mut self, offset: u32, size: u32) -> io::Result<Vec<u8>> {
        let buf = vec![0u8; size as usize];
        let (_, payload) = self
            .frontend
            .get_config(offset, size, VhostUserConfigFlags::WRITABLE, &buf)
            .map_err(other)?;
        Ok(payload)
    }

    /// `VHOST_USER_RESET_DEVICE`.
    pub fn reset_device(&mut self) -> io::Result<()> {
        self.frontend.reset_device().map_err(other)
    }

    /// Returns finished tx chains' slots to the pool.
    pub fn reclaim_tx(&mut self) {
        while let Ok(Some(u)) = self.tx.pop_used() {
            self.tx_free.push(u.token);
        }
    }

    fn tx_slot(&mut self) -> io::Result<u16> {
        if let Some(s) = self.tx_free.pop() {
            return Ok(s);
        }
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            self.reclaim_tx();
            if let Some(s) = self.tx_free.pop() {
                return Ok(s);
            }
            if Instant::now() > until {
                return Err(other("tx queue stuck: no used chains for 5 s"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Queues one message (header + payload bytes as given) on tx, split over `split`
    /// descriptors (1 = one buffer). Not visible to the device until [`LabVm::kick`].
    pub fn queue_raw(&mut self, msg: &[u8], split: usize) -> io::Result<()> {
        if msg.len() > RX_BUFFER_LEN {
            return Err(other("message longer than a tx slot"));
        }
        let s = self.tx_slot()?;
        let off = usize::from(s) * TX_SLOT;
        self.tx_buf
            .write_at(off, msg)
            .ok_or_else(|| other("slot"))?;
        let base = self.tx_buf.dev_addr() + off as u64;
        let split = split.clamp(1, msg.len().max(1));
        let step = msg.len().div_ceil(split);
        let segs: Vec<Segment> = (0..msg.len())
            .step_by(step.max(1))
            .map(|o| Segment::new(base + o as u64, (step.min(msg.len() - o)) as u32))
            .collect();
        self.add(&segs, &[], s)
    }

    fn add(&mut self, out: &[Segment], inp: &[Segment], s: u16) -> io::Result<()> {
        self.tx.add_chain(out, inp, s).map_err(|e| {
            self.tx_free.push(s);
            other(e)
        })
    }

    /// Queues a chain of arbitrary segments (device-readable `out`, device-writable
    /// `inp`): for crafting bad chains.
    pub fn queue_chain(&mut self, out: &[Segment], inp: &[Segment]) -> io::Result<()> {
        let s = self.tx_slot()?;
        self.add(out, inp, s)
    }

    /// Queues a message: header + payload.
    pub fn queue(&mut self, h: &MsgHeader, payload: &[u8]) -> io::Result<()> {
        self.queue_raw(&pvcm_wire::testing::message(h, payload), 1)
    }

    /// Queues a MAD to `dst`.
    pub fn queue_mad(&mut self, dst: Gid, mad: &[u8; MAD_LEN]) -> io::Result<()> {
        self.queue(&MsgHeader::mad(dst), mad)
    }

    /// Publishes queued tx chains and kicks the device if it wants.
    pub fn kick(&mut self) {
        self.tx.kick(&self.kicks);
    }

    /// Sends one MAD now.
    pub fn send_mad(&mut self, dst: Gid, mad: &[u8; MAD_LEN]) -> io::Result<()> {
        self.queue_mad(dst, mad)?;
        self.kick();
        Ok(())
    }

    /// Sends one message now.
    pub fn send(&mut self, h: &MsgHeader, payload: &[u8]) -> io::Result<()> {
        self.queue(h, payload)?;
        self.kick();
        Ok(())
    }

    /// Scratch guest memory for crafted buffers: writes `b` at `offset` and returns its
    /// guest-physical address.
    pub fn scratch(&mut self, offset: usize, b: &[u8]) -> io::Result<u64> {
        self.scratch
            .write_at(offset, b)
            .ok_or_else(|| other("scratch overflow"))?;
        Ok(self.scratch.dev_addr() + offset as u64)
    }

    /// The next rx message, waiting up to `timeout`.
    pub fn recv(&mut self, timeout: Duration) -> Option<RxMsg> {
        let until = Instant::now() + timeout;
        loop {
            if let Ok(Some(u)) = self.rx.pop_used() {
                let msg = self.rx.buf(u.token).ok().and_then(|b| {
                    let b = &b[..(u.len as usize).min(b.len())];
                    let h = MsgHeader::parse(b).ok()?;
                    let end = (HEADER_LEN + h.len as usize).min(b.len());
                    Some(RxMsg {
                        header: h,
                        payload: b[HEADER_LEN..end].to_vec(),
                    })
                });
                let _ = self.rx.post(u.token);
                self.rx.kick(&self.kicks);
                if let Some(m) = msg {
                    return Some(m);
                }
                continue;
            }
            if self.rx.enable_notifications() {
                continue;
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            let left = until - now;
            let mut pfd = libc::pollfd {
                fd: self.calls[usize::from(RX_QUEUE)].as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, 50) as libc::c_int;
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms) };
            let _ = self.calls[usize::from(RX_QUEUE)].read();
        }
    }

    /// Takes every message the device has delivered, re-posts the buffers with one kick,
    /// and returns how many there were; waits up to `timeout` for the first. For
    /// throughput runs: the messages are counted, not parsed.
    pub fn recv_count(&mut self, timeout: Duration) -> usize {
        let until = Instant::now() + timeout;
        loop {
            let mut n = 0;
            while let Ok(Some(u)) = self.rx.pop_used() {
                let _ = self.rx.post(u.token);
                n += 1;
            }
            if n > 0 {
                self.rx.kick(&self.kicks);
                return n;
            }
            if self.rx.enable_notifications() {
                continue;
            }
            let now = Instant::now();
            if now >= until {
                return 0;
            }
            let mut pfd = libc::pollfd {
                fd: self.calls[usize::from(RX_QUEUE)].as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = (until - now).as_millis().clamp(1, 50) as libc::c_int;
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms) };
            let _ = self.calls[usize::from(RX_QUEUE)].read();
        }
    }

    /// Every rx message arriving within `timeout` of the last one.
    pub fn recv_all(&mut self, timeout: Duration) -> Vec<RxMsg> {
        let mut v = Vec::new();
        while let Some(m) = self.recv(timeout) {
            v.push(m);
        }
        v
    }

    /// The next rx message of type `t`, skipping others (returned too).
    pub fn recv_type(&mut self, t: MsgType, timeout: Duration) -> Option<RxMsg> {
        let until = Instant::now() + timeout;
        loop {
            let left = until.checked_duration_since(Instant::now())?;
            let m = self.recv(left)?;
            if m.header.msg_type == t {
                return Some(m);
            }
        }
    }

    /// Asks for PORT_INFO and returns it.
    pub fn port_info(&mut self) -> io::Result<PortInfo> {
        self.send(&MsgHeader::control(MsgType::PortInfoRequest, 0), &[])?;
        let m = self
            .recv_type(MsgType::PortInfo, Duration::from_secs(5))
            .ok_or_else(|| other("no PORT_INFO"))?;
        // At least the original record; appended fields are read when present.
        if m.payload.len() < PORT_INFO_MIN_LEN || m.payload.len() > PORT_INFO_MAX_LEN {
            return Err(other("PORT_INFO of the wrong length"));
        }
        PortInfo::parse(&m.payload).map_err(other)
    }

    /// The ABI the config space announces.
    pub fn config_abi(&mut self) -> io::Result<(u32, u32)> {
        let c = self.get_config(0, abi::CONFIG_LEN as u32)?;
        let w = |i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
        Ok((w(0), w(4)))
    }

    /// The DMA allocator (for extra buffers).
    pub fn dma(&self) -> &LinearDma {
        &self.dma
    }

    /// Ends the session (the socket closes).
    pub fn disconnect(self) {
        drop(self);
    }
}
