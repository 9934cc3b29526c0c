//! Property test of the mux's core safety property: whatever the interleaving of MADs
//! from several VMs behind one host and several remote peers (colliding comm IDs, stale
//! and random `pv_cm_id`s, frames addressed to the wrong VM, detach and reattach, time
//! passing, restarts), a wire MAD is only ever delivered to the VM that owns the
//! connection it names, never to a detached VM, the VMs' own comm IDs never reach the
//! wire, a VM's REQ retry while its handshake is open leaves under the same `pv_cm_id`
//! (never a second connection), the mux never panics, and once every VM is gone every
//! entry drains away.
//!
//! The model and its checks are `common/model.rs`, which the mux fuzz target runs too;
//! this test draws the operations from proptest strategies, shrinks a failing case, and
//! checks the property was not vacuous (every kind of routing and refusal happened).
#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/model.rs"]
mod model;

use std::cell::RefCell;

use model::{Base, Config, Coverage, KINDS, Kind, NPEER, NVM, Op, PEER_COMMS, Target, VM_COMMS};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestError, TestRunner};

/// A VM slot, `NVM` included when `nobody` (a GID no VM has).
fn slot(nobody: bool) -> impl Strategy<Value = u8> {
    0..(NVM as u8 + u8::from(nobody))
}

fn peer() -> impl Strategy<Value = u8> {
    0..NPEER as u8
}

/// A peer comm ID (the model takes 1 + c % PEER_COMMS).
fn peer_comm() -> impl Strategy<Value = u8> {
    0..PEER_COMMS as u8
}

/// A VM comm ID (the model takes 1 + c % VM_COMMS).
fn vm_comm() -> impl Strategy<Value = u8> {
    0..VM_COMMS as u8
}

fn kind() -> impl Strategy<Value = Kind> {
    proptest::sample::select(&KINDS[..])
}

fn base() -> impl Strategy<Value = Base> {
    prop_oneof![
        Just(Base::Req),
        kind().prop_map(Base::Conn),
        Just(Base::SidrReq),
        Just(Base::SidrRep),
        Just(Base::CpiGet),
        Just(Base::CpiGetResp),
        Just(Base::RejTimeout),
    ]
}

/// Up to 3 byte edits (offset, value) of a raw MAD.
fn edits() -> impl Strategy<Value = Vec<(u8, u8)>> {
    proptest::collection::vec((any::<u8>(), any::<u8>()), 0..4)
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        4 => any::<u8>().prop_map(Target::Recent),
        3 => any::<u8>().prop_map(Target::Known),
        1 => (any::<u8>(), slot(false)).prop_map(|(i, v)| Target::WrongGid(i, v)),
        1 => any::<u8>().prop_map(Target::Foreign),
        1 => (any::<u32>(), slot(false)).prop_map(|(x, v)| Target::Random(x, v)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            peer(),
            slot(true),
            peer_comm(),
            any::<bool>(),
            proptest::option::weighted(0.2, slot(false)),
        )
            .prop_map(|(peer, vm, comm, short, frame_dst)| Op::PeerReq {
                peer,
                vm,
                comm,
                short,
                frame_dst,
            }),
        5 => (peer(), kind(), target(), peer_comm(), 0u8..=31).prop_map(
            |(peer, kind, target, comm, svc)| Op::PeerMsg {
                peer,
                kind,
                target,
                comm,
                svc,
            }
        ),
        5 => (peer(), any::<u8>(), peer_comm())
            .prop_map(|(peer, pick, comm)| Op::PeerStep { peer, pick, comm }),
        4 => (slot(false), any::<u8>()).prop_map(|(vm, pick)| Op::VmStep { vm, pick }),
        1 => (peer(), peer_comm(), peer(), slot(false)).prop_map(
            |(peer, comm, guid_of, vm)| Op::PeerRejTimeout {
                peer,
                comm,
                guid_of,
                vm,
            }
        ),
        5 => (
            slot(false),
            any::<u8>(),
            proptest::sample::select(&[Kind::Rep, Kind::Rep, Kind::Mra, Kind::Rej][..]),
            vm_comm(),
            0u8..=31,
        )
            .prop_map(|(vm, pick, kind, sl, svc)| Op::VmAnswer {
                vm,
                pick,
                kind,
                sl,
                svc,
            }),
        5 => (
            slot(false),
            any::<u8>(),
            kind(),
            proptest::option::weighted(0.1, vm_comm()),
            0u8..=31,
        )
            .prop_map(|(vm, pick, kind, any_sl, svc)| Op::VmMsg {
                vm,
                pick,
                kind,
                any_sl,
                svc,
            }),
        2 => (slot(false), vm_comm(), peer(), any::<bool>())
            .prop_map(|(vm, sl, peer, short)| Op::VmReq { vm, sl, peer, short }),
        2 => (slot(false), any::<u8>()).prop_map(|(vm, pick)| Op::VmReqRetry { vm, pick }),
        1 => (slot(false), any::<u8>(), proptest::bool::weighted(0.2))
            .prop_map(|(vm, pick, spoof)| Op::VmRejTimeout { vm, pick, spoof }),
        1 => (slot(false), peer(), base(), any::<u8>(), any::<u8>(), edits()).prop_map(
            |(vm, peer, base, local, remote, edits)| Op::GuestRaw {
                vm,
                peer,
                base,
                local,
                remote,
                edits,
            }
        ),
        1 => (peer(), any::<u8>(), base(), any::<u8>(), any::<u8>(), edits()).prop_map(
            |(peer, dst, base, pick, comm, edits)| Op::WireRaw {
                peer,
                dst,
                base,
                pick,
                comm,
                edits,
            }
        ),
        3 => (0u16..40_000).prop_map(|ms| Op::Advance { ms, scale: 0 }),
        1 => slot(false).prop_map(|vm| Op::Detach { vm }),
        3 => slot(false).prop_map(|vm| Op::Reattach { vm }),
        1 => Just(Op::Restart),
    ]
}

