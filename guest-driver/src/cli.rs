//! The `pvcm-guest` command line: the guest side of pvcm from the command line.
//!
//! The binary (`src/bin/pvcm-guest.rs`) is [`main`]. The commands run on any
//! [`Device`] through [`run_command`], so `pvcm-lab attach` runs the same commands
//! through an in-process VM attached to a running backend (the guest CLI without QEMU).
//!
//! `pvcm-guest` drives the pvcm device through the user-space virtio-pci driver
//! (`pvcm_guest::device::pci`): run it as root, with huge pages reserved and the device
//! not claimed by another process. The lab's devices (memfd memory and eventfds in the
//! lab's own process) cannot be named here; `pvcm-lab` drives the library directly.
//!
//! When `pvcm-guestd` owns the device (its control socket answers), the commands run
//! through the service's rdma_cm device instead, with the same output and exit
//! statuses ([`via_service`]; `--via auto|service|device`). `listen`, `connect` and
//! `cmtime` are written once ([`commands`]) over [`route::Route`], which the device
//! route ([`device_route`]) and the service route implement.
//!
//! Commands: `info`, `listen`, `connect`, `connect-destroy` (seed 002: connect, then
//! destroy at once) and `cmtime` (rdma-core's connection-rate benchmark). `--json`
//! prints one JSON object per line instead of text. `--linux-drep` makes the agent
//! answer a peer's DREQ only when the application disconnects, as Linux does (by
//! default the DREP goes out at once).
//!
//! Exit status: 0 success; 1 device or setup error; 2 usage error; 3 the CM operation
//! failed (rejected, unreachable, timed out, no DREP), or, for `cmtime`, any connection
//! failed or fewer than asked for were established and torn down. Every failure is
//! reported with its reason (a REJ's reason name and number, `unreachable`, `timeout`).

use std::fmt::Display;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use crate::cm::rdma_cm::{
    CmaHdr, REQ_USER_PRIVATE_DATA_LEN, req_private_data, split_private_data, tcp_service_id,
};
use crate::cm::{AgentConfig, ConnectOptions, Group, Pacing};
use crate::device::cmtime::{self, ClientOptions, ServerOptions};
use crate::report::{cm_counters_json, ms, pacing_json};
use crate::service::cli::DEFAULT_CONTROL;
use commands::ListenArgs;
use device_route::DeviceRoute;
use route::{ConnectArgs, Route};
use via_service::{DEFAULT_RDMA_CM, Via};

pub mod commands;
pub mod device_route;
pub mod route;
pub mod via_service;
pub use crate::device::args::{DeviceArgs, DeviceSpec};
use crate::device::pci::PciDevice;
use crate::device::{Device, DeviceError, Notice, Transport};
use crate::time::Clock;
use clap::{Parser, Subcommand};
use pvcm_wire::Gid;
use pvcm_wire::mad::AttributeId;
use serde_json::{Value, json};

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(v).map_err(|e| format!("{s:?}: {e}"))
}

fn parse_text(s: &str) -> Result<String, String> {
    if s.len() > REQ_USER_PRIVATE_DATA_LEN {
        return Err(format!(
            "{} bytes: a REQ carries at most {REQ_USER_PRIVATE_DATA_LEN} bytes after \
             rdma_cm's header",
            s.len()
        ));
    }
    Ok(s.to_string())
}

