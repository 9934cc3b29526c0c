//! The lab transport (`pvcm_guest::transport::lab`) end to end: two VMs whose DMA
//! windows are carved out of their guest memory, real kick and call eventfds, and a
//! device thread that sleeps in `ppoll` on the kick eventfds, serves both fake devices
//! (PORT_INFO, MADs copied between the VMs) and signals the call eventfds when the
//! driver asked for used-buffer notifications (EVENT_IDX) — what the lab's VMM and
//! `pvcm-backend` do. The drivers block in `LabTransport::wait`.

#![allow(clippy::unwrap_used)]

#[path = "device_support.rs"]
mod support;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pvcm_guest::cm::rdma_cm::tcp_service_id;
use pvcm_guest::cm::{ConnectOptions, Event};
use pvcm_guest::device::cmtime::{self, ClientOptions, ServerOptions};
use pvcm_guest::device::{Device, DeviceOptions, Queues, Transport};
use pvcm_guest::time::SystemClock;
use pvcm_guest::transport::lab::{LabTransport, eventfd};
use pvcm_guest::virtq::{DmaMemory, features};
use support::*;

fn dup(fd: &OwnedFd) -> OwnedFd {
    fd.try_clone().unwrap()
}

/// Adds a VM whose queues live in a lab window of its memory; the host keeps the call
/// eventfds, the returned kick eventfds are for the device thread to poll.
fn lab_vm(
    host: &std::sync::Mutex<FakeHost>,
    info: pvcm_wire::abi::PortInfo,
    size: u16,
) -> (LabTransport, Queues, [OwnedFd; 2]) {
    let (mem, dma) = guest();
    // Some memory before the window, as a VMM would have other things there.
    let _other = dma.alloc(3 * 4096, 4096).unwrap();
    let window = dma
        .alloc(LabTransport::<OwnedFd>::window_len(size), 4096)
        .unwrap();
    let kicks = [eventfd().unwrap(), eventfd().unwrap()];
    let calls = [eventfd().unwrap(), eventfd().unwrap()];
    let device_kicks = [dup(&kicks[0]), dup(&kicks[1])];
    let device_calls = [dup(&calls[0]), dup(&calls[1])];
    let lab = LabTransport::new(window, kicks, calls, features::PVCM);
    let queues = lab.queues(size).unwrap();
    host.lock()
        .unwrap()
        .attach(mem, info, &queues, features::PVCM, Some(device_calls));
    (lab, queues, device_kicks)
}

