//! `pvcm-guestd`'s command line: serve the rdma_cm device, or print a running
//! service's counters (`pvcm-guestd stat`).

use std::io::{BufRead, BufReader};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

use super::cma::Cma;
use super::server::{Server, ServerOptions, ServiceError, default_threads};
use super::verbs::{PortError, PortWatch, RdmaPort};
use crate::device::args::DeviceArgs;
use crate::device::{Device, Transport};
use crate::time::SystemClock;

/// The control socket's default path.
pub const DEFAULT_CONTROL: &str = "/run/pvcm-guestd.sock";

/// The service's own options (beside the device's), shared by `pvcm-guestd` and
/// `pvcm-lab attach ... guestd`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    /// The node's name under /dev.
    #[arg(long, default_value = "infiniband/rdma_cm", value_name = "NAME")]
    pub devname: String,
    /// The CUSE device.
    #[arg(long, default_value = "/dev/cuse", value_name = "PATH")]
    pub cuse: PathBuf,
    /// The node's mode (octal); the kernel's rdma_cm node is 0666.
    #[arg(long, default_value = "0666", value_parser = parse_mode, value_name = "MODE")]
    pub mode: u32,
    /// The control socket (`pvcm-guestd stat`).
    #[arg(long, default_value = DEFAULT_CONTROL, value_name = "PATH")]
    pub control: PathBuf,
    /// How long to wait for the VM's RDMA device to show the pvcm GID (seconds).
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub gid_wait: u64,
    /// Where sysfs is (the RDMA devices' GID tables).
    #[arg(long = "rdma-sysfs", default_value = "/sys", value_name = "DIR")]
    pub rdma_sysfs: PathBuf,
    /// The TOS of ids whose program sets none (rdma_set_option RDMA_OPTION_ID_TOS), as the
    /// kernel's `default_roce_tos` of the port in configfs
    /// (/sys/kernel/config/rdma_cm/DEV/ports/N/default_roce_tos): their routes' traffic
    /// class, and SL on a VLAN device.
    #[arg(long, default_value_t = 0, value_name = "TOS")]
    pub default_roce_tos: u8,
    /// Threads serving requests: with one, one thread reads the requests and drives
    /// the device; with more, that many read and serve requests (each file's in order,
    /// other files' side by side) beside a thread driving the device. Default: one per
    /// CPU, at least 4, at most 8.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: Option<u16>,
}

#[derive(Debug, Parser)]
#[command(
    name = "pvcm-guestd",
    version,
    about = "pvcm guest CM service: serves the Linux rdma_cm device \
             (/dev/infiniband/rdma_cm) through CUSE, so librdmacm programs run \
             unchanged, their CM carried by the pvcm device",
    after_help = "Runs as root in the VM, with the cuse module loaded and the kernel's \
                  rdma_ucm kept out (modprobe.d: install rdma_ucm /bin/false), beside \
                  the VM's own RDMA device (the one whose RoCE v2 GID is the pvcm GID). \
                  Exit status: 0 stopped by a signal, 1 setup or device error, 2 usage."
)]
struct GuestdCli {
    #[command(flatten)]
    dev: DeviceArgs,
    #[command(flatten)]
    service: ServiceArgs,
    /// The log format on stderr: `text` (one line per event; colour only on a
    /// terminal, never with NO_COLOR set) or `json` (one JSON object per line). RUST_LOG
    /// sets the level.
    #[arg(long, value_name = "FORMAT", value_enum, default_value = "text")]
    log_format: pvcm_log::LogFormat,
    #[command(subcommand)]
    cmd: Option<Sub>,
}

#[derive(Debug, Subcommand)]
enum Sub {
    /// Print a running service's counters.
    Stat {
        /// The control socket.
        #[arg(long, default_value = DEFAULT_CONTROL, value_name = "PATH")]
        control: PathBuf,
        /// The raw JSON.
        #[arg(long)]
        json: bool,
    },
    /// The device's keeper, started by the service itself (see `service/keeper.rs`).
    #[command(hide = true)]
    Keep {
        /// The service's pid.
        #[arg(long)]
        parent: i32,
    },
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal mode (e.g. 0666)"))
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// `pvcm-guestd`'s `main`.
pub fn main() -> ExitCode {
    let cli = GuestdCli::parse();
    if let Some(Sub::Stat { control, json }) = &cli.cmd {
        return stat(control, *json);
    }
    pvcm_log::init(cli.log_format);
    if let Some(Sub::Keep { parent }) = &cli.cmd {
        return match super::keeper::keep(*parent) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(error = %e, "the keeper failed");
                ExitCode::from(1)
            }
        };
    }
    match serve(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "pvcm-guestd failed");
            ExitCode::from(1)
        }
    }
}

