//! `pvcm-guest`'s commands through pvcm-guestd's rdma_cm layer: the CLI's client
//! ([`RdmaCm`]) writes its commands into two services' rdma_cm layers ([`Cma`]) wired
//! back to back in memory (two VMs: their CM agents, MADs handed across), each command
//! side running on its own thread as two processes would; the answers land in this
//! process's buffers through `process_vm_writev`, as pvcm-guestd writes them. Then the
//! binary: `--via`, the control socket, the errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod service_support;

use std::net::Ipv4Addr;
use std::process::{Command, ExitCode};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pvcm_guest::cli::Cmd;
use pvcm_guest::cli::via_service::{
    Captured, Control, DEFAULT_RDMA_CM, ViaError, info, run_command,
};
use pvcm_guest::cm::{Group, RejReason};
use pvcm_guest::service::abi::{event, ps};
use pvcm_guest::service::caller::ProcessMemory;
use pvcm_guest::service::client::{Channel, RdmaCm};
use pvcm_guest::service::cma::{Env, Fh, Outcome};
use pvcm_guest::service::server::pvcm_stat_json;
use pvcm_guest::time::{Clock, SystemClock};
use pvcm_wire::Gid;
use pvcm_wire::abi::PortInfo;
use pvcm_wire::mad::AttributeId;
use serde_json::{Value, json};
use service_support::{ROOT, Vm};

/// Two VMs (10.99.0.11 and 10.99.0.12, QPN range 16 + 0x20000) and real time.
struct World {
    vms: [Vm; 2],
    clock: SystemClock,
    /// Which sides move MADs while they wait (both, but in the pipelining test).
    pumps: [bool; 2],
}

impl World {
    fn tick(&mut self) {
        let now = self.clock.now().after(Duration::from_millis(1));
        for vm in &mut self.vms {
            vm.now = vm.now.max(now);
        }
    }

    /// Moves MADs between the VMs until none is left, runs the agents' timers and
    /// routes the agents' events into the services.
    fn pump(&mut self) {
        self.tick();
        loop {
            let mut moved = 0;
            for from in 0..2 {
                let to = 1 - from;
                let now = self.vms[from].now;
                self.vms[from].agent.poll(now);
                let mads: Vec<_> = self.vms[from].agent.drain_outbox().collect();
                let (src, dst) = (self.vms[from].gid, self.vms[to].gid);
                for m in &mads {
                    if m.dst == dst {
                        let now = self.vms[to].now;
                        self.vms[to].agent.handle_mad(&m.mad, src, now);
                    }
                }
                moved += mads.len();
                for vm in &mut self.vms {
                    vm.events_from_agent();
                    let now = vm.now;
                    vm.cma.poll_addr(now);
                }
            }
            if moved == 0 {
                return;
            }
        }
    }

    fn port_info(&self, side: usize) -> PortInfo {
        port_info(&self.vms[side], side)
    }
}

/// The pvcm port a VM's device would report (PORT_INFO) for its agent's configuration.
fn port_info(vm: &Vm, side: usize) -> PortInfo {
    let c = vm.agent.config();
    PortInfo {
        abi_version: 1,
        port_up: true,
        gid: c.gid,
        more_gids: Vec::new(),
        ca_guid: c.ca_guid,
        lid: c.lid,
        pkey: c.pkey,
        qpn_base: c.qpn_base,
        qpn_count: c.qpn_count,
        max_entries: 0,
        name: format!("vm{side}"),
        active_mtu: 3,
        ca_ack_delay: 0,
    }
}

struct Shared {
    world: Mutex<World>,
    cv: Condvar,
}

fn world() -> Arc<Shared> {
    world_pumped_by([true, true])
}

fn world_pumped_by(pumps: [bool; 2]) -> Arc<Shared> {
    Arc::new(Shared {
        world: Mutex::new(World {
            vms: [Vm::new(11), Vm::new(12)],
            clock: SystemClock::new(),
            pumps,
        }),
        cv: Condvar::new(),
    })
}

/// One process's file of one VM's service. Commands run at once; MADs move only while
/// a side waits for events (the service's loop pumps the device on its own time), so
/// a client that does not wait keeps every request in flight.
struct Loop {
    shared: Arc<Shared>,
    side: usize,
    fh: Fh,
}

