//! The lab's options, resolved: what a scenario runs with.

use std::path::PathBuf;
use std::time::Duration;

use pvcm_backend::mux::Policy;
use pvcm_guest::cm::ConnectOptions;
use pvcm_wire::timeout::exponent_to_duration;
use serde::Serialize;

use super::relay::Faults;

/// The scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScenarioName {
    /// Seed 000: many connections set up, then all torn down at once (DREQ retry storms).
    Teardown,
    /// Seed 002: connect then destroy at once; the REJ(TIMEOUT) must reach the passive VM.
    RejTimeout,
    /// Seed 003: connect/teardown churn with REJs and abandoned handshakes; no leaks.
    Churn,
    /// Seed 001: QPNs reused while their old connections are in TimeWait; no stale rejects.
    TimewaitReuse,
    /// Seed 004: IPoIB connected mode; one side vanishes, the other cleans up.
    IpoibCm,
    /// Connection rate between two VMs on two hosts (rdma-core's cmtime).
    Cmtime,
    /// MAD forwarding throughput through the backends next to raw UDP.
    Rate,
    /// cmtime whose servers exit right after their last DREP (their device reset) while
    /// the wire loses DREPs: every client DREQ must still get its DREP.
    ServerExit,
}

impl ScenarioName {
    /// Every scenario.
    pub const ALL: [ScenarioName; 8] = [
        ScenarioName::Teardown,
        ScenarioName::RejTimeout,
        ScenarioName::Churn,
        ScenarioName::TimewaitReuse,
        ScenarioName::IpoibCm,
        ScenarioName::Cmtime,
        ScenarioName::Rate,
        ScenarioName::ServerExit,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            ScenarioName::Teardown => "teardown",
            ScenarioName::RejTimeout => "rej-timeout",
            ScenarioName::Churn => "churn",
            ScenarioName::TimewaitReuse => "timewait-reuse",
            ScenarioName::IpoibCm => "ipoib-cm",
            ScenarioName::Cmtime => "cmtime",
            ScenarioName::Rate => "rate",
            ScenarioName::ServerExit => "server-exit",
        }
    }

    /// The seed scenario it reproduces, if any.
    pub fn seed(self) -> Option<&'static str> {
        match self {
            ScenarioName::Teardown => Some("000"),
            ScenarioName::TimewaitReuse => Some("001"),
            ScenarioName::RejTimeout => Some("002"),
            ScenarioName::Churn => Some("003"),
            ScenarioName::IpoibCm => Some("004"),
            _ => None,
        }
    }
}

/// The CM timeouts every `connect()` of a run uses (the mux derives its windows from the
/// same fields of the REQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CmTimeouts {
    /// Remote and local CM response timeout (5-bit exponent; rdma_cm: 20).
    pub response: u8,
    /// Path packet lifetime (5-bit exponent; rdma_cm on RoCE: 16, 18 before 2020).
    pub packet_life: u8,
    /// Max CM retries (rdma_cm: 15).
    pub retries: u8,
}

impl CmTimeouts {
    /// Linux rdma_cm's values on RoCE before 2020 (packet lifetime 18): a DREQ attempt of
    /// 2 x 1 s + 4 s = 6.1 s, longer than mlx4's 5 s cache timer.
    pub const LINUX_PRE2020: CmTimeouts = CmTimeouts {
        response: 20,
        packet_life: 18,
        retries: 15,
    };

    /// Short timeouts for fast runs: attempts of ~100 ms, 3 retries.
    pub const SHORT: CmTimeouts = CmTimeouts {
        response: 14,
        packet_life: 12,
        retries: 3,
    };

    /// The agent's `connect()` options.
    pub fn connect_options(&self) -> ConnectOptions {
        ConnectOptions {
            packet_life_time: self.packet_life,
            remote_cm_response_timeout: self.response,
            local_cm_response_timeout: self.response,
            max_cm_retries: self.retries,
            ..ConnectOptions::default()
        }
    }

