//! One configured VM as the daemon keeps it across sessions: its rx backlog, counters,
//! wake eventfd and current session.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use pvcm_wire::Gid;

use vhost_user_backend::ShutdownHandle;
use vmm_sys_util::eventfd::EventFd;

use crate::backlog::{HostBudget, RxBacklog};
use crate::config::VmSpec;
use crate::mux::VmId;
use crate::rx::RxMsg;
use crate::stats::DevCounters;

/// Locks a mutex, taking over a poisoned one (a panicking thread leaves no state half
/// written that the others could not use).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A running session's rx queue, filled by whichever thread calls it (the device's
/// `RxRing`): it writes the VM port's backlogged messages into the driver's buffers and
/// returns how many it wrote.
pub(crate) trait RxRingFill: fmt::Debug + Send + Sync {
    fn deliver(&self, port: &VmPort) -> u64;
}

/// The handle that ends a VM's vhost-user session.
pub(crate) struct Session(pub(crate) ShutdownHandle);

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Session")
    }
}

/// Where a VM stands with the mux. One value, so that no impossible combination (a
/// VM both awaited and attached, a departed VM with a tx position) can be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lifecycle {
    /// Not attached: no session yet, or its session ended and its connections were
    /// released. The next session attaches it.
    Detached,
    /// `incoming=yes` and not arrived yet: sessions do not attach the VM; a state load
    /// (or rings starting without one, a fresh boot) does.
    Awaiting,
    /// Restored from the state journal and not reconnected yet: its connections are
    /// kept, and its MADs wait in the rx backlog, until it reconnects or the grace ends.
    /// `tx_resume`: the tx ring's next avail index the journal recorded last.
    Restored {
        /// The mux's ID of the VM.
        vm: VmId,
        /// The tx ring position of the last committed batch, if the journal has one.
        tx_resume: Option<u16>,
    },
    /// Attached to the mux: a session runs (or a state was loaded for one).
    Attached {
        /// The mux's ID of the VM.
        vm: VmId,
        /// Restored and reconnected: the first tx round returns the chains before this
        /// avail index unsent (their MADs left before the restart). Taken once.
        tx_resume: Option<u16>,
    },
    /// Left this host by migration: the state saved for it. If the VM runs here again
    /// (the migration failed and the source resumed), it is loaded back.
    Departed {
        /// The saved state ([`crate::migration`]'s format).
        state: Vec<u8>,
    },
}

impl Lifecycle {
    /// The lifecycle a configured VM starts in: awaited if it arrives by migration.
    pub(crate) fn initial(incoming: bool) -> Lifecycle {
        if incoming {
            Lifecycle::Awaiting
        } else {
            Lifecycle::Detached
        }
    }

    /// The mux's ID of the VM, while the mux holds its connections.
    pub(crate) fn vm(&self) -> Option<VmId> {
        match self {
            Lifecycle::Restored { vm, .. } | Lifecycle::Attached { vm, .. } => Some(*vm),
            Lifecycle::Detached | Lifecycle::Awaiting | Lifecycle::Departed { .. } => None,
        }
    }

    /// The lifecycle's name in `vm list`: `detached`, `awaiting`, `restored`, `attached`
    /// or `departed`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Lifecycle::Detached => "detached",
            Lifecycle::Awaiting => "awaiting",
            Lifecycle::Restored { .. } => "restored",
            Lifecycle::Attached { .. } => "attached",
            Lifecycle::Departed { .. } => "departed",
        }
    }

    /// The tx ring position a reconnected, restored VM resumes at (taken once).
    pub(crate) fn take_tx_resume(&mut self) -> Option<u16> {
        match self {
            Lifecycle::Attached { tx_resume, .. } => tx_resume.take(),
            _ => None,
        }
    }
}

/// One configured VM: its rx backlog and counters, across sessions.
#[derive(Debug)]
pub struct VmPort {
    pub(crate) index: usize,
    pub(crate) spec: VmSpec,
    /// Where the VM stands with the mux. Lock order: this, then the core.
    pub(crate) lifecycle: Mutex<Lifecycle>,
    pub(crate) rx: Mutex<RxBacklog>,
    pub(crate) rx_wake: EventFd,
    /// The running session's rx queue, once its device has one.
    rx_ring: Mutex<Option<Arc<dyn RxRingFill>>>,
    pub(crate) counters: DevCounters,
    pub(crate) session: Mutex<Option<Session>>,
    /// The VM's quota of live connections now (0: the host's default); the spec's at
    /// first, changed at runtime by `vm quota`.
    quota: AtomicU32,
    /// Removed at runtime: its thread serves no further session.
    pub(crate) leaving: AtomicBool,
    /// Wakes the VM's thread from its wait for a connection: the daemon stops or the
    /// VM is removed ([`VmPort::wake_accept`]). The socket's path is never used for
    /// it: the file may be gone, or another's.
    pub(crate) accept_wake: EventFd,
    pub(crate) span: tracing::Span,
}

