//! The `pvcm-lab` command line.
//!
//! ```text
//! pvcm-lab <SCENARIO> [options]
//! pvcm-lab teardown                                   # small: 2 hosts x 4 VMs x 8 processes
//! pvcm-lab teardown --vms-per-host 16 --procs 64      # seed 000 at full scale
//! pvcm-lab teardown --policy mlx4-pre2020 --slow-guest 5500 --linux-drep --cm-retries 1
//! pvcm-lab churn --loss 0.01 --reorder 0.05 --json
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, Parser};
use pvcm_backend::mux::Policy;
use pvcm_wire::mad::AttributeId;

use super::opts::{LabOptions, ScenarioName};
use super::progress;
use super::relay::Faults;

/// `pvcm-lab`: hosts (real pvcm-backend processes), VMs (vhost-user sessions, memfd guest
/// memory, the guest driver and its CM agent), and the seed scenarios, on one machine.
#[derive(Debug, Parser)]
#[command(
    name = "pvcm-lab",
    version,
    long_about = None,
    after_help = "Other commands (each has its own --help):\n  \
        pvcm-lab attach --socket PATH COMMAND  run a pvcm-guest command through an \
        in-process VM on a running backend's socket\n  \
        pvcm-lab hostile   a neighbour VM's cmtime alone and while a hostile VM floods \
        the same backend\n  \
        pvcm-lab migrate   live-migrate a VM between two backends in the middle of its \
        handshakes\n  \
        pvcm-lab restart   kill a backend under established connections and start it \
        again over its --state-dir\n  \
        pvcm-lab scale     teardown at 16,384, 32,768 and 65,536 connections per host \
        and 256 idle VMs per backend: cost per connection, memory, threads\n\n\
        Unset options take the scenario's defaults; those that differ by scenario are \
        given as 'SCENARIO N'. See docs/lab.md."
)]
pub struct Cli {
    /// The scenario to run.
    #[arg(value_enum)]
    pub scenario: ScenarioName,
    /// Options.
    #[command(flatten)]
    pub args: LabArgs,
}