/// `pvcm-guest`'s command line.
#[derive(Debug, Parser)]
#[command(
    name = "pvcm-guest",
    version,
    about = "pvcm guest CM: connect, listen and benchmark through the pvcm device",
    after_help = "Runs inside a VM as root (user-space virtio-pci driver: unbinds the \
                  kernel driver, maps BARs, DMA from hugetlbfs with physical addresses from \
                  /proc/self/pagemap). When pvcm-guestd runs (its control socket answers), \
                  the commands go through its rdma_cm device instead (--via).\n\nExit status: 0 success, 1 device or setup error, \
                  2 usage error, 3 the CM operation failed (rejected, unreachable, timed out)."
)]
pub struct Cli {
    /// The device and how it is driven.
    #[command(flatten)]
    pub dev: DeviceArgs,
    /// One JSON object per line instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// Answer a peer's DREQ only when the application disconnects, as Linux's rdma_cm
    /// does (default: the DREP goes out at once, so a late application never makes the
    /// peer retry its DREQ).
    #[arg(long, global = true)]
    linux_drep: bool,
    /// The most requests (REQ, DREQ) outstanding per destination; the window grows to it
    /// while answers come (default 1024; 0: no pacing, every request at once).
    #[arg(long, global = true, value_name = "N")]
    max_window: Option<u32>,
    /// The window a destination starts with (default 32; at most --max-window).
    #[arg(long, global = true, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    initial_window: Option<u32>,
    /// Which way the commands go: through pvcm-guestd's rdma_cm device (service), the
    /// pvcm device itself (device; refused while the service answers), or the service
    /// when its control socket answers, else the device (auto).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "auto",
        value_name = "WAY"
    )]
    via: Via,
    /// pvcm-guestd's control socket (how `auto` finds the service).
    #[arg(long, global = true, default_value = DEFAULT_CONTROL, value_name = "PATH")]
    control: PathBuf,
    /// The rdma_cm device pvcm-guestd serves.
    #[arg(long, global = true, default_value = DEFAULT_RDMA_CM, value_name = "PATH")]
    rdma_cm: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

/// A `pvcm-guest` command.
#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Show the port (from PORT_INFO), the device and the CM counters.
    Info,
    /// Accept connections on an rdma_cm TCP port and print their events.
    Listen {
        /// The port (service ID 0x0000000001060000 | port).
        #[arg(long)]
        port: u16,
        /// Exit after this many connections were torn down (default: never).
        #[arg(long, value_name = "N")]
        count: Option<u32>,
        /// Private data for the REP.
        #[arg(long, value_name = "TEXT", value_parser = parse_text)]
        data: Option<String>,
        /// Reject every request instead (REJ consumer-defined).
        #[arg(long)]
        reject: bool,
        /// Act like an application that reacts late: destroy a connection the peer
        /// disconnected only this many seconds after the event (the agent has answered
        /// the DREQ already unless --linux-drep).
        #[arg(long, default_value = "0", value_parser = parse_secs, value_name = "SECS")]
        react_after: Duration,
    },
    /// Connect, report, disconnect and destroy.
    Connect {
        /// The server's GID: an IPv4 address (its IPv4-mapped GID, RoCEv2 over IPv4) or
        /// an IPv6 address (RoCEv2 over IPv6), of the same family as this VM's GID.
        #[arg(long, value_name = "GID", value_parser = parse_dest)]
        dest: Gid,
        /// The server's port.
        #[arg(long)]
        port: u16,
        /// Private data after rdma_cm's header (at most 56 bytes).
        #[arg(long, value_name = "TEXT", value_parser = parse_text)]
        data: Option<String>,
        /// Seconds to wait for each answer.
        #[arg(long, default_value = "10", value_parser = parse_secs, value_name = "SECS")]
        timeout: Duration,
        /// Seconds to stay connected before disconnecting.
        #[arg(long, default_value = "0", value_parser = parse_secs, value_name = "SECS")]
        hold: Duration,
        /// Source port for rdma_cm's header (a bound id); default: an ephemeral port,
        /// as rdma_cm picks for an unbound id.
        #[arg(long, value_name = "PORT")]
        src_port: Option<u16>,
    },
    /// Connect, then destroy at once (seed 002: the REQ, then REJ(TIMEOUT)).
    ConnectDestroy {
        /// The server's GID (IPv4 or IPv6 address).
        #[arg(long, value_name = "GID", value_parser = parse_dest)]
        dest: Gid,
        /// The server's port.
        #[arg(long)]
        port: u16,
        /// Seconds to watch what comes back afterwards.
        #[arg(long, default_value = "0.5", value_parser = parse_secs, value_name = "SECS")]
        settle: Duration,
    },
    /// Connection-rate benchmark modelled on rdma-core's cmtime.
    Cmtime {
        /// The server's GID (client side; IPv4 or IPv6 address).
        #[arg(long, value_name = "GID", required_unless_present = "server", value_parser = parse_dest)]
        dest: Option<Gid>,
        /// Connections.
        #[arg(long, default_value_t = cmtime::DEFAULT_CONNECTIONS, value_name = "N")]
        connections: u32,
        /// The port.
        #[arg(long, default_value_t = cmtime::DEFAULT_PORT)]
        port: u16,
        /// Be the server: accept N connections and tear them down as asked.
        #[arg(long, conflicts_with = "dest")]
        server: bool,
        /// Seconds allowed per phase (client) or in all (server; default: no limit).
        #[arg(long, value_parser = parse_secs, value_name = "SECS")]
        timeout: Option<Duration>,
        /// Client: seconds to stay connected between establishing and disconnecting.
        #[arg(long, default_value = "0", value_parser = parse_secs, value_name = "SECS", conflicts_with = "server")]
        hold: Duration,
        /// Bursts to run in this one process, one after the other (the client reports
        /// each; the server serves N connections per round). A long-running guest CM
        /// service is warm after its first burst; the first round shows the cold start.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000), value_name = "R")]
        rounds: u32,
        /// Client: seconds between rounds (the device keeps being served).
        #[arg(long, default_value = "1", value_parser = parse_secs, value_name = "SECS", conflicts_with = "server")]
        pause: Duration,
    },
}

