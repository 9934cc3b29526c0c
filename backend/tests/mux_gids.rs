//! A VM with several GIDs (its addresses): the wire reaches it at each one, it speaks
//! as each one, and as no GID of another VM; the list survives a restart (journal) and
//! a migration.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use pvcm_backend::mux::{
    AttachError, DropReason, GuestVerdict, IdRange, Policy, VmConfig, WireVerdict,
};
use pvcm_wire::Gid;

fn v6(s: &str) -> Gid {
    s.parse().unwrap()
}

/// A's VM 0 ("dual": 127.0.1.1 and 2001:db8::5) and VM 1 ("other": 127.0.1.2 and
/// 2001:db8::6); B's VM 0 ("peer6": 2001:db8::9).
fn dual_net() -> Net {
    let mut n = Net::new(Policy::Default);
    for (name, g4, g6) in [
        ("dual", gid(1, 1), "2001:db8::5"),
        ("other", gid(1, 2), "2001:db8::6"),
    ] {
        let cfg = VmConfig {
            more_gids: vec![v6(g6)],
            ..VmConfig::new(name, g4)
        };
        let id = n.a.mux.attach_vm(cfg.clone()).unwrap();
        n.a.vms.push((id, cfg));
    }
    n.b.add_vm("peer6", v6("2001:db8::9"));
    n
}

#[test]
fn a_req_from_the_second_gid_goes_out_and_its_rep_comes_back() {
    let mut n = dual_net();
    let (src, dst) = (v6("2001:db8::5"), n.b.gid(0));
    let me = n.a.cfg(0).clone();
    let mut m = pvcm_wire::testing::req_with(src, me.ca_guid, 7, 0x77, dst, me.qpn_base, &LINUX);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, dst),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.b.mux.from_wire(&mut m, src, dst),
        WireVerdict::ToVm(n.b.id(0))
    );
    let a_pv = view(&m).local_comm_id().unwrap();
    // The peer's REP goes to the address the REQ came from, and reaches the VM there.
    let q = n.b.qpn(0, 1);
    let mut r = rep(n.b.cfg(0), 0x77, 900, a_pv, q);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut r, src),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.a.mux.from_wire(&mut r, dst, src),
        WireVerdict::ToVm(n.a.id(0))
    );
    assert_eq!(view(&r).remote_comm_id(), Some(7));
    assert_eq!(n.a.mux.vm_stats(n.a.id(0)).drops.total(), 0);
}

#[test]
fn a_req_to_the_second_gid_reaches_the_vm() {
    let mut n = dual_net();
    let (src, dst) = (n.b.gid(0), v6("2001:db8::5"));
    let mut m = req(n.b.cfg(0), 3, 0x33, dst, n.b.qpn(0, 0), &LINUX);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, dst),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.a.mux.from_wire(&mut m, src, dst),
        WireVerdict::ToVm(n.a.id(0))
    );
    // The other VM's second GID reaches the other VM, not this one.
    let dst = v6("2001:db8::6");
    let mut m = req(n.b.cfg(0), 4, 0x34, dst, n.b.qpn(0, 1), &LINUX);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, dst),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.a.mux.from_wire(&mut m, src, dst),
        WireVerdict::ToVm(n.a.id(1))
    );
}

#[test]
fn a_req_from_another_vms_gid_is_dropped_and_counted() {
    let mut n = dual_net();
    let dst = n.b.gid(0);
    let me = n.a.cfg(0).clone();
    for (i, theirs) in [v6("2001:db8::6"), gid(1, 2), v6("2001:db8::7")]
        .into_iter()
        .enumerate()
    {
        let mut m = pvcm_wire::testing::req_with(
            theirs,
            me.ca_guid,
            20 + i as u32,
            0x90 + i as u64,
            dst,
            me.qpn_base,
            &LINUX,
        );
        assert_eq!(
            n.a.mux.from_guest(n.a.id(0), &mut m, dst),
            GuestVerdict::Drop(DropReason::SpoofedGid),
            "{theirs}"
        );
    }
    assert_eq!(
        n.a.mux
            .vm_stats(n.a.id(0))
            .drops
            .get(DropReason::SpoofedGid),
        3
    );
}

