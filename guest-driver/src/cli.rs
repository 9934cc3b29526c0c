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
//! statuses ([`via_service`]; `--via auto|service|device`).
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
    CmaHdr, EphemeralPorts, REQ_USER_PRIVATE_DATA_LEN, req_private_data, split_private_data,
    tcp_service_id,
};
use crate::cm::{AgentConfig, CmError, CmId, ConnectOptions, Event, Group, Pacing, RejReason};
use crate::device::cmtime::{self, ClientOptions, Failure, ServerOptions, Step};
use crate::report::{cm_counters_json, pacing_json};
use crate::service::cli::DEFAULT_CONTROL;
use via_service::{DEFAULT_RDMA_CM, Via};

pub mod via_service;
pub use crate::device::args::{DeviceArgs, DeviceSpec};
use crate::device::pci::PciDevice;
use crate::device::{Device, DeviceError, DeviceEvent, DeviceStats, Notice, Transport};
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

/// Exit status of a failed CM operation.
const EXIT_CM_FAILED: u8 = 3;

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
    match cmd {
        Cmd::Info => info(dev, out),
        Cmd::Listen {
            port,
            count,
            data,
            reject,
            react_after,
        } => listen(
            dev,
            out,
            ListenArgs {
                port: *port,
                count: *count,
                data: data.as_deref(),
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
        } => connect(
            dev,
            out,
            ConnectArgs {
                dest: *dest,
                port: *port,
                data: data.as_deref(),
                timeout: *timeout,
                hold: *hold,
                src_port: *src_port,
            },
        ),
        Cmd::ConnectDestroy { dest, port, settle } => {
            connect_destroy(dev, out, *dest, *port, *settle)
        }
        Cmd::Cmtime { .. } => match CmtimePlan::of(cmd).map_err(DeviceError::Invalid)? {
            CmtimePlan::Client {
                opts,
                rounds,
                pause,
            } => cmtime_client(dev, out, &opts, rounds, pause),
            CmtimePlan::Server(o) => cmtime_server(dev, out, &o),
        },
    }
}

