//! The pvcm device as the guest's CM sees it: the CM [`Agent`] joined to the device's two
//! virtqueues over a [`Transport`].
//!
//! [`Device`] owns the tx and rx [`MsgQueue`]s ([`Queues`]), the agent, and the port the
//! device described in its PORT_INFO. [`Device::start`] posts every rx buffer
//! (`abi::RX_BUFFER_LEN` bytes each), sends PORT_INFO_REQUEST and builds the agent from
//! the answer (GID, CA GUID, P_Key, QPN range, quota; a different ABI version is
//! [`DeviceError::AbiMismatch`]). From then on [`Device::pump`] is the whole I/O step:
//!
//! 1. reclaims finished tx buffers;
//! 2. takes every used rx buffer, copies the message out (one stack buffer, no
//!    allocation), re-posts the buffer, and handles the message: a MAD goes to
//!    [`Agent::handle_mad`] with the header's remote GID as its source; an EVENT
//!    (port up/down, device reset) and a SEND_ERROR become [`DeviceEvent`]s and counters;
//!    anything malformed is a counted drop ([`RxDrop`]), never a panic;
//! 3. runs the agent's timers ([`Agent::poll`]);
//! 4. moves the agent's outbox into tx buffers (header `MsgHeader::mad(dst)` + the
//!    256-byte MAD), as many as there are free tx buffers: the rest stay in the outbox
//!    for the next pump (counted in [`DeviceStats::tx_backpressure`]);
//! 5. publishes each queue once and notifies the device only if it asked (EVENT_IDX):
//!    one kick per pump at most, however many messages.
//!
//! Nothing on this path allocates per message (the buffer pools are fixed, MADs travel
//! as arrays; only the agent's own bookkeeping allocates).
//!
//! [`Device::run_until`] is the blocking loop: pump, test a predicate, then sleep until the
//! device notifies (the transport's [`Transport::wait`]: an eventfd in the lab, a short
//! poll interval on PCI), the agent's next timer, or the timeout. Before sleeping it
//! re-arms used-buffer notifications and re-checks the rings, so no wakeup is lost.
//! [`Device::next_notice`] waits for the next CM or device event.
//!
//! A device reset (EVENT DEVICE_RESET: the host has released every connection of this
//! VM) drops the whole agent — connections, timers, unsent MADs, queued events — and
//! starts a fresh one with a new seed (new comm-ID operand and TID prefix); handles the
//! application held become unknown. The driver then asks for PORT_INFO again; if the
//! port's identity changed, the agent is rebuilt for it ([`DeviceEvent::PortChanged`]).
//!
//! Transports: [`crate::transport::lab::LabTransport`] (the lab's memfd guest memory
//! and eventfds) and [`pci::PciDevice`] (a real virtio-pci function inside a VM).
//! [`cmtime`] is the connection-rate benchmark of the CLI.

pub mod args;
pub mod cmtime;
pub mod pci;

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::RawFd;
use std::time::Duration;

use pvcm_wire::Gid;
use pvcm_wire::abi::{
    self, Event as AbiEvent, HEADER_LEN, MsgHeader, MsgType, PortInfo, RX_BUFFER_LEN,
};
use pvcm_wire::mad::{self, AttributeId, MAD_LEN};

use crate::cm::{
    AcceptOptions, Agent, AgentConfig, CmError, CmId, ConnectOptions, Event as CmEvent, Pacing,
    SplitMix64,
};
use crate::time::{Clock, SystemClock, Time};
use crate::transport::pci::PciError;
pub use crate::transport::{Queues, Transport, TransportError};
use crate::virtq::{DmaError, MsgQueue, VirtqError};

/// How [`Device::start`] builds the agent.
#[derive(Debug, Clone, Copy)]
pub struct DeviceOptions {
    /// Seed of the agent's comm-ID operand, TID prefix and PSNs (each device reset
    /// derives a new one from it).
    pub seed: u64,
    /// How long to wait for the device's PORT_INFO.
    pub port_info_timeout: Duration,
    /// Device events kept for the application; older ones are dropped (and counted in
    /// [`DeviceStats::events_lost`]) when it does not read them.
    pub max_device_events: usize,
    /// Adjusts the agent's configuration after it is built from PORT_INFO (MRA delay,
    /// automatic DREP, ...). Identity fields set by the device should be left alone.
    pub configure: Option<fn(&mut AgentConfig)>,
    /// Replaces the agent's pacing policy (`None`: keep the agent's; `Some(None)`: no
    /// pacing, every request goes out at once).
    pub pacing: Option<Option<Pacing>>,
    /// Messages one pump takes from rx before the application sees their events and
    /// the answers go out (at least 1; at most the queue's size is used). Smaller
    /// batches let the peer work on the first answers while this side handles the
    /// rest of a burst; each batch costs a notification.
    pub rx_batch: usize,
}

/// [`DeviceOptions::rx_batch`] by default.
pub const DEFAULT_RX_BATCH: usize = 64;

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            seed: random_seed(),
            port_info_timeout: Duration::from_secs(5),
            max_device_events: 1024,
            configure: None,
            pacing: None,
            rx_batch: DEFAULT_RX_BATCH,
        }
    }
}

/// A seed from the OS's random source that never blocks ([`pvcm_wire::seed::os_seed`]:
/// a guest driver starts early in boot, when a blocking `getrandom(2)` can wait minutes).
pub fn random_seed() -> u64 {
    pvcm_wire::seed::os_seed()
}

