//! A lab run's world: the temporary directory, the host processes, the relay, and the
//! VM threads with their phase gates; and the harness that runs a VM program on every
//! VM, waits for quiesce and collects the figures.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use pvcm_backend::stats::Snapshot;
use pvcm_guest::cm::{AgentConfig, DropReason, Group, MESSAGES};
use pvcm_guest::device::{DeviceError, Notice};
use serde::Serialize;

use super::guest::{GuestOpts, GuestVm, LabDevice};
use super::host::{HostProc, HostSpec, VmSlot};
use super::opts::LabOptions;
use super::progress::Progress;
use super::relay::{Relay, RelayHost, RelayStats};

/// The RoCEv2 port hosts use when no relay is in the path.
pub const ROCE_PORT: u16 = pvcm_wire::roce::UDP_PORT;

pub use super::error::{LabError, LabResult};

/// VMs per host that fit in one /24 of the lab's addresses.
pub const VMS_PER_BLOCK: usize = 250;

/// The most VMs one host can have: two blocks.
pub const MAX_VMS_PER_HOST: usize = 2 * VMS_PER_BLOCK;

/// The most hosts a run with more than [`VMS_PER_BLOCK`] VMs per host can have (their
/// second blocks start at third octet 129, below the rate scenario's 250).
pub const MAX_HOSTS_WITH_TWO_BLOCKS: usize = 120;

/// VM `vm` (0-based) of host `host` (0-based) on net `net`: `127.net.(host+1).(vm+1)`
/// for the first [`VMS_PER_BLOCK`] VMs, `127.net.(host+129).(vm-249)` for the rest.
pub fn vm_addr(net: u8, host: usize, vm: usize) -> Ipv4Addr {
    let (block, v) = (vm / VMS_PER_BLOCK, vm % VMS_PER_BLOCK);
    Ipv4Addr::new(127, net, (host + 1 + 128 * block) as u8, (v + 1) as u8)
}

/// The hosts and the relay of one run.
#[derive(Debug)]
pub struct World {
    /// Every VM, host-major.
    pub slots: Vec<VmSlot>,
    /// The host processes.
    pub hosts: Vec<HostProc>,
    /// The fault relay, if any fault was asked for.
    pub relay: Option<Relay>,
    /// A run ID (in every private-data stamp).
    pub run_id: u32,
    /// RSS of each backend right after start (KiB).
    pub rss_start: Vec<Option<u64>>,
    /// The run's directory is kept after the run (`--keep-dir`).
    pub keep_dir: bool,
    dir: tempfile::TempDir,
}