/// Why the service did not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum GuestdError {
    /// The pvcm device.
    #[error("{0}")]
    Device(#[from] crate::device::DeviceError),
    /// The VM's RDMA device.
    #[error("{0}")]
    Port(#[from] PortError),
    /// CUSE or the loop.
    #[error("{0}")]
    Service(#[from] ServiceError),
}

fn find_port(
    sysfs: &Path,
    gid: pvcm_wire::Gid,
    more: &[pvcm_wire::Gid],
    wait: Duration,
) -> Result<RdmaPort, PortError> {
    let until = Instant::now() + wait;
    loop {
        match RdmaPort::find(sysfs, gid, more) {
            Ok(p) => return Ok(p),
            Err(e) if Instant::now() >= until => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Catches SIGTERM and SIGINT: the service then stops.
pub fn stop_on_signals() -> &'static AtomicBool {
    // SAFETY: installing a handler that only stores to an atomic, which is
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    &STOP
}

/// Serves the rdma_cm device for a started pvcm device until `stop` is set: finds the
/// VM's RDMA port for the device's GID, answers CUSE's handshake, runs the loop.
/// `keeper`: the executable whose `keep` subcommand keeps the device
/// ([`super::keeper`]), `None` for none.
pub fn serve_on<T: Transport + Send>(
    dev: &mut Device<T, SystemClock>,
    args: &ServiceArgs,
    stop: &'static AtomicBool,
    keeper: Option<&str>,
) -> Result<(), GuestdError> {
    let gid = dev.port_info().gid;
    let more = dev.port_info().more_gids.clone();
    let port = find_port(
        &args.rdma_sysfs,
        gid,
        &more,
        Duration::from_secs(args.gid_wait),
    )?;
    tracing::info!(
        %gid,
        device = %port.device,
        port = port.port_num,
        gid_index = port.gid_index,
        netdev = %port.netdev,
        path_mtu = port.path_mtu,
        "the pvcm GID's RDMA port found"
    );
    for g in &more {
        match port.served().find(|s| s.gid == *g) {
            Some(s) => {
                tracing::info!(gid = %g, gid_index = s.gid_index, "a further GID of the VM served")
            }
            None => tracing::warn!(
                gid = %g,
                device = %port.device,
                "a further GID of the VM the backend serves is not in the port's GID table \
                 (yet): its address binds once it is"
            ),
        }
    }
    let seed = dev.options().seed;
    let port = RdmaPort {
        default_roce_tos: args.default_roce_tos,
        ..port
    };
    let cma = Cma::new(port, seed);
    let mut watch = PortWatch::new(args.rdma_sysfs.clone(), gid, Duration::from_millis(500));
    watch.more_gids = more;
    let opts = ServerOptions {
        cuse: args.cuse.clone(),
        devname: args.devname.clone(),
        mode: args.mode,
        control: Some(args.control.clone()),
        watch: Some(watch),
        threads: args.threads.map_or_else(default_threads, usize::from),
        keeper: keeper.map(str::to_owned),
    };
    let mut server = Server::start(dev, cma, &opts, stop)?;
    tracing::info!(
        device = %format_args!("/dev/{}", args.devname),
        control = %args.control.display(),
        threads = opts.threads,
        "serving"
    );
    notify_ready();
    server.run()?;
    tracing::info!("stopping");
    Ok(())
}

fn serve(cli: &GuestdCli) -> Result<(), GuestdError> {
    let stop = stop_on_signals();
    let mut dev = cli.dev.open(None, None)?;
    // The keeper is this executable: by its path while that is still it (an upgrade
    // may have replaced or removed it since), else through /proc/self/exe.
    let exe = std::env::current_exe()
        .ok()
        .filter(|p| p.is_file())
        .map_or_else(|| "/proc/self/exe".to_owned(), |p| p.display().to_string());
    serve_on(&mut dev, &cli.service, stop, Some(&exe))
}

/// Tells systemd the service is ready (`NOTIFY_SOCKET`), when it asked.
fn notify_ready() {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return;
    };
    let p = path.to_string_lossy().into_owned();
    if let Some(abstract_name) = p.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        if let Ok(a) = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name) {
            let _ = sock.send_to_addr(b"READY=1", &a);
        }
    } else {
        let _ = sock.send_to(b"READY=1", &p);
    }
}

fn stat(control: &Path, json: bool) -> ExitCode {
    let s = match UnixStream::connect(control) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "pvcm-guestd stat: cannot connect to {}: {e} (is pvcm-guestd running?)",
                control.display()
            );
            return ExitCode::from(1);
        }
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    if BufReader::new(s).read_line(&mut line).is_err() || line.is_empty() {
        eprintln!("pvcm-guestd stat: no answer from {}", control.display());
        return ExitCode::from(1);
    }
    if json {
        print!("{line}");
        return ExitCode::SUCCESS;
    }
    match serde_json::from_str::<serde_json::Value>(&line) {
        Ok(v) => {
            if let Some(m) = v.as_object() {
                for (k, val) in m {
                    println!("{k:<18} {val}");
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("pvcm-guestd stat: bad answer: {e}");
            ExitCode::from(1)
        }
    }
}
