//! Live migration in the mux: a VM with its own ID range moves from host A to host B
//! (export, import) and keeps every connection; what the move refuses leaves the
//! destination unchanged.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pvcm_backend::mux::{
    AttachError, GuestVerdict, ID_RANGE_BIT, IdRange, ManualClock, MigrateError, Mux, Policy,
    State, VmConfig, WireVerdict, records,
};
use pvcm_wire::mad::AttributeId;

/// A copy of `m` (through its journal snapshot), to show a refused call changed nothing.
fn copy(m: &Mux<ManualClock>) -> Mux<ManualClock> {
    let mut j = Vec::new();
    m.journal_snapshot(&mut j);
    let recs: Vec<(u8, &[u8])> = records(&j).collect::<Result<_, _>>().unwrap();
    Mux::restore(m.config().clone(), m.clock().clone(), recs)
        .unwrap()
        .mux
}

fn range(s: &str) -> IdRange {
    s.parse().unwrap()
}

/// A VM config with an ID range and a quota that fits it.
fn migratable(name: &str, g: pvcm_wire::Gid, r: &str, quota: u32) -> VmConfig {
    VmConfig {
        id_range: Some(range(r)),
        quota: Some(quota),
        ..VmConfig::new(name, g)
    }
}

fn add(h: &mut Host, cfg: VmConfig) -> usize {
    let id = h.mux.attach_vm(cfg.clone()).unwrap();
    h.vms.push((id, cfg));
    h.vms.len() - 1
}

/// A REQ from A's VM `av` that B's VM never answers yet: returns its pv_cm_id.
fn half_open(n: &mut Net, av: usize, sl: u32, qpn: u32) -> u32 {
    let got = n.send_req(av, 0, sl, qpn, &LINUX);
    view(&got).local_comm_id().unwrap()
}

