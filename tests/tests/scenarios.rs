//! Every lab scenario at a small scale, end to end through the real pieces (backend
//! processes, vhost-user sessions, memfd guest memory, the guest driver and its CM
//! agent), with its invariants asserted; for teardown, rej-timeout and ipoib-cm also the
//! legacy policies next to the default.
//!
//! Each test uses its own loopback net (127.NET.H.V), so they run in parallel.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use pvcm_backend::mux::Policy;
use pvcm_lab::lab::opts::CmTimeouts;
use pvcm_lab::lab::{LabOptions, Report, ScenarioName};

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pvcm-lab"))
}

fn opts(s: ScenarioName, net: u8) -> LabOptions {
    let mut o = LabOptions::new(s, exe());
    o.net = net;
    o.phase_timeout = Duration::from_secs(60);
    o
}

fn run(o: &LabOptions) -> Report {
    match pvcm_lab::lab::run(o) {
        Ok(r) => r,
        Err(e) => panic!("{} failed to run: {e}", o.scenario.name()),
    }
}

fn assert_ok(r: &Report) {
    assert!(r.ok, "invariant broken:\n{}", r.render());
    // The JSON document is whole.
    let v: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
    assert_eq!(v["ok"], true);
}

#[test]
fn teardown_small() {
    let mut o = opts(ScenarioName::Teardown, 61);
    o.vms_per_host = 2;
    o.procs = 3;
    o.cm = CmTimeouts::SHORT;
    let r = run(&o);
    assert_ok(&r);
    assert_eq!(r.num("connections"), 12.0);
    assert_eq!(r.num("torn_down"), 12.0);
    assert_eq!(r.num("dreq_retries_guests"), 0.0);
    assert_eq!(r.num("live_entries_after_quiesce"), 0.0);
    // Per host: the backend's table and the guests' agree on what crossed the wire.
    for h in &r.hosts {
        let b = h.backend.as_ref().unwrap();
        for m in ["req", "rep", "rtu", "dreq", "drep"] {
            assert_eq!(
                b.host.cm("cm_tx_msgs", m),
                h.guests.cm("cm_tx_msgs", m),
                "{m}"
            );
            assert_eq!(
                b.host.cm("cm_rx_msgs", m),
                h.guests.cm("cm_rx_msgs", m),
                "{m}"
            );
        }
    }
}

/// Seed 000's slow-guest teardown (one VM per host, 5.5 s late applications, rdma_cm's
/// pre-2020 RoCE timeouts with one retry) under mlx4-pre2020 and the default policy, run
/// side by side on networks `nets`; returns (legacy, default).
fn slow_teardown_pair(linux_drep: bool, nets: (u8, u8)) -> (Report, Report) {
    let base = |policy, net| {
        let mut o = opts(ScenarioName::Teardown, net);
        o.vms_per_host = 1;
        o.procs = 2;
        o.policy = policy;
        o.cm = CmTimeouts {
            retries: 1,
            ..CmTimeouts::LINUX_PRE2020
        };
        o.slow_guest = Duration::from_millis(5500);
        o.linux_drep = linux_drep;
        o
    };
    let legacy = base(Policy::Mlx4Pre2020, nets.0);
    let default = base(Policy::Default, nets.1);
    std::thread::scope(|s| {
        let l = s.spawn(|| run(&legacy));
        let d = s.spawn(|| run(&default));
        (l.join().unwrap(), d.join().unwrap())
    })
}

/// Seed 000: a guest slower than mlx4's 5 s timer but faster than the DREQ attempt
/// (6.1 s with rdma_cm's pre-2020 RoCE timeouts), with guests that send the DREP only
/// when the application disconnects, as Linux's rdma_cm (`--linux-drep`). Legacy: the
/// entry is gone when the DREP comes, so the peer retries (and gives up); default: no
/// retry at all.
#[test]
fn teardown_slow_guest_legacy_storm_vs_default() {
    let (l, d) = slow_teardown_pair(true, (62, 63));
    assert_ok(&d);
    assert_eq!(d.num("dreq_retries_guests"), 0.0, "{}", d.render());
    assert_eq!(d.num("drops_mux"), 0.0, "{}", d.render());
    assert!(d.secs("teardown") < 6.0, "{}", d.render());
    assert!(l.num("dreq_retries_guests") > 0.0, "{}", l.render());
    assert!(l.num("drops_mux") > 0.0, "{}", l.render());
    assert!(
        l.secs("teardown") > d.secs("teardown") + 5.0,
        "{}",
        l.render()
    );
}

