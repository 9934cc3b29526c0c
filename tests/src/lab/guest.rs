//! One simulated VM: the VMM side (memfd guest memory, a vhost-user session with the
//! host's backend) and the guest side (pvcm-guest's [`Device`] over its lab transport,
//! with its CM agent).
//!
//! The VMM steps are those of [`crate::vmm::LabVm::connect`] (features, protocol
//! features, memory table, vring setup), but the queues are the guest driver's own:
//! [`LabTransport::queues`] allocates them in a window of the guest memory, the VMM
//! hands their addresses to the backend, and [`Device::start`] takes over (PORT_INFO,
//! the agent, the pump). `LabVm` keeps its own hand-driven queues, so it cannot be reused
//! as is for a driver-owned device (a gap noted in the lab's report).

use std::io;
use std::path::Path;
use std::sync::Arc;

use pvcm_guest::cm::AgentConfig;
use pvcm_guest::device::{Device, DeviceOptions};
use pvcm_guest::time::SystemClock;
use pvcm_guest::transport::lab::LabTransport;
use pvcm_guest::transport::pci::QueueSetup;
use pvcm_guest::virtq::{DmaMemory, features};
use vhost::vhost_user::Frontend;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// The vhost-user protocol features a lab VM asks for: its config space, queues, device
/// state (migration) and device reset (its program exits), as QEMU does.
const LAB_PROTOCOL: VhostUserProtocolFeatures = VhostUserProtocolFeatures::CONFIG
    .union(VhostUserProtocolFeatures::MQ)
    .union(VhostUserProtocolFeatures::DEVICE_STATE)
    .union(VhostUserProtocolFeatures::RESET_DEVICE);

use crate::vmm::{
    GUEST_BASE, GuestMem, PROTOCOL_FEATURES, negotiate, setup_vring, setup_vring_at, transfer_state,
};

/// The guest driver's device as the lab runs it.
pub type LabDevice = Device<LabTransport<EventFd>, SystemClock>;

/// How a lab VM is set up.
#[derive(Debug, Clone, Copy)]
pub struct GuestOpts {
    /// Queue size of both queues (a power of two, up to 1024).
    pub queue_size: u16,
    /// Guest memory size.
    pub mem_len: usize,
    /// Seed of the agent (comm-ID operand, TID prefix, PSNs).
    pub seed: u64,
    /// Adjusts the agent's configuration (see [`DeviceOptions::configure`]).
    pub configure: Option<fn(&mut AgentConfig)>,
}

impl Default for GuestOpts {
    fn default() -> Self {
        GuestOpts {
            queue_size: 256,
            mem_len: 2 << 20,
            seed: 1,
            configure: None,
        }
    }
}

fn other(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

/// A VM: its device (and agent), the vhost-user session, and its memory.
///
/// Field order is drop order: the device (transport and queues) first, then the session
/// (the backend sees the socket close and detaches the VM), then the memory.
pub struct GuestVm {
    /// The guest driver's device, with the CM agent.
    pub dev: LabDevice,
    frontend: Frontend,
    mem: Arc<GuestMem>,
    rings: [QueueSetup; 2],
    features: u64,
}

impl std::fmt::Debug for GuestVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestVm")
            .field("dev", &self.dev)
            .finish_non_exhaustive()
    }
}

impl GuestVm {
    /// Connects to a backend's vhost-user socket, sets the device up as QEMU would, and
    /// starts the guest driver on it (PORT_INFO handshake included).
    pub fn connect(socket: &Path, opts: &GuestOpts) -> io::Result<GuestVm> {
        let mem = GuestMem::new(opts.mem_len, GUEST_BASE)?;
        let mut frontend =
            Frontend::connect(socket, 2).map_err(|e| other("vhost-user connect", e))?;
        let (negotiated, _) = negotiate(
            &mut frontend,
            &mem,
            features::VERSION_1 | features::EVENT_IDX,
            LAB_PROTOCOL,
        )?;

        // The driver's DMA window: page-aligned, inside the shared memory.
        let window = mem
            .dma()
            .alloc(LabTransport::<EventFd>::window_len(opts.queue_size), 4096)
            .map_err(|e| other("DMA window", e))?;
        let kicks = [EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?];
        let calls = [EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?];
        // The transport's features are the virtio ones (without the vhost-user bit).
        let lab = LabTransport::new(window, kicks, calls, negotiated & !PROTOCOL_FEATURES);
        let queues = lab
            .queues(opts.queue_size)
            .map_err(|e| other("queues", e))?;
        let rings = queues.setups();
        for ring in queues.setups() {
            setup_vring(
                &mut frontend,
                &mem,
                &ring,
                lab.kick_fd(ring.index),
                lab.call_fd(ring.index),
            )?;
        }
        let dopts = DeviceOptions {
            seed: opts.seed,
            configure: opts.configure,
            ..DeviceOptions::default()
        };
        let dev = Device::start(lab, queues, SystemClock::new(), dopts)
            .map_err(|e| other("device start", e))?;
        Ok(GuestVm {
            dev,
            frontend,
            mem,
            rings,
            features: negotiated,
        })
    }