/// What `cmtime`'s arguments ask for, whichever way the CM is reached.
pub(crate) enum CmtimePlan {
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
    pub(crate) fn of(cmd: &Cmd) -> Result<CmtimePlan, String> {
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

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// The user part of rdma_cm private data, as text (trailing NULs cut).
fn pd_text(pd: &[u8], has_cma_hdr: bool) -> String {
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

/// A REJ reason for people and for JSON: `timeout(4)`; `reason` keeps the variant name
/// (`Timeout`) that scripts match.
fn rej_json(reason: RejReason) -> Value {
    json!({
        "reason": format!("{reason:?}"),
        "reason_name": reason.name(),
        "reason_code": reason.code(),
    })
}

/// A failure as JSON fields: `failure` (its kind) and, for a REJ, its reason.
fn failure_json(f: Failure) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("failure".into(), json!(f.kind()));
    if let Some(Value::Object(r)) = f.rej_reason().map(rej_json) {
        m.extend(r);
    }
    m
}

/// `base` with `extra`'s fields added.
fn with(mut base: Value, extra: serde_json::Map<String, Value>) -> Value {
    if let Value::Object(m) = &mut base {
        m.extend(extra);
    }
    base
}

fn device_event(out: Out, e: &DeviceEvent) {
    out.emit(
        format!("device: {e}"),
        json!({"event": "device", "what": e.to_string()}),
    );
}

/// What `listen` was asked.
struct ListenArgs<'a> {
    port: u16,
    count: Option<u32>,
    data: Option<&'a str>,
    reject: bool,
    react_after: Duration,
}

fn listen<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    a: ListenArgs<'_>,
) -> Result<ExitCode, DeviceError> {
    let ListenArgs {
        port,
        count,
        data,
        reject,
        react_after,
    } = a;
    // Connections the peer ended, destroyed by the "application" at these instants.
    let mut late: std::collections::VecDeque<(std::time::Instant, CmId)> =
        std::collections::VecDeque::new();
    let sid = tcp_service_id(port);
    let mut lid = dev.listen(sid)?;
    let gid = dev.agent().config().gid;
    out.emit(
        format!("listening on {gid} port {port} (service id {sid:#018x})"),
        json!({"event": "listening", "gid": gid.to_string(), "port": port, "service_id": format!("{sid:#018x}")}),
    );
    let reply = data.unwrap_or("").as_bytes().to_vec();
    let mut done = 0u32;
    loop {
        while let Some(&(at, id)) = late.front() {
            if std::time::Instant::now() < at {
                break;
            }
            late.pop_front();
            dev.destroy(id)?;
            done += 1;
            out.emit(
                format!("{id}: destroyed {:.1} s after the peer disconnected", react_after.as_secs_f64()),
                json!({"event": "destroyed_late", "id": id.to_string(), "secs": react_after.as_secs_f64()}),
            );
        }
        if count.is_some_and(|c| done >= c) {
            dev.flush(Duration::from_secs(1))?;
            return Ok(ExitCode::SUCCESS);
        }
        let wait = late.front().map_or(Duration::from_secs(3600), |&(at, _)| {
            at.saturating_duration_since(std::time::Instant::now())
        });
        let Some(n) = dev.next_notice(wait)? else {
            continue;
        };
        match n {
            Notice::Device(e) => {
                device_event(out, &e);
                if e == DeviceEvent::Reset {
                    lid = dev.listen(sid)?;
                }
            }
            Notice::Cm(Event::ConnectRequest {
                id,
                listen_id,
                remote_gid,
                remote_qpn,
                private_data,
                ..
            }) if listen_id == lid => {
                let text = pd_text(&private_data, true);
                out.emit(
                    format!("{id}: request from {remote_gid} qpn {remote_qpn:#x} data {text:?}"),
                    json!({"event": "connect_request", "id": id.to_string(), "remote_gid": remote_gid.to_string(), "remote_qpn": remote_qpn, "data": text}),
                );
                // The peer may have withdrawn the request already (e.g. rdma_connect()
                // then rdma_destroy_id(): its REJ(TIMEOUT) arrived in the same batch);
                // its Rejected event follows, so answering late is not an error.
                let answered = if reject {
                    dev.reject(id, &reply)
                } else {
                    dev.accept(id, &reply)
                };
                match answered {
                    Ok(()) if reject => {
                        dev.destroy(id)?;
                        out.emit(
                            format!("{id}: rejected"),
                            json!({"event": "rejected_by_us", "id": id.to_string()}),
                        );
                    }
                    Ok(()) => {}
                    Err(CmError::InvalidState(state)) => out.emit(
                        format!("{id}: request withdrawn before we answered (state {state})"),
                        json!({"event": "withdrawn", "id": id.to_string(), "state": state.to_string()}),
                    ),
                    Err(e) => return Err(e.into()),
                }
            }
            Notice::Cm(Event::Established { id, remote_qpn, .. }) => out.emit(
                format!("{id}: established (remote qpn {remote_qpn:#x})"),
                json!({"event": "established", "id": id.to_string(), "remote_qpn": remote_qpn}),
            ),
            Notice::Cm(Event::Disconnected { id }) => {
                out.emit(
                    format!("{id}: disconnected"),
                    json!({"event": "disconnected", "id": id.to_string()}),
                );
                if react_after.is_zero() {
                    // The agent keeps the comm ID through TimeWait.
                    dev.destroy(id)?;
                    done += 1;
                } else {
                    late.push_back((std::time::Instant::now() + react_after, id));
                }
            }
            Notice::Cm(Event::Rejected { id, reason, .. }) => {
                dev.destroy(id)?;
                done += 1;
                out.emit(
                    format!("{id}: rejected by the peer: REJ reason {reason}"),
                    with(
                        json!({"event": "rejected", "id": id.to_string()}),
                        failure_json(Failure::Rejected(reason)),
                    ),
                );
            }
            Notice::Cm(Event::Unreachable { id }) => {
                dev.destroy(id)?;
                done += 1;
                out.emit(
                    format!("{id}: unreachable"),
                    json!({"event": "unreachable", "id": id.to_string()}),
                );
            }
            Notice::Cm(_) => {}
        }
    }
}

/// Waits for the first event about `id` that `pick` accepts, printing device events.
fn wait_for<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    id: CmId,
    timeout: Duration,
    mut pick: impl FnMut(&Event) -> bool,
) -> Result<Option<Event>, DeviceError> {
    let until = dev.now().after(timeout);
    loop {
        let left = until.since(dev.now());
        if left.is_zero() {
            return Ok(None);
        }
        match dev.next_notice(left)? {
            None => return Ok(None),
            Some(Notice::Device(e)) => {
                device_event(out, &e);
                if e == DeviceEvent::Reset {
                    return Ok(None);
                }
            }
            Some(Notice::Cm(ev)) if ev.id() == id && pick(&ev) => return Ok(Some(ev)),
            Some(Notice::Cm(_)) => {}
        }
    }
}

fn failed<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    id: CmId,
) -> Result<ExitCode, DeviceError> {
    // Destroying an unknown handle (after a reset) is fine to ignore.
    let _ = dev.destroy(id);
    dev.flush(Duration::from_secs(1))?;
    Ok(ExitCode::from(EXIT_CM_FAILED))
}

/// What `connect` was asked to do.
#[derive(Debug, Clone, Copy)]
struct ConnectArgs<'a> {
    dest: Gid,
    port: u16,
    data: Option<&'a str>,
    timeout: Duration,
    hold: Duration,
    src_port: Option<u16>,
}