/// Seed 000 with guests that answer a DREQ at once (the agent's default,
/// `AgentConfig::auto_drep`): however slow the application, neither policy sees a retry.
#[test]
fn teardown_slow_guest_no_dreq_retry_under_either_policy() {
    let (l, d) = slow_teardown_pair(false, (90, 91));
    assert_ok(&d);
    assert_eq!(d.num("dreq_retries_guests"), 0.0, "{}", d.render());
    assert_eq!(d.num("drops_mux"), 0.0, "{}", d.render());
    assert!(d.secs("teardown") < 6.0, "{}", d.render());
    assert_ok(&l);
    assert_eq!(l.num("dreq_retries_guests"), 0.0, "{}", l.render());
    assert_eq!(l.num("drops_mux"), 0.0, "{}", l.render());
    assert!(l.secs("teardown") < 6.0, "{}", l.render());
}

/// Seed 002 with two active hosts whose comm IDs collide at the passive host.
#[test]
fn rej_timeout_per_policy() {
    let base = |policy, net| {
        let mut o = opts(ScenarioName::RejTimeout, net);
        o.rounds = 10;
        o.policy = policy;
        if policy != Policy::Default {
            // Leaks are expected there; no need to wait out the legacy timers.
            o.quiesce_timeout = Some(Duration::from_secs(2));
        }
        o
    };
    let (d, post, pre) = (
        base(Policy::Default, 64),
        base(Policy::Mlx4Post2020, 65),
        base(Policy::Mlx4Pre2020, 66),
    );
    let (d, post, pre) = std::thread::scope(|s| {
        let a = s.spawn(|| run(&d));
        let b = s.spawn(|| run(&post));
        let c = s.spawn(|| run(&pre));
        (a.join().unwrap(), b.join().unwrap(), c.join().unwrap())
    });
    assert_ok(&d);
    assert_eq!(
        d.num("rounds_with_comm_id_collision"),
        10.0,
        "{}",
        d.render()
    );
    assert_eq!(d.num("rej_timeout_delivered"), 20.0);
    assert_eq!(d.num("rej_timeout_lost"), 0.0);
    assert_eq!(d.num("rej_timeout_misrouted"), 0.0);
    assert!(post.num("rej_timeout_misrouted") > 0.0, "{}", post.render());
    assert!(!post.held("no_rej_at_wrong_vm"));
    assert!(pre.num("rej_timeout_lost") > 0.0, "{}", pre.render());
    assert!(!pre.ok);
}

#[test]
fn churn_default_and_faulty_wire() {
    let mut a = opts(ScenarioName::Churn, 67);
    a.rounds = 10;
    let mut b = opts(ScenarioName::Churn, 68);
    b.rounds = 10;
    b.faults.loss = 0.02;
    b.faults.dup = 0.02;
    b.faults.reorder = 0.05;
    b.faults.delay = Duration::from_micros(300);
    let (a, b) = std::thread::scope(|s| {
        let x = s.spawn(|| run(&a));
        let y = s.spawn(|| run(&b));
        (x.join().unwrap(), y.join().unwrap())
    });
    assert_ok(&a);
    assert_eq!(a.num("unexpected_active_ends"), 0.0);
    assert_eq!(a.num("live_entries_after_quiesce"), 0.0);
    assert_ok(&b);
    let relay = b.relay.unwrap();
    assert!(
        relay.lost > 0 && relay.duplicated > 0 && relay.reordered > 0,
        "{relay:?}"
    );
    assert_eq!(b.num("live_entries_after_quiesce"), 0.0);
}

#[test]
fn timewait_reuse_no_stale_rejects() {
    let mut o = opts(ScenarioName::TimewaitReuse, 69);
    o.connections = 100;
    let r = run(&o);
    assert_ok(&r);
    assert_eq!(r.num("stale_conn_rejects"), 0.0);
    assert!(r.num("local_qpn_reused_in_timewait") > 0.0);
    assert!(r.num("remote_qpn_recurred_in_timewait") > 0.0);
}

