//! A run's summary: timings, figures, per host the infiniband_cm-style counter tables
//! (the backend's as its mux observes the MADs, read from its control socket, and the
//! guests' own counters summed over the host's vPorts), and the invariants.

use std::fmt::Write as _;

use pvcm_backend::stats::Snapshot;
use pvcm_wire::mad::AttributeId;
use serde::Serialize;
use serde_json::Value;

use super::opts::LabOptions;
use super::relay::RelayStats;
use super::world::{GuestFigures, Outcome, World};

/// A named duration.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// What was timed.
    pub name: String,
    /// Seconds.
    pub seconds: f64,
}

/// A named figure.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// What was counted or measured.
    pub name: String,
    /// Its value (a number, usually).
    pub value: Value,
}

/// One invariant and whether it held.
#[derive(Debug, Clone, Serialize)]
pub struct Invariant {
    /// Its name.
    pub name: String,
    /// Whether it held.
    pub ok: bool,
    /// The numbers behind it.
    pub detail: String,
}

/// One host's figures.
#[derive(Debug, Clone, Serialize)]
pub struct HostReport {
    /// Name (`h1`).
    pub name: String,
    /// VMs configured.
    pub vms: usize,
    /// Their addresses (`127.10.1.1-16`).
    pub addrs: String,
    /// The backend's figures (control socket), after quiesce.
    pub backend: Option<Snapshot>,
    /// The guests' own counters, summed over the host's VMs.
    pub guests: GuestFigures,
    /// The backend's resident memory at start and at the end (KiB).
    pub rss_kib: (Option<u64>, Option<u64>),
    /// The backend's threads at the end, its VMs attached.
    pub threads: Option<u64>,
    /// The backend's CPU use with its VMs attached and idle (share of one core), when
    /// measured.
    pub idle_cpu: Option<f64>,
}

/// A run's summary.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The scenario.
    pub scenario: String,
    /// The seed scenario it reproduces.
    pub seed_scenario: Option<String>,
    /// The mux policy.
    pub policy: String,
    /// Whether every invariant held.
    pub ok: bool,
    /// The options of the run.
    pub options: Value,
    /// Timings.
    pub timings: Vec<Timing>,
    /// Figures.
    pub figures: Vec<Figure>,
    /// Per host.
    pub hosts: Vec<HostReport>,
    /// The fault relay's figures, if one was in the path.
    pub relay: Option<RelayStats>,
    /// Invariants.
    pub invariants: Vec<Invariant>,
    /// A preformatted table (cmtime's, rate's).
    pub table: Option<String>,
    /// Remarks.
    pub notes: Vec<String>,
    /// Frames that went to an address no host serves (a host that is down), counted by
    /// the lab's sink there.
    pub frames_to_down_host: Option<u64>,
}

impl Report {
    /// An empty report for these options.
    pub fn new(o: &LabOptions) -> Report {
        Report {
            scenario: o.scenario.name().to_string(),
            seed_scenario: o.scenario.seed().map(str::to_string),
            policy: o.policy.name().to_string(),
            ok: true,
            options: serde_json::to_value(o).unwrap_or(Value::Null),
            timings: Vec::new(),
            figures: Vec::new(),
            hosts: Vec::new(),
            relay: None,
            invariants: Vec::new(),
            table: None,
            notes: Vec::new(),
            frames_to_down_host: None,
        }
    }

    /// Adds a timing.
    pub fn time(&mut self, name: &str, d: std::time::Duration) {
        self.timings.push(Timing {
            name: name.to_string(),
            seconds: d.as_secs_f64(),
        });
    }

    /// Adds a figure.
    pub fn figure(&mut self, name: &str, v: impl Into<Value>) {
        self.figures.push(Figure {
            name: name.to_string(),
            value: v.into(),
        });
    }

    /// A figure's value as a number.
    ///
    /// # Panics
    ///
    /// If the report has no figure of that name, or its value is not a number: a test
    /// that asks for a figure the scenario does not record fails instead of comparing
    /// against a made-up 0.
    pub fn num(&self, name: &str) -> f64 {
        let Some(f) = self.figures.iter().find(|f| f.name == name) else {
            let known: Vec<&str> = self.figures.iter().map(|f| f.name.as_str()).collect();
            panic!("no figure {name:?} in the report (it has {known:?})");
        };
        match f.value.as_f64() {
            Some(v) => v,
            None => panic!("figure {name:?} is not a number: {}", f.value),
        }
    }

