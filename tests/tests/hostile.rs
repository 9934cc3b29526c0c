//! A hostile VM flooding its backend (`pvcm-lab hostile`): the neighbour on the same
//! backend loses no connection and no MAD, every kind of bad input is counted against
//! the hostile VM, and the backend's memory stays bounded. The neighbour's rate ratio
//! is a figure of the lab command, not asserted here (a timed assertion on a shared
//! machine would be noise).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use pvcm_lab::lab::hostile::{HostileCli, run};

#[test]
fn a_flooding_vm_cannot_hurt_its_neighbour() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_pvcm-lab"));
    let r = run(
        &exe,
        &HostileCli {
            connections: 500,
            net: 78,
            resets: 3,
        },
    )
    .unwrap();
    eprintln!("{}", r.render());
    for run in [r.solo, r.flooded] {
        assert_eq!(
            (run.established, run.disconnected),
            (500, 500),
            "{}",
            r.render()
        );
    }
    assert_eq!(r.neighbour_drops, 0, "{}", r.render());
    assert!(r.flood_sent > 1000, "{}", r.render());
    let counted = |reason: &str| {
        r.hostile_drops
            .iter()
            .find(|(k, _)| k == reason)
            .map_or(0, |(_, v)| *v)
    };
    for reason in [
        "bad_address",
        "wrong_direction",
        "chain_too_long",
        "truncated",
        "unknown_type",
        "oversize",
        "not_cm",
        "spoofed_gid",
        "spoofed_qpn",
        "spoofed_ca_guid",
        "over_quota",
    ] {
        assert!(counted(reason) > 0, "{reason} not counted: {}", r.render());
    }
    // Bounded: the per-VM rx budget (32 MiB) and the mux's table for the quota.
    assert!(r.rss_kib.1 < 256 * 1024, "{}", r.render());
}