#[test]
fn ipoib_cm_vanish_default_and_legacy() {
    let d = opts(ScenarioName::IpoibCm, 70);
    let mut l = opts(ScenarioName::IpoibCm, 71);
    l.policy = Policy::Mlx4Pre2020;
    l.stale_timeout = Duration::from_millis(1000);
    l.quiesce_timeout = Some(Duration::from_secs(2));
    let (d, l) = std::thread::scope(|s| {
        let x = s.spawn(|| run(&d));
        let y = s.spawn(|| run(&l));
        (x.join().unwrap(), y.join().unwrap())
    });
    assert_ok(&d);
    assert_eq!(d.num("reaped_by_survivors"), 0.0);
    assert_eq!(d.num("cleaned_by_vanished_vms_host"), 8.0);
    assert_eq!(l.num("cleaned_by_vanished_vms_host"), 0.0, "{}", l.render());
    assert_eq!(l.num("reaped_by_survivors"), 8.0);
    assert!(l.num("live_entries_after_quiesce") > 0.0);
}

#[test]
fn cmtime_small() {
    let mut o = opts(ScenarioName::Cmtime, 72);
    o.connections = 100;
    let r = run(&o);
    assert_ok(&r);
    assert_eq!(r.num("established"), 100.0);
    assert!(r.num("connections_per_s_establish") > 0.0);
    assert!(r.table.as_deref().unwrap_or("").contains("establish"));
}

/// Servers that exit right after their last DREP (their device reset) while the wire
/// loses a fifth of the DREPs: under the default every client DREQ still gets its DREP,
/// answered by the server host's mux; under mlx4's policy each lost DREP costs its
/// client the whole DREQ retry budget.
#[test]
fn server_exit_gets_every_drep() {
    let mut o = opts(ScenarioName::ServerExit, 79);
    o.connections = 100;
    let d = run(&o);
    assert_ok(&d);
    let lost = d.num("dreps_lost_on_the_wire");
    assert!(lost > 0.0, "{}", d.render());
    // Each lost DREP (the VM's or the mux's) costs one DREQ retry, and is answered.
    assert_eq!(d.num("dreq_retries_guests"), lost, "{}", d.render());
    assert_eq!(d.num("answered_on_behalf_backends"), lost, "{}", d.render());

    let mut o = opts(ScenarioName::ServerExit, 80);
    o.connections = 100;
    o.policy = Policy::Mlx4Post2020;
    let l = run(&o);
    assert!(!l.ok, "{}", l.render());
    assert!(!l.held("no_dreq_timeout"), "{}", l.render());
    let (lost, retries) = (
        l.num("dreps_lost_on_the_wire"),
        l.num("dreq_retries_guests"),
    );
    assert!(lost > 0.0);
    assert_eq!(retries, lost * f64::from(o.cm.retries), "{}", l.render());
    assert_eq!(l.num("answered_on_behalf_backends"), 0.0);
}

#[test]
fn rate_small() {
    let mut o = opts(ScenarioName::Rate, 73);
    o.messages = 20_000;
    let r = run(&o);
    assert_ok(&r);
    let ratio = r.num("ratio_backends_to_raw");
    assert!(ratio > 0.0 && ratio.is_finite(), "{}", r.render());
}

/// The command itself: `--json` prints one document; the exit code follows the
/// invariants (an invalid option is a usage error).
#[test]
fn command_line() {
    let out = Command::new(exe())
        .args([
            "teardown",
            "--json",
            "--net",
            "74",
            "--vms-per-host",
            "1",
            "--procs",
            "2",
            "--cm-timeout",
            "14",
            "--packet-life",
            "12",
            "--cm-retries",
            "3",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["scenario"], "teardown");
    assert_eq!(v["ok"], true);
    assert_eq!(v["hosts"].as_array().unwrap().len(), 2);
    let bad = Command::new(exe())
        .args(["teardown", "--policy", "bogus"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let bad = Command::new(exe()).args(["nonsense"]).output().unwrap();
    assert!(!bad.status.success());
}