/// Text or JSON output.
#[derive(Debug, Clone, Copy)]
pub struct Out {
    /// One JSON object per line instead of text.
    pub json: bool,
}

impl Out {
    /// Prints `text`, or `v` as one JSON line.
    pub fn emit(&self, text: impl Display, v: Value) {
        if self.json {
            println!("{v}");
        } else {
            println!("{text}");
        }
    }
}

/// Where a command's lines go: stdout ([`Out`]) or memory ([`Captured`]).
pub trait Report {
    /// One line: `text`, or `v` as one JSON line.
    fn line(&mut self, text: String, v: Value);
}

impl Report for Out {
    fn line(&mut self, text: String, v: Value) {
        self.emit(text, v);
    }
}

/// Lines kept in memory (tests).
#[derive(Debug, Clone, Default)]
pub struct Captured {
    /// Every line: its text and its JSON.
    pub lines: Vec<(String, Value)>,
}

impl Report for Captured {
    fn line(&mut self, text: String, v: Value) {
        self.lines.push((text, v));
    }
}

impl Captured {
    /// The JSON lines whose `event` is `name`.
    pub fn events(&self, name: &str) -> Vec<&Value> {
        self.lines
            .iter()
            .map(|(_, v)| v)
            .filter(|v| v["event"] == name)
            .collect()
    }
}

/// Exit status of a failed CM operation.
pub(crate) const EXIT_CM_FAILED: u8 = 3;

/// `pvcm-guest`'s `main`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let out = Out { json: cli.json };
    if let Some(code) = via_service::divert(&cli, out) {
        return code;
    }
    match run(&cli, out) {
        Ok(code) => code,
        Err(e) => report_error("pvcm-guest", &e, out),
    }
}

/// Prints a device or setup error (and its hint) as `prog` does; exit status 1.
pub fn report_error(prog: &str, e: &DeviceError, out: Out) -> ExitCode {
    eprintln!("{prog}: error: {e}");
    let hint = e.hint();
    if let Some(h) = hint {
        eprintln!("{prog}: hint: {h}");
    }
    if out.json {
        println!("{}", json!({"error": e.to_string(), "hint": hint}));
    }
    ExitCode::from(1)
}

fn open(cli: &Cli) -> Result<Device<PciDevice>, DeviceError> {
    cli.dev.open(
        agent_configure(cli.linux_drep),
        pacing_from(cli.max_window, cli.initial_window),
    )
}

/// The pacing the options ask for (`None`: the agent's default; `Some(None)`: none):
/// [`Pacing::new`] is the one place the policy is derived.
pub fn pacing_from(max_window: Option<u32>, initial_window: Option<u32>) -> Option<Option<Pacing>> {
    (max_window.is_some() || initial_window.is_some())
        .then(|| Pacing::new(max_window, initial_window))
}

