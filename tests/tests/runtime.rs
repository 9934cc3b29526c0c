//! VMs added and removed on a running backend, over real vhost-user sockets, while two
//! other VMs of the same backend set up, hold and tear down 1,000 connections: those
//! see no retry and no drop; a removed VM's connections are released on its behalf
//! (its peer is sent DREQs and disconnects them).
//!
//! Run twice: with the soft port's raw receive (its filter follows the VMs) where the
//! test may open a raw socket, and in udp mode (each VM's socket polled by the host
//! loop from when it is added). Loopback addresses 127.93.x.x and 127.94.x.x are this
//! test's.

#![allow(clippy::unwrap_used)]

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use pvcm_backend::config::RxMode;
use pvcm_backend::control;
use pvcm_guest::cm::ConnectOptions;
use pvcm_guest::cm::rdma_cm::tcp_service_id;
use pvcm_lab::backend::{self, LabVmSpec};
use pvcm_lab::lab::guest::{GuestOpts, GuestVm};
use pvcm_lab::lab::standalone::{PairSide, big_guest, pair_connections, pump_pair_side};
use pvcm_wire::Gid;

/// Connections the steady VMs hold.
const N: u32 = 1000;
/// Connections between each pair of VMs that come and go.
const K: u32 = 20;
/// Rounds of adding and removing VMs.
const ROUNDS: u8 = 3;

fn ip(net: u8, c: u8, d: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, net, c, d)
}

/// The workload's phases: 1 = every connection up, 2 = tear them down (the main thread
/// says), 3 = done.
#[derive(Debug, Default)]
struct Phase(AtomicU32);

impl Phase {
    fn get(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
    fn set(&self, p: u32) {
        self.0.store(p, Ordering::Release);
    }
}

/// `n` connections from `client` to `server` (at `to`), all set up, held until `phase`
/// reaches 2, then torn down from the client. Both guests are pumped in this thread.
fn cmtime(
    client: &mut GuestVm,
    server: &mut GuestVm,
    to: Gid,
    n: u32,
    port: u16,
    phase: &Phase,
) -> (PairSide, PairSide) {
    let r = pair_connections(
        client,
        server,
        to,
        port,
        b"rt",
        n,
        Duration::from_secs(300),
        |all_up| {
            if all_up && phase.get() == 0 {
                phase.set(1);
            }
            phase.get() >= 2
        },
    )
    .unwrap();
    phase.set(3);
    r
}

fn vm_request(ctl: &Path, req: &str) -> String {
    let a = control::request(ctl, req).unwrap();
    assert!(a.starts_with("ok: ") || a.starts_with('['), "{req}: {a}");
    a
}

fn names(ctl: &Path) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&vm_request(ctl, "vm list")).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap().to_string())
        .collect()
}

/// One round: VMs `c` and `d` are added, their guests connect, `c` opens `K`
/// connections to `d`; then `c` is removed while they are up, and `d` must see every
/// one of them disconnected (the backend's DREQs on `c`'s behalf); then `d` goes too.
fn round(dir: &Path, ctl: &Path, net: u8, r: u8) {
    let (c, d) = (format!("c{r}"), format!("d{r}"));
    let (gc, gd) = (ip(net, 1, 2 * r + 1), ip(net, 1, 2 * r + 2));
    for (n, g) in [(&c, gc), (&d, gd)] {
        let a = vm_request(
            ctl,
            &format!(
                "vm add name={n},socket={},gid={g}",
                backend::socket(dir, n).display()
            ),
        );
        assert!(a.contains("listens"), "{a}");
    }
    let opts = |seed| GuestOpts {
        seed,
        ..GuestOpts::default()
    };
    let mut vc = GuestVm::connect(&backend::socket(dir, &c), &opts(100 + u64::from(r))).unwrap();
    let mut vd = GuestVm::connect(&backend::socket(dir, &d), &opts(200 + u64::from(r))).unwrap();
    let listen = vd.dev.listen(tcp_service_id(7000 + u16::from(r))).unwrap();
    for _ in 0..K {
        vc.dev
            .connect(
                Gid::from_ipv4(gd),
                tcp_service_id(7000 + u16::from(r)),
                b"x",
                &ConnectOptions::default(),
            )
            .unwrap();
    }
    let (mut sc, mut sd) = (PairSide::default(), PairSide::default());
    let mut up = Vec::new();
    let until = Instant::now() + Duration::from_secs(60);
    while sc.established < K || sd.established < K {
        assert!(Instant::now() < until, "round {r}: c {sc:?}, d {sd:?}");
        pump_pair_side(&mut vd, &mut sd, Some(listen), &mut Vec::new()).unwrap();
        pump_pair_side(&mut vc, &mut sc, None, &mut up).unwrap();
    }
    // c goes away with its K connections up: its guest is left unpumped (the VM is
    // gone), the backend releases them on its behalf.
    let a = vm_request(ctl, &format!("vm remove {c}"));
    assert!(a.contains(&format!("its {K} live connections")), "{a}");
    assert!(!backend::socket(dir, &c).exists());
    let until = Instant::now() + Duration::from_secs(30);
    while sd.disconnected < K {
        assert!(
            Instant::now() < until,
            "round {r}: d saw {sd:?} after c left"
        );
        pump_pair_side(&mut vd, &mut sd, Some(listen), &mut Vec::new()).unwrap();
    }
    drop(vc);
    vm_request(ctl, &format!("vm remove {d}"));
    drop(vd);
}