#[test]
fn wire_mads_reach_only_their_owner() {
    let config = ProptestConfig {
        cases: 256,
        max_shrink_iters: 20_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    let cov = RefCell::new(Coverage::new());
    // 50..300 operations; an operation shrinks to `None` (skipped), so that a failing
    // case shrinks below 50 operations. A failed check panics, which proptest takes as
    // the case failing.
    let ops = proptest::collection::vec(proptest::option::weighted(0.98, op()), 50..300);
    let strategy = (any::<u64>(), ops);
    let result = runner.run(&strategy, |(seed, ops)| {
        let config = Config {
            coverage: true,
            ..Config::new(seed)
        };
        let w = model::run(&config, ops.iter().flatten());
        let mut c = cov.borrow_mut();
        for (k, v) in w.cov.into_iter().flatten() {
            *c.entry(k).or_default() += v;
        }
        Ok(())
    });
    if let Err(e) = result {
        match e {
            TestError::Fail(why, (seed, ops)) => {
                let ops: Vec<Op> = ops.into_iter().flatten().collect();
                panic!(
                    "{why}\nminimal case: seed {seed:#x}, {} ops:\n{ops:#?}",
                    ops.len()
                )
            }
            TestError::Abort(why) => panic!("aborted: {why}"),
        }
    }
    // The property is not vacuous: every kind of routing (and of refusal) happened.
    let cov = cov.into_inner();
    for (k, v) in &cov {
        eprintln!("{v:8}  {k}");
    }
    let seen = |what: &str| {
        cov.iter()
            .filter(|(k, _)| k.contains(what))
            .map(|x| *x.1)
            .sum::<u64>()
    };
    for must in [
        "wire Req ToVm",
        "wire Rep ToVm",
        "wire Mra ToVm",
        "wire Rej ToVm",
        "wire RejTimeout ToVm",
        "wire Rtu ToVm",
        "wire Dreq ToVm",
        "wire Drep ToVm",
        "wire Lap ToVm",
        "wire Apr ToVm",
        "wire Dreq Reply",
        "Drop(WrongDestination)",
        "Drop(Quarantined)",
        "Drop(NoRoute)",
        "Drop(Absorbed)",
        "Drop(BadState)",
        "Drop(UnknownGid)",
        "guest Req ToWire",
        "guest Rep ToWire",
        "guest Mra ToWire",
        "guest Rej ToWire",
        "guest Rtu ToWire",
        "guest Dreq ToWire",
        "guest Drep ToWire",
        "guest Rej Drop(SpoofedCaGuid)",
        "guest Req retry in ReqSent: same pv",
        "guest Req retry in RepRcvd: same pv",
        "guest Req retry in Quarantined: Drop(BadState)",
        "from detached VM",
        "established (VM active)",
        "established (VM passive)",
        "outbox Dreq",
        "outbox Rej",
        "reattach",
        "restart",
    ] {
        assert!(seen(must) > 0, "never happened: {must}");
    }
}
