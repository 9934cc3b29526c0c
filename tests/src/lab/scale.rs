//! `pvcm-lab scale`: the cost of the teardown scenario as it grows, in one run.
//!
//! The teardown scenario (seed 000) at 128 VMs per host with 1, 2 and 4 processes per VM
//! (16,384, 32,768 and 65,536 connections per host), then 256 VMs on each backend with
//! one process and 16 peers each (4,096 connections per host) and those 256 VMs left
//! attached and idle for a few seconds. Per size it prints setup and teardown time per connection and
//! their ratio to the smallest size, the retries, duplicates and lost frames, the
//! backend's resident memory per connection and its threads per VM; for the idle VMs,
//! the backend's threads, memory and CPU.
//!
//! ```text
//! pvcm-lab scale                       # 128 VMs x 1, 2, 4 processes; then 256 VMs
//! pvcm-lab scale --procs 1,2 --many-vms 0
//! ```

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use serde::Serialize;

use super::error::{LabError, LabResult};
use super::opts::{LabOptions, ScenarioName};
use super::report::Report;
use super::scenarios;

/// The per-connection cost at the largest size may be at most this many times the cost
/// at the smallest.
pub const LINEAR_BOUND: f64 = 1.5;

/// `pvcm-lab scale` options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pvcm-lab scale",
    about = "Teardown at growing sizes in one run: cost per connection, memory, threads; \
             then many idle VMs on one backend"
)]
pub struct ScaleCli {
    /// VMs per host of the growing sizes.
    #[arg(long, default_value_t = 128)]
    pub vms_per_host: usize,
    /// Processes per VM of each size, comma-separated (connections per host: VMs x VMs
    /// x processes).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub procs: Vec<usize>,
    /// VMs per backend of the many-VMs run (one process each; 0: not run).
    #[arg(long, default_value_t = 256)]
    pub many_vms: usize,
    /// Peers of each VM on the other host in the many-VMs run.
    #[arg(long, default_value_t = 16)]
    pub many_peers: usize,
    /// Seconds the many VMs stay attached and idle while the backends' CPU is measured.
    #[arg(long, default_value_t = 3.0)]
    pub idle_secs: f64,
    /// Second octet of the hosts' loopback addresses (127.N.H.V).
    #[arg(long, default_value_t = 10)]
    pub net: u8,
    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Size {
    /// VMs per host.
    pub vms_per_host: usize,
    /// Processes per VM.
    pub procs: usize,
    /// Connections per host.
    pub connections_per_host: u64,
    /// Setup, seconds.
    pub setup_s: f64,
    /// Teardown, seconds.
    pub teardown_s: f64,
    /// Setup per connection, microseconds.
    pub setup_us_per_conn: f64,
    /// Teardown per connection, microseconds.
    pub teardown_us_per_conn: f64,
    /// DREQ retries (guests).
    pub dreq_retries: u64,
    /// Duplicates the guests received.
    pub duplicates: u64,
    /// Frames a receiving kernel dropped (counted by the backends).
    pub frames_lost: u64,
    /// Backend resident memory grown over the run, per connection of its host (bytes;
    /// the largest of the hosts).
    pub rss_bytes_per_conn: Option<f64>,
    /// Backend threads per VM at the end (the largest of the hosts).
    pub threads_per_vm: Option<f64>,
    /// Backend threads at the end (the largest of the hosts).
    pub threads: Option<u64>,
    /// Backend resident memory at the end, MiB (the largest of the hosts).
    pub rss_mib: Option<f64>,
    /// Backend CPU with the VMs attached and idle, share of one core (the largest of
    /// the hosts), when measured.
    pub idle_cpu: Option<f64>,
    /// Whether every invariant of the run held.
    pub invariants_held: bool,
    /// The invariants that broke.
    pub broken: Vec<String>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleReport {
    /// The growing sizes.
    pub sizes: Vec<Size>,
    /// The many-VMs run.
    pub many: Option<Size>,
    /// Print JSON.
    #[serde(skip)]
    pub json: bool,
}

impl ScaleReport {
    /// Per-connection cost at the largest size over the smallest: (setup, teardown).
    pub fn growth(&self) -> Option<(f64, f64)> {
        let (a, b) = (self.sizes.first()?, self.sizes.last()?);
        Some((
            b.setup_us_per_conn / a.setup_us_per_conn.max(1e-9),
            b.teardown_us_per_conn / a.teardown_us_per_conn.max(1e-9),
        ))
    }

    /// The checks: cost linear within [`LINEAR_BOUND`], every invariant held (no frame
    /// lost among them), no retry.
    pub fn checks(&self) -> Vec<(&'static str, bool, String)> {
        let mut c = Vec::new();
        if let Some((s, t)) = self.growth() {
            c.push((
                "linear_cost",
                s <= LINEAR_BOUND && t <= LINEAR_BOUND,
                format!(
                    "per connection at the largest size: setup {s:.2}x, teardown {t:.2}x \
                     the smallest (at most {LINEAR_BOUND}x)"
                ),
            ));
        }
        for z in self.sizes.iter().chain(&self.many) {
            let name = format!("{} VMs x {} procs", z.vms_per_host, z.procs);
            c.push((
                "invariants",
                z.invariants_held,
                if z.invariants_held {
                    format!("{name}: all held")
                } else {
                    format!("{name}: broke {}", z.broken.join(", "))
                },
            ));
            c.push((
                "no_retries",
                z.dreq_retries == 0 && z.duplicates == 0,
                format!(
                    "{name}: {} DREQ retries, {} duplicates",
                    z.dreq_retries, z.duplicates
                ),
            ));
        }
        c
    }

    /// The table and the checks, or JSON.
    pub fn render(&self) -> String {
        if self.json {
            return serde_json::to_string_pretty(self).unwrap_or_default() + "\n";
        }
        let mut o = String::new();
        let _ = writeln!(
            o,
            "pvcm-lab scale: teardown (seed 000) at growing sizes, 2 hosts, default options"
        );
        let _ = writeln!(
            o,
            "{:>5} {:>6} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8}",
            "VMs",
            "procs",
            "conns",
            "setup s",
            "tdown s",
            "setup us",
            "tdown us",
            "retries",
            "dups",
            "lost",
            "RSS B/c",
            "thr/VM",
            "ok"
        );
        for z in self.sizes.iter().chain(&self.many) {
            let _ = writeln!(
                o,
                "{:>5} {:>6} {:>9} {:>8.2} {:>8.2} {:>9.1} {:>9.1} {:>8} {:>8} {:>8} {:>9} {:>8} {:>8}",
                z.vms_per_host,
                z.procs,
                z.connections_per_host,
                z.setup_s,
                z.teardown_s,
                z.setup_us_per_conn,
                z.teardown_us_per_conn,
                z.dreq_retries,
                z.duplicates,
                z.frames_lost,
                z.rss_bytes_per_conn
                    .map_or("-".into(), |b| format!("{b:.0}")),
                z.threads_per_vm.map_or("-".into(), |t| format!("{t:.2}")),
                if z.invariants_held { "yes" } else { "NO" },
            );
        }
        if let Some((s, t)) = self.growth() {
            let _ = writeln!(
                o,
                "per-connection cost, largest over smallest size: setup {s:.2}x, teardown {t:.2}x"
            );
        }
        if let Some(m) = &self.many {
            let _ = writeln!(
                o,
                "{} idle VMs attached to one backend: {} threads ({} per VM), {} MiB resident, \
                 CPU {} of one core",
                m.vms_per_host,
                m.threads.map_or("-".into(), |t| t.to_string()),
                m.threads_per_vm.map_or("-".into(), |t| format!("{t:.2}")),
                m.rss_mib.map_or("-".into(), |r| format!("{r:.0}")),
                m.idle_cpu
                    .map_or("-".into(), |c| format!("{:.2}%", c * 100.0)),
            );
        }
        super::render_checks(&mut o, &self.checks());
        o
    }
}

/// `pvcm-lab scale`.
pub fn main<I: IntoIterator<Item = OsString>>(args: I) -> ExitCode {
    super::command_main(
        "pvcm-lab scale",
        args,
        run,
        ScaleReport::render,
        |_: &ScaleCli, r: &ScaleReport| r.checks().iter().all(|c| c.1),
        "a size broke an invariant, retried, or cost more than linearly",
    )
}

/// Runs every size, then the many-VMs run.
pub fn run(exe: &Path, a: &ScaleCli) -> LabResult<ScaleReport> {
    if a.procs.is_empty() {
        return Err(LabError::Usage("--procs: at least one size".into()));
    }
    if !(a.idle_secs.is_finite() && a.idle_secs >= 0.0) {
        return Err(LabError::Usage("--idle-secs must be 0 or more".into()));
    }
    let mut sizes = Vec::new();
    for &p in &a.procs {
        eprintln!(
            "pvcm-lab scale: {} VMs per host x {p} processes",
            a.vms_per_host
        );
        sizes.push(one(exe, a, (a.vms_per_host, p, None), None)?);
    }
    let many = match a.many_vms {
        0 => None,
        n => {
            eprintln!(
                "pvcm-lab scale: {n} VMs per host x 1 process, {} peers each, then idle",
                a.many_peers
            );
            Some(one(
                exe,
                a,
                (n, 1, Some(a.many_peers)),
                Some(Duration::from_secs_f64(a.idle_secs)),
            )?)
        }
    };
    Ok(ScaleReport {
        sizes,
        many,
        json: a.json,
    })
}

/// One teardown run of (VMs per host, processes per VM, peers per VM).
fn one(
    exe: &Path,
    a: &ScaleCli,
    (vms, procs, peers): (usize, usize, Option<usize>),
    idle: Option<Duration>,
) -> LabResult<Size> {
    let mut o = LabOptions::new(ScenarioName::Teardown, exe.to_path_buf());
    o.vms_per_host = vms;
    o.procs = procs;
    o.peers = peers;
    o.net = a.net;
    o.idle_window = idle;
    let r = scenarios::run(&o)?;
    Ok(size_of(&r, vms, procs))
}

fn size_of(r: &Report, vms: usize, procs: usize) -> Size {
    let conns = r.num("connections_per_host") as u64;
    let (setup, teardown) = (r.secs("setup"), r.secs("teardown"));
    let per = |s: f64| s * 1e6 / conns.max(1) as f64;
    let max = |f: &dyn Fn(&super::report::HostReport) -> Option<f64>| {
        r.hosts.iter().filter_map(f).reduce(f64::max)
    };
    let lost: u64 = r
        .hosts
        .iter()
        .filter_map(|h| h.backend.as_ref())
        .map(|b| b.host.dropped("wire_rx_overflow"))
        .sum();
    Size {
        vms_per_host: vms,
        procs,
        connections_per_host: conns,
        setup_s: setup,
        teardown_s: teardown,
        setup_us_per_conn: per(setup),
        teardown_us_per_conn: per(teardown),
        dreq_retries: r.num("dreq_retries_guests") as u64,
        duplicates: r.num("duplicates_guests") as u64,
        frames_lost: lost,
        rss_bytes_per_conn: max(&|h| match h.rss_kib {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 * 1024.0 / conns.max(1) as f64),
            _ => None,
        }),
        threads_per_vm: max(&|h| h.threads.map(|t| t as f64 / h.vms.max(1) as f64)),
        threads: max(&|h| h.threads.map(|t| t as f64)).map(|t| t as u64),
        rss_mib: max(&|h| h.rss_kib.1.map(|k| k as f64 / 1024.0)),
        idle_cpu: max(&|h| h.idle_cpu),
        invariants_held: r.ok,
        broken: r
            .invariants
            .iter()
            .filter(|i| !i.ok)
            .map(|i| i.name.clone())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(procs: usize, conns: u64, setup_us: f64, retries: u64) -> Size {
        Size {
            vms_per_host: 128,
            procs,
            connections_per_host: conns,
            setup_s: setup_us * conns as f64 / 1e6,
            teardown_s: 0.0,
            setup_us_per_conn: setup_us,
            teardown_us_per_conn: 10.0,
            dreq_retries: retries,
            duplicates: 0,
            frames_lost: 0,
            rss_bytes_per_conn: None,
            threads_per_vm: None,
            threads: None,
            rss_mib: None,
            idle_cpu: None,
            invariants_held: true,
            broken: Vec::new(),
        }
    }

    #[test]
    fn the_checks_hold_sizes_to_linear_cost_and_no_retries() {
        let mut r = ScaleReport {
            sizes: vec![size(1, 16_384, 40.0, 0), size(4, 65_536, 60.0, 0)],
            many: None,
            json: false,
        };
        assert_eq!(r.growth(), Some((1.5, 1.0)));
        assert!(r.checks().iter().all(|c| c.1), "{:?}", r.checks());
        r.sizes[1].setup_us_per_conn = 61.0;
        assert!(!r.checks().iter().find(|c| c.0 == "linear_cost").unwrap().1);
        r.sizes[1].setup_us_per_conn = 60.0;
        r.sizes[1].dreq_retries = 1;
        assert!(!r.checks().iter().all(|c| c.1));
        assert!(r.render().contains("FAIL no_retries"));
    }

    #[test]
    fn peers_pick_pairs_both_ends_agree_on() {
        let mut o = LabOptions::new(ScenarioName::Teardown, "pvcm-lab".into());
        o.vms_per_host = 256;
        o.procs = 1;
        o.peers = Some(16);
        for a in 0..256 {
            let mine: Vec<usize> = (0..256).filter(|&b| o.peered(a, b)).collect();
            assert_eq!(mine.len(), 16, "VM {a}: {mine:?}");
            assert!(mine.iter().all(|&b| o.peered(b, a)));
        }
        assert_eq!(scenarios::teardown::total_connections(&o), 4096);
        o.peers = None;
        assert_eq!(scenarios::teardown::total_connections(&o), 65_536);
    }
}