/// The source port of an rdma_cm id: the bound one, else an ephemeral one as rdma_cm
/// picks (`cma_alloc_any_port()`).
fn source_port<T: Transport, C: Clock>(dev: &Device<T, C>, bound: Option<u16>) -> u16 {
    bound
        .or_else(|| EphemeralPorts::new(dev.options().seed ^ u64::from(std::process::id())).alloc())
        .unwrap_or(0)
}

fn connect<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    a: ConnectArgs<'_>,
) -> Result<ExitCode, DeviceError> {
    let ConnectArgs {
        dest,
        port,
        data,
        timeout,
        hold,
        src_port,
    } = a;
    let local = dev.agent().config().gid;
    let sport = source_port(dev, src_port);
    let pd = req_private_data(
        &CmaHdr::from_gids(local, dest, sport),
        data.unwrap_or("").as_bytes(),
    )
    .map_err(|e| DeviceError::Invalid(format!("private data: {e}")))?;
    let t0 = dev.now();
    let id = dev.connect(dest, tcp_service_id(port), &pd, &ConnectOptions::default())?;
    let first = wait_for(dev, out, id, timeout, |e| {
        matches!(
            e,
            Event::Established { .. } | Event::Rejected { .. } | Event::Unreachable { .. }
        )
    })?;
    let took = ms(dev.now().since(t0));
    if let Some(f) = Failure::of_attempt(first.as_ref()) {
        let text = match f {
            Failure::Rejected(r) => {
                format!("{id}: failed: rejected by {dest}: REJ reason {r} after {took} ms")
            }
            Failure::Unreachable => {
                format!("{id}: failed: {dest} unreachable (no answer to any retry) after {took} ms")
            }
            _ => format!(
                "{id}: failed: timeout: no answer within {timeout:?}; destroying (REJ timeout)"
            ),
        };
        // The event names scripts know: rejected / unreachable / timeout.
        let event = f.kind();
        out.emit(
            text,
            with(
                json!({"event": event, "id": id.to_string(), "dest": dest.to_string(), "port": port, "ms": took}),
                failure_json(f),
            ),
        );
        return failed(dev, id);
    }
    if let Some(Event::Established {
        remote_qpn,
        private_data,
        ..
    }) = first
    {
        let text = pd_text(&private_data, false);
        out.emit(
            format!("{id}: established to {dest} port {port} from port {sport} in {took} ms (remote qpn {remote_qpn:#x}, data {text:?})"),
            json!({"event": "established", "id": id.to_string(), "dest": dest.to_string(), "port": port, "src_port": sport, "ms": took, "remote_qpn": remote_qpn, "data": text}),
        );
    }
    // Hold, watching for the peer's DREQ.
    let peer_left = wait_for(dev, out, id, hold, |e| {
        matches!(e, Event::Disconnected { .. })
    })?
    .is_some();
    let t1 = dev.now();
    dev.disconnect(id)?;
    let mut code = ExitCode::SUCCESS;
    if peer_left {
        out.emit(
            format!("{id}: disconnected by the peer"),
            json!({"event": "disconnected", "by": "peer", "id": id.to_string()}),
        );
    } else {
        let got = wait_for(dev, out, id, timeout, |e| {
            matches!(e, Event::Disconnected { .. })
        })?;
        let took = ms(dev.now().since(t1));
        if got.is_some() {
            out.emit(
                format!("{id}: disconnected in {took} ms"),
                json!({"event": "disconnected", "by": "us", "id": id.to_string(), "ms": took, "drep": true}),
            );
        } else {
            // A teardown that timed out is a failure too.
            out.emit(
                format!("{id}: failed: disconnect_timeout: no DREP within {timeout:?}"),
                with(
                    json!({"event": "disconnected", "by": "us", "id": id.to_string(), "ms": took, "drep": false}),
                    failure_json(Failure::DisconnectTimeout),
                ),
            );
            code = ExitCode::from(EXIT_CM_FAILED);
        }
    }
    dev.destroy(id)?;
    dev.flush(Duration::from_secs(1))?;
    out.emit(
        format!("{id}: destroyed"),
        json!({"event": "destroyed", "id": id.to_string()}),
    );
    Ok(code)
}

fn connect_destroy<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    dest: Gid,
    port: u16,
    settle: Duration,
) -> Result<ExitCode, DeviceError> {
    let local = dev.agent().config().gid;
    let sport = source_port(dev, None);
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
            device_event(out, &e);
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

fn cmtime_client<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    o: &ClientOptions,
    rounds: u32,
    pause: Duration,
) -> Result<ExitCode, DeviceError> {
    let mut ok = true;
    for round in 1..=rounds {
        if rounds > 1 {
            if round > 1 {
                dev.run_until(pause, |_| false)?;
            }
            out.emit(
                format!("round {round} of {rounds}"),
                json!({"event": "round", "round": round, "rounds": rounds}),
            );
        }
        ok &= cmtime_client_round(dev, out, o)?;
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CM_FAILED)
    })
}