#[test]
fn a_gid_held_by_an_attached_vm_cannot_attach_again() {
    let mut n = dual_net();
    let cfg = VmConfig {
        more_gids: vec![v6("2001:db8::6")],
        ..VmConfig::new("late", gid(1, 9))
    };
    match n.a.mux.attach_vm(cfg) {
        Err(AttachError::GidInUse { gid, name }) => {
            assert_eq!((gid, name.as_str()), (v6("2001:db8::6"), "other"));
        }
        other => panic!("{other:?}"),
    }
    // Its primary GID as another VM's second one: refused too.
    let cfg = VmConfig::new("late2", v6("2001:db8::5"));
    assert!(matches!(
        n.a.mux.attach_vm(cfg),
        Err(AttachError::GidInUse { .. })
    ));
}

#[test]
fn the_gids_survive_a_restart_and_a_detach_frees_all_of_them() {
    let mut n = dual_net();
    let mut journal = start_journal(&mut n.a.mux);
    let attached = restart_from_journal(&mut n.a.mux, &mut journal, &n.clock).unwrap();
    assert_eq!(attached.len(), 2);
    let cfg = n.a.mux.vm_config(n.a.id(0)).unwrap().clone();
    assert_eq!(cfg.more_gids, vec![v6("2001:db8::5")]);
    // Routed by the restored index.
    let (src, dst) = (n.b.gid(0), v6("2001:db8::5"));
    let mut m = req(n.b.cfg(0), 3, 0x33, dst, n.b.qpn(0, 0), &LINUX);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, dst),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.a.mux.from_wire(&mut m, src, dst),
        WireVerdict::ToVm(n.a.id(0))
    );
    n.a.mux.detach_vm(n.a.id(0));
    let again = VmConfig {
        more_gids: vec![gid(1, 1)],
        ..VmConfig::new("again", v6("2001:db8::5"))
    };
    n.a.mux.attach_vm(again).unwrap();
}

#[test]
fn a_migrated_vm_brings_its_gids() {
    let mut n = Net::new(Policy::Default);
    let range: IdRange = "0x80010000/16".parse().unwrap();
    let cfg = VmConfig {
        more_gids: vec![v6("2001:db8::5")],
        id_range: Some(range),
        quota: Some(1000),
        ..VmConfig::new("mover", gid(1, 1))
    };
    let id = n.a.mux.attach_vm(cfg.clone()).unwrap();
    let state = n.a.mux.export_vm(id).unwrap();
    // A let both GIDs go: another VM may take them.
    n.a.mux
        .attach_vm(VmConfig::new("next", v6("2001:db8::5")))
        .unwrap();
    let new_id = n.b.mux.import_vm(&state).unwrap();
    assert_eq!(n.b.mux.vm_config(new_id), Some(&cfg));
    n.b.add_vm("peer6", v6("2001:db8::9"));
    let dst = v6("2001:db8::5");
    let mut m = req(n.b.cfg(0), 3, 0x33, dst, n.b.qpn(0, 0), &LINUX);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, dst),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.b.mux.from_wire(&mut m, v6("2001:db8::9"), dst),
        WireVerdict::ToVm(new_id)
    );
}

#[test]
fn source_for_picks_the_gid_of_the_destinations_family() {
    let one = VmConfig::new("one", gid(1, 1));
    assert_eq!(one.source_for(v6("2001:db8::9")), gid(1, 1));
    let dual = VmConfig {
        more_gids: vec![v6("fd00::5"), v6("2001:db8::5")],
        ..VmConfig::new("dual", gid(1, 1))
    };
    assert_eq!(dual.source_for(gid(2, 2)), gid(1, 1));
    assert_eq!(dual.source_for(v6("2001:db8::9")), v6("fd00::5"));
    let ll = VmConfig {
        more_gids: vec![v6("2001:db8::5")],
        ..VmConfig::new("ll", v6("fe80::5"))
    };
    assert_eq!(ll.source_for(v6("2001:db8::9")), v6("2001:db8::5"));
    assert_eq!(ll.source_for(v6("fe80::9")), v6("fe80::5"));
    assert!(dual.holds(v6("2001:db8::5")) && !dual.holds(v6("2001:db8::6")));
}
