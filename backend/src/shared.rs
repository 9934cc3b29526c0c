//! The state shared by the VM threads, their devices and the host loop: the mux behind
//! one lock, the VM ports, the wire port.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pvcm_wire::abi;

use vmm_sys_util::eventfd::EventFd;

use crate::mux::{Mux, Outgoing, SystemClock, Time, VmId};
use crate::pcap::Capture;
use crate::port::{OutMad, PortCtx, WirePort};
use crate::rx::RxMsg;
use crate::state::Journal;
use crate::stats::{DevCounters, DevDrop, Figures, Snapshot, VmFigures};
use crate::vm_port::{Lifecycle, VmPort, VmSet, VmTable, lock};

/// The mux and the map from its VM IDs to ports, under one lock.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) mux: Mux<SystemClock>,
    pub(crate) by_vm: HashMap<VmId, usize>,
    /// `--state-dir`: the mux's journal.
    pub(crate) journal: Option<Journal>,
}

impl Core {
    /// Writes what the last mux calls changed to the journal (if any). Called under the
    /// lock after every batch, before any of the batch's MADs leave.
    pub(crate) fn commit(&mut self) {
        if let Some(j) = &mut self.journal {
            j.commit(&mut self.mux);
        }
    }

    /// With a journal: notes how far the VM's tx ring was consumed, for the next commit.
    pub(crate) fn note_tx_progress(&mut self, name: &str, next_avail: u16) {
        if let Some(j) = &mut self.journal {
            j.note_tx_progress(name, next_avail);
        }
    }
}

/// State shared by the VM threads, their devices and the host loop.
#[derive(Debug)]
pub struct Shared {
    pub(crate) core: Mutex<Core>,
    /// The VMs served now (changed at runtime by [`crate::runtime`]).
    pub(crate) vms: VmTable,
    pub(crate) capture: Option<Capture>,
    pub(crate) timer_wake: EventFd,
    pub(crate) armed: AtomicU64,
    pub(crate) default_quota: u32,
    /// The path MTU (IBTA code) a VM's PORT_INFO reports where the port cannot tell
    /// its link's (`--path-mtu`).
    pub(crate) path_mtu: u8,
    /// The local CA ACK delay a VM's PORT_INFO reports (`--ca-ack-delay`).
    pub(crate) ca_ack_delay: u8,
    pub(crate) policy: String,
    /// The wire port (soft or umad).
    pub(crate) port: Box<dyn WirePort>,
    /// Drops no VM owns (umad: a MAD for a GID index nobody has); in the host sums.
    pub(crate) port_counters: DevCounters,
    /// The device counters of VMs removed at runtime, so the host sums never go back.
    pub(crate) retired: DevCounters,
    pub(crate) stop: AtomicBool,
    /// `--state-dir`: stopping keeps the VMs' connections (the next daemon restores
    /// them) instead of releasing them.
    pub(crate) keeps_state: bool,
    /// The reloads of the configuration so far.
    pub(crate) reloads: Mutex<crate::stats::Reloads>,
}