#[test]
fn a_migrated_vm_keeps_its_connections_handshakes_and_quarantine() {
    // A: the migrating VM (range) and a neighbour that stays; B-side of the Net: the
    // peer host. The destination host is built apart and swapped in for A.
    let mut n = Net::new(Policy::Default);
    n.b.add_vm("peer", gid(2, 1));
    let cfg = migratable("mover", gid(1, 1), "0x80010000/16", 1000);
    let mv = add(&mut n.a, cfg.clone());
    n.a.add_vm("stays", gid(1, 2));

    let conns: Vec<Conn> = (0..50)
        .map(|i| n.connect(mv, 0, 10 + i, 5000 + i, i))
        .collect();
    let stay: Vec<Conn> = (0..5)
        .map(|i| n.connect(1, 0, 10 + i, 7000 + i, i))
        .collect();
    for c in &conns {
        assert!(range("0x80010000/16").contains(c.a_pv), "{:#x}", c.a_pv);
    }
    for c in &stay {
        assert_eq!(c.a_pv & ID_RANGE_BIT, 0, "host IDs stay in the lower half");
    }
    // A handshake in flight (REQ out, no REP yet) and a closed connection in quarantine.
    let pending_pv = half_open(&mut n, mv, 900, 900);
    let closed = n.connect(mv, 0, 901, 6901, 901);
    n.disconnect_from_a(&closed);
    n.advance(Duration::from_secs(60)); // TimeWait over: the ID is quarantined
    assert_eq!(
        n.a.mux.lookup(closed.a_pv).map(|(s, _)| s),
        Some(State::Quarantined)
    );

    // The destination has a VM of its own with connections (host-space IDs).
    let mut b = Host::new(Policy::Default, 0xB2, &n.clock);
    b.add_vm("native", gid(3, 1));
    for i in 0..20u32 {
        let mut m = req(
            b.cfg(0),
            i + 1,
            u64::from(i),
            gid(2, 1),
            b.qpn(0, i),
            &LINUX,
        );
        assert_eq!(
            b.mux.from_guest(b.id(0), &mut m, gid(2, 1)),
            GuestVerdict::ToWire
        );
    }
    let mut b_journal = start_journal(&mut b.mux);

    // The move.
    let live_before = n.a.mux.vm_stats(n.a.id(mv)).live;
    let state = n.a.mux.export_vm(n.a.id(mv)).unwrap();
    assert_eq!(n.a.mux.vm_config(n.a.id(mv)), None, "A let the VM go");
    for c in &conns {
        assert_eq!(n.a.mux.lookup(c.a_pv), None, "A holds nothing of the VM");
    }
    assert_eq!(n.a.mux.live_entries(), stay.len() as u64);
    assert_eq!(n.a.mux.quarantined_entries(), 0);
    let new_id = b.mux.import_vm(&state).unwrap();
    assert_eq!(b.mux.vm_stats(new_id).live, live_before);
    assert_eq!(b.mux.vm_stats(new_id).quarantined, 1);
    restart_from_journal(&mut b.mux, &mut b_journal, &n.clock).expect("B's journal has the import");
    b.vms = vec![(new_id, cfg.clone())];
    let old_a = std::mem::replace(&mut n.a, b);
    let mv = 0;

    // The handshake in flight completes: the peer's REP reaches the VM on B with its
    // comm ID and REQ TID restored.
    let q = n.b.qpn(0, 900);
    let mut m = rep(n.b.cfg(0), 0xAAAA_0000_0000_0000 | 900, 6900, pending_pv, q);
    let v = n.b_to_a(0, mv, &mut m);
    assert_eq!(v, (GuestVerdict::ToWire, Some(WireVerdict::ToVm(new_id))));
    assert_eq!(view(&m).remote_comm_id(), Some(900));
    assert_eq!(view(&m).tid(), 0xAAAA_0000_0000_0000 | 900);
    let b_pv = view(&m).local_comm_id().unwrap();
    let mut rtu = ids(AttributeId::Rtu, view(&m).tid(), 900, b_pv);
    assert_eq!(
        n.a_to_b(mv, 0, &mut rtu).1,
        Some(WireVerdict::ToVm(n.b.id(0)))
    );

    // The quarantined ID is still held on B.
    assert_eq!(
        n.a.mux.lookup(closed.a_pv).map(|(s, _)| s),
        Some(State::Quarantined)
    );

    // That one, and half the others, are torn down by the VM; the rest by the peer.
    n.disconnect_from_a(&Conn {
        av: mv,
        bv: 0,
        a_sl: 900,
        b_sl: 6900,
        a_pv: pending_pv,
        b_pv,
        a_qpn: 900,
        b_qpn: q,
    });
    for c in &conns[..25] {
        n.disconnect_from_a(c);
    }
    for c in &conns[25..] {
        let mut d = dreq(0xBB << 32 | u64::from(c.b_sl), c.b_sl, c.a_pv, c.a_qpn);
        let v = n.b_to_a(0, mv, &mut d);
        assert_eq!(v, (GuestVerdict::ToWire, Some(WireVerdict::ToVm(new_id))));
        assert_eq!(
            view(&d).remote_comm_id(),
            Some(c.a_sl),
            "routed by the old pv_cm_id"
        );
        let mut r = ids(AttributeId::Drep, view(&d).tid(), c.a_sl, c.b_pv);
        assert_eq!(
            n.a_to_b(mv, 0, &mut r).1,
            Some(WireVerdict::ToVm(n.b.id(0)))
        );
        assert_eq!(view(&r).tid(), 0xBB << 32 | u64::from(c.b_sl));
    }
    let s = n.a.mux.host_stats();
    assert_eq!(s.drops.total(), 0, "nothing dropped on B: {:?}", s.drops);
    n.quiesce();
    let mut old_a = old_a;
    old_a.mux.poll();
    assert_eq!(n.a.mux.vm_stats(new_id).live, 0);
    assert_eq!(n.a.mux.vm_stats(new_id).quarantined, 0);
    assert_eq!(
        old_a.mux.live_entries(),
        stay.len() as u64,
        "A keeps only the neighbour's connections"
    );
}