/// The device thread: sleeps on every kick eventfd, then runs host rounds.
fn device_thread(
    host: Arc<std::sync::Mutex<FakeHost>>,
    kicks: Vec<OwnedFd>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut wakeups = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut fds: Vec<libc::pollfd> = kicks
                .iter()
                .map(|k| libc::pollfd {
                    fd: k.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // SAFETY: valid pollfds for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
            if n > 0 {
                wakeups += 1;
                for (p, k) in fds.iter().zip(&kicks) {
                    if p.revents & libc::POLLIN != 0 {
                        let mut v = 0u64;
                        // SAFETY: reads 8 bytes into a live u64.
                        unsafe { libc::read(k.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                    }
                }
            }
            // Rounds until idle (a backlog may wait for rx buffers).
            while host.lock().unwrap().step() > 0 {}
        }
        wakeups
    })
}

/// Two started devices (VMs 1 and 2) on one fake host, served by a device thread that
/// runs until `stop` is set.
struct TwoVms {
    host: Arc<std::sync::Mutex<FakeHost>>,
    a: Device<LabTransport, SystemClock>,
    b: Device<LabTransport, SystemClock>,
    stop: Arc<AtomicBool>,
    dev_thread: std::thread::JoinHandle<u64>,
}

fn two_vms(seed: u64) -> TwoVms {
    let host = FakeHost::new();
    let (la, qa, ka) = lab_vm(&host, port(1), 64);
    let (lb, qb, kb) = lab_vm(&host, port(2), 64);
    let stop = Arc::new(AtomicBool::new(false));
    let dev_thread = device_thread(
        host.clone(),
        ka.into_iter().chain(kb).collect(),
        stop.clone(),
    );
    let opts = DeviceOptions {
        seed,
        ..DeviceOptions::default()
    };
    let t = Instant::now();
    let a = Device::start(la, qa, SystemClock::new(), opts).unwrap();
    let b = Device::start(lb, qb, SystemClock::new(), opts).unwrap();
    assert!(t.elapsed() < Duration::from_secs(3));
    TwoVms {
        host,
        a,
        b,
        stop,
        dev_thread,
    }
}

#[test]
fn lab_transport_handshake_connect_and_cmtime() {
    let TwoVms {
        host,
        mut a,
        mut b,
        stop,
        dev_thread,
    } = two_vms(7);
    assert_eq!(a.agent().config().gid, gid(1));
    assert_eq!(b.port_info().name, "vm2");
    assert_eq!(a.transport().describe(), "lab");

    // One connection by hand, B on its own thread blocking in its transport's wait.
    let listener = b.listen(tcp_service_id(5000)).unwrap();
    let server = std::thread::spawn(move || {
        let ev = b.next_cm_event(Duration::from_secs(10)).unwrap();
        let Some(Event::ConnectRequest { id, listen_id, .. }) = ev else {
            panic!("{ev:?}");
        };
        assert_eq!(listen_id, listener);
        b.accept(id, b"hi").unwrap();
        let ev = b.next_cm_event(Duration::from_secs(10)).unwrap();
        assert!(matches!(ev, Some(Event::Established { .. })), "{ev:?}");
        let ev = b.next_cm_event(Duration::from_secs(10)).unwrap();
        assert!(matches!(ev, Some(Event::Disconnected { .. })), "{ev:?}");
        b.destroy(id).unwrap();
        assert!(b.flush(Duration::from_secs(5)).unwrap());
        b
    });
    let id = a
        .connect(
            gid(2),
            tcp_service_id(5000),
            &[],
            &ConnectOptions::default(),
        )
        .unwrap();
    let ev = a.next_cm_event(Duration::from_secs(10)).unwrap();
    assert!(
        matches!(&ev, Some(Event::Established { private_data, .. }) if private_data.starts_with(b"hi")),
        "{ev:?}"
    );
    a.disconnect(id).unwrap();
    let ev = a.next_cm_event(Duration::from_secs(10)).unwrap();
    assert!(matches!(ev, Some(Event::Disconnected { .. })), "{ev:?}");
    a.destroy(id).unwrap();
    // Waiting for tx completions arms tx notifications: no sleeping out the timeout.
    let t = Instant::now();
    assert!(a.flush(Duration::from_secs(5)).unwrap());
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
    let mut b = server.join().unwrap();

    // cmtime over the same devices.
    const N: u32 = 25;
    let listener = b.listen(tcp_service_id(6000)).unwrap();
    let server = std::thread::spawn(move || {
        let r = cmtime::serve(
            &mut b,
            listener,
            &ServerOptions {
                port: 6000,
                connections: N,
                timeout: Some(Duration::from_secs(30)),
            },
        )
        .unwrap();
        (r, b)
    });
    let r = cmtime::client(
        &mut a,
        &ClientOptions {
            dest: gid(2),
            port: 6000,
            connections: N,
            timeout: Duration::from_secs(20),
            hold: Duration::ZERO,
            connect: ConnectOptions::default(),
        },
    )
    .unwrap();
    let (s, b) = server.join().unwrap();
    assert_eq!((r.established, r.disconnected, r.failed), (N, N, 0), "{r}");
    assert_eq!(s.disconnected, N, "{s}");

    stop.store(true, Ordering::Relaxed);
    let wakeups = dev_thread.join().unwrap();
    assert!(wakeups > 0, "the device slept on the kick eventfds");
    let h = host.lock().unwrap();
    // The drivers asked for used-buffer notifications on rx only (tx is reclaimed by
    // polling): calls went out on rx.
    assert!(h.devs[0].interrupts[1] > 0 && h.devs[1].interrupts[1] > 0);
    assert_eq!(a.stats().rx_dropped() + b.stats().rx_dropped(), 0);
    assert_eq!(a.stats().send_errors + b.stats().send_errors, 0);
}

#[test]
fn cmtime_rounds_run_bursts_back_to_back_in_one_process() {
    use pvcm_guest::cli::{Cmd, Out, run_command};
    use pvcm_wire::counters::Group;
    use pvcm_wire::mad::AttributeId;

    let TwoVms {
        mut a,
        mut b,
        stop,
        dev_thread,
        ..
    } = two_vms(11);
    const N: u32 = 20;
    const ROUNDS: u32 = 3;
    let cmtime = |dest, server| Cmd::Cmtime {
        dest,
        connections: N,
        port: 6100,
        server,
        timeout: Some(Duration::from_secs(20)),
        hold: Duration::ZERO,
        rounds: ROUNDS,
        pause: Duration::from_millis(50),
    };
    let out = Out { json: true };
    let server_cmd = cmtime(None, true);
    let server = std::thread::spawn(move || {
        let code = run_command(&mut b, &server_cmd, out).unwrap();
        (format!("{code:?}"), b)
    });
    // The server listens from its first pump; give it that before the first REQ.
    std::thread::sleep(Duration::from_millis(200));
    let code = run_command(&mut a, &cmtime(Some(gid(2)), false), out).unwrap();
    let (server_code, b) = server.join().unwrap();
    let ok = format!("{:?}", std::process::ExitCode::SUCCESS);
    assert_eq!(format!("{code:?}"), ok);
    // The server stops only after N connections of every round were torn down.
    assert_eq!(server_code, ok);
    let (ca, cb) = (a.agent().counters(), b.agent().counters());
    assert_eq!(
        ca.get(Group::TxMsgs, AttributeId::Req),
        u64::from(N * ROUNDS)
    );
    assert_eq!(
        ca.get(Group::TxMsgs, AttributeId::Dreq),
        u64::from(N * ROUNDS)
    );
    assert_eq!(
        cb.get(Group::TxMsgs, AttributeId::Rep),
        u64::from(N * ROUNDS)
    );
    assert_eq!(ca.get(Group::TxRetries, AttributeId::Req), 0);
    stop.store(true, Ordering::Relaxed);
    dev_thread.join().unwrap();
}

/// A sleep its caller waits out itself (`Device::sleep_begin`, as pvcm-guestd's device
/// thread sleeps while its other threads use the device): the descriptors it gives
/// become readable when a MAD arrives, well before the timeout, and `sleep_end` takes
/// the notification.
#[test]
fn a_sleep_waited_out_by_its_caller_ends_when_a_mad_arrives() {
    let TwoVms {
        mut a,
        mut b,
        stop,
        dev_thread,
        ..
    } = two_vms(9);
    let listener = b.listen(tcp_service_id(5100)).unwrap();
    let s = loop {
        b.pump_now().unwrap();
        if let Some(s) = b.sleep_begin(Duration::from_secs(20)) {
            break s;
        }
    };
    assert_eq!(s.fds.len(), 2, "the lab transport's call eventfds");
    assert!(s.timeout <= Duration::from_secs(20));
    let (fds, timeout) = (s.fds.clone(), s.timeout);
    a.connect(
        gid(2),
        tcp_service_id(5100),
        &[],
        &ConnectOptions::default(),
    )
    .unwrap();
    a.pump_now().unwrap();
    let t = Instant::now();
    let (mine, _) = pvcm_guest::transport::poll_readable(&fds, &[], timeout).unwrap();
    assert_ne!(mine, 0, "woken by the device, not the timeout");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    b.sleep_end(s).unwrap();
    let ev = b.next_cm_event(Duration::from_secs(10)).unwrap();
    assert!(
        matches!(ev, Some(Event::ConnectRequest { listen_id, .. }) if listen_id == listener),
        "{ev:?}"
    );
    stop.store(true, Ordering::Relaxed);
    dev_thread.join().unwrap();
}