impl VmPort {
    /// VM `index` of the configuration, with no session yet: its rx backlog holds up to
    /// `rx_bytes` of the host's `host` budget; an `incoming` VM awaits its migration.
    pub(crate) fn new(
        index: usize,
        spec: VmSpec,
        rx_bytes: usize,
        host: Arc<HostBudget>,
    ) -> std::io::Result<VmPort> {
        // The field is `vm`, not `name`: a JSON log writes the span's own name as `name`
        // beside its fields.
        let span = tracing::info_span!("vm", vm = %spec.vm.name, gid = %spec.vm.gid);
        Ok(VmPort {
            index,
            lifecycle: Mutex::new(Lifecycle::initial(spec.incoming)),
            rx: Mutex::new(RxBacklog::new(rx_bytes, host)),
            rx_wake: EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?,
            rx_ring: Mutex::new(None),
            counters: DevCounters::default(),
            session: Mutex::new(None),
            quota: AtomicU32::new(spec.vm.quota.unwrap_or(0)),
            leaving: AtomicBool::new(false),
            accept_wake: EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?,
            span,
            spec,
        })
    }

    /// The VM's quota now (`None`: the host's default).
    pub(crate) fn quota(&self) -> Option<u32> {
        Some(self.quota.load(Ordering::Acquire)).filter(|&q| q != 0)
    }

    /// Sets the VM's quota (`None`: the host's default); the next attach and PORT_INFO
    /// use it.
    pub(crate) fn set_quota(&self, quota: Option<u32>) {
        self.quota.store(quota.unwrap_or(0), Ordering::Release);
    }

    /// The VM's spec as it is now (its quota changed at runtime included).
    pub fn spec(&self) -> VmSpec {
        let mut s = self.spec.clone();
        s.vm.quota = self.quota();
        s
    }

    /// The VM's lifecycle, locked (before the core, never after).
    pub(crate) fn lifecycle(&self) -> MutexGuard<'_, Lifecycle> {
        lock(&self.lifecycle)
    }

    /// The mux's ID of the VM, while the mux holds its connections.
    pub(crate) fn current_vm(&self) -> Option<VmId> {
        self.lifecycle().vm()
    }

    pub(crate) fn lock_rx(&self) -> MutexGuard<'_, RxBacklog> {
        lock(&self.rx)
    }

    /// Queues a message for the VM's rx; false (and counted) when the backlog is full.
    pub(crate) fn push_rx(&self, m: RxMsg) -> bool {
        let r = lock(&self.rx).push(m);
        match r {
            Ok(()) => true,
            Err(reason) => {
                self.counters.drop(reason);
                tracing::debug!(parent: &self.span, reason = reason.name(), "rx backlog budget spent: message dropped");
                false
            }
        }
    }

    /// Wakes the VM's thread if it waits for a connection, so that it sees the daemon
    /// stopping or the VM leaving; it waits for nothing else than a connection or this.
    pub(crate) fn wake_accept(&self) {
        let _ = self.accept_wake.write(1);
    }

    /// Wakes the VM's worker to deliver its backlog.
    pub(crate) fn wake_rx(&self) {
        let _ = self.rx_wake.write(1);
    }

    /// Sets (or, `None`, forgets) the running session's rx queue.
    pub(crate) fn publish_rx_ring(&self, ring: Option<Arc<dyn RxRingFill>>) {
        *lock(&self.rx_ring) = ring;
    }

    /// Delivers the backlog now, on the calling thread, into the running session's rx
    /// queue; without one, wakes the VM's worker to do it. The caller holds no other
    /// lock: this takes the backlog, then the vring. What finds no buffer waits in the
    /// backlog for the driver's next kick, as it would for the worker.
    pub(crate) fn deliver_rx(&self) {
        let ring = lock(&self.rx_ring).clone();
        match ring {
            Some(r) => {
                r.deliver(self);
            }
            None => self.wake_rx(),
        }
    }

    /// A VM port without a session and the default budgets, for tests.
    #[cfg(test)]
    pub(crate) fn for_test(index: usize, spec: VmSpec) -> std::sync::Arc<VmPort> {
        use crate::backlog::{DEFAULT_HOST_BYTES, DEFAULT_VM_BYTES};
        let host = HostBudget::new(DEFAULT_HOST_BYTES);
        std::sync::Arc::new(
            VmPort::new(index, spec, DEFAULT_VM_BYTES, host).expect("eventfd for a test VM port"),
        )
    }
}

