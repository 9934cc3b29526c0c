//! Inputs of the mux fuzz target (`fuzz/fuzz_targets/mux.rs`) as plain tests; each is
//! also kept under `fuzz/seeds/mux/`.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use pvcm_backend::mux::{DropReason, GuestVerdict, Policy};
use pvcm_wire::cm::RejReason;

/// `seeds/mux/rej-timeout-short-ari`: a VM's REJ(TIMEOUT) (Remote Comm ID 0) whose ARI
/// length is below 8 passed the CA GUID check, although a Linux peer reads the first 8
/// ARI bytes whatever the length says: the VM could name another CA GUID there.
#[test]
fn vm_rej_timeout_with_short_ari_is_spoofed() {
    let mut net = Net::new(Policy::Default);
    net.a.add_vm("a0", gid(1, 1));
    net.b.add_vm("b0", gid(2, 1));
    net.send_req(0, 0, 7, 1, &LINUX);
    let own = net.a.cfg(0).ca_guid;
    let other = net.b.cfg(0).ca_guid;
    for (guid, ari_len) in [(other, 0u8), (own, 0), (own, 7), (other, 8)] {
        let mut m = rej(
            0xAAAA_0000_0000_0007,
            7,
            0,
            RejReason::Timeout,
            &guid.to_be_bytes(),
        );
        m[33] = ari_len << 1;
        let v = net.a.mux.from_guest(net.a.id(0), &mut m, net.b.gid(0));
        assert_eq!(
            v,
            GuestVerdict::Drop(DropReason::SpoofedCaGuid),
            "{guid:#x}, {ari_len}"
        );
    }
    // Its own CA GUID in a full ARI still withdraws the REQ.
    let mut m = rej(
        0xAAAA_0000_0000_0007,
        7,
        0,
        RejReason::Timeout,
        &own.to_be_bytes(),
    );
    let v = net.a.mux.from_guest(net.a.id(0), &mut m, net.b.gid(0));
    assert_eq!(v, GuestVerdict::ToWire);
}