    /// One attempt as the mux counts it: response timeout + ACK timeout (~ 2 x packet
    /// lifetime), exact IBA exponents.
    pub fn attempt(&self) -> Duration {
        exponent_to_duration(self.response) + exponent_to_duration(self.packet_life + 1)
    }

    /// The longest the mux keeps an entry after its last MAD under the default policy:
    /// a whole retry window, then TimeWait (one more attempt + the ACK timeout), plus
    /// its grace periods.
    pub fn default_quiesce(&self) -> Duration {
        self.attempt() * (u32::from(self.retries) + 2)
            + exponent_to_duration(self.packet_life + 1)
            + Duration::from_secs(3)
    }
}

/// Everything a run needs, resolved (scenario defaults applied).
#[derive(Debug, Clone, Serialize)]
pub struct LabOptions {
    /// Which scenario.
    pub scenario: ScenarioName,
    /// Hosts (backend processes).
    pub hosts: usize,
    /// VMs per host.
    pub vms_per_host: usize,
    /// Processes (logical actors) per VM.
    pub procs: usize,
    /// Mux policy of every host.
    #[serde(serialize_with = "ser_policy")]
    pub policy: Policy,
    /// Wire faults (a relay is put between hosts when any is set).
    pub faults: Faults,
    /// How late a slow guest answers DREQs (zero: at once).
    #[serde(serialize_with = "ser_ms")]
    pub slow_guest: Duration,
    /// How many VMs per host are slow (`None`: all, when `slow_guest` is set).
    pub slow_vms: Option<usize>,
    /// teardown: each VM connects to about this many VMs of each other host (`None`: to
    /// all of them); see [`LabOptions::peered`].
    pub peers: Option<usize>,
    /// Guests answer a DREQ only when the application disconnects, as Linux's rdma_cm
    /// does (`AgentConfig::auto_drep = false`), instead of at once: with `slow_guest`
    /// this brings back seed 000's retry storm under the mlx4 policies.
    pub linux_drep: bool,
    /// CM timeouts of every connection.
    pub cm: CmTimeouts,
    /// Rounds (churn, rej-timeout).
    pub rounds: usize,
    /// Connections (cmtime, timewait-reuse).
    pub connections: usize,
    /// QPNs cycled (timewait-reuse).
    pub qpns: usize,
    /// MADs to send (rate).
    pub messages: u64,
    /// rate: live connections of the large-table measurement (0: not run).
    pub live: u32,
    /// Every VM's quota of live entries (`None`: the backend's default).
    pub quota: Option<u32>,
    /// How long a survivor waits before reaping a connection whose peer vanished
    /// (ipoib-cm).
    #[serde(serialize_with = "ser_ms")]
    pub stale_timeout: Duration,
    /// rej-timeout: the active hosts' muxes issue the same comm-ID sequence.
    pub collide: bool,
    /// Seed of everything random (agents, muxes, the relay, workload choices).
    pub seed: u64,
    /// Second octet of the lab's addresses: VM `V` of host `H` is `127.NET.H.V`.
    pub net: u8,
    /// Virtqueue size of every VM.
    pub queue_size: u16,
    /// How long to wait for quiesce after the workload (`None`: from the CM timeouts and
    /// the policy).
    #[serde(skip)]
    pub quiesce_timeout: Option<Duration>,
    /// How long any one phase of the workload may take.
    #[serde(serialize_with = "ser_ms")]
    pub phase_timeout: Duration,
    /// Directory for `--pcap` captures (one file per host).
    pub pcap: Option<PathBuf>,
    /// Print JSON.
    #[serde(skip)]
    pub json: bool,
    /// Show a progress bar (when stderr is a terminal and not `--json`).
    #[serde(skip)]
    pub progress: bool,
    /// Keep the run's directory (sockets, logs) for inspection.
    #[serde(skip)]
    pub keep_dir: bool,
    /// The `pvcm-lab` executable, re-executed as `__backend` for each host.
    #[serde(skip)]
    pub exe: PathBuf,
    /// After quiesce, with every VM still attached and idle, measure each backend's CPU
    /// use over this long (`None`: not measured).
    #[serde(skip)]
    pub idle_window: Option<Duration>,
}

