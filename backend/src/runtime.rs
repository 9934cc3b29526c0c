//! VMs that come and go while the daemon runs.
//!
//! - The control socket's `vm add`, `vm remove`, `vm quota` and `vm list` requests
//!   (`pvcm-backend vm ...`) change one VM at a time.
//! - SIGHUP reads the config file again and applies the difference between the VMs it
//!   had and those it has now ([`diff`]); a file that does not parse or check changes
//!   nothing.
//! - With `--state-dir`, the changes made through the control socket are kept in
//!   `DIR/vms.toml` ([`Overlay`]) and applied over the config file at the next start.
//!
//! Every VM set the daemon serves is checked by [`check_vm_set`], the rule the config
//! file is checked by, and every VM by the rules of `--vm` ([`VmSpec::from_pairs`]).
//! Removing a VM ends its session and releases its connections on its behalf exactly as
//! when its VM dies ([`Shared::detach`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use vhost::vhost_user::Listener;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::backlog::HostBudget;
use crate::config::{
    ConfigError, SocketAccess, VmSpec, check_sockets_outside_state, check_vm_set, toml_vms,
    vm_tables,
};
use crate::files::{SocketFile, owner_only};
use crate::mux::AttachError;
use crate::port::PortError;
use crate::shared::Shared;
use crate::vm_port::{VmPort, lock};

pub use crate::state::OVERLAY_FILE;

/// Why a runtime change to the VMs was refused.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The VM's spec, or the set it would make, breaks a rule of the configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The daemon is stopping.
    #[error("the daemon is stopping")]
    Stopping,
    /// No VM has that name.
    #[error("no VM named {0:?}")]
    UnknownVm(String),
    /// The mux cannot take the VM (its GID or ID range is still in use).
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// The wire port cannot take the VM (its address cannot be bound, or the port's VMs
    /// are fixed).
    #[error(transparent)]
    Port(#[from] PortError),
    /// The VM's socket cannot be put at its path.
    #[error(transparent)]
    SocketPath(#[from] crate::files::SocketPathError),
    /// An OS call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// `DIR/vms.toml` cannot be read.
    #[error(
        "{}: {why}; move it away to start with the config file's VMs only",
        path.display()
    )]
    Overlay {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RuntimeError {
    let what = what.into();
    move |source| RuntimeError::Io { what, source }
}

/// The changes made through the control socket to the config file's VMs: VMs added,
/// config-file VMs removed, config-file VMs' quotas changed. Kept in `DIR/vms.toml`
/// with `--state-dir`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlay {
    /// VMs added at runtime (their quota changes included).
    pub added: Vec<VmSpec>,
    /// Config-file VMs removed at runtime, by name.
    pub removed: BTreeSet<String>,
    /// Config-file VMs' quotas set at runtime, by name.
    pub quotas: BTreeMap<String, u32>,
}

impl Overlay {
    /// The VMs to serve: the file's (less those removed, with their runtime quotas),
    /// then those added. `strict`: a VM added at runtime that clashes with the file's
    /// (name, socket, GID or ID range) is an error; otherwise it is left out, and the
    /// returned warnings say so (a start must not fail for it).
    pub fn apply(
        &self,
        file: &[VmSpec],
        control: Option<&Path>,
        strict: bool,
    ) -> Result<(Vec<VmSpec>, Vec<String>), ConfigError> {
        let mut out = Vec::new();
        let mut warnings = Vec::new();
        for spec in file {
            if self.removed.contains(&spec.vm.name) {
                continue;
            }
            match self.quotas.get(&spec.vm.name) {
                Some(&q) => match spec.with_quota(Some(q)) {
                    Ok(s) => out.push(s),
                    Err(e) => {
                        warnings.push(format!(
                            "VM {:?}: the quota {q} set at runtime no longer fits ({e}): the \
                             config file's quota applies",
                            spec.vm.name
                        ));
                        out.push(spec.clone());
                    }
                },
                None => out.push(spec.clone()),
            }
        }
        check_vm_set(&out, control)?;
        for spec in &self.added {
            out.push(spec.clone());
            if let Err(e) = check_vm_set(&out, control) {
                if strict {
                    return Err(ConfigError::Vm {
                        vm: format!("the VM {:?} added at runtime", spec.vm.name),
                        source: Box::new(e),
                    });
                }
                out.pop();
                warnings.push(format!(
                    "VM {:?} added at runtime clashes with the config file ({e}): not served",
                    spec.vm.name
                ));
            }
        }
        Ok((out, warnings))
    }