#[test]
fn vms_come_and_go_while_two_others_hold_1000_connections() {
    run(93, RxMode::Auto);
}

#[test]
fn vms_come_and_go_in_udp_mode_while_two_others_hold_1000_connections() {
    run(94, RxMode::Udp);
}

fn run(net: u8, mode: RxMode) {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("pvcm-runtime-test-{}-{net}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (
        LabVmSpec::new("a", ip(net, 0, 1)),
        LabVmSpec::new("b", ip(net, 0, 2)),
    );
    let mut cfg = backend::config(&dir, "h", &[&a, &b], u64::from(net));
    cfg.wire_rx = mode;
    let daemon = backend::start(cfg);
    let ctl = dir.join("h.ctl");
    let phase = Arc::new(Phase::default());
    let work = {
        let (dir, phase, to) = (dir.clone(), phase.clone(), b.gid());
        std::thread::spawn(move || {
            let mut va = big_guest(&backend::socket(&dir, "a"), 11).unwrap();
            let mut vb = big_guest(&backend::socket(&dir, "b"), 12).unwrap();
            cmtime(&mut va, &mut vb, to, N, 7471, &phase)
        })
    };
    // Rounds while the connections are being set up, and while they are all up.
    let mut during_setup = 0;
    for r in 0..ROUNDS {
        if phase.get() == 0 {
            during_setup += 1;
        }
        round(&dir, &ctl, net, r);
    }
    let until = Instant::now() + Duration::from_secs(300);
    while phase.get() < 1 {
        assert!(
            Instant::now() < until,
            "the 1,000 connections did not come up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    round(&dir, &ctl, net, ROUNDS);
    // A quota change on a VM in use: above what it holds, nothing else changes.
    let q = vm_request(&ctl, "vm quota a 5000");
    assert!(q.contains(&format!("holds {N} live")), "{q}");
    assert_eq!(names(&ctl), ["a", "b"]);
    phase.set(2);
    let (ca, sb) = work.join().unwrap();
    eprintln!(
        "{mode:?}: client a {ca:?}, server b {sb:?}; {} of {} rounds ran while the connections were \
         being set up",
        during_setup,
        ROUNDS + 1
    );
    for side in [ca, sb] {
        assert_eq!((side.established, side.disconnected), (N, N), "{side:?}");
        assert_eq!((side.failed, side.retries), (0, 0), "{side:?}");
    }
    let s = control::query(&ctl).unwrap();
    assert_eq!(s.vms.len(), 2, "removed VMs are gone from stat");
    // Their sessions stay in the host's sums: a and b's, and two per round.
    let sessions = s.host.io.get("sessions").copied().unwrap_or(0);
    assert!(
        sessions >= 2 + 2 * u64::from(ROUNDS + 1),
        "{sessions} sessions"
    );
    for v in &s.vms {
        for (k, n) in v.figures.drops.iter().chain(&v.figures.device_drops) {
            assert_eq!(*n, 0, "VM {}: {k}", v.name);
        }
    }
    daemon.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}