fn ser_policy<S: serde::Serializer>(p: &Policy, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl LabOptions {
    /// The scenario's small defaults (each finishes in well under a minute).
    pub fn new(scenario: ScenarioName, exe: PathBuf) -> LabOptions {
        let mut o = LabOptions {
            scenario,
            hosts: 2,
            vms_per_host: 2,
            procs: 4,
            policy: Policy::Default,
            faults: Faults::default(),
            slow_guest: Duration::ZERO,
            slow_vms: None,
            peers: None,
            linux_drep: false,
            cm: CmTimeouts::SHORT,
            rounds: 25,
            connections: 500,
            qpns: 4,
            messages: 200_000,
            live: 0,
            quota: None,
            stale_timeout: Duration::from_secs(3),
            collide: true,
            seed: 1,
            net: 10,
            queue_size: 256,
            quiesce_timeout: None,
            phase_timeout: Duration::from_secs(300),
            pcap: None,
            json: false,
            progress: false,
            keep_dir: false,
            exe,
            idle_window: None,
        };
        match scenario {
            ScenarioName::Teardown => {
                o.vms_per_host = 4;
                o.procs = 8;
                o.cm = CmTimeouts::LINUX_PRE2020;
            }
            ScenarioName::RejTimeout => {
                o.hosts = 3;
                o.vms_per_host = 2;
                o.rounds = 40;
            }
            ScenarioName::Churn => {}
            ScenarioName::TimewaitReuse => {
                o.vms_per_host = 1;
                o.cm = CmTimeouts {
                    packet_life: 16,
                    ..CmTimeouts::SHORT
                };
            }
            ScenarioName::IpoibCm => {}
            ScenarioName::Cmtime => {
                o.vms_per_host = 1;
                o.connections = 1000;
                // cmtime connects with rdma_cm's defaults (see pvcm_guest's cmtime).
                o.cm = CmTimeouts {
                    response: pvcm_guest::cm::CMA_CM_RESPONSE_TIMEOUT,
                    packet_life: pvcm_guest::cm::CMA_IBOE_PACKET_LIFETIME,
                    retries: pvcm_guest::cm::CMA_MAX_CM_RETRIES,
                };
            }
            ScenarioName::Rate => {
                o.vms_per_host = 1;
            }
            ScenarioName::ServerExit => {
                o.connections = 200;
                // A fifth of the DREPs lost; DREQ attempts of ~0.3 s, 15 retries.
                o.faults.loss = 0.2;
                o.faults.loss_only = Some(pvcm_wire::mad::AttributeId::Drep as u16);
                o.cm = CmTimeouts {
                    response: 16,
                    packet_life: 14,
                    retries: 15,
                };
            }
        }
        o
    }

    /// Whether VMs `a` and `b` (0-based within their hosts) of two different hosts
    /// connect (teardown): all pairs, or with `peers` set, the pairs whose indices sum to
    /// a multiple of `VMs / peers`, about `peers` per VM (symmetric, so both ends agree).
    pub fn peered(&self, a: usize, b: usize) -> bool {
        self.peers.is_none_or(|p| {
            let stride = (self.vms_per_host / p.max(1)).max(1);
            (a + b) % stride == 0
        })
    }

    /// Whether VM `vm` (0-based within its host) is a slow guest.
    pub fn is_slow(&self, vm: usize) -> bool {
        !self.slow_guest.is_zero() && self.slow_vms.is_none_or(|n| vm < n)
    }

    /// How long to wait for every mux entry and guest connection to go after the
    /// workload.
    pub fn quiesce(&self) -> Duration {
        if let Some(q) = self.quiesce_timeout {
            return q;
        }
        let base = self.cm.default_quiesce() + self.slow_guest;
        match self.policy {
            Policy::Default => base,
            Policy::Mlx4Pre2020 => base.max(Duration::from_secs(7)),
            Policy::Mlx4Post2020 => base.max(Duration::from_secs(33)),
        }
    }
}