impl World {
    /// Starts one backend per entry of `layout` (its VM count), with `seeds[h]` as host
    /// `h`'s mux seed (default: derived from the run's seed), and the relay if faults are
    /// asked for.
    pub fn start(o: &LabOptions, layout: &[usize], seeds: Option<&[u64]>) -> LabResult<World> {
        let two_blocks = layout.iter().any(|&n| n > VMS_PER_BLOCK);
        let max_hosts = if two_blocks {
            MAX_HOSTS_WITH_TWO_BLOCKS
        } else {
            200
        };
        if layout.is_empty()
            || layout.len() > max_hosts
            || layout.iter().any(|&n| n == 0 || n > MAX_VMS_PER_HOST)
        {
            return Err(format!(
                "bad layout {layout:?}: 1 to 200 hosts of 1 to {VMS_PER_BLOCK} VMs, or 1 to \
                 {MAX_HOSTS_WITH_TWO_BLOCKS} hosts of up to {MAX_VMS_PER_HOST}"
            )
            .into());
        }
        let dir = tempfile::Builder::new()
            .prefix("pvcm-lab-")
            .tempdir()
            .map_err(|e| format!("temporary directory: {e}"))?;
        let relay_on = o.faults.any();
        let mut slots = Vec::new();
        let mut specs = Vec::new();
        for (h, &n) in layout.iter().enumerate() {
            let vms: Vec<VmSlot> = (0..n)
                .map(|v| {
                    let name = format!("h{}v{}", h + 1, v + 1);
                    VmSlot {
                        host: h,
                        vm: v,
                        global: slots.len() + v,
                        socket: dir.path().join(format!("{name}.sock")),
                        name,
                        addr: vm_addr(o.net, h, v),
                        quota: o.quota,
                    }
                })
                .collect();
            slots.extend(vms.iter().cloned());
            let name = format!("h{}", h + 1);
            specs.push(HostSpec {
                index: h,
                vms,
                policy: o.policy,
                seed: seeds
                    .and_then(|s| s.get(h).copied())
                    .unwrap_or(o.seed.wrapping_mul(0x9E37_79B9).wrapping_add(h as u64 + 1)),
                bind_port: if relay_on {
                    ROCE_PORT + 1 + h as u16
                } else {
                    ROCE_PORT
                },
                control: dir.path().join(format!("{name}.ctl")),
                pcap: o.pcap.as_ref().map(|d| d.join(format!("{name}.pcap"))),
                rx_backlog: 1 << 20,
                log: dir.path().join(format!("{name}.log")),
                name,
                extra: Vec::new(),
            });
        }
        if let Some(d) = &o.pcap {
            std::fs::create_dir_all(d).map_err(|e| format!("--pcap {}: {e}", d.display()))?;
        }
        let relay = if relay_on {
            let rh: Vec<RelayHost> = specs
                .iter()
                .map(|s| RelayHost {
                    port: s.bind_port,
                    addrs: s.vms.iter().map(|v| v.addr).collect(),
                })
                .collect();
            Some(Relay::start(&rh, o.faults, o.seed).map_err(|e| format!("relay: {e}"))?)
        } else {
            None
        };
        let mut hosts = Vec::new();
        for s in specs {
            let name = s.name.clone();
            let h = HostProc::spawn(&o.exe, s, Duration::from_secs(20))
                .map_err(|e| format!("host {name}: {e}"))?;
            hosts.push(h);
        }
        let rss_start = hosts.iter().map(HostProc::rss_kib).collect();
        let run_id = (o.seed as u32) ^ std::process::id().rotate_left(16);
        let mut dir = dir;
        if o.keep_dir {
            dir.disable_cleanup(true);
        }
        Ok(World {
            slots,
            hosts,
            relay,
            run_id,
            rss_start,
            keep_dir: o.keep_dir,
            dir,
        })
    }

    /// The run's directory (sockets, control sockets, backend logs).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// The VMs of host `h`.
    pub fn vms_of(&self, h: usize) -> impl Iterator<Item = &VmSlot> {
        self.slots.iter().filter(move |s| s.host == h)
    }

    /// Every host's figures (None for a host that does not answer).
    pub fn snapshots(&self) -> Vec<Option<Snapshot>> {
        self.hosts.iter().map(|h| h.stat().ok()).collect()
    }

    /// Live mux entries summed over the hosts (None if one does not answer).
    pub fn live_entries(&self) -> Option<u64> {
        let mut n = 0;
        for h in &self.hosts {
            n += h.stat().ok()?.host.live;
        }
        Some(n)
    }

    /// Stops the relay and the hosts; returns the relay's figures.
    pub fn shutdown(mut self) -> Option<RelayStats> {
        let r = self.relay.take().map(Relay::stop);
        for h in &mut self.hosts {
            h.stop();
        }
        r
    }
}

/// A phase gate: VMs arrive; it is open once all have.
#[derive(Debug, Default)]
pub struct Gate {
    arrived: AtomicUsize,
    last: Mutex<Option<Instant>>,
}

impl Gate {
    /// One VM arrived.
    pub fn arrive(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        self.arrived.fetch_add(1, Ordering::AcqRel);
    }

    /// How many arrived.
    pub fn arrived(&self) -> usize {
        self.arrived.load(Ordering::Acquire)
    }

