//! A backend killed (SIGKILL) or stopped (SIGTERM) under 1,000 established connections
//! across 4 VMs, then started again with the same options (`--state-dir`): the VMs
//! reconnect, every connection keeps its IDs, the teardown after completes with every
//! DREQ answered and nothing leaked, and the peers' DREQs lost while the backend was
//! down are recovered by their retries (`pvcm-lab restart`, see `lab::restart`).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use pvcm_lab::lab::restart::{Mode, RestartCli, run};

fn check(mode: Mode, connections: u32, net: u8) {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_pvcm-lab"));
    let r = run(
        &exe,
        &RestartCli {
            connections,
            vms: 4,
            mode,
            net,
            cost_connections: 0,
            cost_rounds: 1,
        },
    )
    .unwrap();
    eprintln!("{}", r.render());
    assert!(r.passed(), "{}", r.render());
    // The gap's DREQs were really lost and recovered by retries.
    assert!(r.peer.dreq_retries > 0, "{}", r.render());
    assert_eq!(r.vm.dreq_retries, 0, "{}", r.render());
}

#[test]
fn a_killed_backend_restarts_without_losing_a_connection() {
    check(Mode::Kill, 1000, 95);
}

#[test]
fn a_stopped_backend_restarts_without_losing_a_connection() {
    check(Mode::Term, 400, 97);
}
