//! A VM live-migrates between two backends while half of its 100 handshakes wait for
//! the peer's REP: every connection is established and torn down, the source holds
//! nothing of it afterwards, no MAD is dropped and no retry is needed
//! (`pvcm-lab migrate`, see `lab::migrate`).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use pvcm_lab::lab::migrate::{MigrateCli, run};

#[test]
fn a_vm_moves_mid_handshake_and_keeps_every_connection() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_pvcm-lab"));
    let r = run(
        &exe,
        &MigrateCli {
            connections: 100,
            net: 87,
        },
    )
    .unwrap();
    eprintln!("{}", r.render());
    assert!(r.passed(), "{}", r.render());
    assert_eq!(r.in_flight, 50, "{}", r.render());
    assert_eq!(r.vm.req_retries + r.vm.dreq_retries, 0, "{}", r.render());
    assert_eq!(r.peer.dreq_retries, 0, "{}", r.render());
}