    /// A timing's seconds.
    ///
    /// # Panics
    ///
    /// If the report has no timing of that name, for the reason [`Report::num`] does.
    pub fn secs(&self, name: &str) -> f64 {
        match self.timings.iter().find(|t| t.name == name) {
            Some(t) => t.seconds,
            None => {
                let known: Vec<&str> = self.timings.iter().map(|t| t.name.as_str()).collect();
                panic!("no timing {name:?} in the report (it has {known:?})");
            }
        }
    }

    /// Adds an invariant.
    pub fn check(&mut self, name: &str, ok: bool, detail: impl Into<String>) {
        self.ok &= ok;
        self.invariants.push(Invariant {
            name: name.to_string(),
            ok,
            detail: detail.into(),
        });
    }

    /// Whether the named invariant held (false if absent).
    pub fn held(&self, name: &str) -> bool {
        self.invariants.iter().any(|i| i.name == name && i.ok)
    }

    /// Adds a remark.
    pub fn note(&mut self, s: impl Into<String>) {
        self.notes.push(s.into());
    }

    /// Per-host sections and the checks common to every scenario that runs VMs:
    /// counters consistent between the ends, no MAD at a wrong VM (as the muxes see it),
    /// no leaked entries after quiesce.
    pub fn add_hosts<O>(&mut self, world: &World, out: &Outcome<O>, relay: Option<RelayStats>) {
        self.relay = relay;
        for (h, host) in world.hosts.iter().enumerate() {
            let mut guests = GuestFigures::default();
            for v in world.vms_of(h) {
                if let Some(f) = out.vms.get(v.global).and_then(|o| o.figures.as_ref()) {
                    guests.add(f);
                }
            }
            let n = host.spec.vms.len();
            self.hosts.push(HostReport {
                name: host.spec.name.clone(),
                vms: n,
                addrs: vm_ranges(&host.spec.vms.iter().map(|v| v.addr).collect::<Vec<_>>()),
                backend: out.snapshots.get(h).cloned().flatten(),
                guests,
                rss_kib: (
                    world.rss_start.get(h).copied().flatten(),
                    out.rss_end.get(h).copied().flatten(),
                ),
                threads: out.threads_end.get(h).copied().flatten(),
                idle_cpu: out.idle_cpu.get(h).copied().flatten(),
            });
        }
        for e in &out.errors {
            self.note(format!("error: {e}"));
        }
        if world.keep_dir {
            self.note(format!(
                "run directory kept (sockets, backend logs): {}",
                world.dir().display()
            ));
        }
        self.check(
            "vms_ran",
            out.errors.is_empty() && out.vms.iter().all(|v| v.result.is_ok()),
            format!("{} errors", out.errors.len()),
        );
        self.wire_consistency(relay);
        self.vm_consistency(world, out);
        let wrong: u64 = self
            .backends()
            .map(|s| s.host.dropped("wrong_destination"))
            .sum();
        self.check(
            "no_mad_at_wrong_vm_mux",
            wrong == 0,
            format!("{wrong} MADs for a connection addressed to another VM's GID"),
        );
    }

    fn backends(&self) -> impl Iterator<Item = &Snapshot> {
        self.hosts.iter().filter_map(|h| h.backend.as_ref())
    }