/// The agent options the command line changes (`--linux-drep`).
pub fn agent_configure(linux_drep: bool) -> Option<fn(&mut AgentConfig)> {
    linux_drep.then_some(|c: &mut AgentConfig| c.auto_drep = false)
}

fn run(cli: &Cli, out: Out) -> Result<ExitCode, DeviceError> {
    let mut dev = open(cli)?;
    run_command(&mut dev, &cli.cmd, out)
}

/// Runs one command on a started device; the exit status as `pvcm-guest` returns it.
pub fn run_command<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    cmd: &Cmd,
    out: Out,
) -> Result<ExitCode, DeviceError> {
    let mut rep = out;
    match cmd {
        Cmd::Info => info(dev, out),
        Cmd::ConnectDestroy { dest, port, settle } => {
            connect_destroy(dev, out, *dest, *port, *settle)
        }
        _ => run_on(
            &mut DeviceRoute::new(dev),
            cmd,
            &mut rep,
            DeviceError::Invalid,
        ),
    }
}

/// Runs `listen`, `connect` or `cmtime` over a route (`invalid`: the route's error for
/// arguments that do not fit).
pub(crate) fn run_on<R: Route>(
    route: &mut R,
    cmd: &Cmd,
    rep: &mut dyn Report,
    invalid: fn(String) -> R::Error,
) -> Result<ExitCode, R::Error> {
    match cmd {
        Cmd::Listen {
            port,
            count,
            data,
            reject,
            react_after,
        } => commands::listen(
            route,
            rep,
            &ListenArgs {
                port: *port,
                count: *count,
                data: data.as_deref().unwrap_or(""),
                reject: *reject,
                react_after: *react_after,
            },
        ),
        Cmd::Connect {
            dest,
            port,
            data,
            timeout,
            hold,
            src_port,
        } => commands::connect(
            route,
            rep,
            &ConnectArgs {
                dest: *dest,
                port: *port,
                data: data.as_deref().unwrap_or(""),
                timeout: *timeout,
                hold: *hold,
                src_port: *src_port,
            },
        ),
        Cmd::Cmtime { .. } => commands::cmtime(route, rep, &CmtimePlan::of(cmd).map_err(invalid)?),
        Cmd::Info | Cmd::ConnectDestroy { .. } => Err(invalid(
            "info and connect-destroy are run by each route itself".into(),
        )),
    }
}

/// What `cmtime`'s arguments ask for, whichever way the CM is reached.
#[derive(Debug)]
pub enum CmtimePlan {
    /// Connect `opts.connections` to the server, `rounds` times, `pause` apart.
    Client {
        /// The options of one round.
        opts: ClientOptions,
        /// Rounds.
        rounds: u32,
        /// Pause between rounds.
        pause: Duration,
    },
    /// Serve every round's connections.
    Server(ServerOptions),
}

impl CmtimePlan {
    /// From `cmtime`'s arguments: a client with `--dest` (timeout 30 s unless given), a
    /// server otherwise; an error when the server's total does not fit (or `cmd` is not
    /// `cmtime`).
    pub fn of(cmd: &Cmd) -> Result<CmtimePlan, String> {
        let &Cmd::Cmtime {
            dest,
            connections,
            port,
            server,
            timeout,
            hold,
            rounds,
            pause,
        } = cmd
        else {
            return Err("not a cmtime command".into());
        };
        match (dest, server) {
            (Some(dest), false) => Ok(CmtimePlan::Client {
                opts: ClientOptions {
                    dest,
                    port,
                    connections,
                    timeout: timeout.unwrap_or(Duration::from_secs(30)),
                    hold,
                    connect: crate::cm::ConnectOptions::default(),
                },
                rounds,
                pause,
            }),
            _ => {
                let total = connections.checked_mul(rounds).ok_or_else(|| {
                    format!(
                        "--connections {connections} x --rounds {rounds} is more than {} \
                         connections",
                        u32::MAX
                    )
                })?;
                Ok(CmtimePlan::Server(ServerOptions {
                    port,
                    connections: total,
                    timeout,
                }))
            }
        }
    }
}

