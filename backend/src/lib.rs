//! `pvcm-backend`: the host side of pvcm.
//!
//! - [`mux`]: the PF multiplexer, pure and I/O-free: comm-ID and TID remapping, demux,
//!   REJ(TIMEOUT) routing, protocol-aware entry lifetimes, VM cleanup, anti-spoofing.
//! - [`config`]: the daemon's command line and config file.
//! - [`device`]: the pvcm virtio device served over vhost-user (ABI: `docs/device-abi.md`).
//! - [`port`]: the wire port, one trait and three implementations: the soft RoCEv2 port
//!   (RoCEv2 over UDP, ICRC, `sendmmsg`/`recvmmsg`), the umad port (a real RDMA
//!   device's QP1 through `/dev/infiniband/umadN`) and the packet port (QP1 frames of
//!   VMs with their own NIC, diverted to a network device).
//! - [`rx`], [`backlog`], [`vm_port`], [`shared`]: the state the VM threads and the
//!   host loop share (rx messages, per-VM backlogs under a budget, one configured VM,
//!   the mux behind one lock).
//! - [`migration`], [`dirty_log`]: a VM's backend state on the move and the dirty-page
//!   log of a live migration.
//! - [`session`]: a VM's thread: its vhost-user sessions, one after another.
//! - [`daemon`]: the serve loop (the VMs' threads, the host event loop).
//! - [`error`]: the daemon's typed errors.
//! - [`files`]: the files the daemon creates (its sockets, where it may put them and
//!   when it removes them; the capture and journal's options).
//! - [`control`]: the control socket, `pvcm-backend stat`, Prometheus metrics.
//! - [`stats`]: device and wire counters, the snapshot and its renderings.
//! - [`pcap`]: `--pcap` capture of every frame.
//! - [`state`]: `--state-dir`, the mux's state journal (restart without loss).
//! - [`runtime`]: VMs added, removed and changed while the daemon runs (control
//!   socket, SIGHUP), kept in `--state-dir`.
//! - [`notify`]: readiness for systemd (`sd_notify`).
//!
//! The binary (`src/main.rs`) only parses the command line and calls [`daemon::run`],
//! [`control::stat`] or [`control::vm`].

#![warn(missing_docs)]

pub mod backlog;
pub mod config;
pub mod control;
pub mod daemon;
pub mod device;
pub mod dirty_log;
pub mod error;
pub mod files;
pub mod migration;
pub mod mux;
pub mod notify;
pub mod pcap;
pub mod port;
pub mod preflight;
pub mod runtime;
pub mod rx;
pub mod session;
pub mod shared;
pub mod state;
pub mod stats;
pub mod vm_port;

pub use config::Config;
pub use daemon::Daemon;

/// The `pvcm-backend` command line, run in this process: `args` are the arguments after
/// the program name. The binary's `main` is this; the lab runs its hosts through it too
/// (`pvcm-lab __backend ...`), so both are the same daemon.
pub fn run_cli<I, T>(args: I) -> std::process::ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::Parser;
    use std::process::ExitCode;

    let argv = std::iter::once(std::ffi::OsString::from("pvcm-backend"))
        .chain(args.into_iter().map(Into::into));
    let cli = match config::Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    match cli.command {
        Some(config::Command::Stat(a)) => match a
            .daemon
            .control_socket()
            .and_then(|c| control::stat(&c, a.json).map_err(|e| e.to_string()))
        {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("pvcm-backend stat: {e}");
                ExitCode::FAILURE
            }
        },
        Some(config::Command::Vm(a)) => match a
            .daemon
            .control_socket()
            .and_then(|c| control::vm(&c, &a.op).map_err(|e| e.to_string()))
        {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("pvcm-backend vm: {e}");
                ExitCode::FAILURE
            }
        },
        Some(config::Command::Reload(a)) => {
            match a
                .control_socket()
                .and_then(|c| control::reload(&c).map_err(|e| e.to_string()))
            {
                Ok(text) => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("pvcm-backend reload: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(config::Command::CheckConfig(a)) => {
            let args = config::ServeArgs {
                config: Some(a.file.clone()),
                ..config::ServeArgs::default()
            };
            let file = a.file.display().to_string();
            let checked = config::Config::from_args(&args)
                .map_err(|e| match e.to_string() {
                    // An error across the file's VMs names no file by itself.
                    e if e.contains(&file) => e,
                    e => format!("{file}: {e}"),
                })
                .and_then(|cfg| {
                    // The sockets' paths as the daemon would find them at its start, and
                    // every place it writes in.
                    let mut problems: Vec<String> = cfg
                        .socket_paths()
                        .filter_map(|p| files::check_socket_path(p).err())
                        .map(|e| e.to_string())
                        .collect();
                    problems.extend(preflight::problems(&cfg));
                    if problems.is_empty() {
                        Ok(cfg)
                    } else {
                        let file = a.file.display();
                        Err(format!("{file}: {}", problems.join(&format!("\n{file}: "))))
                    }
                });
            match checked {
                Ok(cfg) => {
                    println!("{}: ok\n{}", a.file.display(), cfg.summary().trim_end());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("pvcm-backend check-config: {e}");
                    ExitCode::from(2)
                }
            }
        }
        None => {
            let cfg = match config::Config::from_args(&cli.serve) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("pvcm-backend: {e}");
                    return ExitCode::from(2);
                }
            };
            pvcm_log::init(cfg.log_format);
            match daemon::run(cfg, &cli.serve) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("pvcm-backend: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