    /// Every frame a host sent arrived at a host (or at the relay, which accounts for it),
    /// and every MAD a mux forwarded or sent itself left as a frame.
    fn wire_consistency(&mut self, relay: Option<RelayStats>) {
        if self.hosts.iter().any(|h| h.backend.is_none()) {
            self.check("counters_consistent_wire", false, "a host did not answer");
            return;
        }
        let tx: u64 = self.backends().map(|s| s.host.io("wire_tx_frames")).sum();
        let rx: u64 = self.backends().map(|s| s.host.io("wire_rx_frames")).sum();
        // Frames the receiving kernel dropped before the backend read them: counted by
        // the backend that lost them.
        let lost: u64 = self
            .backends()
            .map(|s| s.host.dropped("wire_rx_overflow"))
            .sum();
        let (rin, rout) = relay.map_or((0, 0), |r| (r.received, r.forwarded));
        let down = self.frames_to_down_host.unwrap_or(0);
        let direct_tx = tx.saturating_sub(rin + down);
        self.check(
            "counters_consistent_wire",
            rin + down <= tx && rout <= rx && direct_tx == rx - rout + lost,
            format!(
                "frames sent by hosts {tx}, received by hosts {rx}, lost in a receiving \
                 kernel and counted {lost}, relay took {rin} gave {rout}, {down} to a host \
                 that is down"
            ),
        );
        self.check(
            "no_frame_lost",
            lost == 0,
            format!("{lost} frames dropped by a receiving host's kernel (wire_rx_overflow)"),
        );
        let mut bad = Vec::new();
        for h in &self.hosts {
            let Some(s) = &h.backend else { continue };
            let cm_tx: u64 = s.host.cm.get("cm_tx_msgs").map_or(0, |m| m.values().sum());
            let frames = s.host.io("wire_tx_frames")
                + s.host.dropped("wire_send_error")
                + s.host.dropped("bad_remote_gid");
            if cm_tx != frames {
                bad.push(format!("{}: cm_tx_msgs {cm_tx} vs frames {frames}", h.name));
            }
        }
        self.check(
            "counters_consistent_mux_wire",
            bad.is_empty(),
            if bad.is_empty() {
                "every MAD a mux forwarded or sent went out as one frame".to_string()
            } else {
                bad.join("; ")
            },
        );
    }

    /// What each guest put on its queues is what its device took, and what the device
    /// delivered is what the guest took (checked when the run quiesced).
    fn vm_consistency<O>(&mut self, world: &World, out: &Outcome<O>) {
        if !out.quiesced {
            return;
        }
        let mut bad = Vec::new();
        let mut checked = 0;
        for slot in &world.slots {
            let Some(g) = out.vms.get(slot.global).and_then(|v| v.figures.as_ref()) else {
                continue;
            };
            let Some(snap) = out.snapshots.get(slot.host).cloned().flatten() else {
                continue;
            };
            let Some(b) = snap.vm(&slot.name) else {
                continue;
            };
            checked += 1;
            let g_tx = g.dev("tx_mads") + g.dev("tx_control");
            let b_tx = b.figures.io("tx_messages");
            let g_rx = g.dev("rx_msgs");
            let b_rx = b.figures.io("rx_messages");
            if g_tx != b_tx || g_rx != b_rx {
                bad.push(format!(
                    "{}: guest tx {g_tx} / device took {b_tx}, device gave {b_rx} / guest took {g_rx}",
                    slot.name
                ));
            }
        }
        self.check(
            "counters_consistent_guest_device",
            bad.is_empty(),
            if bad.is_empty() {
                format!("{checked} VMs: guest and device counts agree both ways")
            } else {
                bad.join("; ")
            },
        );
    }

    /// No live mux entry and no guest connection left after quiesce.
    pub fn check_leaks<O>(&mut self, out: &Outcome<O>) {
        let live: Vec<String> = self
            .hosts
            .iter()
            .map(|h| match &h.backend {
                Some(s) => format!("{} {}", h.name, s.host.live),
                None => format!("{} ?", h.name),
            })
            .collect();
        let live_total: u64 = self.backends().map(|s| s.host.live).sum();
        let conns: u64 = self.hosts.iter().map(|h| h.guests.connections_left).sum();
        self.figure("live_entries_after_quiesce", live_total);
        self.figure("guest_connections_after_quiesce", conns);
        self.time("quiesce", out.quiesce);
        self.check(
            "no_leaked_entries",
            out.quiesced && live_total == 0 && conns == 0,
            format!(
                "live mux entries [{}], guest connections {conns}, quiesced {}",
                live.join(", "),
                out.quiesced
            ),
        );
    }

    /// Sum of a guest counter over every host.
    pub fn guest_sum(&self, group: &str, msg: &str) -> u64 {
        self.hosts.iter().map(|h| h.guests.cm(group, msg)).sum()
    }