/// The user part of rdma_cm private data, as text (trailing NULs cut).
pub(crate) fn pd_text(pd: &[u8], has_cma_hdr: bool) -> String {
    let user = if has_cma_hdr {
        split_private_data(pd).map_or(pd, |(_, u)| u)
    } else {
        pd
    };
    let end = user.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    String::from_utf8_lossy(&user[..end]).into_owned()
}

fn counters_json<T: Transport, C: Clock>(dev: &Device<T, C>) -> Value {
    cm_counters_json(dev.agent().counters())
}

fn info<T: Transport, C: Clock>(dev: &mut Device<T, C>, out: Out) -> Result<ExitCode, DeviceError> {
    let p = dev.port_info().clone();
    let (tx, rx) = dev.queues();
    let (txs, rxs) = (tx.virtq().size(), rx.virtq().size());
    let features = dev.transport().features();
    let text = format!(
        "device      {}\nname        {}\nabi         {}\nport        {}\ngid         {}\n\
         ca_guid     {:#018x}\nlid         {:#06x}\npkey        {:#06x}\n\
         qpns        {:#x}..{:#x} ({})\nquota       {} connections\n\
         mtu         {} (code {})\nack_delay   {}\n\
         features    {:#x}\nqueues      tx {} rx {}\n{}{}\n{}",
        dev.transport().describe(),
        p.name,
        p.abi_version,
        if dev.port_up() { "up" } else { "down" },
        p.gid,
        p.ca_guid,
        p.lid,
        p.pkey,
        p.qpn_base,
        u64::from(p.qpn_base) + u64::from(p.qpn_count),
        p.qpn_count,
        p.max_entries,
        128u32 << p.mtu_or_default(),
        p.active_mtu,
        p.ca_ack_delay,
        features,
        txs,
        rxs,
        dev.agent().counters(),
        dev.stats(),
        dev.agent().pacing(),
    );
    out.emit(
        text,
        json!({
            "device": dev.transport().describe(),
            "name": p.name,
            "abi_version": p.abi_version,
            "port_up": dev.port_up(),
            "gid": p.gid.to_string(),
            "ca_guid": format!("{:#018x}", p.ca_guid),
            "lid": p.lid,
            "pkey": p.pkey,
            "qpn_base": p.qpn_base,
            "qpn_count": p.qpn_count,
            "max_entries": p.max_entries,
            "active_mtu": p.active_mtu,
            "ca_ack_delay": p.ca_ack_delay,
            "features": format!("{features:#x}"),
            "queue_size": {"tx": txs, "rx": rxs},
            "counters": counters_json(dev),
            "pacing": pacing_json(&dev.agent().pacing()),
        }),
    );
    Ok(ExitCode::SUCCESS)
}

fn connect_destroy<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    dest: Gid,
    port: u16,
    settle: Duration,
) -> Result<ExitCode, DeviceError> {
    let mut rep = out;
    let local = dev.agent().config().gid;
    let sport = DeviceRoute::new(dev).source_port(None);
    let pd = req_private_data(&CmaHdr::from_gids(local, dest, sport), &[])
        .map_err(|e| DeviceError::Invalid(format!("private data: {e}")))?;
    let id = dev.connect(dest, tcp_service_id(port), &pd, &ConnectOptions::default())?;
    dev.destroy(id)?;
    dev.flush(Duration::from_secs(1))?;
    // Watch what the peer does with it (its REP is answered by the agent).
    let until = dev.now().after(settle);
    while dev.now() < until {
        let left = until.since(dev.now());
        if let Some(Notice::Device(e)) = dev.next_notice(left)? {
            commands::device_event(&mut rep, &e);
        }
    }
    dev.flush(Duration::from_secs(1))?;
    let c = dev.agent().counters();
    let tx = |a| c.get(Group::TxMsgs, a);
    let rx = |a| c.get(Group::RxMsgs, a);
    out.emit(
        format!(
            "{id}: connect + destroy to {dest} port {port}: sent REQ {} REJ {}; received REP {} REJ {} MRA {}; send errors {}",
            tx(AttributeId::Req),
            tx(AttributeId::Rej),
            rx(AttributeId::Rep),
            rx(AttributeId::Rej),
            rx(AttributeId::Mra),
            dev.stats().send_errors,
        ),
        json!({
            "event": "connect_destroy", "id": id.to_string(), "dest": dest.to_string(), "port": port,
            "counters": counters_json(dev), "send_errors": dev.stats().send_errors,
        }),
    );
    Ok(ExitCode::SUCCESS)
}