    /// The config file changed from `old` to `new`: runtime removals of VMs the file no
    /// longer names are forgotten, and so are runtime quotas of VMs whose quota the file
    /// changed (the file's newer word wins).
    pub fn rebase(&mut self, old: &[VmSpec], new: &[VmSpec]) {
        let find = |set: &[VmSpec], n: &str| set.iter().find(|s| s.vm.name == n).cloned();
        self.removed.retain(|n| find(new, n).is_some());
        self.quotas
            .retain(|n, _| match (find(old, n), find(new, n)) {
                (Some(o), Some(n)) => o.vm.quota == n.vm.quota,
                _ => false,
            });
    }

    /// Reads `DIR/vms.toml` (none: no changes).
    pub fn load(dir: &Path) -> Result<Overlay, RuntimeError> {
        let path = dir.join(OVERLAY_FILE);
        let bad = |why: String| RuntimeError::Overlay {
            path: path.clone(),
            why,
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Overlay::default()),
            Err(e) => return Err(bad(e.to_string())),
        };
        let table = toml::de::DeTable::parse(&text)
            .map_err(|e| bad(e.to_string().trim_end().to_string()))?;
        let mut o = Overlay::default();
        for (key, value) in table.get_ref().iter() {
            match (key.get_ref().as_ref(), value.get_ref()) {
                ("vm", _) => {
                    o.added = vm_tables(value).map_err(|l| bad(l.error.to_string()))?;
                }
                ("removed", toml::de::DeValue::Array(names)) => {
                    for n in names.iter() {
                        let n = n
                            .get_ref()
                            .as_str()
                            .ok_or_else(|| bad("removed: expected VM names".into()))?;
                        o.removed.insert(n.to_string());
                    }
                }
                ("quota", toml::de::DeValue::Table(q)) => {
                    for (n, v) in q.iter() {
                        let n = n.get_ref();
                        let v = v
                            .get_ref()
                            .as_integer()
                            .and_then(|v| u32::from_str_radix(v.as_str(), v.radix()).ok())
                            .filter(|&v| v > 0)
                            .ok_or_else(|| bad(format!("quota.{n}: expected 1 to 2^32-1")))?;
                        o.quotas.insert(n.to_string(), v);
                    }
                }
                _ => return Err(bad(format!("unexpected key {:?}", key.get_ref()))),
            }
        }
        Ok(o)
    }

    /// The file's text.
    pub fn to_toml(&self) -> Result<String, toml::ser::Error> {
        let mut t = toml::Table::new();
        if !self.removed.is_empty() {
            t.insert(
                "removed".into(),
                toml::Value::Array(
                    self.removed
                        .iter()
                        .map(|n| toml::Value::String(n.clone()))
                        .collect(),
                ),
            );
        }
        if !self.quotas.is_empty() {
            t.insert(
                "quota".into(),
                toml::Value::Table(
                    self.quotas
                        .iter()
                        .map(|(n, q)| (n.clone(), toml::Value::Integer(i64::from(*q))))
                        .collect(),
                ),
            );
        }
        if !self.added.is_empty() {
            t.insert("vm".into(), toml_vms(&self.added));
        }
        let body = toml::to_string(&t)?;
        Ok(format!(
            "# pvcm-backend: the VM changes made through the control socket (vm add, vm \
             remove, vm quota),\n# applied over the config file at start. Written by the \
             daemon; see docs/operations.md.\n{body}"
        ))
    }

    /// Writes `DIR/vms.toml` whole: to a temporary file, fsynced, renamed over it.
    pub fn save(&self, dir: &Path) -> io::Result<()> {
        let text = self.to_toml().map_err(io::Error::other)?;
        let path = dir.join(OVERLAY_FILE);
        let tmp = dir.join(format!("{OVERLAY_FILE}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let mut f = owner_only().write(true).create_new(true).open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_data()?;
        std::fs::rename(&tmp, &path)?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

/// One change to the VMs served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A VM no longer wanted.
    Remove(String),
    /// A VM whose socket, GID, ID range or another part of its identity changed: it is
    /// removed (its connections released) and added anew.
    Replace(VmSpec),
    /// A VM whose quota alone changed (`None`: the host's default).
    Quota(String, Option<u32>),
    /// A new VM.
    Add(VmSpec),
}

/// The changes that turn the VMs served (`current`) into `wanted`, matched by name:
/// removals first (they free sockets, GIDs and ID ranges), then replacements, quota
/// changes and additions.
pub fn diff(current: &[VmSpec], wanted: &[VmSpec]) -> Vec<Change> {
    let by_name = |set: &[VmSpec], n: &str| set.iter().find(|s| s.vm.name == n).cloned();
    let mut out = Vec::new();
    for c in current {
        if by_name(wanted, &c.vm.name).is_none() {
            out.push(Change::Remove(c.vm.name.clone()));
        }
    }
    for c in current {
        if let Some(w) = by_name(wanted, &c.vm.name)
            && !c.same_but_quota(&w)
        {
            out.push(Change::Replace(w));
        }
    }
    for c in current {
        if let Some(w) = by_name(wanted, &c.vm.name)
            && c.same_but_quota(&w)
            && c.vm.quota != w.vm.quota
        {
            out.push(Change::Quota(w.vm.name.clone(), w.vm.quota));
        }
    }
    for w in wanted {
        if by_name(current, &w.vm.name).is_none() {
            out.push(Change::Add(w.clone()));
        }
    }
    out
}

/// A served VM's thread and socket file (removed when dropped).
#[derive(Debug)]
pub(crate) struct VmThread {
    handle: JoinHandle<()>,
    _file: SocketFile,
}

/// VMs added, removed and changed while the daemon runs. The daemon owns it; the
/// control socket and SIGHUP change the VMs through it, one change at a time.
#[derive(Debug)]
pub struct Runtime {
    shared: Arc<Shared>,
    state: Mutex<RuntimeState>,
    /// Where a reload reads the configuration again: the daemon's command line (with
    /// its config file), and the configuration it started with (`None`: a daemon
    /// started from a [`crate::config::Config`] alone has nothing to read again).
    reload_source: Mutex<Option<(crate::config::ServeArgs, crate::config::Config)>>,
}

/// What a reload did.
#[derive(Debug)]
pub struct Reloaded {
    /// The VMs' changes.
    pub report: ReloadReport,
    /// Options that differ from the running configuration: they take effect at the
    /// next start only.
    pub restart_needed: Vec<&'static str>,
}

/// What adding a VM needs from the configuration, the VMs' threads, and the runtime
/// changes made so far. In [`Runtime`] behind a lock: one change at a time.
#[derive(Debug)]
pub(crate) struct RuntimeState {
    pub(crate) rx_backlog_bytes: usize,
    pub(crate) host_budget: Arc<HostBudget>,
    pub(crate) vm_sockets: SocketAccess,
    pub(crate) control: Option<PathBuf>,
    pub(crate) state_dir: Option<PathBuf>,
    /// The host loop's epoll (the wire port's sockets of a VM added are polled there).
    pub(crate) epoll: Arc<Epoll>,
    pub(crate) threads: HashMap<usize, VmThread>,
    /// The VMs of the config file and the command line, as last read.
    pub(crate) file_vms: Vec<VmSpec>,
    pub(crate) overlay: Overlay,
}

/// What a reload did.
#[derive(Debug, Default)]
pub struct ReloadReport {
    /// Changes applied.
    pub applied: Vec<String>,
    /// Changes that failed, with the error.
    pub failed: Vec<String>,
}

impl RuntimeState {
    /// Starts serving `port` on `listener`: its thread takes one session after another.
    pub(crate) fn spawn(
        &mut self,
        shared: &Arc<Shared>,
        port: Arc<VmPort>,
        listener: Listener,
        file: SocketFile,
    ) -> Result<(), RuntimeError> {
        let (s, p) = (shared.clone(), port.clone());
        let handle = std::thread::Builder::new()
            .name(format!("pvcm-vm-{}", port.index))
            .spawn(move || crate::session::vm_thread(s, p, listener))
            .map_err(io_err("spawn"))?;
        self.threads.insert(
            port.index,
            VmThread {
                handle,
                _file: file,
            },
        );
        Ok(())
    }

    /// Adds a VM: checked with the VMs served, its address taken by the wire port, its
    /// socket bound and served.
    fn add(&mut self, shared: &Arc<Shared>, spec: VmSpec) -> Result<(), RuntimeError> {
        if shared.stopping() {
            return Err(RuntimeError::Stopping);
        }
        let vms = shared.vms();
        let mut all: Vec<VmSpec> = vms.iter().map(|p| p.spec()).collect();
        all.push(spec.clone());
        check_vm_set(&all, self.control.as_deref())?;
        check_sockets_outside_state([spec.socket.as_path()], self.state_dir.as_deref())?;
        shared.lock_core().mux.can_attach(&spec.vm)?;
        let index = vms.next_index();
        let epoll = self.epoll.clone();
        shared.port.add_vm(index, &spec, &mut |fd, tok| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, tok),
            )
        })?;
        let unpoll = |shared: &Shared| {
            shared.port.remove_vm(index, &mut |fd| {
                let _ = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
            })
        };
        let port = match VmPort::new(
            index,
            spec.clone(),
            self.rx_backlog_bytes,
            self.host_budget.clone(),
        ) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                unpoll(shared);
                return Err(io_err("eventfd")(e));
            }
        };
        let listener = match crate::files::bind_socket(&spec.socket, &self.vm_sockets) {
            Ok((l, file)) => (Listener::from(l), file),
            Err(e) => {
                unpoll(shared);
                return Err(e.into());
            }
        };
        shared.vms.update(|s| s.with(port.clone()));
        let (listener, file) = listener;
        if let Err(e) = self.spawn(shared, port, listener, file) {
            shared.vms.update(|s| s.without(index));
            unpoll(shared);
            return Err(e);
        }
        tracing::info!(vm = %spec.vm.name, gid = %spec.gids_text(), socket = %spec.socket.display(), "VM added");
        Ok(())
    }

    /// Removes a VM: ends its session, releases its connections on its behalf (as when
    /// the VM dies), stops its thread, gives its address up, removes its socket.
    /// Returns how many live connections it held.
    fn remove(&mut self, shared: &Arc<Shared>, name: &str) -> Result<u64, RuntimeError> {
        let vms = shared.vms();
        let port = vms
            .by_name(name)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownVm(name.to_string()))?;
        if !shared.port.changes_vms() {
            return Err(PortError::FixedVms(shared.port.rx_mode()).into());
        }
        let live = port.current_vm().map_or(0, |vm| {
            let core = shared.lock_core();
            core.mux.vm_stats(vm).live
        });
        port.leaving.store(true, Ordering::Release);
        if let Some(h) = lock(&port.session).as_ref() {
            h.0.shutdown();
        }
        port.wake_accept();
        if let Some(t) = self.threads.remove(&port.index) {
            // Its session was told to end and its wait for a connection woken: the
            // join waits for neither a VMM nor the socket's path.
            let _ = t.handle.join();
        }
        // A VM with no session (restored and not back yet) is released here.
        shared.detach(&port);
        let epoll = self.epoll.clone();
        shared.port.remove_vm(port.index, &mut |fd| {
            let _ = epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
        });
        shared.vms.update(|s| s.without(port.index));
        shared.retired.absorb(&port.counters);
        tracing::info!(vm = %name, released = live, "VM removed");
        Ok(live)
    }

    /// Sets a VM's quota; returns its live connections.
    fn set_quota(
        &mut self,
        shared: &Arc<Shared>,
        name: &str,
        quota: Option<u32>,
    ) -> Result<u64, RuntimeError> {
        let vms = shared.vms();
        let port = vms
            .by_name(name)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownVm(name.to_string()))?;
        // The VM's own rules (a quota its ID range holds) before anything changes.
        port.spec().with_quota(quota).map_err(|e| ConfigError::Vm {
            vm: format!("VM {name:?}"),
            source: Box::new(e),
        })?;
        let life = port.lifecycle();
        let live = match life.vm() {
            Some(vm) => {
                let mut core = shared.lock_core();
                let live = core.mux.set_quota(vm, quota)?;
                core.commit();
                u64::from(live)
            }
            None => 0,
        };
        port.set_quota(quota);
        drop(life);
        tracing::info!(vm = %name, quota = ?quota, live, "VM quota changed");
        Ok(live)
    }

    /// Every VM thread, taken out to be joined ([`join_threads`]) once the daemon
    /// stops.
    pub(crate) fn take_threads(&mut self) -> Vec<VmThread> {
        self.threads.drain().map(|(_, t)| t).collect()
    }

    fn persist(&self) {
        if let Some(dir) = &self.state_dir
            && let Err(e) = self.overlay.save(dir)
        {
            tracing::error!(error = %e, dir = %dir.display(), "cannot keep the runtime VM changes: a restart loses them");
        }
    }

    fn is_added(&self, name: &str) -> bool {
        self.overlay.added.iter().any(|s| s.vm.name == name)
    }

    fn in_file(&self, name: &str) -> bool {
        self.file_vms.iter().any(|s| s.vm.name == name)
    }

    /// Applies `changes`, each on its own: one that fails is reported, the others go on.
    fn apply(&mut self, shared: &Arc<Shared>, changes: Vec<Change>) -> ReloadReport {
        let mut r = ReloadReport::default();
        for c in changes {
            let (what, res) = match &c {
                Change::Remove(n) => (format!("remove {n}"), self.remove(shared, n).map(|_| ())),
                Change::Replace(s) => {
                    tracing::info!(vm = %s.vm.name, "the VM's socket, GID, ID range or identity changed: removed and added anew");
                    let res = self
                        .remove(shared, &s.vm.name)
                        .and_then(|_| self.add(shared, s.clone()));
                    (format!("replace {}", s.vm.name), res)
                }
                Change::Quota(n, q) => (
                    format!(
                        "quota {n} {}",
                        q.map_or("default".into(), |q| q.to_string())
                    ),
                    self.set_quota(shared, n, *q).map(|_| ()),
                ),
                Change::Add(s) => (format!("add {}", s.vm.name), self.add(shared, s.clone())),
            };
            match res {
                Ok(()) => r.applied.push(what),
                Err(e) => {
                    tracing::error!(change = %what, error = %e, "reload: change failed");
                    r.failed.push(format!("{what}: {e}"));
                }
            }
        }
        r
    }
}