/// Errors of the device layer and its transports.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A virtqueue failed (the device broke the ring protocol, or a setup error).
    #[error("virtqueue: {0}")]
    Queue(#[from] VirtqError),
    /// DMA memory could not be allocated.
    #[error("DMA memory: {0}")]
    Dma(#[from] DmaError),
    /// The PCI transport failed.
    #[error("{0}")]
    Pci(#[from] PciError),
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// No PCI function with the pvcm device's IDs.
    #[error(
        "no virtio-pci device {vendor:04x}:{device:04x} (virtio ID {virtio_id}) under {root}/bus/pci/devices{which}"
    )]
    NoDevice {
        /// PCI vendor ID looked for.
        vendor: u16,
        /// PCI device ID looked for.
        device: u16,
        /// The virtio device ID.
        virtio_id: u32,
        /// The sysfs root searched.
        root: String,
        /// ` at <bdf>` when a specific function was asked for.
        which: String,
    },
    /// The device speaks another ABI version.
    #[error("device speaks pvcm ABI version {device}, this driver speaks {driver}")]
    AbiMismatch {
        /// The device's version.
        device: u32,
        /// This driver's ([`abi::ABI_VERSION`]).
        driver: u32,
    },
    /// The device-specific config space does not start with the pvcm magic.
    #[error("device config space starts with {0:#010x}, not the pvcm magic \"PVCM\"")]
    NotPvcm(u32),
    /// The device did not answer PORT_INFO_REQUEST in time.
    #[error("no PORT_INFO from the device within {0:?}")]
    NoPortInfo(Duration),
    /// The device answered with a PORT_INFO that does not parse.
    #[error("malformed PORT_INFO from the device: {0}")]
    BadPortInfo(pvcm_wire::Error),
    /// A CM call failed.
    #[error("CM: {0}")]
    Cm(#[from] CmError),
    /// A bad argument (queue size, option).
    #[error("{0}")]
    Invalid(String),
}

impl From<TransportError> for DeviceError {
    fn from(e: TransportError) -> DeviceError {
        DeviceError::Io {
            what: e.what,
            source: e.source,
        }
    }
}

impl DeviceError {
    /// What the user can do about the error, when something useful can be said.
    pub fn hint(&self) -> Option<&'static str> {
        use crate::transport::pci::PagemapError;
        match self {
            DeviceError::NoDevice { .. } => Some(
                "start the VM with the pvcm device (see qemu-scripts/), or name another \
                 virtio ID with --device pci:ID (41 behind QEMU's vhost-user-gpio-pci)",
            ),
            DeviceError::AbiMismatch { .. } | DeviceError::NotPvcm(_) => {
                Some("the driver and the device (pvcm-backend) are from different pvcm versions")
            }
            DeviceError::NoPortInfo(_) => Some(
                "the device did not answer: is pvcm-backend running and serving this VM's socket?",
            ),
            DeviceError::Cm(CmError::NoResources) => Some(
                "more connections than the port's quota or QPN range allow (see `pvcm-guest \
                 info`), or connections still in TimeWait",
            ),
            DeviceError::Pci(e) => match e {
                PciError::ConfigTooShort(_) => Some("reading the full PCI config space needs root"),
                PciError::Pagemap {
                    error: PagemapError::PfnHidden,
                    ..
                } => Some("physical addresses from /proc/self/pagemap need root (CAP_SYS_ADMIN)"),
                PciError::NotHugetlbfs(_) => Some(
                    "mount hugetlbfs (mount -t hugetlbfs none /dev/hugepages) or name the \
                     mount with --hugepages DIR",
                ),
                PciError::Io { source, what } => match source.raw_os_error() {
                    Some(libc::EACCES) | Some(libc::EPERM) => Some(
                        "run as root: the driver unbinds the kernel driver, maps BARs from \
                         sysfs and reads /proc/self/pagemap",
                    ),
                    Some(libc::ENOENT) if what.starts_with("listing") => Some(
                        "no PCI devices under this sysfs root: run inside the VM (or name \
                         the sysfs mount with --sysfs DIR)",
                    ),
                    Some(libc::ENOMEM) | Some(libc::ENOSPC) | Some(libc::EAGAIN)
                        if what.contains("DMA") || what.contains("mmap") =>
                    {
                        Some(
                            "reserve huge pages (echo 16 > /proc/sys/vm/nr_hugepages) and \
                             check RLIMIT_MEMLOCK",
                        )
                    }
                    _ => None,
                },
                _ => None,
            },
            DeviceError::Io { source, .. }
                if source.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                Some("permission denied: run as root")
            }
            _ => None,
        }
    }
}

/// Something the device told the driver, for the application.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The port came up (EVENT PORT_UP).
    PortUp,
    /// The port went down (EVENT PORT_DOWN): MADs sent now come back as SEND_ERROR.
    PortDown,
    /// The device reset (EVENT DEVICE_RESET): the host released every connection of
    /// this VM; the agent was dropped and a fresh one started. Every handle the
    /// application held is now unknown.
    Reset,
    /// The PORT_INFO read after a reset names another identity (GID, CA GUID, QPN range,
    /// quota); the agent was rebuilt for it.
    PortChanged,
    /// The device now announces another ABI version; the driver stopped sending.
    AbiMismatch {
        /// The device's version.
        device: u32,
    },
    /// A MAD the driver sent was not sent (SEND_ERROR). The agent treats it as lost
    /// (it retries requests on its timers).
    SendError {
        /// A `abi::SendStatus` code (see [`send_status_name`]).
        status: u16,
        /// Where the MAD was going.
        dest: Gid,
        /// Its attribute, if the payload holds one.
        attr: Option<AttributeId>,
        /// Its TID (0 if the payload is shorter than a MAD header).
        tid: u64,
    },
}