/// The VMs a daemon serves, by index (the wire port's and the mux map's name for a VM).
/// Indices are never reused: a VM removed at runtime leaves a hole, so nothing still
/// holding an old index can reach a newer VM.
#[derive(Debug, Default, Clone)]
pub struct VmSet {
    ports: Vec<Option<Arc<VmPort>>>,
    /// Every GID of every served VM (a VM has one or more).
    by_gid: HashMap<Gid, usize>,
    /// How many VMs are served.
    served: usize,
}

impl VmSet {
    /// The set of `ports`, each at its own index.
    pub fn new(ports: Vec<Arc<VmPort>>) -> VmSet {
        let mut set = VmSet::default();
        for p in ports {
            set = set.with(p);
        }
        set
    }

    /// The VM at `index`, if it is served.
    pub fn get(&self, index: usize) -> Option<&Arc<VmPort>> {
        self.ports.get(index)?.as_ref()
    }

    /// Every served VM, by index.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<VmPort>> {
        self.ports.iter().flatten()
    }

    /// The VM holding this GID (any of its GIDs).
    pub fn by_gid(&self, gid: &Gid) -> Option<&Arc<VmPort>> {
        self.get(*self.by_gid.get(gid)?)
    }

    /// The VM with this name.
    pub fn by_name(&self, name: &str) -> Option<&Arc<VmPort>> {
        self.iter().find(|p| p.spec.vm.name == name)
    }

    /// How many VMs are served.
    pub fn len(&self) -> usize {
        self.served
    }

    /// Whether no VM is served.
    pub fn is_empty(&self) -> bool {
        self.served == 0
    }

    /// The index the next VM added gets.
    pub fn next_index(&self) -> usize {
        self.ports.len()
    }

    /// This set with `port` at its index.
    pub(crate) fn with(&self, port: Arc<VmPort>) -> VmSet {
        let mut set = self.clone();
        if set.ports.len() <= port.index {
            set.ports.resize(port.index + 1, None);
        }
        let index = port.index;
        for gid in port.spec.vm.gids() {
            set.by_gid.insert(gid, index);
        }
        if set.ports[index].replace(port).is_none() {
            set.served += 1;
        }
        set
    }

    /// This set without the VM at `index`.
    pub(crate) fn without(&self, index: usize) -> VmSet {
        let mut set = self.clone();
        if let Some(p) = set.ports.get_mut(index).and_then(Option::take) {
            for gid in p.spec.vm.gids() {
                set.by_gid.remove(&gid);
            }
            set.served -= 1;
        }
        set
    }
}

impl std::ops::Index<usize> for VmSet {
    type Output = Arc<VmPort>;

    /// The VM at `index`; panics if none is served there (as a slice's index does).
    fn index(&self, index: usize) -> &Arc<VmPort> {
        match self.get(index) {
            Some(p) => p,
            None => panic!("no VM at index {index}"),
        }
    }
}

/// The served VMs, copied on write: readers take the current set (one `Arc` clone) and
/// keep it for a batch; a change publishes a new set.
#[derive(Debug, Default)]
pub(crate) struct VmTable(RwLock<Arc<VmSet>>);

impl VmTable {
    pub(crate) fn new(set: VmSet) -> VmTable {
        VmTable(RwLock::new(Arc::new(set)))
    }

    /// The current set.
    pub(crate) fn current(&self) -> Arc<VmSet> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces the set with `f(current)`.
    pub(crate) fn update(&self, f: impl FnOnce(&VmSet) -> VmSet) {
        let mut w = self.0.write().unwrap_or_else(PoisonError::into_inner);
        let next = f(&w);
        *w = Arc::new(next);
    }
}
