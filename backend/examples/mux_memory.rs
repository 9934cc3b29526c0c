//! Memory per connection of the mux, and the handshake rate.
//!
//! `cargo run --release -p pvcm-backend --example mux_memory [N]` (default 1 000 000)
//! establishes N connections between two hosts through the real REQ/REP/RTU handshake
//! (the setup of `benches/mux.rs`), then prints the live entries per host, the mux's own
//! estimate (`Mux::memory_bytes`) per live entry, and the process's RSS growth per live
//! entry (both hosts' muxes over both hosts' entries; the harness's own per-connection
//! records are freed before the second reading).

#[path = "../benches/common/mod.rs"]
mod common;

use common::{Testbed, rss_bytes};

fn main() {
    let n: usize = match std::env::args().nth(1) {
        None => 1_000_000,
        Some(s) => match s.replace('_', "").parse() {
            Ok(n) => n,
            Err(e) => {
                eprintln!("usage: mux_memory [N]  ({s:?}: {e})");
                std::process::exit(2);
            }
        },
    };
    let rss0 = rss_bytes();
    let mut tb = Testbed::with_connections(n);
    // The harness's records are not the mux's: free them before measuring.
    let (setup, calls) = (tb.setup_time, tb.mux_calls);
    tb.conns = Vec::new();
    let rss1 = rss_bytes();

    let secs = setup.as_secs_f64();
    println!(
        "connections:      {n} (established, {} VMs per host)",
        common::VMS_PER_HOST
    );
    println!(
        "setup:            {setup:.2?}  ({:.0} handshakes/s, {:.0} mux calls/s, {:.0} ns/call; 6 calls = 3 MADs x 2 muxes per handshake, MAD building included)",
        n as f64 / secs,
        calls as f64 / secs,
        secs * 1e9 / calls as f64,
    );
    let mut live_total = 0u64;
    for (name, host) in [("A", &tb.a), ("B", &tb.b)] {
        let live = host.mux.live_entries();
        live_total += live;
        let est = host.mux.memory_bytes();
        println!(
            "host {name}:           live entries {live}, memory_bytes() {est} = {:.1} B/live entry",
            est as f64 / live.max(1) as f64
        );
    }
    match (rss0, rss1) {
        (Some(r0), Some(r1)) => println!(
            "RSS growth:       {} bytes over {live_total} live entries (2 hosts) = {:.1} B/live entry",
            r1.saturating_sub(r0),
            r1.saturating_sub(r0) as f64 / live_total.max(1) as f64
        ),
        _ => println!("RSS growth:       /proc/self/statm unreadable"),
    }
}