/// Joins VM threads whose sessions were told to end and whose accept waits were woken,
/// then removes their sockets.
pub(crate) fn join_threads(threads: Vec<VmThread>) {
    for t in threads {
        let _ = t.handle.join();
    }
}

impl Runtime {
    /// The runtime of the VMs served by `shared`, starting from `state`.
    pub(crate) fn new(shared: Arc<Shared>, state: RuntimeState) -> Runtime {
        Runtime {
            shared,
            state: Mutex::new(state),
            reload_source: Mutex::new(None),
        }
    }

    /// The state the VMs' threads and the host loop share.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The runtime's own state, locked: no other change applies while it is held.
    pub(crate) fn state(&self) -> MutexGuard<'_, RuntimeState> {
        lock(&self.state)
    }

    /// `vm add SPEC`: serves a new VM.
    pub fn add_vm(&self, spec: VmSpec) -> Result<(), RuntimeError> {
        let mut rt = self.state();
        rt.add(&self.shared, spec.clone())?;
        rt.overlay.added.push(spec);
        rt.persist();
        Ok(())
    }

    /// `vm remove NAME`: stops serving a VM; returns the live connections released.
    pub fn remove_vm(&self, name: &str) -> Result<u64, RuntimeError> {
        let mut rt = self.state();
        let live = rt.remove(&self.shared, name)?;
        if rt.is_added(name) {
            rt.overlay.added.retain(|s| s.vm.name != name);
        } else if rt.in_file(name) {
            rt.overlay.removed.insert(name.to_string());
            rt.overlay.quotas.remove(name);
        }
        rt.persist();
        Ok(live)
    }

    /// `vm quota NAME N`: sets a VM's quota (`None`: the host's default); returns its
    /// live connections.
    pub fn set_vm_quota(&self, name: &str, quota: Option<u32>) -> Result<u64, RuntimeError> {
        let mut rt = self.state();
        let live = rt.set_quota(&self.shared, name, quota)?;
        if let Some(s) = rt.overlay.added.iter_mut().find(|s| s.vm.name == name) {
            s.vm.quota = quota;
        } else {
            let file_quota = rt
                .file_vms
                .iter()
                .find(|s| s.vm.name == name)
                .and_then(|s| s.vm.quota);
            match quota {
                Some(q) if quota != file_quota => {
                    rt.overlay.quotas.insert(name.to_string(), q);
                }
                _ => {
                    rt.overlay.quotas.remove(name);
                }
            }
        }
        rt.persist();
        Ok(live)
    }

    /// `vm list`: the VMs served, as JSON.
    pub fn list_vms(&self) -> serde_json::Value {
        let rt = self.state();
        let vms: Vec<serde_json::Value> = self
            .shared
            .vms()
            .iter()
            .map(|p| {
                let spec = p.spec();
                let life = p.lifecycle();
                serde_json::json!({
                    "name": spec.vm.name,
                    "socket": spec.socket.display().to_string(),
                    "gid": spec.vm.gid.to_string(),
                    "gids": spec.vm.gids().map(|g| g.to_string()).collect::<Vec<_>>(),
                    "quota": spec.vm.quota.unwrap_or(self.shared.default_quota()),
                    "quota_is_default": spec.vm.quota.is_none(),
                    "id_range": spec.vm.id_range.map(|r| r.to_string()),
                    "attached": life.vm().is_some(),
                    "state": life.name(),
                    "origin": if rt.is_added(&spec.vm.name) { "runtime" } else { "config" },
                    "spec": spec.to_arg(),
                })
            })
            .collect();
        serde_json::Value::Array(vms)
    }

    /// Gives the runtime what a reload reads again: the daemon's command line and the
    /// configuration it started with.
    pub fn set_reload_source(
        &self,
        args: crate::config::ServeArgs,
        running: crate::config::Config,
    ) {
        *lock(&self.reload_source) = Some((args, running));
    }

    /// Reads the configuration again (SIGHUP, `pvcm-backend reload`) and applies the
    /// difference in its VMs ([`Runtime::reload_vms`]); names the other options that
    /// changed, which take effect at the next start. A file that does not read or check,
    /// or VMs that break a rule, change nothing and are the error. Either way the
    /// outcome is recorded for `stat` and the metrics.
    pub fn reload(&self) -> Result<Reloaded, String> {
        let source = lock(&self.reload_source).clone();
        let outcome = match source {
            None => Err("this daemon has no configuration to read again".to_string()),
            Some((args, running)) => crate::config::Config::from_args(&args)
                .map_err(|e| format!("the configuration does not read or check: {e}"))
                .and_then(|new| {
                    let restart_needed = running.restart_options(&new);
                    self.reload_vms(new.vms)
                        .map(|report| Reloaded {
                            report,
                            restart_needed,
                        })
                        .map_err(|e| format!("the VMs were refused: {e}"))
                }),
        };
        let mut r = lock(&self.shared.reloads);
        match &outcome {
            Ok(done) => {
                r.ok += 1;
                r.restart_needed = done.restart_needed.iter().map(|s| s.to_string()).collect();
            }
            Err(_) => r.failed += 1,
        }
        r.last_ok = outcome.is_ok();
        r.last_unix_seconds = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        outcome
    }

    /// SIGHUP: the config file's VMs are now `file`. The VMs served change by the
    /// difference (runtime changes kept over it); a set that breaks the rules changes
    /// nothing and is the error.
    pub fn reload_vms(&self, file: Vec<VmSpec>) -> Result<ReloadReport, RuntimeError> {
        let mut rt = self.state();
        let mut overlay = rt.overlay.clone();
        overlay.rebase(&rt.file_vms, &file);
        let (wanted, _) = overlay.apply(&file, rt.control.as_deref(), true)?;
        let current: Vec<VmSpec> = self.shared.vms().iter().map(|p| p.spec()).collect();
        let report = rt.apply(&self.shared, diff(&current, &wanted));
        rt.file_vms = file;
        rt.overlay = overlay;
        rt.persist();
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(s: &str) -> VmSpec {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn the_diff_removes_first_then_replaces_requotas_and_adds() {
        let cur = vec![
            vm("name=a,socket=/s/a,gid=127.0.0.1"),
            vm("name=b,socket=/s/b,gid=127.0.0.2,quota=10"),
            vm("name=c,socket=/s/c,gid=127.0.0.3"),
            vm("name=d,socket=/s/d,gid=127.0.0.4"),
        ];
        let want = vec![
            vm("name=e,socket=/s/e,gid=127.0.0.5"),
            vm("name=b,socket=/s/b,gid=127.0.0.2,quota=20"),
            vm("name=c,socket=/s/c2,gid=127.0.0.3"),
            vm("name=d,socket=/s/d,gid=127.0.0.4"),
        ];
        assert_eq!(
            diff(&cur, &want),
            vec![
                Change::Remove("a".into()),
                Change::Replace(want[2].clone()),
                Change::Quota("b".into(), Some(20)),
                Change::Add(want[0].clone()),
            ]
        );
        assert_eq!(diff(&want, &want), vec![]);
        // A quota back to the host's default is a quota change too.
        let b = vec![vm("name=b,socket=/s/b,gid=127.0.0.2")];
        assert_eq!(diff(&cur[1..2], &b), vec![Change::Quota("b".into(), None)]);
        // A changed GID or ID range is a new VM under the old name.
        let g = vec![vm("name=d,socket=/s/d,gid=127.0.0.9")];
        assert_eq!(diff(&cur[3..4], &g), vec![Change::Replace(g[0].clone())]);
        let r = vec![vm(
            "name=d,socket=/s/d,gid=127.0.0.4,id-range=0x80000000/16,quota=100",
        )];
        assert_eq!(diff(&cur[3..4], &r), vec![Change::Replace(r[0].clone())]);
    }

    #[test]
    fn the_overlay_applies_over_the_file_and_clashes_are_named() {
        let file = vec![
            vm("name=a,socket=/s/a,gid=127.0.0.1"),
            vm("name=b,socket=/s/b,gid=127.0.0.2"),
        ];
        let mut o = Overlay::default();
        o.removed.insert("a".into());
        o.quotas.insert("b".into(), 7);
        o.added.push(vm("name=c,socket=/s/c,gid=127.0.0.3"));
        let (set, warn) = o.apply(&file, None, true).unwrap();
        let names: Vec<_> = set.iter().map(|s| s.vm.name.as_str()).collect();
        assert_eq!(names, ["b", "c"]);
        assert_eq!(set[0].vm.quota, Some(7));
        assert!(warn.is_empty());
        // A VM added at runtime whose GID the file now gives another VM: refused by a
        // reload, left out (with a warning) at a start.
        o.added.push(vm("name=d,socket=/s/d,gid=127.0.0.2"));
        let e = o.apply(&file, None, true).unwrap_err().to_string();
        assert!(
            e.contains("\"d\" added at runtime") && e.contains("GID"),
            "{e}"
        );
        let (set, warn) = o.apply(&file, None, false).unwrap();
        assert_eq!(set.len(), 2);
        assert!(warn[0].contains("\"d\""), "{warn:?}");
        // Overlapping ID ranges and the control socket's path are refused too.
        let mut o = Overlay::default();
        o.added.push(vm(
            "name=x,socket=/s/x,gid=127.0.1.1,id-range=0x80000000/16,quota=100",
        ));
        o.added.push(vm(
            "name=y,socket=/s/y,gid=127.0.1.2,id-range=0x80008000/17,quota=100",
        ));
        let e = o.apply(&[], None, true).unwrap_err().to_string();
        assert!(e.contains("ID ranges") && e.contains("overlap"), "{e}");
        o.added.pop();
        let e = o
            .apply(&[], Some(Path::new("/s/x")), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("control socket"), "{e}");
    }

    #[test]
    fn a_rebase_forgets_what_the_file_changed() {
        let old = vec![
            vm("name=a,socket=/s/a,gid=127.0.0.1,quota=5"),
            vm("name=b,socket=/s/b,gid=127.0.0.2"),
            vm("name=c,socket=/s/c,gid=127.0.0.3"),
        ];
        let new = vec![
            vm("name=a,socket=/s/a,gid=127.0.0.1,quota=6"),
            vm("name=b,socket=/s/b,gid=127.0.0.2"),
        ];
        let mut o = Overlay::default();
        o.quotas.insert("a".into(), 100);
        o.quotas.insert("b".into(), 100);
        o.removed.insert("c".into());
        o.rebase(&old, &new);
        assert_eq!(o.quotas.keys().collect::<Vec<_>>(), ["b"]);
        assert!(o.removed.is_empty());
    }

    #[test]
    fn the_overlay_file_round_trips_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Overlay::load(dir.path()).unwrap(), Overlay::default());
        let mut o = Overlay::default();
        o.removed.insert("a".into());
        o.quotas.insert("b".into(), 7);
        o.added.push(vm(
            "name=c,socket=/s/c,gid=fe80::1%lo,quota=100,id-range=0x80000000/16,incoming=yes,\
             qpn-base=16,qpn-count=0x100,ca-guid=0x1234",
        ));
        o.added.push(vm("name=d,socket=/s/d,gid=127.0.0.4"));
        o.save(dir.path()).unwrap();
        assert_eq!(Overlay::load(dir.path()).unwrap(), o);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        for bad in [
            "colour = 1\n",
            "removed = [1]\n",
            "[quota]\nb = 0\n",
            "[[vm]]\nname = \"x\"\n",
            "removed = \n",
        ] {
            std::fs::write(dir.path().join(OVERLAY_FILE), bad).unwrap();
            let e = Overlay::load(dir.path()).unwrap_err().to_string();
            assert!(
                e.contains(OVERLAY_FILE) && e.contains("move it away"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_quota_is_checked_by_the_vms_own_rules() {
        let s = vm("name=a,socket=/s/a,gid=127.0.0.1,id-range=0x80000000/24,quota=8");
        assert!(s.with_quota(Some(128)).is_ok());
        // The host's default quota does not fit a /24.
        let e = s.with_quota(None).unwrap_err().to_string();
        assert!(e.contains("default quota"), "{e}");
        let e = s.with_quota(Some(129)).unwrap_err().to_string();
        assert!(e.contains("quota") && e.contains("256 IDs"), "{e}");
        assert!(s.with_quota(Some(0)).is_err());
        assert!(s.same_but_quota(&s.with_quota(Some(3)).unwrap()));
    }
}
