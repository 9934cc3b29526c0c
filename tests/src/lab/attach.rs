//! `pvcm-lab attach`: one in-process VM attached to a running backend's vhost-user
//! socket, running any `pvcm-guest` command through it: the guest CLI without QEMU.
//!
//! ```text
//! pvcm-lab attach --socket /run/pvcm/a.sock info
//! pvcm-lab attach --socket /run/pvcm/a.sock cmtime --dest 10.99.0.3 --connections 1000
//! pvcm-lab attach --socket /run/pvcm/b.sock --json listen --port 7471 --count 1
//! ```
//!
//! The VM is a [`GuestVm`] (memfd guest memory, the vhost-user frontend as QEMU sets it
//! up, the guest driver and its CM agent); the commands, their output and their exit
//! status are `pvcm-guest`'s own ([`pvcm_guest::cli::run_command`]). When the command
//! ends the session closes and the backend detaches the VM.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pvcm_guest::cli::{self, Cmd, Out};
use pvcm_guest::device::random_seed;
use pvcm_guest::service::cli::{ServiceArgs, serve_on, stop_on_signals};

use super::guest::{GuestOpts, GuestVm};

/// `pvcm-lab attach` options; the command is any `pvcm-guest` command.
#[derive(Debug, Parser)]
#[command(
    name = "pvcm-lab attach",
    about = "Attach one in-process VM to a running pvcm-backend's vhost-user socket and \
             run a pvcm-guest command through it",
    after_help = "Exit status: as pvcm-guest: 0 success, 1 device or setup error (e.g. the \
                  backend refused the VM), 2 usage error, 3 the CM operation failed."
)]
pub struct AttachCli {
    /// The VM's vhost-user socket (a `--vm socket=...` of the backend).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Queue size of both queues (power of two, up to 1024).
    #[arg(long, global = true, default_value_t = 256, value_name = "N")]
    pub queue_size: u16,
    /// Seed of comm IDs, TIDs and PSNs (default: random).
    #[arg(long, global = true, value_name = "N")]
    pub seed: Option<u64>,
    /// One JSON object per line instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// Answer a peer's DREQ only when the application disconnects, as Linux's rdma_cm.
    #[arg(long, global = true)]
    pub linux_drep: bool,
    /// The pvcm-guest command, or `guestd`.
    #[command(subcommand)]
    pub cmd: AttachCmd,
}

/// What runs on the attached VM.
#[derive(Debug, Subcommand)]
pub enum AttachCmd {
    /// A pvcm-guest command.
    #[command(flatten)]
    Guest(Cmd),
    /// The guest CM service (pvcm-guestd) on this VM's device, serving the rdma_cm
    /// device of the machine this runs on, until SIGTERM.
    Guestd(ServiceArgs),
}

/// Runs `pvcm-lab attach ARGS` (`args` after `attach`).
pub fn main<I: IntoIterator<Item = OsString>>(args: I) -> ExitCode {
    let argv = std::iter::once(OsString::from("pvcm-lab attach")).chain(args);
    let a = match AttachCli::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    run(&a)
}

/// Attaches the VM and runs the command.
pub fn run(a: &AttachCli) -> ExitCode {
    let out = Out { json: a.json };
    if !a.queue_size.is_power_of_two() || a.queue_size > 1024 {
        eprintln!(
            "pvcm-lab attach: --queue-size {}: a power of two up to 1024",
            a.queue_size
        );
        return ExitCode::from(2);
    }
    let opts = GuestOpts {
        queue_size: a.queue_size,
        // The queues' window and its buffers, with room to spare.
        mem_len: (usize::from(a.queue_size) * 2048).max(2 << 20) * 2,
        seed: a.seed.unwrap_or_else(random_seed),
        configure: cli::agent_configure(a.linux_drep),
    };
    let mut vm = match GuestVm::connect(&a.socket, &opts) {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!(
                "pvcm-lab attach: cannot attach to {}: {e}",
                a.socket.display()
            );
            return ExitCode::from(1);
        }
    };
    match &a.cmd {
        AttachCmd::Guest(cmd) => match cli::run_command(&mut vm.dev, cmd, out) {
            Ok(code) => code,
            Err(e) => cli::report_error("pvcm-lab attach", &e, out),
        },
        AttachCmd::Guestd(args) => match serve_on(&mut vm.dev, args, stop_on_signals(), None) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("pvcm-lab attach guestd: error: {e}");
                ExitCode::from(1)
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_any_guest_command() {
        let a = AttachCli::try_parse_from([
            "x",
            "--socket",
            "/tmp/a.sock",
            "cmtime",
            "--dest",
            "10.0.0.2",
            "--connections",
            "5",
            "--json",
        ])
        .unwrap();
        assert!(a.json);
        assert!(matches!(a.cmd, AttachCmd::Guest(Cmd::Cmtime { .. })));
        let g = AttachCli::try_parse_from([
            "x",
            "--socket",
            "/tmp/a.sock",
            "guestd",
            "--control",
            "/tmp/g.sock",
        ])
        .unwrap();
        assert!(matches!(g.cmd, AttachCmd::Guestd(ServiceArgs { .. })));
        assert!(
            AttachCli::try_parse_from(["x", "info"]).is_err(),
            "socket required"
        );
    }
}