    /// When the last VM arrived.
    pub fn last(&self) -> Option<Instant> {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Gates per run.
pub const GATES: usize = 6;

/// What VM threads and the main thread share.
#[derive(Debug)]
pub struct Ctl {
    /// VMs in the run.
    pub vms: usize,
    /// VMs that take part in gates (vanished ones leave).
    pub members: AtomicUsize,
    /// Phase gates.
    pub gates: [Gate; GATES],
    /// Progress units done (for the bar).
    pub progress: AtomicU64,
    /// VMs whose workload is done.
    pub done: AtomicUsize,
    /// Set by a VM that failed: the others stop waiting.
    pub abort: AtomicBool,
    /// Main -> VMs: stop lingering, report.
    pub stop: AtomicBool,
    /// Main -> VMs: you may close your session.
    pub release: AtomicBool,
    /// Per VM: its agent holds no connection state.
    pub quiet: Vec<AtomicBool>,
    /// When the workload started (all VMs connected).
    pub start: Mutex<Option<Instant>>,
    /// Errors.
    pub errors: Mutex<Vec<String>>,
    /// Counters a scenario's VMs share (meaning per scenario).
    pub shared: [AtomicU64; 8],
}

impl Ctl {
    fn new(vms: usize) -> Ctl {
        Ctl {
            vms,
            members: AtomicUsize::new(vms),
            gates: Default::default(),
            progress: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            abort: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            release: AtomicBool::new(false),
            quiet: (0..vms).map(|_| AtomicBool::new(false)).collect(),
            start: Mutex::new(None),
            errors: Mutex::new(Vec::new()),
            shared: Default::default(),
        }
    }

    /// Whether gate `g` is open (every member VM arrived).
    pub fn open(&self, g: usize) -> bool {
        self.gates[g].arrived() >= self.members.load(Ordering::Acquire)
    }

    /// Records an error and makes every VM stop waiting.
    pub fn fail(&self, e: String) {
        self.errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(e);
        self.abort.store(true, Ordering::Release);
    }

    /// Whether the run is aborting.
    pub fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }

    /// Adds progress units.
    pub fn tick(&self, n: u64) {
        self.progress.fetch_add(n, Ordering::Relaxed);
    }
}

/// What a VM program sees.
#[derive(Debug, Clone, Copy)]
pub struct VmEnv<'a> {
    /// This VM.
    pub slot: &'a VmSlot,
    /// Every VM.
    pub slots: &'a [VmSlot],
    /// The run's options.
    pub opts: &'a LabOptions,
    /// Shared control.
    pub ctl: &'a Ctl,
    /// The run ID.
    pub run_id: u32,
}

impl VmEnv<'_> {
    /// Pumps the device until gate `g` is open (or the phase timeout / an abort).
    pub fn wait_gate(&self, dev: &mut LabDevice, g: usize) -> LabResult<()> {
        let until = Instant::now() + self.opts.phase_timeout;
        while !self.ctl.open(g) {
            if self.ctl.aborted() {
                return Err(LabError::Aborted);
            }
            if Instant::now() > until {
                return Err(LabError::Timeout(format!(
                    "{}: gate {g} open",
                    self.slot.name
                )));
            }
            dev.wait(Duration::from_millis(2)).map_err(dev_err)?;
        }
        Ok(())
    }
}

/// A device error as a lab error.
pub fn dev_err(e: DeviceError) -> LabError {
    LabError::device("device")(e)
}

/// Counters of one guest (or of a host's guests summed), in the infiniband_cm shape.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct GuestFigures {
    /// VMs summed.
    pub vms: u64,
    /// Group (`cm_tx_msgs`, ...) -> message (`req`, ...) -> count.
    pub cm: BTreeMap<String, BTreeMap<String, u64>>,
    /// The agents' drops by reason (non-zero only).
    pub drops: BTreeMap<String, u64>,
    /// Device-layer counts.
    pub device: BTreeMap<String, u64>,
    /// Connections the agents still remember (TimeWait included).
    pub connections_left: u64,
    /// Remembered connections per state (non-zero only).
    pub states: BTreeMap<String, u64>,
}