/// This process's CPU time (getrusage), so a run can report what it cost the guest: in
/// a TCG VM, user time is the agent's own work and system time the guest kernel's (the
/// poll's sleeps, page faults).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProcessCpu {
    user: Duration,
    system: Duration,
}

impl ProcessCpu {
    pub(crate) fn now() -> ProcessCpu {
        // SAFETY: `usage` is a plain C struct that getrusage fills; zeroed is a valid
        // value for it, and RUSAGE_SELF needs no other argument.
        let mut usage: libc::rusage = unsafe { core::mem::zeroed() };
        // SAFETY: `usage` is a valid, writable rusage for the duration of the call.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
            return ProcessCpu::default();
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec.max(0) as u64)
                + Duration::from_micros(t.tv_usec.max(0) as u64)
        };
        ProcessCpu {
            user: tv(usage.ru_utime),
            system: tv(usage.ru_stime),
        }
    }

    pub(crate) fn since(self, earlier: ProcessCpu) -> ProcessCpu {
        ProcessCpu {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }

    /// The report line: text and JSON.
    pub(crate) fn report(self) -> (String, Value) {
        (
            format!(
                "cpu user {:.1} ms system {:.1} ms",
                ms(self.user),
                ms(self.system)
            ),
            json!({"event": "cpu", "user_ms": ms(self.user), "system_ms": ms(self.system)}),
        )
    }
}