/// One client burst: runs it and prints its report, CPU and device work; true if every
/// connection was established and torn down.
fn cmtime_client_round<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    o: &ClientOptions,
) -> Result<bool, DeviceError> {
    let (cpu0, work0) = (ProcessCpu::now(), *dev.stats());
    let r = cmtime::client(dev, o)?;
    let cpu = ProcessCpu::now().since(cpu0);
    out.emit(&r, cmtime_report_json(&r));
    cpu.emit(out);
    emit_device_work(dev, out, &work0);
    Ok(r.success())
}

/// A client run's report as JSON (text: its `Display`).
fn cmtime_report_json(r: &cmtime::CmtimeReport) -> Value {
    let mut steps = serde_json::Map::new();
    for s in Step::ALL {
        let t = r.step(s);
        steps.insert(
            s.name().into(),
            json!({
                "total_ms": ms(t.total),
                "avg_us": t.avg().as_secs_f64() * 1e6,
                "min_us": t.min_or_zero().as_secs_f64() * 1e6,
                "max_us": t.max.as_secs_f64() * 1e6,
                "count": t.count,
            }),
        );
    }
    let failures: Vec<Value> = r
        .failures
        .iter()
        .map(|(f, n)| with(json!({"count": n}), failure_json(*f)))
        .collect();
    json!({
        "connections": r.connections, "established": r.established,
        "failed": r.failed, "disconnected": r.disconnected, "failures": failures,
        "steps": steps, "pacing": pacing_json(&r.pacing),
    })
}

fn cmtime_server<T: Transport, C: Clock>(
    dev: &mut Device<T, C>,
    out: Out,
    o: &ServerOptions,
) -> Result<ExitCode, DeviceError> {
    let gid = dev.agent().config().gid;
    out.emit(
        format!("cmtime server on {gid} port {} for {} connections", o.port, o.connections),
        json!({"event": "listening", "gid": gid.to_string(), "port": o.port, "connections": o.connections}),
    );
    let cpu0 = ProcessCpu::now();
    let r = cmtime::server(dev, o)?;
    let cpu = ProcessCpu::now().since(cpu0);
    out.emit(r, server_report_json(&r));
    cpu.emit(out);
    emit_device_work(dev, out, &DeviceStats::default());
    Ok(if r.disconnected >= o.connections {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CM_FAILED)
    })
}

/// A server run's report as JSON (text: its `Display`).
fn server_report_json(r: &cmtime::ServerReport) -> Value {
    json!({
        "accepted": r.accepted, "established": r.established,
        "disconnected": r.disconnected, "failed": r.failed, "resets": r.resets,
    })
}

/// This process's CPU time (getrusage), so a run can report what it cost the guest: in
/// a TCG VM, user time is the agent's own work and system time the guest kernel's (the
/// poll's sleeps, page faults).
#[derive(Debug, Clone, Copy, Default)]
struct ProcessCpu {
    user: Duration,
    system: Duration,
}

/// How the device's queues were worked, for a benchmark's report: messages per
/// notification and per sleep are what a VM pays for in exits and interrupts.
fn emit_device_work<T: Transport, C: Clock>(dev: &Device<T, C>, out: Out, since: &DeviceStats) {
    let (now, b) = (dev.stats(), since);
    let rx_msgs = now.rx_msgs - b.rx_msgs;
    let tx_mads = now.tx_mads - b.tx_mads;
    let tx_batches = now.tx_batches - b.tx_batches;
    let tx_kicks = now.tx_kicks - b.tx_kicks;
    let rx_kicks = now.rx_kicks - b.rx_kicks;
    let waits = now.waits - b.waits;
    out.emit(
        format!(
            "device rx {rx_msgs} tx {tx_mads} in {tx_batches} batches, kicks tx {tx_kicks} rx {rx_kicks}, waits {waits}"
        ),
        json!({"event": "device", "rx_msgs": rx_msgs, "tx_mads": tx_mads,
            "tx_batches": tx_batches, "tx_kicks": tx_kicks, "rx_kicks": rx_kicks,
            "waits": waits}),
    );
}

impl ProcessCpu {
    fn now() -> ProcessCpu {
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

    fn since(self, earlier: ProcessCpu) -> ProcessCpu {
        ProcessCpu {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }

    fn emit(self, out: Out) {
        let (text, v) = self.report();
        out.emit(text, v);
    }

    /// The report line: text and JSON.
    fn report(self) -> (String, Value) {
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