impl GuestFigures {
    /// The figures of one device.
    pub fn of(dev: &LabDevice) -> GuestFigures {
        let a = dev.agent();
        let mut cm = BTreeMap::new();
        for g in Group::ALL {
            let mut m = BTreeMap::new();
            for t in MESSAGES {
                m.insert(t.name().to_string(), a.counters().get(g, t));
            }
            cm.insert(g.name().to_string(), m);
        }
        let drops = DropReason::ALL
            .iter()
            .map(|r| (r.name().to_string(), a.drops().get(*r)))
            .filter(|(_, n)| *n > 0)
            .collect();
        let s = dev.stats();
        let device = [
            ("rx_msgs", s.rx_msgs),
            ("rx_mads", s.rx_mads),
            ("tx_mads", s.tx_mads),
            ("tx_control", s.tx_control),
            ("send_errors", s.send_errors),
            ("resets", s.resets),
            ("rx_dropped", s.rx_dropped()),
            ("tx_backpressure", s.tx_backpressure),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let states = a
            .state_histogram()
            .into_iter()
            .map(|(s, n)| (s.name().to_string(), n as u64))
            .collect();
        GuestFigures {
            vms: 1,
            cm,
            drops,
            device,
            connections_left: a.connection_count() as u64,
            states,
        }
    }

    /// Adds another's figures.
    pub fn add(&mut self, o: &GuestFigures) {
        self.vms += o.vms;
        for (g, m) in &o.cm {
            let e = self.cm.entry(g.clone()).or_default();
            for (k, v) in m {
                *e.entry(k.clone()).or_default() += v;
            }
        }
        for (maps, other) in [
            (&mut self.drops, &o.drops),
            (&mut self.device, &o.device),
            (&mut self.states, &o.states),
        ] {
            for (k, v) in other {
                *maps.entry(k.clone()).or_default() += v;
            }
        }
        self.connections_left += o.connections_left;
    }

    /// One counter.
    pub fn cm(&self, group: &str, msg: &str) -> u64 {
        self.cm
            .get(group)
            .and_then(|m| m.get(msg))
            .copied()
            .unwrap_or(0)
    }

    /// A group's total.
    pub fn total(&self, group: &str) -> u64 {
        self.cm.get(group).map_or(0, |m| m.values().sum())
    }

    /// One device count.
    pub fn dev(&self, k: &str) -> u64 {
        self.device.get(k).copied().unwrap_or(0)
    }

    /// One drop count.
    pub fn dropped(&self, k: &str) -> u64 {
        self.drops.get(k).copied().unwrap_or(0)
    }
}

/// One VM's outcome.
#[derive(Debug)]
pub struct VmOutcome<O> {
    /// Which VM (global index).
    pub global: usize,
    /// The program's result.
    pub result: LabResult<O>,
    /// Its figures at the end (None if it vanished or never started).
    pub figures: Option<GuestFigures>,
}

/// What [`run_vms`] measured.
#[derive(Debug)]
pub struct Outcome<O> {
    /// Per VM, in global order.
    pub vms: Vec<VmOutcome<O>>,
    /// Each host's figures after quiesce (before the VMs detach).
    pub snapshots: Vec<Option<Snapshot>>,
    /// Each host's RSS at the end (KiB).
    pub rss_end: Vec<Option<u64>>,
    /// Each host's RSS when half the progress units were done (KiB).
    pub rss_mid: Vec<Option<u64>>,
    /// Each backend's threads after quiesce, VMs still attached.
    pub threads_end: Vec<Option<u64>>,
    /// Each backend's CPU use (share of one core) over `idle_window` after quiesce,
    /// with every VM attached and idle.
    pub idle_cpu: Vec<Option<f64>>,
    /// From all VMs connected to all workloads done.
    pub workload: Duration,
    /// From the workloads done to quiesce (or the timeout).
    pub quiesce: Duration,
    /// Whether every agent and every mux emptied.
    pub quiesced: bool,
    /// Gate opening times, from the start.
    pub gates: [Option<Duration>; GATES],
    /// Errors of the run.
    pub errors: Vec<String>,
}

impl<O> Outcome<O> {
    /// Gate `g`'s opening, from the start.
    pub fn gate(&self, g: usize) -> Option<Duration> {
        self.gates[g]
    }