/// Options; unset ones take the scenario's defaults.
#[derive(Debug, Clone, Default, Args)]
pub struct LabArgs {
    /// Hosts (pvcm-backend processes) [default: 2; rej-timeout 3].
    #[arg(long, value_name = "N")]
    pub hosts: Option<usize>,
    /// VMs per host [default: 2; teardown 4; timewait-reuse, cmtime, rate 1].
    #[arg(long, value_name = "N")]
    pub vms_per_host: Option<usize>,
    /// Processes (connection-owning actors) per VM [default: 4; teardown 8].
    #[arg(long, value_name = "N")]
    pub procs: Option<usize>,
    /// Mux policy: default, mlx4-pre2020 or mlx4-post2020 [default: default].
    #[arg(long, value_name = "POLICY")]
    pub policy: Option<String>,
    /// Probability that a frame between hosts is lost [default: 0; server-exit 0.2].
    #[arg(long, value_name = "P")]
    pub loss: Option<f64>,
    /// --loss only loses MADs of this message type (REQ, REP, DREQ, DREP, ...; `any`:
    /// every frame) [default: any; server-exit DREP].
    #[arg(long, value_name = "MSG")]
    pub loss_only: Option<String>,
    /// Probability that a frame between hosts is delivered twice [default: 0].
    #[arg(long, value_name = "P")]
    pub dup: Option<f64>,
    /// Probability that a frame between hosts is overtaken by later ones [default: 0].
    #[arg(long, value_name = "P")]
    pub reorder: Option<f64>,
    /// Delay of every frame between hosts: MS or MS,JITTER_MS [default: 0].
    #[arg(long, value_name = "MS[,JITTER]")]
    pub delay: Option<String>,
    /// Slow guests answer DREQs this many milliseconds late [default: 0, none slow].
    #[arg(long, value_name = "MS")]
    pub slow_guest: Option<u64>,
    /// How many VMs per host are slow (default: all, when --slow-guest is given).
    #[arg(long, value_name = "N")]
    pub slow_vms: Option<usize>,
    /// teardown: each VM connects to about N VMs of each other host instead of all of
    /// them (VMs `a` and `b` are peers when `(a + b) % (VMs / N) == 0`).
    #[arg(long, value_name = "N")]
    pub peers: Option<usize>,
    /// Guests send the DREP only when the application disconnects, as Linux's rdma_cm
    /// (default: at once); with --slow-guest this shows seed 000's retry storm.
    #[arg(long)]
    pub linux_drep: bool,
    /// CM response timeout of every connection (5-bit exponent: 4.096 us x 2^T)
    /// [default: 14; teardown, cmtime 20].
    #[arg(long, value_name = "T")]
    pub cm_timeout: Option<u8>,
    /// Packet lifetime of every connection's path (5-bit exponent) [default: 12;
    /// teardown 18; timewait-reuse, cmtime 16].
    #[arg(long, value_name = "T")]
    pub packet_life: Option<u8>,
    /// Max CM retries of every connection (0 to 15) [default: 3; teardown, cmtime 15].
    #[arg(long, value_name = "N")]
    pub cm_retries: Option<u8>,
    /// Rounds (churn: connections per process; rej-timeout: connect/destroy rounds)
    /// [default: 25; rej-timeout 40].
    #[arg(long, value_name = "N")]
    pub rounds: Option<usize>,
    /// Connections (cmtime; timewait-reuse: per VM pair) [default: 500; cmtime 1000].
    #[arg(long, value_name = "N")]
    pub connections: Option<usize>,
    /// QPNs cycled through (timewait-reuse) [default: 4].
    #[arg(long, value_name = "N")]
    pub qpns: Option<usize>,
    /// MADs to send (rate) [default: 200000].
    #[arg(long, value_name = "N")]
    pub messages: Option<u64>,
    /// rate: also measure the MAD rate with 1,024 live connections and then with N
    /// (e.g. 1000000), LAPs spread over all of them, in one run.
    #[arg(long, value_name = "N")]
    pub live: Option<u32>,
    /// ipoib-cm: how long survivors wait before reaping connections to a vanished peer
    /// [default: 3000].
    #[arg(long, value_name = "MS")]
    pub stale_timeout: Option<u64>,
    /// rej-timeout: give the active hosts independent comm-ID sequences (no collisions).
    #[arg(long)]
    pub no_collide: bool,
    /// Seed of everything random [default: 1].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Second octet of the lab's loopback addresses (127.NET.HOST.VM) [default: 10].
    #[arg(long, value_name = "NET")]
    pub net: Option<u8>,
    /// Virtqueue size of every VM (power of two, up to 1024) [default: 256].
    #[arg(long, value_name = "N")]
    pub queue_size: Option<u16>,
    /// Seconds to wait for quiesce after the workload (default: from the timeouts).
    #[arg(long, value_name = "S")]
    pub quiesce_timeout: Option<f64>,
    /// Seconds any one phase may take [default: 300].
    #[arg(long, value_name = "S")]
    pub phase_timeout: Option<f64>,
    /// Capture every host's frames into DIR/hN.pcap.
    #[arg(long, value_name = "DIR")]
    pub pcap: Option<PathBuf>,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Keep the run's directory (sockets, backend logs) and print where it is.
    #[arg(long)]
    pub keep_dir: bool,
}

/// A CM message type by name (`DREP`, case-insensitive) as its attribute ID; `any`: none.
fn parse_message(s: &str) -> Result<Option<u16>, String> {
    if s.eq_ignore_ascii_case("any") {
        return Ok(None);
    }
    AttributeId::CM_MESSAGES
        .iter()
        .find(|a| a.name().eq_ignore_ascii_case(s))
        .map(|a| Some(*a as u16))
        .ok_or_else(|| {
            let names: Vec<&str> = AttributeId::CM_MESSAGES.iter().map(|a| a.name()).collect();
            format!("--loss-only {s:?}: one of {} or any", names.join(", "))
        })
}