    /// Sum of a backend counter over every host.
    pub fn backend_sum(&self, group: &str, msg: &str) -> u64 {
        self.backends().map(|s| s.host.cm(group, msg)).sum()
    }

    /// The summary as text.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let seed = self
            .seed_scenario
            .as_ref()
            .map(|s| format!(" (seed {s})"))
            .unwrap_or_default();
        let opt = |k: &str| self.options.get(k).cloned().unwrap_or(Value::Null);
        let procs = match self.scenario.as_str() {
            "teardown" | "churn" => format!(" x {} processes", opt("procs")),
            _ => String::new(),
        };
        let _ = writeln!(
            o,
            "pvcm-lab {}{seed}: {} hosts x {} VMs{procs}, policy {}",
            self.scenario,
            opt("hosts"),
            opt("vms_per_host"),
            self.policy
        );
        if let Some(c) = self.options.get("cm") {
            let _ = writeln!(
                o,
                "  CM timeouts: response {} packet life {} retries {}; slow guest {} ms; faults {}",
                c.get("response").cloned().unwrap_or(Value::Null),
                c.get("packet_life").cloned().unwrap_or(Value::Null),
                c.get("retries").cloned().unwrap_or(Value::Null),
                opt("slow_guest"),
                opt("faults"),
            );
        }
        if !self.timings.is_empty() {
            let _ = writeln!(o, "timings:");
            for t in &self.timings {
                let _ = writeln!(o, "  {:<34} {:>10.3} s", t.name, t.seconds);
            }
        }
        if !self.figures.is_empty() {
            let _ = writeln!(o, "figures:");
            for f in &self.figures {
                let v = match &f.value {
                    Value::Number(n) if n.is_f64() => format!("{:.3}", n.as_f64().unwrap_or(0.0)),
                    v => v.to_string(),
                };
                let _ = writeln!(o, "  {:<34} {:>10}", f.name, v);
            }
        }
        if let Some(t) = &self.table {
            let _ = writeln!(o, "{t}");
        }
        for h in &self.hosts {
            render_host(&mut o, h, &self.policy);
        }
        if let Some(r) = &self.relay {
            let _ = writeln!(
                o,
                "relay: received {} forwarded {} lost {} duplicated {} reordered {} bad {}",
                r.received, r.forwarded, r.lost, r.duplicated, r.reordered, r.bad
            );
        }
        for n in &self.notes {
            let _ = writeln!(o, "note: {n}");
        }
        let _ = writeln!(o, "invariants:");
        for i in &self.invariants {
            let _ = writeln!(
                o,
                "  {} {:<34} {}",
                if i.ok { "ok  " } else { "FAIL" },
                i.name,
                i.detail
            );
        }
        let _ = writeln!(
            o,
            "{}",
            if self.ok {
                "result: every invariant held"
            } else {
                "result: INVARIANT BROKEN"
            }
        );
        o
    }

    /// The summary as one JSON document.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

const GROUPS: [&str; 4] = [
    "cm_tx_msgs",
    "cm_tx_retries",
    "cm_rx_msgs",
    "cm_rx_duplicates",
];

