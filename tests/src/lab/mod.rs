//! The lab: many VMs on many hosts on one machine, the seed scenarios end to
//! end through the real pieces.
//!
//! - **Hosts** ([`host`]) are real `pvcm-backend` processes: the `pvcm-lab` binary
//!   re-executes itself with the hidden `__backend` subcommand, which runs the backend's
//!   own command line ([`host::backend_main`]). Host `H` owns the loopback addresses
//!   `127.N.H.V` (one per VM), its vhost-user sockets and control socket in the run's
//!   temporary directory, and the `--policy` of the run.
//! - **Wire faults** (`--loss`, `--dup`, `--reorder`, `--delay`): the backend has no
//!   fault option, but it can be pointed at a relay: each host binds its own UDP port
//!   (`--bind-port 4791 + H`) and sends to its peers' addresses on that port, where the
//!   lab's [`relay`] listens, injects the faults and forwards to the real host port
//!   (re-framing each MAD from the sender's address, so ICRCs stay valid).
//! - **VMs** ([`guest`]) run in the lab process: memfd guest memory shared with the
//!   backend over a vhost-user session (the `vhost` crate's frontend, as QEMU would set
//!   it up), the guest driver's [`pvcm_guest::device::Device`] over its lab transport
//!   (queues in that memory, eventfd kicks and calls), and its CM agent. One thread per
//!   VM pumps the device and runs the VM's "processes": logical actors that use the
//!   rdma_cm-style API (listen, connect, accept, disconnect, destroy).
//! - **Scenarios** ([`scenarios`]): `teardown` (seed 000), `rej-timeout` (002), `churn`
//!   (003), `timewait-reuse` (001), `ipoib-cm` (004), `cmtime` and `rate`. Each returns
//!   a [`report::Report`]: timings, figures, per host the infiniband_cm-style counter
//!   tables (the backend's, read from its control socket, and the guests' summed over
//!   the host's vPorts), and the invariants checked.
//! - **attach** ([`attach`]): one in-process VM on a running backend's socket, running
//!   any `pvcm-guest` command (`pvcm-lab attach --socket PATH COMMAND`).

pub mod attach;
pub mod cli;
pub mod error;
pub mod guest;
pub mod host;
pub mod hostile;
pub mod migrate;
pub mod opts;
pub mod progress;
pub mod relay;
pub mod report;
pub mod restart;
pub mod scale;
pub mod scenarios;
pub mod stamp;
pub mod standalone;
pub mod world;

pub use opts::{LabOptions, ScenarioName};
pub use report::Report;
pub use scenarios::run;

/// One line per check of a lab command's report: `PASS name: detail` or `FAIL ...`
/// (the form the QEMU scripts print too).
pub fn render_checks(out: &mut String, checks: &[(&str, bool, String)]) {
    for (name, ok, detail) in checks {
        out.push_str(&format!(
            "{} {name}: {detail}\n",
            if *ok { "PASS" } else { "FAIL" }
        ));
    }
}

/// The `main` of a lab command that measures with backends it starts itself
/// (`pvcm-lab hostile`, `pvcm-lab restart`): parses `args` as `T` (named `name`), runs
/// `run(exe, &options)` with this executable, prints the report, and exits 0 when
/// `passed` says so (else prints `failed` and exits 1).
pub fn command_main<T, R>(
    name: &str,
    args: impl IntoIterator<Item = std::ffi::OsString>,
    run: impl FnOnce(&std::path::Path, &T) -> error::LabResult<R>,
    render: impl Fn(&R) -> String,
    passed: impl Fn(&T, &R) -> bool,
    failed: &str,
) -> std::process::ExitCode
where
    T: clap::Parser,
{
    use std::process::ExitCode;
    let argv = std::iter::once(std::ffi::OsString::from(name)).chain(args);
    let a = match T::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::from(1);
        }
    };
    match run(&exe, &a) {
        Ok(r) => {
            print!("{}", render(&r));
            if passed(&a, &r) {
                ExitCode::SUCCESS
            } else {
                eprintln!("{name}: {failed}");
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("{name}: {e}");
            ExitCode::from(1)
        }
    }
}