#[test]
fn a_refused_import_changes_nothing() {
    let clock = ManualClock::new();
    let mut a = Host::new(Policy::Default, 1, &clock);
    let mv = add(
        &mut a,
        migratable("mover", gid(1, 1), "0x80010000/16", 1000),
    );
    for i in 0..10u32 {
        let mut m = req(
            a.cfg(mv),
            i + 1,
            u64::from(i),
            gid(2, 1),
            a.qpn(mv, i),
            &LINUX,
        );
        a.mux.from_guest(a.id(mv), &mut m, gid(2, 1));
    }
    let state = a.mux.export_vm(a.id(mv)).unwrap();

    // A destination whose VM already has an overlapping range.
    let mut b = Host::new(Policy::Default, 2, &clock);
    add(&mut b, migratable("other", gid(3, 1), "0x80000000/8", 1000));
    let before = copy(&b.mux);
    assert!(matches!(
        b.mux.import_vm(&state),
        Err(MigrateError::Attach(AttachError::IdRangeOverlap { .. }))
    ));
    b.mux.same_state_as(&before).unwrap();

    // The GID in use.
    let mut c = Host::new(Policy::Default, 3, &clock);
    c.add_vm("same-gid", gid(1, 1));
    assert!(matches!(
        c.mux.import_vm(&state),
        Err(MigrateError::Attach(AttachError::GidInUse { .. }))
    ));

    // Truncated and corrupted state.
    let mut d = Host::new(Policy::Default, 4, &clock);
    let before = copy(&d.mux);
    assert!(matches!(
        d.mux.import_vm(&state[..state.len() - 3]),
        Err(MigrateError::Corrupt(_))
    ));
    let mut bad = state.clone();
    bad[3] = 99; // the format version
    assert!(matches!(
        d.mux.import_vm(&bad),
        Err(MigrateError::Corrupt(_))
    ));
    d.mux.same_state_as(&before).unwrap();

    // A VM without a range cannot leave, and stays attached.
    let plain = a.add_vm("plain", gid(1, 9));
    assert!(matches!(
        a.mux.export_vm(a.id(plain)),
        Err(MigrateError::NotMigratable(_))
    ));
    assert!(a.mux.vm_config(a.id(plain)).is_some());

    // The state imports where it fits, once.
    assert!(d.mux.import_vm(&state).is_ok());
    assert!(d.mux.import_vm(&state).is_err());
}

#[test]
fn a_range_that_cannot_hold_twice_the_quota_is_refused() {
    let clock = ManualClock::new();
    let mut a = Host::new(Policy::Default, 1, &clock);
    let e = a
        .mux
        .attach_vm(migratable("x", gid(1, 1), "0x80000000/24", 200))
        .unwrap_err();
    assert!(
        matches!(e, AttachError::IdRangeTooSmall { size: 256, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("shorter prefix"), "{e}");
    let mut l = Host::new(Policy::Mlx4Pre2020, 1, &clock);
    assert_eq!(
        l.mux
            .attach_vm(migratable("x", gid(1, 1), "0x80000000/24", 100))
            .unwrap_err(),
        AttachError::IdRangeLegacy
    );
}

#[test]
fn a_full_range_refuses_new_connections_until_quarantine_frees_ids() {
    // 256 IDs, quota 128: connections churn until live + quarantined fill the range.
    let mut n = Net::new(Policy::Default);
    n.b.add_vm("peer", gid(2, 1));
    let mv = add(
        &mut n.a,
        migratable("small", gid(1, 1), "0x80aa5500/24", 128),
    );
    let mut sl = 1;
    let mut seen = std::collections::HashSet::new();
    for _round in 0..2 {
        let cs: Vec<Conn> = (0..128)
            .map(|i| {
                sl += 1;
                n.connect(mv, 0, sl, 10_000 + sl, i)
            })
            .collect();
        for c in &cs {
            assert!(seen.insert(c.a_pv), "an ID came back while quarantined");
            n.disconnect_from_a(c);
        }
        n.advance(Duration::from_secs(20)); // TimeWait over, quarantine (30 s) not
    }
    assert_eq!(n.a.mux.vm_stats(n.a.id(mv)).quarantined, 256);
    // Full: a REQ gets REJ(NO_RESOURCES) from the mux, not a reused ID or a hang.
    let mut m = req(n.a.cfg(mv), 9999, 1, n.b.gid(0), n.a.qpn(mv, 1), &LINUX);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(mv), &mut m, n.b.gid(0)),
        GuestVerdict::Reply
    );
    n.advance(Duration::from_secs(40)); // quarantine over
    let c = n.connect(mv, 0, 77_777, 88_888, 5);
    assert!(range("0x80aa5500/24").contains(c.a_pv));
}

mod hostile_state {
    //! The state comes from the source through the VMM: a broken or hostile one must be
    //! refused with the destination unchanged, never panic, and never leave it with
    //! entries it cannot route or release.
    use super::*;
    use proptest::prelude::*;

    /// A valid export of a VM with established, half-open and quarantined entries.
    fn exported() -> Vec<u8> {
        let mut n = Net::new(Policy::Default);
        n.b.add_vm("peer", gid(2, 1));
        let mv = add(&mut n.a, migratable("m", gid(1, 1), "0x80010000/16", 1000));
        let cs: Vec<Conn> = (0..6)
            .map(|i| n.connect(mv, 0, 10 + i, 50 + i, i))
            .collect();
        n.disconnect_from_a(&cs[0]);
        n.advance(Duration::from_secs(60));
        half_open(&mut n, mv, 99, 99);
        n.a.mux.export_vm(n.a.id(mv)).unwrap()
    }

