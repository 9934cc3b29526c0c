//! Per-MAD cost of the mux with 1 000 and 1 000 000 live connections.
//!
//! Setup (once per group): two hosts, [`common::VMS_PER_HOST`] VMs each, N connections
//! established through the real REQ/REP/RTU handshake. Each iteration then pushes
//! [`BATCH`] MADs through one mux, on connections taken in a shuffled order so the
//! table, the maps and the MAD templates are touched as real traffic would:
//! - `copy_baseline`: what every iteration pays besides the mux: pick the connection,
//!   copy the 256-byte template into a scratch buffer (the mux rewrites in place),
//!   patch the comm IDs and TID;
//! - `guest_to_wire_lap`: the A VM re-sends a LAP, `A.from_guest` -> `ToWire`;
//! - `wire_to_guest_apr`: an APR from the wire names A's `pv_cm_id`,
//!   `A.from_wire` -> `ToVm`.
//! - `*_batch`: the same through the batched entry points, as the daemon calls them;
//! - `guest_to_wire_lap_batch_journal`: the batch with `--state-dir`'s journal on: the
//!   changed entries encoded and written to a file after each batch (one `write`), as
//!   the daemon commits (compare with `guest_to_wire_lap_batch`).
//!
//! Throughput is `Elements(BATCH)`: criterion's elem/s is MADs per second, and the
//! per-MAD time is time/iter divided by [`BATCH`] (minus `copy_baseline`'s, for the mux
//! alone).
//!
//! `cargo bench -p pvcm-backend --bench mux`

mod common;

use std::hint::black_box;
use std::io::{Seek, Write};
use std::time::Duration;

use common::{MadBuf, Testbed, patch_apr, patch_lap, shuffled};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pvcm_backend::mux::{GuestVerdict, WireVerdict};
use pvcm_wire::Gid;

/// MADs per iteration.
const BATCH: usize = 1024;

/// Walks a shuffled order of the connections, forever.
struct Cursor {
    order: Vec<u32>,
    pos: usize,
}

impl Cursor {
    fn new(n: usize) -> Cursor {
        Cursor {
            order: shuffled(n),
            pos: 0,
        }
    }

    #[inline]
    fn next(&mut self) -> usize {
        let i = self.order[self.pos] as usize;
        self.pos += 1;
        if self.pos == self.order.len() {
            self.pos = 0;
        }
        i
    }
}