impl fmt::Display for DeviceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceEvent::PortUp => f.write_str("port up"),
            DeviceEvent::PortDown => f.write_str("port down"),
            DeviceEvent::Reset => f.write_str("device reset: every connection was dropped"),
            DeviceEvent::PortChanged => f.write_str("port identity changed"),
            DeviceEvent::AbiMismatch { device } => {
                write!(f, "device now speaks ABI version {device}")
            }
            DeviceEvent::SendError {
                status,
                dest,
                attr,
                tid,
            } => write!(
                f,
                "send error {} for {} to {dest} (tid {tid:#x})",
                send_status_name(*status),
                attr.map_or("?", |a| a.name()),
            ),
        }
    }
}

/// The name of a SEND_ERROR status code.
pub fn send_status_name(status: u16) -> &'static str {
    match status {
        0 => "ok",
        1 => "malformed",
        2 => "unknown_connection",
        3 => "spoofed",
        4 => "no_resources",
        5 => "bad_state",
        6 => "wire_error",
        _ => "unknown",
    }
}

/// Why a message from the device was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RxDrop {
    /// Shorter than its header, or than the header's `len` says.
    Truncated,
    /// A header that does not parse (unknown type, `len` above 256).
    BadHeader,
    /// A MAD message whose payload is not 256 bytes.
    BadMadLength,
    /// An EVENT whose payload does not parse.
    BadEvent,
    /// A PORT_INFO whose payload does not parse.
    BadPortInfo,
    /// A PORT_INFO nobody asked for.
    UnsolicitedPortInfo,
    /// A driver-to-device type (PORT_INFO_REQUEST) on rx.
    UnexpectedType,
    /// A MAD or SEND_ERROR before the agent existed (during [`Device::start`]).
    BeforeStart,
}

impl RxDrop {
    /// Every reason.
    pub const ALL: [RxDrop; 8] = [
        RxDrop::Truncated,
        RxDrop::BadHeader,
        RxDrop::BadMadLength,
        RxDrop::BadEvent,
        RxDrop::BadPortInfo,
        RxDrop::UnsolicitedPortInfo,
        RxDrop::UnexpectedType,
        RxDrop::BeforeStart,
    ];

    /// Short name for logs.
    pub fn name(self) -> &'static str {
        match self {
            RxDrop::Truncated => "truncated",
            RxDrop::BadHeader => "bad_header",
            RxDrop::BadMadLength => "bad_mad_length",
            RxDrop::BadEvent => "bad_event",
            RxDrop::BadPortInfo => "bad_port_info",
            RxDrop::UnsolicitedPortInfo => "unsolicited_port_info",
            RxDrop::UnexpectedType => "unexpected_type",
            RxDrop::BeforeStart => "before_start",
        }
    }
}

/// Counters of a [`Device`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Messages taken from rx.
    pub rx_msgs: u64,
    /// MADs handed to the agent.
    pub rx_mads: u64,
    /// MADs put on tx.
    pub tx_mads: u64,
    /// Control messages (PORT_INFO_REQUEST) put on tx.
    pub tx_control: u64,
    /// Tx publishes (batches made visible to the device).
    pub tx_batches: u64,
    /// Tx notifications sent (kicks the device asked for).
    pub tx_kicks: u64,
    /// Rx notifications sent (after re-posting buffers, when the device asked).
    pub rx_kicks: u64,
    /// Pumps that left MADs in the agent's outbox because every tx buffer was in use.
    pub tx_backpressure: u64,
    /// SEND_ERRORs received.
    pub send_errors: u64,
    /// SEND_ERRORs per status code (index = `abi::SendStatus` value; 7 = other).
    pub send_errors_by_status: [u64; 8],
    /// PORT_UP events.
    pub port_up_events: u64,
    /// PORT_DOWN events.
    pub port_down_events: u64,
    /// Device resets handled.
    pub resets: u64,
    /// Device events dropped because the application did not read them.
    pub events_lost: u64,
    /// Times the driver slept on the transport (an interrupt or a timed poll) with
    /// nothing to do.
    pub waits: u64,
    rx_drops: [u64; 8],
}

impl DeviceStats {
    /// Drops for one reason.
    pub fn rx_drop(&self, r: RxDrop) -> u64 {
        self.rx_drops[r as usize]
    }

    /// All rx drops.
    pub fn rx_dropped(&self) -> u64 {
        self.rx_drops.iter().sum()
    }

    fn drop_rx(&mut self, r: RxDrop) {
        self.rx_drops[r as usize] += 1;
    }
}

impl fmt::Display for DeviceStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rx_msgs={} rx_mads={} tx_mads={} tx_control={} tx_batches={} tx_kicks={} \
             rx_kicks={} tx_backpressure={} send_errors={} resets={} port_up={} port_down={} \
             events_lost={}",
            self.rx_msgs,
            self.rx_mads,
            self.tx_mads,
            self.tx_control,
            self.tx_batches,
            self.tx_kicks,
            self.rx_kicks,
            self.tx_backpressure,
            self.send_errors,
            self.resets,
            self.port_up_events,
            self.port_down_events,
            self.events_lost,
        )?;
        write!(f, "\nrx_drops")?;
        for r in RxDrop::ALL {
            write!(f, " {}={}", r.name(), self.rx_drop(r))?;
        }
        Ok(())
    }
}

/// What one [`Device::pump`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pump {
    /// Messages taken from rx.
    pub rx: usize,
    /// Messages put on tx.
    pub tx: usize,
}

/// The next thing for the application: a CM event or a device event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// From the CM agent.
    Cm(CmEvent),
    /// From the device.
    Device(DeviceEvent),
}