    fn destination(clock: &ManualClock) -> Host {
        let mut b = Host::new(Policy::Default, 7, clock);
        b.add_vm("native", gid(3, 1));
        let mut m = req(b.cfg(0), 1, 1, gid(2, 1), b.qpn(0, 1), &LINUX);
        b.mux.from_guest(b.id(0), &mut m, gid(2, 1));
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn a_mutated_state_is_imported_whole_or_refused_cleanly(
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let mut s = exported();
            for (i, v) in edits {
                let at = i.index(s.len());
                s[at] = v;
            }
            if let Some(c) = cut {
                s.truncate(c.index(s.len()));
            }
            let clock = ManualClock::new();
            let mut b = destination(&clock);
            let before = copy(&b.mux);
            match b.mux.import_vm(&s) {
                Err(_) => b.mux.same_state_as(&before).unwrap(),
                Ok(id) => {
                    // Whatever came in can be routed, timed out and released: run
                    // every window out and nothing of it may stay.
                    for _ in 0..6 {
                        clock.advance(Duration::from_secs(700));
                        b.mux.poll();
                    }
                    b.mux.detach_vm(id);
                    for _ in 0..6 {
                        clock.advance(Duration::from_secs(700));
                        b.mux.poll();
                        b.mux.drain_outbox().for_each(drop);
                    }
                    prop_assert_eq!(b.mux.vm_stats(id).live, 0);
                    prop_assert_eq!(b.mux.vm_stats(id).quarantined, 0);
                }
            }
        }

        #[test]
        fn random_bytes_never_import(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let clock = ManualClock::new();
            let mut b = destination(&clock);
            let before = copy(&b.mux);
            prop_assert!(b.mux.import_vm(&bytes).is_err());
            b.mux.same_state_as(&before).unwrap();
        }
    }
}

/// Deadlines arrive as time left: one longer than this host would ever set (a source
/// with a longer quarantine, or a hostile state) is shortened, so the quarantine queue
/// stays in release order and nothing is pinned for hours (an imported quarantine of
/// 2.4 h would hold up every later release behind it; the property test below reaches
/// such inputs).
#[test]
fn imported_deadlines_are_no_longer_than_this_host_sets() {
    let mut n = Net::new(Policy::Default);
    n.b.add_vm("peer", gid(2, 1));
    let mv = add(&mut n.a, migratable("m", gid(1, 1), "0x80010000/16", 1000));
    let cs: Vec<Conn> = (0..3)
        .map(|i| n.connect(mv, 0, 10 + i, 50 + i, i))
        .collect();
    n.disconnect_from_a(&cs[0]);
    n.advance(Duration::from_secs(60)); // cs[0] quarantined
    let mut s = n.a.mux.export_vm(n.a.id(mv)).unwrap();
    // Every entry's time left (its last 8 bytes) becomes ~2.4 hours or "never".
    let mut at = 0;
    let mut entries = 0;
    while at + 3 <= s.len() {
        // kind (1 byte), payload length (u16 LE), payload
        let len = usize::from(u16::from_le_bytes([s[at + 1], s[at + 2]]));
        if s[at] == 0x21 {
            let end = at + 3 + len;
            let left: u64 = if entries % 2 == 0 {
                8_800_000_000_000
            } else {
                u64::MAX
            };
            s[end - 8..end].copy_from_slice(&left.to_le_bytes());
            entries += 1;
        }
        at += 3 + len;
    }
    assert_eq!(entries, 3);
    let clock = ManualClock::new();
    let mut b = Host::new(Policy::Default, 7, &clock);
    let id = b.mux.import_vm(&s).unwrap();
    assert_eq!(b.mux.vm_stats(id).quarantined, 1);
    b.mux.detach_vm(id); // the two live ones are disconnected on the VM's behalf
    for _ in 0..30 {
        clock.advance(Duration::from_secs(60));
        b.mux.poll();
        b.mux.drain_outbox().for_each(drop);
    }
    let st = b.mux.vm_stats(id);
    assert_eq!((st.live, st.quarantined), (0, 0));
    assert_eq!(b.mux.host_stats().quarantined, 0);
}