fn bench_n(c: &mut Criterion, n: usize) {
    let mut tb = Testbed::with_connections(n);
    eprintln!(
        "setup N={n}: {:.2?}, {:.0} mux calls/s, live A={} B={}",
        tb.setup_time,
        tb.mux_calls as f64 / tb.setup_time.as_secs_f64(),
        tb.a.mux.live_entries(),
        tb.b.mux.live_entries()
    );
    let lap_tid_hi = tb.lap_tid_hi();
    let laps = tb.lap_templates();
    let aprs = tb.apr_templates();
    let a_vms = tb.a.vms.clone();
    let a_gids: Vec<_> = (0..a_vms.len()).map(|j| tb.a.gid(j)).collect();
    let b_gids: Vec<_> = (0..tb.b.vms.len()).map(|j| tb.b.gid(j)).collect();
    let conns = std::mem::take(&mut tb.conns);
    let mux = &mut tb.a.mux;

    let label = if n >= 1_000_000 {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000 {
        format!("{}K", n / 1_000)
    } else {
        n.to_string()
    };
    let mut g = c.benchmark_group(format!("mux_{label}"));
    g.throughput(Throughput::Elements(BATCH as u64))
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    let mut cur = Cursor::new(n);
    g.bench_function("copy_baseline", |b| {
        b.iter(|| {
            let mut scratch: MadBuf = [0; 256];
            for _ in 0..BATCH {
                let k = &conns[cur.next()];
                scratch.copy_from_slice(&laps[k.pair()]);
                patch_lap(&mut scratch, k);
                black_box(&mut scratch);
                black_box((a_vms[k.a_vm as usize], &b_gids[k.b_vm as usize]));
            }
        })
    });

    let mut cur = Cursor::new(n);
    g.bench_function("guest_to_wire_lap", |b| {
        b.iter(|| {
            let mut scratch: MadBuf = [0; 256];
            for _ in 0..BATCH {
                let k = &conns[cur.next()];
                scratch.copy_from_slice(&laps[k.pair()]);
                patch_lap(&mut scratch, k);
                let v = mux.from_guest(
                    a_vms[k.a_vm as usize],
                    &mut scratch,
                    b_gids[k.b_vm as usize],
                );
                assert!(v == GuestVerdict::ToWire, "LAP: {v:?}");
            }
            black_box(&scratch);
        })
    });

    let mut cur = Cursor::new(n);
    g.bench_function("wire_to_guest_apr", |b| {
        b.iter(|| {
            let mut scratch: MadBuf = [0; 256];
            for _ in 0..BATCH {
                let k = &conns[cur.next()];
                scratch.copy_from_slice(&aprs[k.pair()]);
                patch_apr(&mut scratch, k, lap_tid_hi);
                let v = mux.from_wire(
                    &mut scratch,
                    b_gids[k.b_vm as usize],
                    a_gids[k.a_vm as usize],
                );
                assert!(v == WireVerdict::ToVm(a_vms[k.a_vm as usize]), "APR: {v:?}");
            }
            black_box(&scratch);
        })
    });
    // The batched entry points, as the daemon calls them (recvmmsg / a virtqueue's
    // available chains): same copy work, then one call per batch.
    let mut bufs: Vec<MadBuf> = vec![[0; 256]; BATCH];
    let mut verdicts = vec![GuestVerdict::ToWire; BATCH];
    let mut cur = Cursor::new(n);
    let vm0 = a_vms[0];
    let vm0_conns: Vec<usize> = (0..conns.len()).filter(|&i| conns[i].a_vm == 0).collect();
    let mut order = shuffled(vm0_conns.len());
    let mut dsts = vec![b_gids[0]; BATCH];
    // A batch of VM 0's LAPs on its connections in `order`, from `pos` on.
    let fill_laps = |bufs: &mut [MadBuf], dsts: &mut [Gid], order: &[u32], pos: &mut usize| {
        for (j, buf) in bufs.iter_mut().enumerate() {
            let k = &conns[vm0_conns[order[*pos] as usize]];
            *pos = (*pos + 1) % order.len();
            buf.copy_from_slice(&laps[k.pair()]);
            patch_lap(buf, k);
            dsts[j] = b_gids[k.b_vm as usize];
        }
    };
    g.bench_function("guest_to_wire_lap_batch", |b| {
        let mut pos = 0usize;
        b.iter(|| {
            fill_laps(&mut bufs, &mut dsts, &order, &mut pos);
            mux.from_guest_batch(vm0, &mut bufs, |i, _| dsts[i], &mut verdicts);
            assert!(verdicts.iter().all(|v| *v == GuestVerdict::ToWire));
        })
    });
    order.clear();
    let mut addrs = vec![(b_gids[0], a_gids[0]); BATCH];
    let mut wire_verdicts = vec![WireVerdict::Reply; BATCH];
    g.bench_function("wire_to_guest_apr_batch", |b| {
        b.iter(|| {
            for (j, buf) in bufs.iter_mut().enumerate() {
                let k = &conns[cur.next()];
                buf.copy_from_slice(&aprs[k.pair()]);
                patch_apr(buf, k, lap_tid_hi);
                addrs[j] = (b_gids[k.b_vm as usize], a_gids[k.a_vm as usize]);
            }
            mux.from_wire_batch(&mut bufs, |i, _| addrs[i], &mut wire_verdicts);
            assert!(
                wire_verdicts
                    .iter()
                    .all(|v| matches!(v, WireVerdict::ToVm(_)))
            );
        })
    });
    // Last: the journal stays on once enabled.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut file = std::fs::File::create(dir.path().join("journal")).expect("journal file");
    let mut frame = Vec::new();
    mux.enable_journal();
    let mut order = shuffled(vm0_conns.len());
    g.bench_function("guest_to_wire_lap_batch_journal", |b| {
        let mut pos = 0usize;
        b.iter(|| {
            fill_laps(&mut bufs, &mut dsts, &order, &mut pos);
            mux.from_guest_batch(vm0, &mut bufs, |i, _| dsts[i], &mut verdicts);
            assert!(verdicts.iter().all(|v| *v == GuestVerdict::ToWire));
            frame.clear();
            mux.journal_changes(&mut frame);
            file.write_all(&frame).expect("write");
            if file.stream_position().unwrap_or(0) > 256 << 20 {
                file.set_len(0).expect("truncate");
                file.rewind().expect("rewind");
            }
        })
    });
    order.clear();
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_n(c, 1_000);
    bench_n(c, 1_000_000);
}

criterion_group!(mux_benches, benches);
criterion_main!(mux_benches);