    /// The successful results.
    pub fn results(&self) -> impl Iterator<Item = (usize, &O)> {
        self.vms
            .iter()
            .filter_map(|v| v.result.as_ref().ok().map(|r| (v.global, r)))
    }
}

/// Pumps until no MAD waits for the device and every tx buffer was consumed.
pub fn flush(dev: &mut LabDevice) {
    let _ = dev.flush(Duration::from_secs(2));
}

/// Takes every pending notice (device and CM).
pub fn notices(dev: &mut LabDevice) -> Vec<Notice> {
    let mut v = Vec::new();
    while let Some(n) = dev.pop_notice() {
        v.push(n);
    }
    v
}

/// Runs `program` on every VM (one thread each), then lingers (pumping) until every
/// agent and every mux is empty or the quiesce timeout, takes the figures, and lets the
/// VMs go. `units` is the progress bar's length.
///
/// The program gets the VM (it may take it out to make it vanish) and its environment;
/// it returns when its workload is done.
pub fn run_vms<O, F>(
    world: &World,
    o: &LabOptions,
    units: u64,
    label: &str,
    program: F,
) -> Outcome<O>
where
    O: Send,
    F: Fn(&mut Option<GuestVm>, &VmEnv<'_>) -> LabResult<O> + Sync,
{
    let n = world.slots.len();
    let ctl = Ctl::new(n);
    let (tx, rx) = mpsc::channel::<VmOutcome<O>>();
    let connected = AtomicUsize::new(0);
    let bar = Progress::new(o.progress, units, label);
    let mut outcome = Outcome {
        vms: Vec::new(),
        snapshots: Vec::new(),
        rss_end: Vec::new(),
        rss_mid: Vec::new(),
        threads_end: Vec::new(),
        idle_cpu: Vec::new(),
        workload: Duration::ZERO,
        quiesce: Duration::ZERO,
        quiesced: false,
        gates: [None; GATES],
        errors: Vec::new(),
    };
    std::thread::scope(|s| {
        for slot in &world.slots {
            let (tx, ctl, connected, program) = (tx.clone(), &ctl, &connected, &program);
            let env = VmEnv {
                slot,
                slots: &world.slots,
                opts: o,
                ctl,
                run_id: world.run_id,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("vm-{}", slot.name))
                .spawn_scoped(s, move || vm_thread(env, connected, tx, program));
            if let Err(e) = spawned {
                ctl.fail(format!("spawning {}: {e}", slot.name));
                ctl.done.fetch_add(1, Ordering::AcqRel);
                connected.fetch_add(1, Ordering::AcqRel);
            }
        }
        drop(tx);
        // Wait for every VM to connect, then time the workload.
        let t_connect = Instant::now();
        while connected.load(Ordering::Acquire) < n && !ctl.aborted() {
            if t_connect.elapsed() > Duration::from_secs(60) {
                ctl.fail("VMs did not connect within 60 s".into());
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let t0 = Instant::now();
        *ctl.start.lock().unwrap_or_else(|e| e.into_inner()) = Some(t0);
        let deadline = t0 + o.phase_timeout * 4;
        while ctl.done.load(Ordering::Acquire) < n {
            let p = ctl.progress.load(Ordering::Relaxed);
            bar.set(p);
            if outcome.rss_mid.is_empty() && p >= units / 2 {
                outcome.rss_mid = world.hosts.iter().map(HostProc::rss_kib).collect();
            }
            if Instant::now() > deadline {
                ctl.fail(format!("workload not done after {:?}", o.phase_timeout * 4));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bar.set(ctl.progress.load(Ordering::Relaxed));
        let t1 = Instant::now();
        outcome.workload = t1 - t0;
        // Quiesce: every agent empty and every mux without live entries.
        let qdeadline = t1 + o.quiesce();
        bar.message("quiesce");
        loop {
            let agents = ctl.quiet.iter().all(|q| q.load(Ordering::Acquire));
            if agents && world.live_entries() == Some(0) {
                outcome.quiesced = true;
                break;
            }
            if Instant::now() > qdeadline || ctl.aborted() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        outcome.quiesce = t1.elapsed();
        ctl.stop.store(true, Ordering::Release);
        let mut got: Vec<VmOutcome<O>> = rx.iter().take(n).collect();
        got.sort_by_key(|v| v.global);
        outcome.vms = got;
        outcome.snapshots = world.snapshots();
        outcome.rss_end = world.hosts.iter().map(HostProc::rss_kib).collect();
        outcome.threads_end = world.hosts.iter().map(HostProc::threads).collect();
        if let Some(w) = o.idle_window {
            let t0: Vec<_> = world.hosts.iter().map(HostProc::cpu_time).collect();
            let start = Instant::now();
            std::thread::sleep(w);
            let elapsed = start.elapsed().as_secs_f64();
            outcome.idle_cpu = world
                .hosts
                .iter()
                .zip(t0)
                .map(|(h, t0)| {
                    let (t0, t1) = (t0?, h.cpu_time()?);
                    Some(t1.saturating_sub(t0).as_secs_f64() / elapsed)
                })
                .collect();
        }
        ctl.release.store(true, Ordering::Release);
        bar.finish();
    });
    for (g, gate) in ctl.gates.iter().enumerate() {
        if gate.arrived() > 0 {
            let start = ctl
                .start
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(Instant::now);
            outcome.gates[g] = gate.last().map(|t| t.saturating_duration_since(start));
        }
    }
    outcome.errors = std::mem::take(&mut *ctl.errors.lock().unwrap_or_else(|e| e.into_inner()));
    outcome
}

fn vm_thread<O, F>(
    env: VmEnv<'_>,
    connected: &AtomicUsize,
    tx: mpsc::Sender<VmOutcome<O>>,
    program: &F,
) where
    F: Fn(&mut Option<GuestVm>, &VmEnv<'_>) -> LabResult<O>,
{
    let ctl = env.ctl;
    let slot = env.slot;
    let gopts = GuestOpts {
        queue_size: env.opts.queue_size,
        seed: env.opts.seed ^ ((slot.global as u64 + 1) << 32) ^ u64::from(env.run_id),
        configure: env
            .opts
            .linux_drep
            .then_some((|c: &mut AgentConfig| c.auto_drep = false) as fn(&mut AgentConfig)),
        ..GuestOpts::default()
    };
    let mut vm = match GuestVm::connect(&slot.socket, &gopts) {
        Ok(v) => Some(v),
        Err(e) => {
            ctl.fail(format!("{}: {e}", slot.name));
            None
        }
    };
    connected.fetch_add(1, Ordering::AcqRel);
    // Start together.
    while ctl
        .start
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_none()
        && !ctl.aborted()
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let result = match vm.is_some() {
        true if !ctl.aborted() => program(&mut vm, &env),
        _ => Err(LabError::NotStarted),
    };
    if let Err(e) = &result {
        if !matches!(e, LabError::Aborted | LabError::NotStarted) {
            ctl.fail(format!("{}: {e}", slot.name));
        }
    }
    if vm.is_none() {
        // Vanished: no longer a gate member.
        ctl.quiet[slot.global].store(true, Ordering::Release);
    }
    ctl.done.fetch_add(1, Ordering::AcqRel);
    // Linger: keep answering the peers until the run is quiet.
    if let Some(v) = vm.as_mut() {
        while !ctl.stop.load(Ordering::Acquire) {
            if v.dev.wait(Duration::from_millis(5)).is_err() {
                break;
            }
            // Late events (TimeWait exits of handles still held) are consumed.
            for n in notices(&mut v.dev) {
                if let Notice::Cm(e) = n {
                    let _ = v.dev.destroy(e.id());
                }
            }
            let q = v.dev.agent().is_quiescent();
            ctl.quiet[slot.global].store(q, Ordering::Release);
        }
        flush(&mut v.dev);
    }
    let figures = vm.as_ref().map(|v| GuestFigures::of(&v.dev));
    let _ = tx.send(VmOutcome {
        global: slot.global,
        result,
        figures,
    });
    while !ctl.release.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(vm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_addresses_past_one_block_take_a_second_block_of_their_own() {
        assert_eq!(vm_addr(10, 0, 0), Ipv4Addr::new(127, 10, 1, 1));
        assert_eq!(vm_addr(10, 1, 249), Ipv4Addr::new(127, 10, 2, 250));
        assert_eq!(vm_addr(10, 1, 250), Ipv4Addr::new(127, 10, 130, 1));
        assert_eq!(
            vm_addr(10, MAX_HOSTS_WITH_TWO_BLOCKS - 1, MAX_VMS_PER_HOST - 1),
            Ipv4Addr::new(127, 10, 248, 250)
        );
        let all: std::collections::HashSet<_> = (0..MAX_HOSTS_WITH_TWO_BLOCKS)
            .flat_map(|h| (0..MAX_VMS_PER_HOST).map(move |v| vm_addr(7, h, v)))
            .collect();
        assert_eq!(all.len(), MAX_HOSTS_WITH_TWO_BLOCKS * MAX_VMS_PER_HOST);
    }
}