/// A copied-out rx message: the parsed header and the payload's range in the copy.
fn read_msg(b: &[u8]) -> Result<(MsgHeader, &[u8]), RxDrop> {
    if b.len() < HEADER_LEN {
        return Err(RxDrop::Truncated);
    }
    let h = MsgHeader::parse(&b[..HEADER_LEN]).map_err(|_| RxDrop::BadHeader)?;
    let end = HEADER_LEN + h.len as usize;
    let payload = b.get(HEADER_LEN..end).ok_or(RxDrop::Truncated)?;
    Ok((h, payload))
}

/// Puts one message (header + payload) on tx; `false` if no tx buffer is free.
fn send_msg(tx: &mut MsgQueue, h: &MsgHeader, payload: &[u8]) -> Result<bool, DeviceError> {
    if tx.virtq().num_free() == 0 || tx.pool().num_free() == 0 {
        reclaim(tx, |_| {})?;
    }
    if tx.virtq().num_free() == 0 {
        return Ok(false);
    }
    let Some(slot) = tx.alloc() else {
        return Ok(false);
    };
    let len = HEADER_LEN + payload.len();
    let r = (|| {
        let buf = tx.buf_mut(slot)?;
        if buf.len() < len {
            return Err(DeviceError::Invalid(format!(
                "message of {len} bytes does not fit a tx buffer"
            )));
        }
        h.emit(buf)
            .map_err(|e| DeviceError::Invalid(format!("header: {e}")))?;
        buf[HEADER_LEN..len].copy_from_slice(payload);
        tx.send(slot, len)?;
        Ok(())
    })();
    if r.is_err() {
        // Not queued: give the buffer back (it is still ours).
        let _ = tx.free(slot);
    }
    r.map(|()| true)
}

/// Returns every finished tx buffer to the pool.
/// Frees the tx buffers the device has used, handing `sent` each MAD it took (their
/// send completions: the agent's response timers start there, see
/// [`Agent::mad_sent`]).
fn reclaim(tx: &mut MsgQueue, mut sent: impl FnMut(&[u8])) -> Result<usize, DeviceError> {
    let mut n = 0;
    while let Some(u) = tx.pop_used()? {
        let buf = tx.buf(u.token)?;
        if let Ok(h) = MsgHeader::parse(buf)
            && h.msg_type == MsgType::Mad
            && let Some(mad) = buf.get(HEADER_LEN..HEADER_LEN + MAD_LEN)
        {
            sent(mad);
        }
        tx.free(u.token)?;
        n += 1;
    }
    Ok(n)
}

/// A sleep on the device's notifications that its caller waits out itself
/// ([`Device::sleep_begin`]).
#[derive(Debug)]
pub struct DeviceSleep {
    /// The descriptors a notification makes readable.
    pub fds: Vec<RawFd>,
    /// The longest wait: the agent's next timer, the caller's timeout, or the
    /// transport's cap.
    pub timeout: Duration,
    blocked: bool,
}

/// The CM agent joined to a pvcm device over transport `T`, with clock `C`.
///
/// See the [module documentation](self) for what [`Device::pump`] does. Field order
/// matters on drop: the transport goes first (a PCI transport resets the device, so it
/// stops using the queues), then the queues' DMA memory.
pub struct Device<T: Transport, C: Clock = SystemClock> {
    transport: T,
    tx: MsgQueue,
    rx: MsgQueue,
    clock: C,
    agent: Agent,
    port: PortInfo,
    port_up: bool,
    opts: DeviceOptions,
    stats: DeviceStats,
    events: VecDeque<DeviceEvent>,
    /// A PORT_INFO_REQUEST is to be sent (after a reset).
    port_info_to_send: bool,
    /// A PORT_INFO answer is expected.
    port_info_pending: bool,
    /// The device announced another ABI: nothing more is sent.
    abi_mismatch: Option<u32>,
}