impl Shared {
    pub(crate) fn lock_core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    pub(crate) fn default_quota(&self) -> u32 {
        self.default_quota
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Tells the host loop to re-arm its timer if `next` is earlier than what it armed.
    pub(crate) fn note_deadline(&self, next: Option<Time>) {
        if let Some(t) = next {
            if t.0 < self.armed.load(Ordering::Relaxed) {
                let _ = self.timer_wake.write(1);
            }
        }
    }

    /// The VMs served now.
    pub fn vms(&self) -> Arc<VmSet> {
        self.vms.current()
    }

    pub(crate) fn port_ctx<'a>(&'a self, vms: &'a VmSet) -> PortCtx<'a> {
        PortCtx {
            vms,
            host: &self.port_counters,
            capture: self.capture.as_ref(),
        }
    }

    /// Sends MADs from `port` to their GIDs.
    pub(crate) fn send_mads(&self, port: &VmPort, mads: &[OutMad<'_>]) {
        if mads.is_empty() {
            return;
        }
        let vms = self.vms();
        self.port.send(&self.port_ctx(&vms), port.index, mads);
    }

    /// Sends what the mux queued itself, each from its source VM's socket.
    pub(crate) fn send_outgoing(&self, out: Vec<Outgoing>) {
        let vms = self.vms();
        let mut per_port: HashMap<usize, Vec<OutMad<'_>>> = HashMap::new();
        for o in &out {
            match vms.by_gid(&o.src) {
                Some(p) => per_port.entry(p.index).or_default().push((o.dst, &o.mad)),
                None => tracing::warn!(src = %o.src, "mux MAD from a GID with no port: not sent"),
            }
        }
        for (p, mads) in per_port {
            if let Some(port) = vms.get(p) {
                tracing::debug!(parent: &port.span, n = mads.len(), "sending MADs on the VM's behalf");
                self.send_mads(port, &mads);
            }
        }
    }

    /// Attaches the port's VM to the mux (a session began). A restored VM keeps its
    /// connections and becomes attached; `reconnected` says so.
    pub(crate) fn attach(&self, port: &VmPort) -> Option<VmId> {
        self.attach_session(port).map(|(vm, _)| vm)
    }

    /// [`Shared::attach`], also telling whether the VM was restored and reconnected now.
    pub(crate) fn attach_session(&self, port: &VmPort) -> Option<(VmId, bool)> {
        let mut life = port.lifecycle();
        match &*life {
            Lifecycle::Attached { vm, .. } => return Some((*vm, false)),
            Lifecycle::Restored { vm, tx_resume } => {
                let (vm, tx_resume) = (*vm, *tx_resume);
                *life = Lifecycle::Attached { vm, tx_resume };
                return Some((vm, true));
            }
            Lifecycle::Awaiting | Lifecycle::Departed { .. } => return None,
            Lifecycle::Detached => {}
        }
        if let Err(e) = self.port.attach(port.index) {
            tracing::error!(parent: &port.span, error = %e, "attach refused");
            return None;
        }
        let mut core = self.lock_core();
        match core.mux.attach_vm(port.spec().vm) {
            Ok(vm) => {
                core.by_vm.insert(vm, port.index);
                core.commit();
                *life = Lifecycle::Attached {
                    vm,
                    tx_resume: None,
                };
                Some((vm, false))
            }
            Err(e) => {
                tracing::error!(parent: &port.span, error = %e, "attach failed");
                None
            }
        }
    }

    /// Detaches the port's VM (its session ended): the mux releases its connections;
    /// what it sends on the VM's behalf goes out now.
    pub(crate) fn detach(&self, port: &VmPort) {
        let mut life = port.lifecycle();
        let Some(vm) = life.vm() else {
            return;
        };
        // A resume index belongs to the ring of the session the journal saw: it goes too.
        *life = Lifecycle::Detached;
        let (out, next) = {
            let mut core = self.lock_core();
            port.counters.end_session(&core.mux.vm_stats(vm));
            core.mux.detach_vm(vm);
            core.by_vm.remove(&vm);
            core.commit();
            let out: Vec<Outgoing> = core.mux.drain_outbox().collect();
            (out, core.mux.next_deadline())
        };
        drop(life);
        // What waited for the old session's driver names the old session's IDs: it goes
        // with it, counted; the peers' retries reach the new session.
        let discarded = lock(&port.rx).clear();
        for _ in 0..discarded {
            port.counters.drop(DevDrop::RxDiscarded);
        }
        tracing::info!(parent: &port.span, on_behalf = out.len(), discarded, "VM detached");
        self.send_outgoing(out);
        self.note_deadline(next);
    }

    /// A device reset: the VM's connections are released and it starts afresh; the
    /// driver is told with an EVENT(DEVICE_RESET).
    pub(crate) fn reset_vm(&self, port: &VmPort) {
        if port.current_vm().is_none() {
            return;
        }
        self.detach(port);
        self.attach(port);
        port.push_rx(RxMsg::event(abi::Event::DeviceReset));
        port.wake_rx();
    }

    /// A driver starts on the VM's device (its PORT_INFO_REQUEST) while the mux holds
    /// entries of the VM: they belong to a CM that is gone, and are released at once as
    /// at a detach (DREQs and REJs on the VM's behalf, TimeWait and quarantine kept).
    /// This is how the host learns that the guest's CM stopped: the service exited or
    /// was restarted, the guest rebooted. QEMU passes a guest's reset of a vhost-user
    /// device on as stopped rings only, which a migration or a pause also gives. The
    /// new driver is not told (it has nothing to forget). Returns whether it released
    /// anything.
    pub(crate) fn driver_started(&self, port: &VmPort) -> bool {
        let Some(vm) = port.current_vm() else {
            return false;
        };
        let held = self.lock_core().mux.vm_stats(vm).live;
        if held == 0 {
            return false;
        }
        tracing::info!(parent: &port.span, held, "a driver started on the device while the VM's connections are held: the CM that held them is gone, releasing them");
        self.detach(port);
        self.attach(port);
        true
    }

    /// Every figure, per VM and summed.
    pub fn snapshot(&self) -> Snapshot {
        // Lock order: a port's lifecycle, then the core (as attach and detach do).
        let ports = self.vms();
        let current: Vec<Option<VmId>> = ports.iter().map(|p| p.current_vm()).collect();
        let core = self.lock_core();
        let host_stats = core.mux.host_stats();
        let mut vms = Vec::new();
        for (p, &vm) in ports.iter().zip(&current) {
            let s = vm.map(|v| core.mux.vm_stats(v)).unwrap_or_default();
            vms.push(VmFigures {
                name: p.spec.vm.name.clone(),
                gid: p.spec.vm.gid.to_string(),
                socket: p.spec.socket.display().to_string(),
                attached: vm.is_some(),
                quota: u64::from(p.quota().unwrap_or(self.default_quota)),
                figures: Figures::new(&p.counters.lifetime(s), &[&p.counters]),
            });
        }
        drop(core);
        let mut all: Vec<&DevCounters> = ports.iter().map(|p| &p.counters).collect();
        all.push(&self.port_counters);
        all.push(&self.retired);
        Snapshot {
            policy: self.policy.clone(),
            wire_rx: self.port.rx_mode(),
            wire_rx_configured: self.port.rx_mode_configured(),
            wire_rx_buffer: self.port.rx_buffer(),
            degraded: self.port.degraded(),
            reloads: lock(&self.reloads).clone(),
            vms,
            host: Figures::new(&host_stats, &all),
        }
    }
}
