//! The CM agent's cost per connection, without a device: two agents in one process,
//! a cmtime-like burst (N connects at once, each REQ accepted as it arrives, then N
//! disconnects at once), MADs handed over in batches as a device pump would. Prints
//! nanoseconds per connection for each phase (median of the rounds).
//!
//!     cargo bench -p pvcm-guest --bench agent_burst [-- N ROUNDS]
//!
//! This is the guest's CPU work per connection that a TCG VM multiplies (about 20x on
//! this machine), so it bounds pvcm VM <-> pvcm VM burst times in real VMs.

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::time::Instant;

use pvcm_guest::cm::{Agent, AgentConfig, ConnectOptions, Event};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;

fn gid(n: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, n))
}

/// Moves every queued MAD from `from` to `to` (one batch).
fn deliver(from: &mut Agent, from_gid: Gid, to: &mut Agent, now: Time) -> usize {
    let mads: Vec<_> = from.drain_outbox().collect();
    for m in &mads {
        to.handle_mad(&m.mad, from_gid, now);
    }
    mads.len()
}

/// One round trip of a burst: the client's due timers and queued MADs go to the server,
/// the server's application reacts to its events, and its MADs come back; returns how
/// many client events `on_client` counted.
fn round_trip(
    c: &mut Agent,
    s: &mut Agent,
    (cg, sg): (Gid, Gid),
    now: Time,
    on_server: &mut dyn FnMut(&mut Agent, Event),
    on_client: &mut dyn FnMut(&mut Agent, Event) -> bool,
) -> usize {
    c.poll(now);
    deliver(c, cg, s, now);
    while let Some(e) = s.pop_event() {
        on_server(s, e);
    }
    s.poll(now);
    deliver(s, sg, c, now);
    let mut n = 0;
    while let Some(e) = c.pop_event() {
        n += usize::from(on_client(c, e));
    }
    n
}

fn round(n: usize, seed: u64) -> [u64; 3] {
    let gids = (gid(1), gid(2));
    let (cg, sg) = gids;
    let mut c = Agent::new(AgentConfig::new(cg, 0x0200_0001, 0x1000, 0x10000, seed));
    let mut s = Agent::new(AgentConfig::new(sg, 0x0200_0002, 0x1000, 0x10000, !seed));
    let sid = 0x0000_0000_0106_1d2f;
    let step = std::time::Duration::from_micros(50);
    let mut now = Time::from_millis(1);
    s.listen(sid).expect("listen");
    let opts = ConnectOptions::default();
    let pd = [0u8; 56];

    let t0 = Instant::now();
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(c.connect(sg, sid, &pd, &opts, now).expect("connect"));
    }
    let t1 = Instant::now();
    let mut established = 0;
    while established < n {
        now = now.after(step);
        established += round_trip(
            &mut c,
            &mut s,
            gids,
            now,
            &mut |s, e| {
                if let Event::ConnectRequest { id, .. } = e {
                    s.accept(id, &[], now).expect("accept");
                }
            },
            &mut |_, e| matches!(e, Event::Established { .. }),
        );
    }
    deliver(&mut c, cg, &mut s, now); // the last RTUs
    while s.pop_event().is_some() {}
    let t2 = Instant::now();
    for id in &ids {
        c.disconnect(*id, now).expect("disconnect");
    }
    let mut done = 0;
    while done < n {
        now = now.after(step);
        // Both sides destroy a connection on its Disconnected, as cmtime does.
        let destroy = |a: &mut Agent, e: Event| {
            if let Event::Disconnected { id } = e {
                a.destroy(id, now).expect("destroy");
                return true;
            }
            false
        };
        done += round_trip(
            &mut c,
            &mut s,
            gids,
            now,
            &mut |s, e| {
                destroy(s, e);
            },
            &mut |c, e| destroy(c, e),
        );
    }
    let t3 = Instant::now();
    black_box((&c, &s));
    let per = |a: Instant, b: Instant| (b - a).as_nanos() as u64 / n as u64;
    [per(t0, t1), per(t1, t2), per(t2, t3)]
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(4000);
    let rounds = args.get(1).copied().unwrap_or(15);
    let mut r: Vec<[u64; 3]> = (0..rounds).map(|i| round(n, 7 + i as u64)).collect();
    let med = |k: usize, r: &mut Vec<[u64; 3]>| {
        r.sort_by_key(|x| x[k]);
        r[r.len() / 2][k]
    };
    let (a, b, c) = (med(0, &mut r), med(1, &mut r), med(2, &mut r));
    println!(
        "agent burst, {n} connections, median of {rounds} rounds, ns per connection (both agents):"
    );
    println!("  connect() calls        {a:>8}");
    println!("  establish (REQ/REP/RTU) {b:>7}");
    println!("  disconnect (DREQ/DREP)  {c:>7}");
}