impl<T: Transport, C: Clock> fmt::Debug for Device<T, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("transport", &self.transport.describe())
            .field("port", &self.port)
            .field("port_up", &self.port_up)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: Transport, C: Clock> Device<T, C> {
    /// Starts the driver on a device whose queues are set up (`queues` are the ones the
    /// device was given): posts every rx buffer, sends PORT_INFO_REQUEST, waits up to
    /// `opts.port_info_timeout` (on `clock`) for PORT_INFO, checks its ABI version, and
    /// builds the agent from it. Events that arrive meanwhile are kept; MADs are
    /// dropped (there is no agent yet) and counted.
    pub fn start(
        mut transport: T,
        queues: Queues,
        clock: C,
        opts: DeviceOptions,
    ) -> Result<Device<T, C>, DeviceError> {
        let Queues { mut tx, mut rx } = queues;
        let mut stats = DeviceStats::default();
        let mut events = VecDeque::new();
        // Tx completions are reclaimed when buffers run short; no interrupts wanted.
        tx.disable_notifications();
        rx.post_all()?;
        if rx.kick(&transport) {
            stats.rx_kicks += 1;
        }
        let req = MsgHeader::control(MsgType::PortInfoRequest, 0);
        if !send_msg(&mut tx, &req, &[])? {
            return Err(DeviceError::Invalid(
                "no tx buffer for PORT_INFO_REQUEST".into(),
            ));
        }
        stats.tx_control += 1;
        stats.tx_batches += 1;
        if tx.kick(&transport) {
            stats.tx_kicks += 1;
        }
        let until = clock.now().after(opts.port_info_timeout);
        let mut copy = [0u8; RX_BUFFER_LEN];
        let port = loop {
            reclaim(&mut tx, |_| {})?;
            let mut found = None;
            let mut reposted = false;
            while let Some(u) = rx.pop_used()? {
                stats.rx_msgs += 1;
                let n = (u.len as usize).min(RX_BUFFER_LEN);
                copy[..n].copy_from_slice(&rx.buf(u.token)?[..n]);
                rx.post(u.token)?;
                reposted = true;
                match read_msg(&copy[..n]) {
                    Err(d) => stats.drop_rx(d),
                    Ok((h, payload)) => match h.msg_type {
                        MsgType::PortInfo if found.is_none() => match PortInfo::parse(payload) {
                            Ok(p) => found = Some(p),
                            Err(e) => return Err(DeviceError::BadPortInfo(e)),
                        },
                        MsgType::PortInfo => stats.drop_rx(RxDrop::UnsolicitedPortInfo),
                        MsgType::Event => match AbiEvent::parse(payload) {
                            Ok(AbiEvent::PortUp) => {
                                stats.port_up_events += 1;
                                events.push_back(DeviceEvent::PortUp);
                            }
                            Ok(AbiEvent::PortDown) => {
                                stats.port_down_events += 1;
                                events.push_back(DeviceEvent::PortDown);
                            }
                            // Nothing to drop yet: the agent does not exist.
                            Ok(AbiEvent::DeviceReset) => {}
                            Err(_) => stats.drop_rx(RxDrop::BadEvent),
                        },
                        MsgType::Mad | MsgType::SendError => stats.drop_rx(RxDrop::BeforeStart),
                        MsgType::PortInfoRequest => stats.drop_rx(RxDrop::UnexpectedType),
                    },
                }
            }
            if reposted && rx.kick(&transport) {
                stats.rx_kicks += 1;
            }
            if let Some(p) = found {
                break p;
            }
            let now = clock.now();
            if now >= until {
                return Err(DeviceError::NoPortInfo(opts.port_info_timeout));
            }
            if rx.enable_notifications() {
                continue;
            }
            transport.wait(until.since(now))?;
        };
        if port.abi_version != abi::ABI_VERSION {
            return Err(DeviceError::AbiMismatch {
                device: port.abi_version,
                driver: abi::ABI_VERSION,
            });
        }
        let agent = Agent::new(Self::agent_config(&port, opts.seed, &opts));
        Ok(Device {
            transport,
            tx,
            rx,
            clock,
            agent,
            port_up: port.port_up,
            port,
            opts,
            stats,
            events,
            port_info_to_send: false,
            port_info_pending: false,
            abi_mismatch: None,
        })
    }

    fn agent_config(port: &PortInfo, seed: u64, opts: &DeviceOptions) -> AgentConfig {
        let mut cfg = AgentConfig::from_port_info(port, seed);
        if let Some(f) = opts.configure {
            f(&mut cfg);
        }
        if let Some(p) = opts.pacing {
            cfg.pacing = p;
        }
        cfg
    }

    // ------------------------------------------------------------ accessors

    /// The agent (state, counters, drops, configuration).
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The agent, for API calls (their MADs go out at the next pump).
    pub fn agent_mut(&mut self) -> &mut Agent {
        &mut self.agent
    }

    /// The port as the device last described it.
    pub fn port_info(&self) -> &PortInfo {
        &self.port
    }

    /// Whether the port is up (PORT_INFO flag, then PORT_UP/PORT_DOWN events).
    pub fn port_up(&self) -> bool {
        self.port_up
    }

    /// Counters.
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, mutably.
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The queues (counters, sizes, addresses).
    pub fn queues(&self) -> (&MsgQueue, &MsgQueue) {
        (&self.tx, &self.rx)
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// The clock's current time.
    pub fn now(&self) -> Time {
        self.clock.now()
    }

    /// The options the device was started with.
    pub fn options(&self) -> &DeviceOptions {
        &self.opts
    }

    /// The next device event.
    pub fn pop_device_event(&mut self) -> Option<DeviceEvent> {
        self.events.pop_front()
    }

    /// The next CM event.
    pub fn pop_cm_event(&mut self) -> Option<CmEvent> {
        self.agent.pop_event()
    }

    /// The next device event, else the next CM event.
    pub fn pop_notice(&mut self) -> Option<Notice> {
        if let Some(e) = self.events.pop_front() {
            return Some(Notice::Device(e));
        }
        self.agent.pop_event().map(Notice::Cm)
    }

    // ------------------------------------------------------------ API calls

    /// [`Agent::listen`].
    pub fn listen(&mut self, service_id: u64) -> Result<CmId, CmError> {
        self.agent.listen(service_id)
    }

    /// [`Agent::connect`] now.
    pub fn connect(
        &mut self,
        dest: Gid,
        service_id: u64,
        private_data: &[u8],
        opts: &ConnectOptions,
    ) -> Result<CmId, CmError> {
        let now = self.clock.now();
        self.agent
            .connect(dest, service_id, private_data, opts, now)
    }

    /// [`Agent::accept`] now.
    pub fn accept(&mut self, id: CmId, private_data: &[u8]) -> Result<(), CmError> {
        let now = self.clock.now();
        self.agent.accept(id, private_data, now)
    }

    /// [`Agent::accept_with`] now.
    pub fn accept_with(
        &mut self,
        id: CmId,
        private_data: &[u8],
        opts: &AcceptOptions,
    ) -> Result<(), CmError> {
        let now = self.clock.now();
        self.agent.accept_with(id, private_data, opts, now)
    }

    /// [`Agent::reject`] now.
    pub fn reject(&mut self, id: CmId, private_data: &[u8]) -> Result<(), CmError> {
        let now = self.clock.now();
        self.agent.reject(id, private_data, now)
    }

    /// [`Agent::disconnect`] now.
    pub fn disconnect(&mut self, id: CmId) -> Result<(), CmError> {
        let now = self.clock.now();
        self.agent.disconnect(id, now)
    }

    /// [`Agent::destroy`] now.
    pub fn destroy(&mut self, id: CmId) -> Result<(), CmError> {
        let now = self.clock.now();
        self.agent.destroy(id, now)
    }

    // ------------------------------------------------------------ the pump

    fn push_event(&mut self, e: DeviceEvent) {
        if self.events.len() >= self.opts.max_device_events.max(1) {
            self.events.pop_front();
            self.stats.events_lost += 1;
        }
        self.events.push_back(e);
    }

    /// One I/O step at `now` (see the [module documentation](self)). Errors only when a
    /// queue breaks (the device violated the ring protocol) or after the device
    /// announced another ABI version; malformed messages are counted drops.
    pub fn pump(&mut self, now: Time) -> Result<Pump, DeviceError> {
        if let Some(v) = self.abi_mismatch {
            return Err(DeviceError::AbiMismatch {
                device: v,
                driver: abi::ABI_VERSION,
            });
        }
        let mut report = Pump::default();
        reclaim(&mut self.tx, |m| self.agent.mad_sent(m, now))?;

        // Rx: at most one batch per pump (never more than the queue holds), so a flood
        // cannot starve tx and a burst's first answers leave while the rest wait.
        let budget = self
            .opts
            .rx_batch
            .clamp(1, usize::from(self.rx.pool().count()).max(1));
        let mut copy = [0u8; RX_BUFFER_LEN];
        while report.rx < budget {
            let Some(u) = self.rx.pop_used()? else { break };
            report.rx += 1;
            self.stats.rx_msgs += 1;
            let n = (u.len as usize).min(RX_BUFFER_LEN);
            copy[..n].copy_from_slice(&self.rx.buf(u.token)?[..n]);
            self.rx.post(u.token)?;
            self.handle_msg(&copy[..n], now);
        }
        if report.rx > 0 && self.rx.kick(&self.transport) {
            self.stats.rx_kicks += 1;
        }

        self.agent.poll(now);
        report.tx = self.flush_tx()?;
        if report.rx > 0 || report.tx > 0 {
            self.transport.note_activity();
        }
        Ok(report)
    }

    /// [`Device::pump`] at the clock's current time.
    pub fn pump_now(&mut self) -> Result<Pump, DeviceError> {
        let now = self.clock.now();
        self.pump(now)
    }

    fn handle_msg(&mut self, b: &[u8], now: Time) {
        let (h, payload) = match read_msg(b) {
            Ok(x) => x,
            Err(d) => {
                self.stats.drop_rx(d);
                return;
            }
        };
        match h.msg_type {
            MsgType::Mad => {
                if payload.len() != MAD_LEN {
                    self.stats.drop_rx(RxDrop::BadMadLength);
                    return;
                }
                self.stats.rx_mads += 1;
                self.agent.handle_mad(payload, h.remote_gid, now);
            }
            MsgType::Event => match AbiEvent::parse(payload) {
                Ok(AbiEvent::PortUp) => {
                    self.stats.port_up_events += 1;
                    self.port_up = true;
                    self.push_event(DeviceEvent::PortUp);
                }
                Ok(AbiEvent::PortDown) => {
                    self.stats.port_down_events += 1;
                    self.port_up = false;
                    self.push_event(DeviceEvent::PortDown);
                }
                Ok(AbiEvent::DeviceReset) => self.device_reset(),
                Err(_) => self.stats.drop_rx(RxDrop::BadEvent),
            },
            MsgType::PortInfo => self.on_port_info(payload),
            MsgType::SendError => {
                self.stats.send_errors += 1;
                self.stats.send_errors_by_status[usize::from(h.status.min(7))] += 1;
                // The returned MAD's header, as far as the payload holds it.
                let (attr_id, tid) = (mad::field::ATTR_ID, mad::field::TID);
                let attr = payload
                    .get(attr_id.range())
                    .and_then(|_| AttributeId::from_u16(attr_id.get(payload) as u16));
                let tid = payload.get(tid.range()).map_or(0, |_| tid.get(payload));
                self.push_event(DeviceEvent::SendError {
                    status: h.status,
                    dest: h.remote_gid,
                    attr,
                    tid,
                });
            }
            MsgType::PortInfoRequest => self.stats.drop_rx(RxDrop::UnexpectedType),
        }
    }

    /// Drops every bit of CM state and starts a fresh agent (new seed), then asks for
    /// PORT_INFO again.
    fn device_reset(&mut self) {
        self.stats.resets += 1;
        let seed = SplitMix64::new(self.opts.seed ^ self.stats.resets.rotate_left(32)).next_u64();
        self.agent
            .reset(Self::agent_config(&self.port, seed, &self.opts));
        self.port_info_to_send = true;
        self.push_event(DeviceEvent::Reset);
    }

    fn on_port_info(&mut self, payload: &[u8]) {
        let p = match PortInfo::parse(payload) {
            Ok(p) => p,
            Err(_) => {
                self.stats.drop_rx(RxDrop::BadPortInfo);
                return;
            }
        };
        if !self.port_info_pending {
            self.stats.drop_rx(RxDrop::UnsolicitedPortInfo);
            return;
        }
        self.port_info_pending = false;
        if p.abi_version != abi::ABI_VERSION {
            self.abi_mismatch = Some(p.abi_version);
            self.push_event(DeviceEvent::AbiMismatch {
                device: p.abi_version,
            });
            return;
        }
        self.port_up = p.port_up;
        let q = &self.port;
        let same = (
            p.gid,
            p.ca_guid,
            p.lid,
            p.pkey,
            p.qpn_base,
            p.qpn_count,
            p.max_entries,
        ) == (
            q.gid,
            q.ca_guid,
            q.lid,
            q.pkey,
            q.qpn_base,
            q.qpn_count,
            q.max_entries,
        );
        self.port = p;
        if !same {
            let seed = self.agent.config().seed;
            self.agent
                .reset(Self::agent_config(&self.port, seed, &self.opts));
            self.push_event(DeviceEvent::PortChanged);
        }
    }

    /// Moves pending control messages and the agent's outbox onto tx and publishes them
    /// with at most one notification; returns how many went.
    fn flush_tx(&mut self) -> Result<usize, DeviceError> {
        let mut n = 0;
        if self.port_info_to_send {
            let h = MsgHeader::control(MsgType::PortInfoRequest, 0);
            if send_msg(&mut self.tx, &h, &[])? {
                self.port_info_to_send = false;
                self.port_info_pending = true;
                self.stats.tx_control += 1;
                n += 1;
            }
        }
        while self.agent.outbox_len() > 0 {
            if self.tx.virtq().num_free() == 0 || self.tx.pool().num_free() == 0 {
                let now = self.clock.now();
                reclaim(&mut self.tx, |m| self.agent.mad_sent(m, now))?;
            }
            if self.tx.virtq().num_free() == 0 {
                break;
            }
            let Some(slot) = self.tx.alloc() else { break };
            let Some(m) = self.agent.pop_outbox() else {
                self.tx.free(slot)?;
                break;
            };
            let buf = self.tx.buf_mut(slot)?;
            // A tx buffer holds RX_BUFFER_LEN = HEADER_LEN + MAD_LEN bytes.
            if MsgHeader::mad(m.dst).emit(buf).is_err() || buf.len() < RX_BUFFER_LEN {
                self.tx.free(slot)?;
                return Err(DeviceError::Invalid("tx buffer too short".into()));
            }
            buf[HEADER_LEN..HEADER_LEN + MAD_LEN].copy_from_slice(&m.mad);
            self.tx.send(slot, HEADER_LEN + MAD_LEN)?;
            self.stats.tx_mads += 1;
            n += 1;
        }
        if self.agent.outbox_len() > 0 || self.port_info_to_send {
            self.stats.tx_backpressure += 1;
        }
        if n > 0 {
            self.stats.tx_batches += 1;
            if self.tx.kick(&self.transport) {
                self.stats.tx_kicks += 1;
            }
        }
        Ok(n)
    }

    /// Whether messages wait for tx buffers.
    pub fn tx_backlogged(&self) -> bool {
        self.agent.outbox_len() > 0 || self.port_info_to_send
    }

    // ------------------------------------------------------------ blocking

    /// Sleeps until the device notifies, the agent's next timer is due, or `until`,
    /// whichever is first; returns at once if there is work.
    fn block(&mut self, until: Time) -> Result<(), DeviceError> {
        self.block_with(until, &[]).map(|_| ())
    }

    /// Sleeps until the device notifies, the agent's next timer is due, `timeout` has
    /// passed, or one of `extra` is readable, whichever is first; returns at once (0) if
    /// the device has work. Returns which of `extra` are readable (bit `i` for
    /// `extra[i]`). For a caller that serves other descriptors beside the device: pump,
    /// handle what is readable, sleep here.
    pub fn sleep_with(&mut self, timeout: Duration, extra: &[RawFd]) -> Result<u64, DeviceError> {
        let until = self.clock.now().after(timeout);
        self.block_with(until, extra)
    }

    fn block_with(&mut self, until: Time, extra: &[RawFd]) -> Result<u64, DeviceError> {
        let Some(blocked) = self.arm(until) else {
            return Ok(0);
        };
        let now = self.clock.now();
        let wake = self.wake_at(until);
        let r = if extra.is_empty() {
            self.transport.wait(wake.since(now)).map(|()| 0)
        } else {
            self.transport.wait_with(wake.since(now), extra)
        };
        if blocked {
            self.tx.disable_notifications();
        }
        Ok(r?)
    }

    /// When a sleep until `until` ends: then, or at the agent's next timer.
    fn wake_at(&mut self, until: Time) -> Time {
        match self.agent.next_deadline() {
            Some(d) => until.min(d),
            None => until,
        }
    }

    /// Readies a sleep until `until`: `None` if there is work now (pump instead),
    /// else the notifications are armed and the sleep counted; `Some(true)` when the tx
    /// notifications were armed too (disarm them on waking).
    fn arm(&mut self, until: Time) -> Option<bool> {
        let now = self.clock.now();
        if self.wake_at(until) <= now {
            return None;
        }
        // MADs the application queued since the last pump (an accept() in run_until's
        // `done`, answering requests an earlier call took in) go out before any sleep:
        // the peer is waiting for them, so nothing else would wake us until its retry.
        // With the tx ring full they cannot: sleep until the device hands buffers back
        // (tx notifications, below) instead of spinning.
        if self.agent.outbox_len() > 0
            && self.tx.virtq().num_free() > 0
            && self.tx.pool().num_free() > 0
        {
            return None;
        }
        // Re-arm and re-check: a used buffer that arrived before re-arming gets no
        // notification, so it must be seen now.
        if self.rx.enable_notifications() {
            return None;
        }
        // Sent MADs the device has not handed back yet: their completions start the
        // agent's response timers (Agent::mad_sent), so the driver must hear of them
        // when they happen, not when it next wakes for something else (its own timer:
        // every attempt of a request nobody answers would last two timeouts).
        let blocked = self.tx_backlogged() || self.tx.virtq().in_flight() > 0;
        if blocked && self.tx.enable_notifications() {
            self.tx.disable_notifications();
            return None;
        }
        self.stats.waits += 1;
        Some(blocked)
    }

    /// [`Device::sleep_with`] for a caller that waits without holding the device (the
    /// guest CM service, whose other threads run commands on the agent meanwhile):
    /// arms the notifications as a sleep of up to `timeout` would and returns what to
    /// wait on, or `None` if there is work now (pump instead). Wait on
    /// [`DeviceSleep::fds`] (with the caller's own descriptors) for at most
    /// [`DeviceSleep::timeout`], then hand it back to [`Device::sleep_end`].
    pub fn sleep_begin(&mut self, timeout: Duration) -> Option<DeviceSleep> {
        let until = self.clock.now().after(timeout);
        let blocked = self.arm(until)?;
        let left = self.wake_at(until).since(self.clock.now());
        let (fds, timeout) = self.transport.wait_fds(left);
        Some(DeviceSleep {
            fds,
            timeout,
            blocked,
        })
    }

    /// Ends a sleep [`Device::sleep_begin`] started: takes the notification that ended
    /// it, if one did, and disarms what waking disarms.
    pub fn sleep_end(&mut self, s: DeviceSleep) -> Result<(), DeviceError> {
        let r = self.transport.wait_with(Duration::ZERO, &[]);
        if s.blocked {
            self.tx.disable_notifications();
        }
        r?;
        Ok(())
    }

    /// Pumps until `done(self)` holds (tested after every pump) or `timeout` has passed
    /// on the device's clock, sleeping on the transport in between. Returns whether
    /// `done` held.
    pub fn run_until<F>(&mut self, timeout: Duration, mut done: F) -> Result<bool, DeviceError>
    where
        F: FnMut(&mut Self) -> bool,
    {
        let until = self.clock.now().after(timeout);
        loop {
            let p = self.pump_now()?;
            if done(self) {
                return Ok(true);
            }
            if self.clock.now() >= until {
                return Ok(false);
            }
            if p.rx == 0 {
                self.block(until)?;
            }
        }
    }

    /// Pumps, then, if nothing arrived, sleeps once (see [`Device::run_until`]) and
    /// pumps again. For callers with their own loop.
    pub fn wait(&mut self, timeout: Duration) -> Result<Pump, DeviceError> {
        let until = self.clock.now().after(timeout);
        let p = self.pump_now()?;
        if p.rx > 0
            || self
                .agent
                .next_deadline()
                .is_some_and(|d| d <= self.clock.now())
        {
            return Ok(p);
        }
        self.block(until)?;
        let q = self.pump_now()?;
        Ok(Pump {
            rx: p.rx + q.rx,
            tx: p.tx + q.tx,
        })
    }

    /// The next device or CM event, waiting up to `timeout`.
    pub fn next_notice(&mut self, timeout: Duration) -> Result<Option<Notice>, DeviceError> {
        if let Some(n) = self.pop_notice() {
            return Ok(Some(n));
        }
        let mut got = None;
        self.run_until(timeout, |d| {
            got = d.pop_notice();
            got.is_some()
        })?;
        Ok(got)
    }

    /// The next CM event, waiting up to `timeout`; device events stay queued.
    pub fn next_cm_event(&mut self, timeout: Duration) -> Result<Option<CmEvent>, DeviceError> {
        if let Some(e) = self.agent.pop_event() {
            return Ok(Some(e));
        }
        let mut got = None;
        self.run_until(timeout, |d| {
            got = d.agent.pop_event();
            got.is_some()
        })?;
        Ok(got)
    }

    /// Pumps until every MAD the agent produced is on the device's queue and the device
    /// has consumed every tx buffer, or `timeout` passed. Returns whether it got there.
    pub fn flush(&mut self, timeout: Duration) -> Result<bool, DeviceError> {
        self.run_until(timeout, |d| {
            !d.tx_backlogged() && d.tx.virtq().in_flight() == 0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvcm_wire::abi::RX_QUEUE;

    #[test]
    fn read_msg_checks_lengths() {
        let mut b = [0u8; RX_BUFFER_LEN];
        MsgHeader::mad(Gid::ZERO).emit(&mut b).expect("emit");
        assert!(read_msg(&b).is_ok_and(|(_, p)| p.len() == MAD_LEN));
        assert_eq!(
            read_msg(&b[..HEADER_LEN + 10]).err(),
            Some(RxDrop::Truncated)
        );
        assert_eq!(read_msg(&b[..10]).err(), Some(RxDrop::Truncated));
        b[0] = 9;
        assert_eq!(read_msg(&b).err(), Some(RxDrop::BadHeader));
    }

    #[test]
    fn dma_bytes_covers_the_queues() {
        use crate::virtq::LinearDma;
        use std::ptr::NonNull;
        for size in [1u16, 4, 64, 256, 1024] {
            let need = Queues::dma_bytes(size);
            let mut mem = vec![0u64; need.div_ceil(8) + 512];
            let base = mem.as_mut_ptr().cast::<u8>();
            let off = base.align_offset(4096);
            let len = need;
            let p = NonNull::new(base.wrapping_add(off)).expect("non-null");
            // SAFETY: `p .. p + len` lies inside `mem` (4 KiB of slack for the
            // alignment), which outlives the allocator and its regions in this scope.
            let dma = unsafe { LinearDma::new(p, 0x10_0000, len, None) };
            let q = Queues::new(&dma, size, crate::virtq::features::PVCM).expect("fits");
            assert!(dma.used() <= need, "size {size}: {} > {need}", dma.used());
            assert_eq!(q.setups()[1].index, RX_QUEUE);
            drop(q);
        }
    }

    #[test]
    fn send_status_names() {
        assert_eq!(
            send_status_name(abi::SendStatus::WireError as u16),
            "wire_error"
        );
        assert_eq!(send_status_name(99), "unknown");
        let e = DeviceEvent::SendError {
            status: 2,
            dest: Gid::ZERO,
            attr: Some(AttributeId::Req),
            tid: 5,
        };
        assert!(e.to_string().contains("unknown_connection"));
    }
}