fn parse_delay(s: &str) -> Result<(Duration, Duration), String> {
    let (d, j) = match s.split_once(',') {
        Some((d, j)) => (d, Some(j)),
        None => (s, None),
    };
    let ms = |v: &str| {
        f64::from_str(v.trim())
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0 && *x < 60_000.0)
            .map(|x| Duration::from_secs_f64(x / 1e3))
            .ok_or_else(|| format!("--delay {s:?}: MS or MS,JITTER_MS (milliseconds)"))
    };
    Ok((ms(d)?, j.map(ms).transpose()?.unwrap_or_default()))
}

impl LabArgs {
    /// The options: the scenario's defaults with these on top.
    pub fn resolve(&self, scenario: ScenarioName, exe: PathBuf) -> Result<LabOptions, String> {
        let mut o = LabOptions::new(scenario, exe);
        if let Some(v) = self.hosts {
            o.hosts = v;
        }
        if let Some(v) = self.vms_per_host {
            o.vms_per_host = v;
        }
        if let Some(v) = self.procs {
            o.procs = v;
        }
        if let Some(p) = &self.policy {
            o.policy = Policy::from_str(p).map_err(|e| format!("--policy: {e}"))?;
        }
        let mut f = Faults {
            loss: self.loss.unwrap_or(o.faults.loss),
            dup: self.dup.unwrap_or(o.faults.dup),
            reorder: self.reorder.unwrap_or(o.faults.reorder),
            ..o.faults
        };
        if let Some(m) = &self.loss_only {
            f.loss_only = parse_message(m)?;
        }
        if let Some(d) = &self.delay {
            let (d, j) = parse_delay(d)?;
            f.delay = d;
            f.jitter = j;
        }
        o.faults = f;
        if let Some(ms) = self.slow_guest {
            o.slow_guest = Duration::from_millis(ms);
        }
        o.slow_vms = self.slow_vms;
        o.peers = self.peers;
        o.linux_drep = self.linux_drep;
        if let Some(t) = self.cm_timeout {
            o.cm.response = t;
        }
        if let Some(t) = self.packet_life {
            o.cm.packet_life = t;
        }
        if let Some(n) = self.cm_retries {
            o.cm.retries = n;
        }
        if let Some(n) = self.rounds {
            o.rounds = n;
        }
        if let Some(n) = self.connections {
            o.connections = n;
        }
        if let Some(n) = self.qpns {
            o.qpns = n;
        }
        if let Some(n) = self.messages {
            o.messages = n;
        }
        if let Some(n) = self.live {
            o.live = n;
        }
        if let Some(ms) = self.stale_timeout {
            o.stale_timeout = Duration::from_millis(ms);
        }
        if self.no_collide {
            o.collide = false;
        }
        if let Some(s) = self.seed {
            o.seed = s;
        }
        if let Some(n) = self.net {
            o.net = n;
        }
        if let Some(q) = self.queue_size {
            o.queue_size = q;
        }
        let secs = |name: &str, s: f64| {
            if s.is_finite() && s > 0.0 && s < 1e6 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(format!("{name} {s}: seconds, more than 0"))
            }
        };
        if let Some(s) = self.quiesce_timeout {
            o.quiesce_timeout = Some(secs("--quiesce-timeout", s)?);
        }
        if let Some(s) = self.phase_timeout {
            o.phase_timeout = secs("--phase-timeout", s)?;
        }
        o.pcap = self.pcap.clone();
        o.json = self.json;
        o.keep_dir = self.keep_dir;
        o.progress = progress::wanted(self.json);
        Ok(o)
    }
}

/// Runs the command line (after `__backend` was ruled out).
pub fn main(cli: Cli) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("pvcm-lab: cannot find my own executable: {e}");
            return ExitCode::from(2);
        }
    };
    let o = match cli.args.resolve(cli.scenario, exe) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("pvcm-lab: {e}");
            return ExitCode::from(2);
        }
    };
    match super::scenarios::run(&o) {
        Ok(r) => {
            if o.json {
                println!("{}", r.json());
            } else {
                print!("{}", r.render());
            }
            if r.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("pvcm-lab {}: {e}", o.scenario.name());
            ExitCode::from(3)
        }
    }
}