fn open(shared: &Arc<Shared>, side: usize) -> Loop {
    let fh = shared.world.lock().unwrap().vms[side].cma.open();
    Loop {
        shared: shared.clone(),
        side,
        fh,
    }
}

impl Channel for Loop {
    fn execute(&mut self, command: &[u8]) -> Result<(), i32> {
        let mut w = self.shared.world.lock().unwrap();
        w.tick();
        let vm = &mut w.vms[self.side];
        let mut mem = ProcessMemory::new(std::process::id());
        let mut env = Env {
            agent: &mut vm.agent,
            now: vm.now,
        };
        let out = vm.cma.write(self.fh, ROOT, command, &mut mem, &mut env);
        self.shared.cv.notify_all();
        match out {
            Outcome::Done(r) => r,
            // The client's file is non-blocking.
            Outcome::WaitEvent { .. } => Err(libc::EAGAIN),
            Outcome::Migrate { .. } => Err(libc::EINVAL),
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<bool, i32> {
        let until = Instant::now() + timeout;
        let mut w = self.shared.world.lock().unwrap();
        loop {
            if w.pumps[self.side] {
                w.pump();
                self.shared.cv.notify_all();
            }
            if w.vms[self.side].cma.has_events(self.fh) {
                return Ok(true);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            w = self
                .shared
                .cv
                .wait_timeout(w, left.min(Duration::from_millis(5)))
                .unwrap()
                .0;
        }
    }
}

impl Drop for Loop {
    /// The process's file closes: the service releases its ids.
    fn drop(&mut self) {
        let mut w = self.shared.world.lock().unwrap();
        let vm = &mut w.vms[self.side];
        let mut env = Env {
            agent: &mut vm.agent,
            now: vm.now,
        };
        vm.cma.release(self.fh, &mut env);
    }
}

/// The service's stat as pvcm-guestd's control socket gives the CLI what it reads.
struct LoopControl {
    shared: Arc<Shared>,
    side: usize,
}

impl Control for LoopControl {
    fn stat(&mut self) -> Result<Value, ViaError> {
        let w = self.shared.world.lock().unwrap();
        let vm = &w.vms[self.side];
        let mut v = pvcm_stat_json(&w.port_info(self.side), true, &vm.agent);
        let m = v.as_object_mut().unwrap();
        m.insert("ids".into(), json!(vm.cma.ids()));
        m.insert(
            "device".into(),
            json!({"rx_mads": 0, "tx_mads": 0, "send_errors": 0}),
        );
        m.insert(
            "port".into(),
            json!({"device": "rxe0", "port": 1, "gid_index": 1, "netdev": "eth0", "path_mtu": 3}),
        );
        Ok(v)
    }

    fn describe(&self) -> String {
        format!("loopback vm{}", self.side)
    }
}

/// Runs `cmd` as a `pvcm-guest` process of VM `side`: its exit status and lines.
fn run(shared: &Arc<Shared>, side: usize, cmd: Cmd) -> (ExitCode, Captured) {
    let mut cm = RdmaCm::new(open(shared, side));
    let mut control = LoopControl {
        shared: shared.clone(),
        side,
    };
    let stat = control.stat().unwrap();
    let mut rep = Captured::default();
    let code = run_command(
        &mut cm,
        &mut control,
        &stat,
        &cmd,
        7 + side as u64,
        &mut rep,
    )
    .unwrap_or_else(|e| panic!("vm{side}: {e}"));
    (code, rep)
}

fn spawn(
    shared: &Arc<Shared>,
    side: usize,
    cmd: Cmd,
) -> std::thread::JoinHandle<(ExitCode, Captured)> {
    let shared = shared.clone();
    std::thread::spawn(move || run(&shared, side, cmd))
}

fn ok(c: ExitCode) -> bool {
    format!("{c:?}") == format!("{:?}", ExitCode::SUCCESS)
}

fn code3(c: ExitCode) -> bool {
    format!("{c:?}") == format!("{:?}", ExitCode::from(3))
}

fn gid(n: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, n))
}

fn in_range(q: &Value) -> bool {
    q.as_u64().is_some_and(|q| (16..16 + 0x20000).contains(&q))
}

fn listen(port: u16, count: u32, data: &str) -> Cmd {
    Cmd::Listen {
        port,
        count: Some(count),
        data: Some(data.into()),
        reject: false,
        react_after: Duration::ZERO,
    }
}

fn connect(port: u16, data: &str) -> Cmd {
    Cmd::Connect {
        dest: gid(12),
        port,
        data: Some(data.into()),
        timeout: Duration::from_secs(10),
        hold: Duration::ZERO,
        src_port: None,
    }
}

/// Waits until VM `side` has a listener in its agent.
fn until_listening(shared: &Arc<Shared>, side: usize) {
    let until = Instant::now() + Duration::from_secs(10);
    while shared.world.lock().unwrap().vms[side]
        .agent
        .listener_count()
        == 0
    {
        assert!(Instant::now() < until, "vm{side} never listened");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn listen_and_connect_with_data_both_ways() {
    let w = world();
    let server = spawn(&w, 1, listen(7471, 2, "hi-from-b"));
    until_listening(&w, 1);
    for n in 0..2 {
        let (code, rep) = run(&w, 0, connect(7471, &format!("hello-{n}")));
        assert!(ok(code), "{:?}", rep.lines);
        let e = rep.events("established");
        assert_eq!(e.len(), 1, "{:?}", rep.lines);
        assert_eq!(e[0]["data"], "hi-from-b");
        assert!(in_range(&e[0]["remote_qpn"]), "{}", e[0]);
        assert!(
            e[0]["src_port"].as_u64().unwrap() >= 32768,
            "ephemeral: {}",
            e[0]
        );
        assert!(e[0]["id"].as_str().unwrap().starts_with("rdma_cm#"));
        let d = rep.events("disconnected");
        assert_eq!(
            (d[0]["by"].as_str(), d[0]["drep"].as_bool()),
            (Some("us"), Some(true))
        );
        assert_eq!(rep.events("destroyed").len(), 1);
        // Text lines as the device path words them.
        assert!(
            rep.lines[0]
                .0
                .contains(": established to ::ffff:10.99.0.12 port 7471 from port")
        );
    }
    let (code, rep) = server.join().unwrap();
    assert!(ok(code), "{:?}", rep.lines);
    assert_eq!(rep.events("listening")[0]["gid"], "::ffff:10.99.0.12");
    let req = rep.events("connect_request");
    assert_eq!(req.len(), 2);
    assert_eq!(req[0]["data"], "hello-0");
    assert_eq!(req[1]["data"], "hello-1");
    assert_eq!(req[0]["remote_gid"], "::ffff:10.99.0.11");
    assert!(in_range(&req[0]["remote_qpn"]));
    assert_eq!(rep.events("established").len(), 2);
    assert!(
        rep.events("established")
            .iter()
            .all(|e| in_range(&e["remote_qpn"]))
    );
    assert_eq!(rep.events("disconnected").len(), 2);
    // Every id went with its command; the MADs were the CM's.
    let w = w.world.lock().unwrap();
    assert_eq!((w.vms[0].cma.ids(), w.vms[1].cma.ids()), (0, 0));
    let (a, b) = (w.vms[0].agent.counters(), w.vms[1].agent.counters());
    assert_eq!(a.get(Group::TxMsgs, AttributeId::Req), 2);
    assert_eq!(a.get(Group::TxMsgs, AttributeId::Rtu), 2);
    assert_eq!(a.get(Group::TxMsgs, AttributeId::Dreq), 2);
    assert_eq!(b.get(Group::TxMsgs, AttributeId::Rep), 2);
    assert_eq!(b.get(Group::TxMsgs, AttributeId::Drep), 2);
}

#[test]
fn cmtime_keeps_every_connection_in_flight() {
    const N: u32 = 300;
    // MADs move only while the client waits: nothing is answered before the client's
    // first wait for an event.
    let w = world_pumped_by([true, false]);
    let server = spawn(
        &w,
        1,
        Cmd::Cmtime {
            dest: None,
            connections: N,
            port: 7471,
            server: true,
            timeout: Some(Duration::from_secs(120)),
            hold: Duration::ZERO,
            rounds: 1,
            pause: Duration::ZERO,
        },
    );
    until_listening(&w, 1);
    let (code, rep) = run(
        &w,
        0,
        Cmd::Cmtime {
            dest: Some(gid(12)),
            connections: N,
            port: 7471,
            server: false,
            timeout: Some(Duration::from_secs(60)),
            hold: Duration::ZERO,
            rounds: 1,
            pause: Duration::ZERO,
        },
    );
    assert!(ok(code), "{:?}", rep.lines);
    let r = &rep.lines[0].1;
    assert_eq!(
        (
            &r["connections"],
            &r["established"],
            &r["disconnected"],
            &r["failed"]
        ),
        (&json!(N), &json!(N), &json!(N), &json!(0)),
        "{r}"
    );
    for step in ["connect", "establish", "disconnect", "destroy"] {
        assert_eq!(r["steps"][step]["count"], N, "{step}: {r}");
    }
    assert!(
        rep.lines[0]
            .0
            .contains("connections 300 established 300 failed 0 disconnected 300")
    );
    // Every connection reached CONNECT before the client first waited: the
    // destination's window (32 at the start) was full and the rest queued behind it.
    assert!(
        r["pacing"]["max_outstanding"].as_u64().unwrap() >= 32,
        "{r}"
    );
    assert_eq!(r["pacing"]["max_queued"], N - 32, "{r}");
    let s = rep.events("service");
    // Per connection: create, resolve ip, resolve route, connect, the RTU, disconnect,
    // destroy, and its events' reads (address, route, response, disconnected, and
    // TIMEWAIT_EXIT when its TimeWait ended before the destroy); a read that finds no
    // event ends a batch of reads (one per 16 connections started or disconnected) or
    // comes before a wait for the file, never one per connection.
    let n = u64::from(N);
    let (commands, events, empty, waits) = (
        s[0]["commands"].as_u64().unwrap(),
        s[0]["events"].as_u64().unwrap(),
        s[0]["empty_reads"].as_u64().unwrap(),
        s[0]["waits"].as_u64().unwrap(),
    );
    assert_eq!(commands, 7 * n + events + empty, "{}", s[0]);
    assert!((4 * n..=5 * n).contains(&events), "{}", s[0]);
    assert!(empty <= waits + 2 * n.div_ceil(16) + 2, "{}", s[0]);
    let (code, srep) = server.join().unwrap();
    assert!(ok(code), "{:?}", srep.lines);
    let sr = &srep.lines[1].1;
    assert_eq!(
        (&sr["accepted"], &sr["established"], &sr["disconnected"]),
        (&json!(N), &json!(N), &json!(N))
    );
    let w = w.world.lock().unwrap();
    let (a, b) = (w.vms[0].agent.counters(), w.vms[1].agent.counters());
    assert_eq!(a.get(Group::TxMsgs, AttributeId::Req), u64::from(N));
    assert_eq!(a.get(Group::TxMsgs, AttributeId::Dreq), u64::from(N));
    assert_eq!(a.get(Group::TxRetries, AttributeId::Req), 0);
    assert_eq!(b.get(Group::TxMsgs, AttributeId::Rep), u64::from(N));
    assert_eq!((w.vms[0].cma.ids(), w.vms[1].cma.ids()), (0, 0));
}

#[test]
fn rejected_and_refused_connections_exit_3_with_the_reason() {
    let w = world();
    // No listener on the port: the peer's CM answers REJ(invalid service ID).
    let (code, rep) = run(&w, 0, connect(9999, ""));
    assert!(code3(code), "{:?}", rep.lines);
    let e = rep.events("rejected");
    assert_eq!(e[0]["reason_name"], "invalid_service_id", "{}", e[0]);
    assert_eq!(e[0]["reason_code"], 8);
    // An application that rejects with private data: consumer defined.
    let shared = w.clone();
    let rejecter = std::thread::spawn(move || {
        let mut cm = RdmaCm::new(open(&shared, 1));
        let l = cm.create_id(1, ps::TCP).unwrap();
        cm.bind_ip(l, "0.0.0.0:7400".parse().unwrap()).unwrap();
        cm.listen(l, 0).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let e = cm.next_event(until).unwrap().expect("a request");
        assert_eq!(e.event, event::CONNECT_REQUEST);
        cm.reject(e.id, b"go away").unwrap();
        cm.destroy_id(e.id).unwrap();
        cm.destroy_id(l).unwrap();
    });
    until_listening(&w, 1);
    let (code, rep) = run(&w, 0, connect(7400, "knock"));
    rejecter.join().unwrap();
    assert!(code3(code), "{:?}", rep.lines);
    let e = rep.events("rejected");
    assert_eq!(e[0]["reason_name"], RejReason::ConsumerDefined.name());
    assert!(
        rep.lines[0]
            .0
            .contains("failed: rejected by ::ffff:10.99.0.12: REJ reason consumer_defined(28)"),
        "{}",
        rep.lines[0].0
    );
    assert_eq!(w.world.lock().unwrap().vms[0].cma.ids(), 0);
}

#[test]
fn unanswered_and_unroutable_connections_exit_3() {
    let w = world();
    // 10.99.0.99 answers ARP but runs no CM: no answer within the timeout; destroying
    // sends REJ(TIMEOUT).
    w.world.lock().unwrap().vms[0].net.answer("10.99.0.99");
    let (code, rep) = run(
        &w,
        0,
        Cmd::Connect {
            dest: gid(99),
            port: 7471,
            data: None,
            timeout: Duration::from_millis(300),
            hold: Duration::ZERO,
            src_port: Some(4791),
        },
    );
    assert!(code3(code), "{:?}", rep.lines);
    assert_eq!(
        rep.events("timeout")[0]["failure"],
        "timeout",
        "{:?}",
        rep.lines
    );
    assert!(
        rep.lines[0]
            .0
            .contains("no answer within 300ms; destroying (REJ timeout)")
    );
    {
        let w = w.world.lock().unwrap();
        let a = w.vms[0].agent.counters();
        assert_eq!(a.get(Group::TxMsgs, AttributeId::Req), 1);
        assert_eq!(a.get(Group::TxMsgs, AttributeId::Rej), 1);
        assert_eq!(w.vms[0].cma.ids(), 0);
    }
    // Nobody at 10.99.0.98, not even for ARP: address resolution fails when its
    // 2000 ms are up (ADDR_ERROR), unreachable, and no REQ leaves.
    let (code, rep) = run(
        &w,
        0,
        Cmd::Connect {
            dest: gid(98),
            port: 7471,
            data: None,
            timeout: Duration::from_secs(5),
            hold: Duration::ZERO,
            src_port: None,
        },
    );
    assert!(code3(code), "{:?}", rep.lines);
    assert_eq!(rep.events("unreachable").len(), 1, "{:?}", rep.lines);
    assert_eq!(
        w.world.lock().unwrap().vms[0]
            .agent
            .counters()
            .get(Group::TxMsgs, AttributeId::Req),
        1,
        "no REQ for an unresolved address"
    );
    // An IPv6 destination from an IPv4 VM: no route (RESOLVE_IP fails), unreachable.
    let (code, rep) = run(
        &w,
        0,
        Cmd::Connect {
            dest: "fd99::2".parse().unwrap(),
            port: 7471,
            data: None,
            timeout: Duration::from_secs(5),
            hold: Duration::ZERO,
            src_port: None,
        },
    );
    assert!(code3(code), "{:?}", rep.lines);
    assert_eq!(rep.events("unreachable").len(), 1, "{:?}", rep.lines);
}

#[test]
fn connect_destroy_sends_the_req_then_rej_timeout() {
    let w = world();
    let server = spawn(&w, 1, listen(7002, 1, ""));
    until_listening(&w, 1);
    let (code, rep) = run(
        &w,
        0,
        Cmd::ConnectDestroy {
            dest: gid(12),
            port: 7002,
            settle: Duration::from_millis(300),
        },
    );
    assert!(ok(code), "{:?}", rep.lines);
    let r = &rep.events("connect_destroy")[0];
    assert_eq!(r["counters"]["cm_tx_msgs"]["req"], 1, "{r}");
    assert_eq!(r["counters"]["cm_tx_msgs"]["rej"], 1, "{r}");
    assert!(
        rep.lines[0].0.contains("sent REQ 1 REJ 1"),
        "{}",
        rep.lines[0].0
    );
    // The listener saw the request and its end: withdrawn before its answer, or
    // rejected: TIMEOUT for the REQ, or consumer-defined when its REP reached the
    // client between CONNECT and DESTROY_ID (two writes, where the device path makes
    // two calls with nothing in between).
    let (code, srep) = server.join().unwrap();
    assert!(ok(code), "{:?}", srep.lines);
    assert_eq!(srep.events("connect_request").len(), 1);
    let rej = srep.events("rejected");
    let ended = srep.events("withdrawn").len()
        + rej
            .iter()
            .filter(|e| e["reason"] == "Timeout" || e["reason"] == "ConsumerDefined")
            .count();
    assert_eq!(ended, 1, "{:?}", srep.lines);
    assert!(srep.events("established").is_empty());
}

#[test]
fn info_prints_the_port_and_the_stat() {
    let w = world();
    let mut control = LoopControl {
        shared: w.clone(),
        side: 0,
    };
    let stat = control.stat().unwrap();
    let mut rep = Captured::default();
    let code = info(
        &stat,
        &mut control,
        std::path::Path::new(DEFAULT_RDMA_CM),
        &mut rep,
    )
    .unwrap();
    assert!(ok(code));
    let (text, v) = &rep.lines[0];
    assert_eq!(v["via"], "service");
    assert_eq!(v["gid"], "::ffff:10.99.0.11");
    assert_eq!(
        (&v["qpn_base"], &v["qpn_count"]),
        (&json!(16), &json!(0x20000))
    );
    assert!(v["counters"]["cm_tx_msgs"].is_object());
    assert_eq!(v["service"]["ids"], 0);
    assert!(
        text.contains("qpns        0x10..0x20010 (131072)"),
        "{text}"
    );
    assert!(
        text.contains("rdma port   rxe0 port 1 GID index 1 (eth0, path MTU code 3)"),
        "{text}"
    );
}

// ------------------------------------------------------------------ the binary

fn cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pvcm-guest"))
}

/// A control socket that answers every connection with `stat`.
fn fake_service(dir: &std::path::Path, stat: Value) -> std::path::PathBuf {
    let p = dir.join("guestd.sock");
    let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
    std::thread::spawn(move || {
        use std::io::Write as _;
        while let Ok((mut s, _)) = l.accept() {
            let _ = writeln!(s, "{stat}");
        }
    });
    p
}

fn a_stat() -> Value {
    let mut v = json!({"files": 0, "ids": 0, "commands": {}});
    let vm = Vm::new(11);
    let extra = pvcm_stat_json(&port_info(&vm, 0), true, &vm.agent);
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    v
}

#[test]
fn the_binary_takes_the_service_when_it_answers() {
    let t = tempfile::tempdir().unwrap();
    let sock = fake_service(t.path(), a_stat());
    let s = sock.to_str().unwrap();
    // auto: the socket answers, so info is the service's.
    let out = cli()
        .args(["--json", "--control", s, "info"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((&v["via"], &v["qpn_base"]), (&json!("service"), &json!(16)));
    // The agent's options cannot apply through the service: a usage error.
    let out = cli()
        .args(["--control", s, "--linux-drep", "listen", "--port", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--linux-drep"));
    // The device cannot be driven under the service.
    let out = cli()
        .args(["--via", "device", "--control", s, "info"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("owns the pvcm device"));
    // The node is missing: a clear error with a hint, exit status 1.
    let out = cli()
        .args([
            "--json",
            "--via",
            "service",
            "--control",
            s,
            "--rdma-cm",
            t.path().join("rdma_cm").to_str().unwrap(),
            "connect",
            "--dest",
            "10.99.0.12",
            "--port",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("opening") && err.contains("hint:"), "{err}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("rdma_cm"));
}

#[test]
fn the_binary_without_the_service() {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(t.path().join("bus/pci/devices")).unwrap();
    let none = t.path().join("none.sock");
    // auto without an answer: the device path (and its error: no device here).
    let out = cli()
        .args([
            "--control",
            none.to_str().unwrap(),
            "--sysfs",
            t.path().to_str().unwrap(),
            "info",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no virtio-pci device"));
    // --via service insists.
    let out = cli()
        .args([
            "--via",
            "service",
            "--control",
            none.to_str().unwrap(),
            "info",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("control socket") && err.contains("pvcm-guestd running"),
        "{err}"
    );
    let out = cli().args(["--via", "nowhere", "info"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    // A socket that answers something else is an error, not a silent device path.
    let bad = fake_service(t.path(), json!("hello"));
    let out = cli()
        .args(["--control", bad.to_str().unwrap(), "info"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the service's stat"));
}