/// Addresses as runs of consecutive ones: `127.10.1.1-250, 127.10.129.1-6`.
fn vm_ranges(addrs: &[std::net::Ipv4Addr]) -> String {
    let mut runs: Vec<(std::net::Ipv4Addr, u32)> = Vec::new();
    for a in addrs {
        match runs.last_mut() {
            Some((first, n)) if u32::from(*first) + *n == u32::from(*a) => *n += 1,
            _ => runs.push((*a, 1)),
        }
    }
    runs.iter()
        .map(|(first, n)| match n {
            1 => first.to_string(),
            n => format!("{first}-{}", first.octets()[3] as u32 + n - 1),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn render_host(o: &mut String, h: &HostReport, policy: &str) {
    let mut rss = match h.rss_kib {
        (Some(a), Some(b)) => format!(", backend RSS {} -> {} MiB", a / 1024, b / 1024),
        _ => String::new(),
    };
    if let Some(t) = h.threads {
        rss.push_str(&format!(", {t} threads"));
    }
    if let Some(c) = h.idle_cpu {
        rss.push_str(&format!(", idle CPU {:.2}% of a core", c * 100.0));
    }
    let _ = writeln!(
        o,
        "host {} ({} VMs at {}, policy {policy}{rss})",
        h.name, h.vms, h.addrs
    );
    let b = h.backend.as_ref();
    let _ = writeln!(
        o,
        "  {:<10} {:>11} {:>13} {:>11} {:>16}   {:>11} {:>13} {:>11} {:>16}",
        "",
        "cm_tx_msgs",
        "cm_tx_retries",
        "cm_rx_msgs",
        "cm_rx_duplicates",
        "cm_tx_msgs",
        "cm_tx_retries",
        "cm_rx_msgs",
        "cm_rx_duplicates"
    );
    let _ = writeln!(
        o,
        "  {:<10} {:^54}   {:^54}",
        "",
        "backend (mux-observed)",
        format!("guests (summed over {} vPorts)", h.guests.vms)
    );
    for a in AttributeId::CM_MESSAGES {
        let m = a.name();
        let bv: Vec<u64> = GROUPS
            .iter()
            .map(|g| b.map_or(0, |s| s.host.cm(g, m)))
            .collect();
        let gv: Vec<u64> = GROUPS.iter().map(|g| h.guests.cm(g, m)).collect();
        if bv.iter().chain(gv.iter()).all(|v| *v == 0) {
            continue;
        }
        let _ = writeln!(
            o,
            "  {:<10} {:>11} {:>13} {:>11} {:>16}   {:>11} {:>13} {:>11} {:>16}",
            m, bv[0], bv[1], bv[2], bv[3], gv[0], gv[1], gv[2], gv[3]
        );
    }
    match b {
        Some(s) => {
            let drops: Vec<String> = s
                .host
                .drops
                .iter()
                .chain(s.host.device_drops.iter())
                .filter(|(_, v)| **v > 0)
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let _ = writeln!(
                o,
                "  backend drops: {}",
                if drops.is_empty() {
                    "none".to_string()
                } else {
                    drops.join(" ")
                }
            );
            let _ = writeln!(
                o,
                "  backend entries: {} live, {} quarantined; frames tx {} rx {}",
                s.host.live,
                s.host.quarantined,
                s.host.io("wire_tx_frames"),
                s.host.io("wire_rx_frames")
            );
        }
        None => {
            let _ = writeln!(o, "  backend: no answer from its control socket");
        }
    }
    let gd: Vec<String> = h
        .guests
        .drops
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let _ = writeln!(
        o,
        "  guest drops: {}; connections left {}",
        if gd.is_empty() {
            "none".to_string()
        } else {
            gd.join(" ")
        },
        h.guests.connections_left
    );
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::super::opts::{LabOptions, ScenarioName};
    use super::Report;

    #[test]
    fn vm_addresses_print_as_runs() {
        let a: Vec<_> = (0..252)
            .map(|v| super::super::world::vm_addr(10, 0, v))
            .collect();
        assert_eq!(super::vm_ranges(&a), "127.10.1.1-250, 127.10.129.1-2");
        assert_eq!(super::vm_ranges(&a[..1]), "127.10.1.1");
    }

    fn report() -> Report {
        let mut r = Report::new(&LabOptions::new(
            ScenarioName::Teardown,
            PathBuf::from("pvcm-lab"),
        ));
        r.figure("connections", 12u64);
        r.figure("policy", "default");
        r.time("teardown", Duration::from_millis(1500));
        r
    }

    #[test]
    fn known_figures_and_timings_read_back() {
        let r = report();
        assert_eq!(r.num("connections"), 12.0);
        assert_eq!(r.secs("teardown"), 1.5);
    }

    #[test]
    #[should_panic(expected = "no figure \"conections\"")]
    fn an_unknown_figure_fails() {
        let _ = report().num("conections");
    }

    #[test]
    #[should_panic(expected = "is not a number")]
    fn a_figure_that_is_not_a_number_fails() {
        let _ = report().num("policy");
    }

    #[test]
    #[should_panic(expected = "no timing \"tear_down\"")]
    fn an_unknown_timing_fails() {
        let _ = report().secs("tear_down");
    }
}
