//! `pvcm-lab`: runs a seed scenario on hosts (real pvcm-backend processes, started by
//! re-executing this binary as `pvcm-lab __backend <pvcm-backend options>`) and VMs
//! (vhost-user sessions, memfd guest memory, the guest driver and its CM agent), then
//! prints the summary and exits non-zero if an invariant broke.
//!
//!     cargo run --release -p pvcm-lab -- teardown
//!     cargo run --release -p pvcm-lab -- --help
//!
//! `pvcm-lab attach --socket PATH COMMAND` attaches one in-process VM to a running
//! backend and runs a `pvcm-guest` command through it (see `lab::attach`).
//! `pvcm-lab hostile` measures a neighbour VM alone and while a hostile VM floods the
//! same backend (see `lab::hostile`).
//! `pvcm-lab migrate` live-migrates a VM between two backends in the middle of its
//! handshakes (see `lab::migrate`).
//! `pvcm-lab restart` kills a backend under established connections and starts it again
//! (see `lab::restart`).
//! `pvcm-lab scale` runs teardown at growing sizes and many idle VMs on one backend, and
//! prints the cost per connection (see `lab::scale`).

use std::process::ExitCode;

use clap::Parser;
use pvcm_lab::lab::cli::{self, Cli};
use pvcm_lab::lab::host::{BACKEND_SUBCOMMAND, backend_main};

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    let _prog = args.next();
    let rest: Vec<_> = args.collect();
    if rest.first().is_some_and(|a| a == BACKEND_SUBCOMMAND) {
        return backend_main(rest.into_iter().skip(1));
    }
    if rest.first().is_some_and(|a| a == "attach") {
        return pvcm_lab::lab::attach::main(rest.into_iter().skip(1));
    }
    if rest.first().is_some_and(|a| a == "hostile") {
        return pvcm_lab::lab::hostile::main(rest.into_iter().skip(1));
    }
    if rest.first().is_some_and(|a| a == "migrate") {
        return pvcm_lab::lab::migrate::main(rest.into_iter().skip(1));
    }
    if rest.first().is_some_and(|a| a == "restart") {
        return pvcm_lab::lab::restart::main(rest.into_iter().skip(1));
    }
    if rest.first().is_some_and(|a| a == "scale") {
        return pvcm_lab::lab::scale::main(rest.into_iter().skip(1));
    }
    cli::main(Cli::parse())
}