/// `--dest`: an IPv4 address (its IPv4-mapped GID), an IPv4-mapped GID or an IPv6
/// address, unicast (what a RoCE port can send to).
fn parse_dest(v: &str) -> Result<Gid, String> {
    let g: Gid = v.parse().map_err(|_| {
        format!("{v:?} is not a GID: give an IPv4 address (10.0.0.2) or an IPv6 one (fd00::2)")
    })?;
    match g.roce_unicast_problem() {
        Some(why) => Err(format!("{v}: {why} is not a RoCE peer")),
        None => Ok(g),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::RejReason;
    use crate::device::cmtime::Failure;
    use crate::report::{failure_json, with};
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("pvcm-guest").chain(args.iter().copied()))
    }

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn destinations_of_both_families() {
        let c = parse(&["connect", "--dest", "fd00:6::2", "--port", "7471"]).unwrap();
        let Cmd::Connect { dest, .. } = c.cmd else {
            panic!("not connect")
        };
        assert_eq!(dest, "fd00:6::2".parse::<Gid>().unwrap());
        assert!(dest.to_ipv4().is_none());
        let c = parse(&["cmtime", "--dest", "10.0.0.2"]).unwrap();
        let Cmd::Cmtime { dest, .. } = c.cmd else {
            panic!("not cmtime")
        };
        assert_eq!(dest.and_then(|g| g.to_ipv4()), Some([10, 0, 0, 2].into()));
        assert!(
            parse(&[
                "connect-destroy",
                "--dest",
                "fe80::5054:ff:fe99:2",
                "--port",
                "1"
            ])
            .is_ok()
        );
        for bad in ["ff02::1", "::", "::1", "224.0.0.1", "fe80::1%eth0", "host"] {
            let e = parse(&["connect", "--dest", bad, "--port", "1"]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{bad}");
        }
    }

    #[test]
    fn defaults() {
        let c = parse(&["info"]).unwrap();
        assert_eq!(c.dev.device, DeviceSpec::Pci { virtio_id: 63 });
        assert_eq!(c.dev.sysfs, PathBuf::from("/sys"));
        assert_eq!(c.dev.hugepages, PathBuf::from("/dev/hugepages"));
        assert_eq!(c.dev.queue_size, 1024);
        assert!(!c.json && c.dev.seed.is_none() && c.dev.pci_addr.is_none());
        assert!(matches!(c.cmd, Cmd::Info));
        assert!(!c.linux_drep && agent_configure(c.linux_drep).is_none());
    }

    #[test]
    fn max_window_sets_the_pacing() {
        let c = parse(&["--max-window", "1024", "cmtime", "--server"]).unwrap();
        let p = pacing_from(c.max_window, c.initial_window)
            .unwrap()
            .unwrap();
        assert_eq!(
            (p.max_window, p.slow_start, p.initial_window),
            (1024, 1024, 32)
        );
        let c = parse(&["cmtime", "--server", "--max-window", "0"]).unwrap();
        assert_eq!(pacing_from(c.max_window, c.initial_window), Some(None));
        assert_eq!(parse(&["cmtime", "--server"]).unwrap().max_window, None);
    }

    #[test]
    fn initial_window_sets_the_start_within_the_bounds() {
        let c = parse(&["--initial-window", "128", "cmtime", "--server"]).unwrap();
        let p = pacing_from(c.max_window, c.initial_window)
            .unwrap()
            .unwrap();
        assert_eq!((p.initial_window, p.max_window), (128, 1024));
        let c = parse(&["--initial-window", "128", "--max-window", "64", "info"]).unwrap();
        let p = pacing_from(c.max_window, c.initial_window)
            .unwrap()
            .unwrap();
        assert_eq!((p.initial_window, p.max_window), (64, 64));
        let c = parse(&["--initial-window", "8", "--max-window", "0", "info"]).unwrap();
        assert_eq!(pacing_from(c.max_window, c.initial_window), Some(None));
        assert_eq!(pacing_from(None, None), None);
        assert!(parse(&["--initial-window", "0", "info"]).is_err());
    }

    #[test]
    fn linux_drep_turns_the_immediate_drep_off() {
        for args in [
            &["--linux-drep", "listen", "--port", "1"][..],
            &["cmtime", "--server", "--linux-drep"][..],
        ] {
            let c = parse(args).unwrap();
            assert!(c.linux_drep);
            let mut cfg = AgentConfig::new(Gid::from_ipv4([10, 0, 0, 1].into()), 1, 0, 1, 1);
            assert!(cfg.auto_drep, "the default answers at once");
            agent_configure(c.linux_drep).unwrap()(&mut cfg);
            assert!(!cfg.auto_drep);
        }
    }

    #[test]
    fn device_selector() {
        let c = parse(&["--device", "pci:41", "info"]).unwrap();
        assert_eq!(c.dev.device, DeviceSpec::Pci { virtio_id: 41 });
        let c = parse(&["info", "--device", "pci:0x3f", "--json"]).unwrap();
        assert_eq!(c.dev.device, DeviceSpec::Pci { virtio_id: 63 });
        assert!(c.json);
        for bad in ["pci:x", "pci:70000", "usb", "lab", "lab:/tmp/vm.sock"] {
            let e = parse(&["--device", bad, "info"]).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{bad}");
        }
        let e = parse(&["--device", "lab:x", "info"]).unwrap_err();
        assert!(e.to_string().contains("pvcm-lab"), "{e}");
    }

    #[test]
    fn listen_and_connect() {
        let c = parse(&["listen", "--port", "7471", "--count", "3", "--data", "hi"]).unwrap();
        match c.cmd {
            Cmd::Listen {
                port,
                count,
                data,
                reject,
                react_after,
            } => {
                assert_eq!(react_after, Duration::ZERO);
                assert_eq!(
                    (port, count, data.as_deref(), reject),
                    (7471, Some(3), Some("hi"), false)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["listen"]).is_err(), "port required");
        let c = parse(&[
            "connect",
            "--dest",
            "10.0.0.2",
            "--port",
            "18515",
            "--data",
            "hello",
            "--timeout",
            "2.5",
        ])
        .unwrap();
        match c.cmd {
            Cmd::Connect {
                dest,
                port,
                data,
                timeout,
                hold,
                src_port,
            } => {
                assert_eq!(dest, Gid::from_ipv4([10, 0, 0, 2].into()));
                assert_eq!(port, 18515);
                assert_eq!(data.as_deref(), Some("hello"));
                assert_eq!(timeout, Duration::from_millis(2500));
                assert_eq!(hold, Duration::ZERO);
                assert_eq!(src_port, None);
            }
            other => panic!("{other:?}"),
        }
        let c = parse(&["connect", "--dest", "fe80::1", "--port", "1"]).unwrap();
        assert!(matches!(c.cmd, Cmd::Connect { dest, .. } if dest.to_string() == "fe80::1"));
        let c = parse(&[
            "connect",
            "--dest",
            "10.0.0.2",
            "--port",
            "1",
            "--src-port",
            "4000",
        ])
        .unwrap();
        assert!(matches!(
            c.cmd,
            Cmd::Connect {
                src_port: Some(4000),
                ..
            }
        ));
        assert!(parse(&["connect", "--dest", "nope", "--port", "1"]).is_err());
        assert!(parse(&["connect", "--dest", "10.0.0.2"]).is_err());
        assert!(parse(&["connect", "--dest", "10.0.0.2", "--port", "70000"]).is_err());
        let long = "x".repeat(REQ_USER_PRIVATE_DATA_LEN + 1);
        assert!(
            parse(&[
                "connect", "--dest", "10.0.0.2", "--port", "1", "--data", &long
            ])
            .is_err()
        );
        assert!(
            parse(&[
                "connect",
                "--dest",
                "10.0.0.2",
                "--port",
                "1",
                "--timeout",
                "-1"
            ])
            .is_err()
        );
    }

    #[test]
    fn connect_destroy_and_cmtime() {
        let c = parse(&[
            "connect-destroy",
            "--dest",
            "::ffff:10.0.0.2",
            "--port",
            "9",
        ])
        .unwrap();
        assert!(
            matches!(c.cmd, Cmd::ConnectDestroy { port: 9, settle, .. } if settle == Duration::from_millis(500))
        );
        let c = parse(&["cmtime", "--dest", "10.0.0.2"]).unwrap();
        match c.cmd {
            Cmd::Cmtime {
                dest,
                connections,
                port,
                server,
                timeout,
                ..
            } => {
                assert!(dest.is_some());
                assert_eq!(
                    (connections, port, server, timeout),
                    (100, 7471, false, None)
                );
            }
            other => panic!("{other:?}"),
        }
        let c = parse(&["cmtime", "--server", "--connections", "1000"]).unwrap();
        assert!(matches!(
            c.cmd,
            Cmd::Cmtime {
                server: true,
                connections: 1000,
                dest: None,
                ..
            }
        ));
        let e = parse(&["cmtime"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::MissingRequiredArgument);
        let e = parse(&["cmtime", "--server", "--dest", "10.0.0.1"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ArgumentConflict);
        assert!(parse(&[]).is_err(), "a command is required");
    }

    #[test]
    fn failures_carry_their_reason() {
        let r = failure_json(Failure::Rejected(RejReason::InvalidServiceId));
        assert_eq!(r["failure"], "rejected");
        assert_eq!(r["reason_name"], "invalid_service_id");
        assert_eq!(r["reason_code"], 8);
        assert_eq!(r["reason"], "InvalidServiceId");
        // What e2e.sh matches for a REJ(TIMEOUT) ("imeout" in the reason).
        let t = failure_json(Failure::Rejected(RejReason::Timeout));
        assert!(t["reason"].as_str().unwrap().contains("imeout"));
        let t = failure_json(Failure::Timeout);
        assert_eq!(t["failure"], "timeout");
        assert!(!t.contains_key("reason_code"));
        let v = with(json!({"event": "x"}), failure_json(Failure::Unreachable));
        assert_eq!(
            (v["event"].as_str(), v["failure"].as_str()),
            (Some("x"), Some("unreachable"))
        );
    }

    #[test]
    fn private_data_text() {
        let hdr = CmaHdr::from_gids(
            Gid::from_ipv4([10, 0, 0, 1].into()),
            Gid::from_ipv4([10, 0, 0, 2].into()),
            0,
        );
        let mut pd = req_private_data(&hdr, b"hello").unwrap();
        pd.resize(92, 0);
        assert_eq!(pd_text(&pd, true), "hello");
        assert_eq!(pd_text(b"ok\0\0", false), "ok");
        assert_eq!(pd_text(&[], true), "");
    }
}