    /// Sets the device up again on a new vhost-user session, as QEMU does when it
    /// reconnects to a restarted backend: the guest notices nothing (its queues, CM
    /// agent and connections stay), and each ring resumes at the used index found in
    /// guest memory.
    pub fn reconnect(&mut self, socket: &Path) -> io::Result<()> {
        let (frontend, _) = self.open_session(socket, "reconnect")?;
        let mut bases = [0u16; 2];
        for (ring, base) in self.rings.iter().zip(&mut bases) {
            // The used ring: flags (u16), then idx (u16).
            *base = self
                .mem
                .read_u16(ring.device + 2)
                .ok_or_else(|| other("reconnect", "used ring outside guest memory"))?;
        }
        self.resume_on(frontend, bases)
    }

    /// Live-migrates the VM's device to the backend at `socket` as QEMU does (see
    /// [`crate::vmm::LabVm::migrate_to`]): rings stopped here, state saved from this
    /// backend and loaded into that one before its rings start at the saved bases. The
    /// guest is paused meanwhile (the caller does not pump), as in QEMU's stop-and-copy;
    /// its memory, queues, CM agent and connections stay. Returns the state's size.
    pub fn migrate_to(&mut self, socket: &Path) -> io::Result<usize> {
        use vhost::VhostBackend;
        use vhost::vhost_user::message::VhostTransferStateDirection;
        let mut bases = [0u16; 2];
        for (ring, base) in self.rings.iter().zip(&mut bases) {
            let b = self
                .frontend
                .get_vring_base(usize::from(ring.index))
                .map_err(|e| other("GET_VRING_BASE", e))?;
            *base = u16::try_from(b).map_err(|e| other("vring base", e))?;
        }
        let state = transfer_state(&self.frontend, VhostTransferStateDirection::SAVE, &[])?;
        let (frontend, protocol) = self.open_session(socket, "migrate")?;
        if !protocol.contains(VhostUserProtocolFeatures::DEVICE_STATE) {
            return Err(other(
                "migrate",
                format!("the destination negotiated {protocol:?}, no DEVICE_STATE"),
            ));
        }
        transfer_state(&frontend, VhostTransferStateDirection::LOAD, &state)?;
        self.resume_on(frontend, bases)?;
        Ok(state.len())
    }

    /// A new vhost-user session at `socket` that must negotiate the features this VM
    /// runs with (the guest cannot renegotiate: it does not know it moved).
    fn open_session(
        &self,
        socket: &Path,
        what: &str,
    ) -> io::Result<(Frontend, VhostUserProtocolFeatures)> {
        let mut frontend =
            Frontend::connect(socket, 2).map_err(|e| other("vhost-user connect", e))?;
        let (negotiated, protocol) = negotiate(
            &mut frontend,
            &self.mem,
            self.features & !PROTOCOL_FEATURES,
            LAB_PROTOCOL,
        )?;
        if negotiated != self.features {
            return Err(other(
                what,
                format!("features {negotiated:#x}, were {:#x}", self.features),
            ));
        }
        Ok((frontend, protocol))
    }

    /// Gives `frontend` the rings, each starting at `bases`, makes it this VM's session
    /// (the old one closes) and wakes its worker for what the driver queued meanwhile.
    fn resume_on(&mut self, mut frontend: Frontend, bases: [u16; 2]) -> io::Result<()> {
        let t = self.dev.transport();
        for (ring, base) in self.rings.iter().zip(bases) {
            setup_vring_at(
                &mut frontend,
                &self.mem,
                ring,
                t.kick_fd(ring.index),
                t.call_fd(ring.index),
                base,
            )?;
        }
        self.frontend = frontend;
        for q in 0..2 {
            let _ = self.dev.transport().kick_fd(q).write(1);
        }
        Ok(())
    }

    /// The VM dies: no goodbye on the CM level, the vhost-user session just closes (as
    /// when QEMU is killed). The backend detaches the VM.
    pub fn vanish(self) {
        drop(self);
    }

    /// The program that drove the device exits: its driver resets the device
    /// (`VHOST_USER_RESET_DEVICE`), and the backend releases what the VM held.
    pub fn reset_device(&mut self) -> io::Result<()> {
        vhost::vhost_user::VhostUserFrontend::reset_device(&mut self.frontend)
            .map_err(io::Error::other)
    }

    /// The vhost-user session (for callers that want to poke it).
    pub fn frontend(&mut self) -> &mut Frontend {
        &mut self.frontend
    }
}
