//! `pvcm-guest`'s commands through `pvcm-guestd`: when the service owns the pvcm device,
//! `listen`, `connect`, `connect-destroy` and `cmtime` run as an rdma_cm application of
//! the service's device node (`/dev/infiniband/rdma_cm`, [`RdmaCm`] over
//! [`DeviceFile`]), with the output (text and `--json`) and exit statuses they have on
//! the device; `info` prints the service's `stat` and its pvcm port.
//!
//! Which way (`--via`): `device` drives the pvcm device itself; `service` goes through
//! pvcm-guestd; `auto` (the default) takes the service when its control socket
//! (`--control`, default `/run/pvcm-guestd.sock`) answers, else the device. `device`
//! is refused while the service answers: opening the device resets it, which would
//! end the service's connections.
//!
//! What differs from the device path, and why:
//! - ids print as `rdma_cm#N`, the rdma_cm id numbers, instead of the agent's `cm#S.G`;
//! - the commands have no QP: their QPNs are simulated, taken from the pvcm port's QPN
//!   range that the service reports (`stat`'s `pvcm.qpn_base`, `pvcm.qpn_count`), as
//!   the device path takes them from PORT_INFO's, so the backend admits them. The pool
//!   starts at a point of the range chosen by the seed, so processes running at the
//!   same time (and the VM's real QPs, which the same range holds) rarely meet;
//! - `connect-destroy`'s counters are the service agent's counters over the command
//!   (MADs of other processes at the same time count too);
//! - `cmtime`'s `connect` step times the rdma_cm calls that set a connection up
//!   (CREATE_ID, RESOLVE_IP, RESOLVE_ROUTE, CONNECT), `establish` runs from CONNECT to
//!   the RTU (CONNECT_RESPONSE answered); the pacing is the service agent's; the work
//!   line is the service's (`event: "service"`) instead of the device's;
//! - a request the peer withdrew before `listen` answered it (ACCEPT refused with
//!   EINVAL) is destroyed and counted at once: its REJECTED event is never reported,
//!   as the kernel drops the events of a new id before ACCEPT gives it a context;
//! - `--linux-drep`, `--max-window` and `--initial-window` configure the agent on the
//!   pvcm device, which the service owns: they are refused (exit status 2).
//!
//! `cmtime` keeps every connection in flight at once: one file, one event loop over
//! non-blocking GET_EVENTs, each connection moved on by its own events
//! (ADDR_RESOLVED -> RESOLVE_ROUTE, ROUTE_RESOLVED -> CONNECT, CONNECT_RESPONSE -> RTU),
//! as rdma-core's cmtime keeps them in flight with its event thread.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Read as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pvcm_wire::Gid;
use pvcm_wire::mad::AttributeId;
use serde_json::{Value, json};

use super::route::{Answer, Attempt, ConnectArgs, Connected, Route, RouteEvent};
pub use super::{Captured, Report};
use super::{Cli, Cmd, Out, pd_text, run_on};
use crate::cm::{
    Group, PacingCounters, RDMA_MAX_INIT_DEPTH, RDMA_MAX_RESP_RES, RejReason, SplitMix64,
};
use crate::device::cmtime::{
    ClientOptions, CmtimeReport, Failure, ServerOptions, ServerReport, Step, StepTimes,
};
use crate::device::random_seed;
use crate::service::abi::{ConnParam, EventParam, EventResp, event, ps};
use crate::service::client::{Channel, ClientStats, CmdError, DeviceFile, RdmaCm};
use crate::service::cma::{gid_sockaddr, sockaddr_gid};
use crate::time::{Clock, SystemClock, Time};

/// The rdma_cm device node pvcm-guestd serves.
pub const DEFAULT_RDMA_CM: &str = "/dev/infiniband/rdma_cm";

/// How long address resolution may take (librdmacm's programs' usual 2000 ms).
const RESOLVE_MS: u32 = 2000;

/// The event loop reads the events that came in after every this many calls.
const DRAIN_EVERY: usize = 16;

/// Which way `pvcm-guest`'s commands go (`--via`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Via {
    /// Through pvcm-guestd when its control socket answers, else the pvcm device.
    Auto,
    /// Through pvcm-guestd's rdma_cm device.
    Service,
    /// The pvcm device itself (refused while pvcm-guestd answers: opening the device
    /// resets it).
    Device,
}

/// Why a command through the service could not run (exit status 1).
#[derive(Debug, thiserror::Error)]
pub enum ViaError {
    /// The control socket could not be reached.
    #[error("pvcm-guestd's control socket {}: {source}", path.display())]
    Control {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The control socket answered something else than the service's `stat`.
    #[error("pvcm-guestd's control socket {}: {what}", path.display())]
    ControlAnswer {
        /// The socket.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
    /// The rdma_cm node could not be opened.
    #[error("opening {}: {source}", path.display())]
    Open {
        /// The node.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A command on the node failed.
    #[error("{0}")]
    Cmd(#[from] CmdError),
    /// Something else the service reported that this client cannot use.
    #[error("{0}")]
    Service(String),
}

impl ViaError {
    /// What to do about it, when there is something to say.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            ViaError::Control { .. } | ViaError::ControlAnswer { .. } => Some(
                "is pvcm-guestd running (pvcm-guestd stat)? --control names its socket; \
                 --via device drives the pvcm device itself when the service is stopped",
            ),
            ViaError::Open { source, .. } => match source.raw_os_error() {
                Some(libc::ENOENT) => Some(
                    "pvcm-guestd answers but its node is missing: --rdma-cm names it \
                     (pvcm-guestd --devname)",
                ),
                Some(libc::EACCES) | Some(libc::EPERM) => {
                    Some("the node's mode (pvcm-guestd --mode) does not let this user open it")
                }
                _ => None,
            },
            ViaError::Cmd(e) => match e.errno() {
                Some(libc::EFAULT) => Some(
                    "pvcm-guestd could not write this process's memory: it needs root or \
                     CAP_SYS_PTRACE",
                ),
                Some(libc::ENOMEM) => {
                    Some("the service's connection quota (the pvcm port's max_entries) is full")
                }
                _ => None,
            },
            ViaError::Service(_) => None,
        }
    }
}

/// Prints an error as `pvcm-guest` does (stderr; a JSON object with `--json`); exit
/// status 1.
pub fn report_error(prog: &str, e: &ViaError, out: Out) -> ExitCode {
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

// ------------------------------------------------------------------ the service's stat

/// The service's `stat`, asked for on its control socket.
pub trait Control {
    /// The stat JSON.
    fn stat(&mut self) -> Result<Value, ViaError>;
    /// Where it comes from, for people.
    fn describe(&self) -> String;
}

/// pvcm-guestd's control socket: it answers every connection with one JSON line.
#[derive(Debug, Clone)]
pub struct ControlSocket {
    path: PathBuf,
}

impl ControlSocket {
    /// The socket at `path`.
    pub fn new(path: &Path) -> ControlSocket {
        ControlSocket {
            path: path.to_path_buf(),
        }
    }

    fn answer_err(&self, what: impl Into<String>) -> ViaError {
        ViaError::ControlAnswer {
            path: self.path.clone(),
            what: what.into(),
        }
    }
}

/// The longest stat line read.
const MAX_STAT: u64 = 1 << 20;

impl Control for ControlSocket {
    fn stat(&mut self) -> Result<Value, ViaError> {
        let s = UnixStream::connect(&self.path).map_err(|source| ViaError::Control {
            path: self.path.clone(),
            source,
        })?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|source| ViaError::Control {
                path: self.path.clone(),
                source,
            })?;
        let mut line = String::new();
        BufReader::new(s.take(MAX_STAT))
            .read_line(&mut line)
            .map_err(|e| self.answer_err(format!("no answer: {e}")))?;
        if line.trim().is_empty() {
            return Err(self.answer_err("closed without answering"));
        }
        let v: Value = serde_json::from_str(&line)
            .map_err(|e| self.answer_err(format!("not the service's stat: {e}")))?;
        if !v.is_object() {
            return Err(self.answer_err("not the service's stat: not a JSON object"));
        }
        Ok(v)
    }

    fn describe(&self) -> String {
        format!("control {}", self.path.display())
    }
}

/// What the commands need of the service: its pvcm port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceView {
    /// The pvcm port's GID (the VM's address).
    pub gid: Gid,
    /// First QPN of the port's range.
    pub qpn_base: u32,
    /// QPNs in the range (0: the device checks none).
    pub qpn_count: u32,
}

fn u32_field(v: &Value, key: &str) -> Result<u32, ViaError> {
    v.get(key)
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| ViaError::Service(format!("pvcm-guestd's stat has no pvcm.{key}")))
}

impl ServiceView {
    /// Reads the pvcm port out of a stat.
    pub fn from_stat(stat: &Value) -> Result<ServiceView, ViaError> {
        let p = stat.get("pvcm").ok_or_else(|| {
            ViaError::Service(
                "pvcm-guestd's stat does not report its pvcm port (pvcm): a service older \
                 than this pvcm-guest"
                    .into(),
            )
        })?;
        let gid = p
            .get("gid")
            .and_then(Value::as_str)
            .and_then(|g| g.parse::<Gid>().ok())
            .ok_or_else(|| ViaError::Service("pvcm-guestd's stat has no pvcm.gid".into()))?;
        Ok(ServiceView {
            gid,
            qpn_base: u32_field(p, "qpn_base")?,
            qpn_count: u32_field(p, "qpn_count")?,
        })
    }
}

/// A number at a path of a JSON value (0 when absent).
fn num(v: &Value, path: &[&str]) -> u64 {
    path.iter()
        .try_fold(v, |v, k| v.get(k))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// The pacing counters a stat reports.
fn pacing_of(stat: &Value) -> PacingCounters {
    let p = |k: &str| num(stat, &["pacing", k]);
    PacingCounters {
        outstanding: p("outstanding"),
        queued: p("queued"),
        destinations: p("destinations"),
        sent: p("sent"),
        waited: p("waited"),
        answered: p("answered"),
        cancelled: p("cancelled"),
        decreases: p("decreases"),
        opened: p("opened"),
        max_outstanding: p("max_outstanding"),
        max_queued: p("max_queued"),
        max_window: p("max_window"),
        min_window: p("min_window"),
    }
}

/// The counter table of `after` less `before` (same shape: `{group: {message: n}}`).
fn counters_delta(before: &Value, after: &Value) -> Value {
    let mut groups = serde_json::Map::new();
    if let Some(g) = after.get("counters").and_then(Value::as_object) {
        for (gname, msgs) in g {
            let mut m = serde_json::Map::new();
            if let Some(msgs) = msgs.as_object() {
                for (a, n) in msgs {
                    let was = num(before, &["counters", gname, a]);
                    m.insert(
                        a.clone(),
                        json!(n.as_u64().unwrap_or(0).saturating_sub(was)),
                    );
                }
            }
            groups.insert(gname.clone(), Value::Object(m));
        }
    }
    Value::Object(groups)
}

// ------------------------------------------------------------------ QPNs

/// Simulated QPNs from the port's range, handed out round robin from a starting point,
/// each at most once at a time (QPNs 0 and 1 are never given).
#[derive(Debug, Clone)]
pub struct SimQpns {
    base: u32,
    count: u32,
    next: u32,
    used: HashSet<u32>,
}

impl SimQpns {
    /// The range `[base, base + count)` (clamped to 24-bit QPNs; `count` 0: every QPN
    /// from `base`), starting `start` into it.
    pub fn new(base: u32, count: u32, start: u32) -> SimQpns {
        let base = base & 0x00FF_FFFF;
        let room = 0x0100_0000 - base;
        let count = if count == 0 { room } else { count.min(room) };
        SimQpns {
            base,
            count,
            next: start.checked_rem(count).unwrap_or(0),
            used: HashSet::new(),
        }
    }

    /// A free QPN, or `None` when the whole range is in use.
    pub fn alloc(&mut self) -> Option<u32> {
        for _ in 0..self.count.min(self.used.len() as u32 + 3) {
            let q = self.base + self.next;
            self.next = (self.next + 1) % self.count;
            if q > 1 && self.used.insert(q) {
                return Some(q);
            }
        }
        None
    }

    /// Gives a QPN back.
    pub fn release(&mut self, q: u32) {
        self.used.remove(&q);
    }

    /// Whether `q` lies in the range.
    pub fn owns(&self, q: u32) -> bool {
        q >= self.base && q - self.base < self.count
    }
}

// ------------------------------------------------------------------ choosing the way

/// `pvcm-guest` before the device path: `None` to drive the device; else the exit
/// status of the command run through pvcm-guestd (or of failing to).
pub(super) fn divert(cli: &Cli, out: Out) -> Option<ExitCode> {
    let mut control = ControlSocket::new(&cli.control);
    let stat = match cli.via {
        // Opening the device resets it: never under a running service.
        Via::Device => match control.stat() {
            Ok(_) => {
                let e = ViaError::Service(format!(
                    "pvcm-guestd owns the pvcm device (its control socket {} answers): \
                     driving the device too would reset it under the service; stop \
                     pvcm-guestd first, or leave --via to auto",
                    cli.control.display()
                ));
                return Some(report_error("pvcm-guest", &e, out));
            }
            Err(_) => return None,
        },
        Via::Auto => match control.stat() {
            Ok(v) => v,
            Err(ViaError::Control { source, .. })
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                return None;
            }
            Err(e) => return Some(report_error("pvcm-guest", &e, out)),
        },
        Via::Service => match control.stat() {
            Ok(v) => v,
            Err(e) => return Some(report_error("pvcm-guest", &e, out)),
        },
    };
    let device_only = [
        (cli.linux_drep, "--linux-drep"),
        (cli.max_window.is_some(), "--max-window"),
        (cli.initial_window.is_some(), "--initial-window"),
    ];
    if let Some((_, opt)) = device_only.iter().find(|(set, _)| *set) {
        eprintln!(
            "pvcm-guest: error: {opt} configures the CM agent on the pvcm device, which \
             pvcm-guestd owns (its control socket {} answers): it cannot apply through \
             the service; stop pvcm-guestd and use --via device",
            cli.control.display()
        );
        return Some(ExitCode::from(2));
    }
    Some(
        run_on_node(cli, &stat, &mut control, out)
            .unwrap_or_else(|e| report_error("pvcm-guest", &e, out)),
    )
}

/// Runs the command line's command through the service's node.
fn run_on_node(
    cli: &Cli,
    stat: &Value,
    control: &mut ControlSocket,
    out: Out,
) -> Result<ExitCode, ViaError> {
    let mut rep = out;
    if matches!(cli.cmd, Cmd::Info) {
        return info(stat, control, &cli.rdma_cm, &mut rep);
    }
    let file = DeviceFile::open(&cli.rdma_cm).map_err(|source| ViaError::Open {
        path: cli.rdma_cm.clone(),
        source,
    })?;
    let mut cm = RdmaCm::new(file);
    let seed = cli.dev.seed.unwrap_or_else(random_seed) ^ u64::from(std::process::id());
    run_command(&mut cm, control, stat, &cli.cmd, seed, &mut rep)
}

/// Runs one command through the rdma_cm device `cm` of the service whose stat is
/// `stat` (read from `control`); its exit status, as `pvcm-guest` returns it.
pub fn run_command<C: Channel>(
    cm: &mut RdmaCm<C>,
    control: &mut dyn Control,
    stat: &Value,
    cmd: &Cmd,
    seed: u64,
    rep: &mut dyn Report,
) -> Result<ExitCode, ViaError> {
    let view = ServiceView::from_stat(stat)?;
    let mut rng = SplitMix64::new(seed);
    if matches!(cmd, Cmd::Info) {
        return info(stat, control, Path::new(DEFAULT_RDMA_CM), rep);
    }
    let mut s = Session {
        cm,
        control,
        view,
        qpns: SimQpns::new(view.qpn_base, view.qpn_count, rng.next_u32()),
        next_uid: 1,
        clock: SystemClock::new(),
        requests: HashMap::new(),
        conns: HashMap::new(),
        last_stat: None,
    };
    match cmd {
        Cmd::ConnectDestroy { dest, port, settle } => s.connect_destroy(rep, *dest, *port, *settle),
        _ => run_on(&mut s, cmd, rep, ViaError::Service),
    }
}

// ------------------------------------------------------------------ info

/// `info` through the service: the pvcm port as the service reports it (the lines of
/// the device path's `info` that the service knows), then its `stat`.
pub fn info(
    stat: &Value,
    control: &mut dyn Control,
    rdma_cm: &Path,
    rep: &mut dyn Report,
) -> Result<ExitCode, ViaError> {
    let view = ServiceView::from_stat(stat)?;
    let p = &stat["pvcm"];
    let port = &stat["port"];
    let mtu_code = num(p, &["active_mtu"]);
    let mtu = if (1..=5).contains(&mtu_code) {
        128u64 << mtu_code
    } else {
        1024
    };
    let mut text = format!(
        "device      pvcm-guestd ({}, rdma_cm {})\nname        {}\nabi         {}\n\
         port        {}\ngid         {}\nca_guid     {}\nlid         {:#06x}\n\
         pkey        {:#06x}\nqpns        {:#x}..{:#x} ({})\nquota       {} connections\n\
         mtu         {} (code {})\nack_delay   {}\n\
         rdma port   {} port {} GID index {} ({}, path MTU code {})\n",
        control.describe(),
        rdma_cm.display(),
        p["name"].as_str().unwrap_or(""),
        num(p, &["abi_version"]),
        if p["port_up"].as_bool().unwrap_or(false) {
            "up"
        } else {
            "down"
        },
        view.gid,
        p["ca_guid"].as_str().unwrap_or(""),
        num(p, &["lid"]),
        num(p, &["pkey"]),
        view.qpn_base,
        u64::from(view.qpn_base) + u64::from(view.qpn_count),
        view.qpn_count,
        num(p, &["max_entries"]),
        mtu,
        mtu_code,
        num(p, &["ca_ack_delay"]),
        port["device"].as_str().unwrap_or("?"),
        num(port, &["port"]),
        num(port, &["gid_index"]),
        port["netdev"].as_str().unwrap_or("?"),
        num(port, &["path_mtu"]),
    );
    if let Some(m) = stat.as_object() {
        for (k, v) in m {
            if !matches!(k.as_str(), "pvcm" | "port" | "counters") {
                text.push_str(&format!("{k:<18} {v}\n"));
            }
        }
    }
    text.push_str(&counters_text(stat));
    let mut v = json!({
        "device": "pvcm-guestd",
        "via": "service",
        "control": control.describe(),
        "rdma_cm": rdma_cm.display().to_string(),
        "counters": stat["counters"],
        "pacing": stat["pacing"],
        "service": stat,
    });
    if let (Value::Object(m), Some(pm)) = (&mut v, p.as_object()) {
        for (k, x) in pm {
            m.insert(k.clone(), x.clone());
        }
    }
    rep.line(text.trim_end().to_string(), v);
    Ok(ExitCode::SUCCESS)
}

/// The non-zero CM counters of a stat, one line per group.
fn counters_text(stat: &Value) -> String {
    let mut s = String::new();
    if let Some(g) = stat["counters"].as_object() {
        for (gname, msgs) in g {
            let nz: Vec<String> = msgs
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(a, n)| n.as_u64().filter(|n| *n > 0).map(|n| format!("{a} {n}")))
                .collect();
            if !nz.is_empty() {
                s.push_str(&format!("{gname:<18} {}\n", nz.join(", ")));
            }
        }
    }
    s
}

// ------------------------------------------------------------------ the commands

/// The instant `d` from now; a century when `d` is longer (any number of seconds is a
/// valid `--timeout`).
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86400)))
        .unwrap_or(now)
}

/// An id as the lines name it.
fn id_name(id: u32) -> String {
    format!("rdma_cm#{id}")
}

/// The unspecified address of `g`'s family.
fn wildcard(g: Gid, port: u16) -> SocketAddr {
    let ip = if g.to_ipv4().is_some() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    SocketAddr::new(ip, port)
}

/// A REJECTED event's reason (its status is the REJ's reason code).
fn rej_reason(status: i32) -> Result<RejReason, ViaError> {
    u16::try_from(status)
        .ok()
        .and_then(RejReason::from_code)
        .ok_or_else(|| {
            ViaError::Service(format!(
                "pvcm-guestd reported REJECTED with status {status}, which is no REJ reason"
            ))
        })
}

/// The failure an event that ends a connection attempt means (`Ok(None)`: it does not
/// end one).
fn attempt_failure(e: &EventResp) -> Result<Option<Failure>, ViaError> {
    Ok(match e.event {
        event::REJECTED => Some(Failure::Rejected(rej_reason(e.status)?)),
        event::UNREACHABLE | event::CONNECT_ERROR | event::ADDR_ERROR | event::ROUTE_ERROR => {
            Some(Failure::Unreachable)
        }
        _ => None,
    })
}

/// The connection parameters of a connect or accept without a QP: a simulated QPN,
/// librdmacm's defaults (the device's maximum RDMA reads, 7 retries).
fn params(qpn: u32, private_data: &[u8]) -> ConnParam {
    ConnParam {
        qp_num: qpn,
        qkey: 0,
        private_data: private_data.to_vec(),
        srq: false,
        responder_resources: RDMA_MAX_RESP_RES,
        initiator_depth: RDMA_MAX_INIT_DEPTH,
        flow_control: false,
        retry_count: 7,
        rnr_retry_count: 7,
        valid: true,
    }
}

fn conn_of(e: &EventResp) -> ConnParam {
    match &e.param {
        EventParam::Conn(c) => c.clone(),
        EventParam::Ud(_) | EventParam::Arg(_) => ConnParam::empty(),
    }
}

/// The service route: one command's use of the service's rdma_cm device, its control
/// socket, the port's QPNs.
struct Session<'a, C: Channel> {
    cm: &'a mut RdmaCm<C>,
    control: &'a mut dyn Control,
    view: ServiceView,
    qpns: SimQpns,
    next_uid: u64,
    /// The clock of [`Route::now`].
    clock: SystemClock,
    /// Connection requests not answered yet: the peer's QPN.
    requests: HashMap<u32, u32>,
    /// Accepted connections: their QPN and the peer's.
    conns: HashMap<u32, (u32, u32)>,
    /// The stat read at the end of the last cmtime run, for its work line.
    last_stat: Option<Value>,
}

impl<C: Channel> Session<'_, C> {
    fn uid(&mut self) -> u64 {
        let u = self.next_uid;
        self.next_uid += 1;
        u
    }

    fn qpn(&mut self) -> Result<u32, ViaError> {
        self.qpns.alloc().ok_or_else(|| {
            ViaError::Service(format!(
                "every QPN of the port's range {:#x} + {} is in use",
                self.view.qpn_base, self.view.qpn_count
            ))
        })
    }

    /// Waits for the first event of `id` that `pick` accepts (others are dropped:
    /// `connect` has one id).
    fn wait_for(
        &mut self,
        id: u32,
        timeout: Duration,
        pick: impl Fn(&EventResp) -> bool,
    ) -> Result<Option<EventResp>, ViaError> {
        let until = after(timeout);
        while let Some(e) = self.cm.next_event(until)? {
            if e.id == id && pick(&e) {
                return Ok(Some(e));
            }
        }
        Ok(None)
    }

    /// The event that ends `id`'s attempt (`pick`s it), or why the attempt failed:
    /// the event's failure, or a timeout.
    fn attempt(
        &mut self,
        id: u32,
        timeout: Duration,
        pick: impl Fn(&EventResp) -> bool,
    ) -> Result<Result<EventResp, Failure>, ViaError> {
        Ok(match self.wait_for(id, timeout, pick)? {
            None => Err(Failure::Timeout),
            Some(e) => match attempt_failure(&e)? {
                Some(f) => Err(f),
                None => Ok(e),
            },
        })
    }

    /// Resolves `id`'s address and route to `dst`: `Ok(Err(failure))` when either
    /// fails or does not come within `timeout`.
    fn resolve(
        &mut self,
        id: u32,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<Result<(), Failure>, ViaError> {
        if let Err(e) = self.cm.resolve_ip(id, src, dst, RESOLVE_MS) {
            // No route: the command itself fails, as the kernel's does.
            return match e.errno() {
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH) => Ok(Err(Failure::Unreachable)),
                _ => Err(e.into()),
            };
        }
        let e = self.wait_for(id, timeout, |e| {
            matches!(e.event, event::ADDR_RESOLVED | event::ADDR_ERROR)
        })?;
        match e {
            Some(e) if e.event == event::ADDR_RESOLVED => {}
            Some(_) => return Ok(Err(Failure::Unreachable)),
            None => return Ok(Err(Failure::Timeout)),
        }
        self.cm.resolve_route(id, RESOLVE_MS)?;
        let e = self.wait_for(id, timeout, |e| {
            matches!(e.event, event::ROUTE_RESOLVED | event::ROUTE_ERROR)
        })?;
        Ok(match e {
            Some(e) if e.event == event::ROUTE_RESOLVED => Ok(()),
            Some(_) => Err(Failure::Unreachable),
            None => Err(Failure::Timeout),
        })
    }

    /// `connect-destroy` through the service: connects, destroys at once, and reports
    /// what the service's agent counted meanwhile.
    fn connect_destroy(
        &mut self,
        rep: &mut dyn Report,
        dest: Gid,
        port: u16,
        settle: Duration,
    ) -> Result<ExitCode, ViaError> {
        let uid = self.uid();
        let id = self.cm.create_id(uid, ps::TCP)?;
        if let Err(f) = self.resolve(id, None, gid_sockaddr(dest, port), Duration::from_secs(10))? {
            let _ = self.cm.destroy_id(id);
            return Err(ViaError::Service(format!(
                "resolving {dest} through pvcm-guestd failed: {f}"
            )));
        }
        let before = self.control.stat()?;
        let qpn = self.qpn()?;
        self.cm.connect(id, &params(qpn, &[]))?;
        self.cm.destroy_id(id)?;
        // Watch what the peer does with it (its REP is answered by the service's agent).
        std::thread::sleep(settle);
        let after = self.control.stat()?;
        let counters = counters_delta(&before, &after);
        let get = |g: Group, a: AttributeId| num(&counters, &[g.name(), a.name()]);
        let send_errors = num(&after, &["device", "send_errors"])
            .saturating_sub(num(&before, &["device", "send_errors"]));
        rep.line(
            format!(
                "{}: connect + destroy to {dest} port {port}: sent REQ {} REJ {}; received REP {} REJ {} MRA {}; send errors {send_errors}",
                id_name(id),
                get(Group::TxMsgs, AttributeId::Req),
                get(Group::TxMsgs, AttributeId::Rej),
                get(Group::RxMsgs, AttributeId::Rep),
                get(Group::RxMsgs, AttributeId::Rej),
                get(Group::RxMsgs, AttributeId::Mra),
            ),
            json!({
                "event": "connect_destroy", "id": id_name(id), "dest": dest.to_string(), "port": port,
                "counters": counters, "send_errors": send_errors,
            }),
        );
        Ok(ExitCode::SUCCESS)
    }

    /// A connection attempt from resolving to the RTU: the event that established it,
    /// or why it failed.
    fn attempt_connect(
        &mut self,
        id: u32,
        a: &ConnectArgs<'_>,
    ) -> Result<Result<EventResp, Failure>, ViaError> {
        let src = a.src_port.map(|p| wildcard(self.view.gid, p));
        let ending = |e: &EventResp| {
            matches!(
                e.event,
                event::CONNECT_RESPONSE
                    | event::ESTABLISHED
                    | event::REJECTED
                    | event::UNREACHABLE
                    | event::CONNECT_ERROR
            )
        };
        let outcome = match self.resolve(id, src, gid_sockaddr(a.dest, a.port), a.timeout)? {
            Err(f) => Err(f),
            Ok(()) => {
                let qpn = self.qpn()?;
                self.cm.connect(id, &params(qpn, a.data.as_bytes()))?;
                self.attempt(id, a.timeout, ending)?
            }
        };
        Ok(match outcome {
            Ok(e) if e.event == event::CONNECT_RESPONSE => match self.cm.complete(id) {
                // The RTU: the connection is established.
                Ok(()) => Ok(e),
                // The peer ended it first: what it sent (its REJ) follows.
                Err(err) if err.errno() == Some(libc::EINVAL) => {
                    self.attempt(id, a.timeout, |e| {
                        ending(e) && e.event != event::CONNECT_RESPONSE
                    })?
                }
                Err(err) => return Err(err.into()),
            },
            o => o,
        })
    }

    /// An answer to a connection request: a request the peer withdrew first (EINVAL)
    /// is over, its REJECTED never reported to an id ACCEPT did not take.
    fn answered(r: Result<(), CmdError>) -> Result<Answer, ViaError> {
        match r {
            Ok(()) => Ok(Answer::Sent),
            Err(err) if err.errno() == Some(libc::EINVAL) => Ok(Answer::Withdrawn {
                why: err.to_string(),
                state: "withdrawn".into(),
                ended: true,
            }),
            Err(err) => Err(err.into()),
        }
    }

    /// An rdma_cm event in the commands' terms.
    fn route_event(&mut self, e: &EventResp) -> Result<RouteEvent<RdmaCmId>, ViaError> {
        let id = RdmaCmId(e.id);
        Ok(match e.event {
            event::CONNECT_REQUEST => {
                let c = conn_of(e);
                // The peer's address, as librdmacm reads it for a new id.
                let remote_gid = self
                    .cm
                    .query_route(e.id)?
                    .dst
                    .map_or_else(|| "?".to_string(), |a| sockaddr_gid(&a).to_string());
                self.requests.insert(e.id, c.qp_num);
                RouteEvent::ConnectRequest {
                    id,
                    listen_id: None,
                    remote_gid,
                    remote_qpn: c.qp_num,
                    data: pd_text(&c.private_data, false),
                }
            }
            event::ESTABLISHED => RouteEvent::Established {
                id,
                remote_qpn: self.conns.get(&e.id).map_or(0, |c| c.1),
                data: String::new(),
            },
            event::DISCONNECTED => RouteEvent::Disconnected { id },
            event::REJECTED => RouteEvent::Rejected {
                id,
                reason: rej_reason(e.status)?,
            },
            event::UNREACHABLE | event::CONNECT_ERROR => RouteEvent::Unreachable { id },
            _ => RouteEvent::Other { id },
        })
    }

    /// `cmtime --server`: accepts every request, destroys each connection when it is
    /// disconnected, until `o.connections` are torn down or failed.
    fn serve(&mut self, o: &ServerOptions) -> Result<ServerReport, ViaError> {
        let uid = self.uid();
        let lid = self.cm.create_id(uid, ps::TCP)?;
        self.cm.bind_ip(lid, wildcard(self.view.gid, o.port))?;
        self.cm.listen(lid, 0)?;
        let mut r = ServerReport::default();
        let until = after(o.timeout.unwrap_or(Duration::MAX));
        while r.disconnected + r.failed < o.connections {
            let Some(e) = self.cm.next_event(until)? else {
                break;
            };
            let id = RdmaCmId(e.id);
            match e.event {
                event::CONNECT_REQUEST => {
                    r.accepted += 1;
                    let qpn = self.qpn()?;
                    self.conns.insert(e.id, (qpn, 0));
                    let uid = self.uid();
                    if let Answer::Withdrawn { .. } =
                        Self::answered(self.cm.accept(e.id, uid, &params(qpn, &[])))?
                    {
                        r.failed += 1;
                        self.destroy(id)?;
                    }
                }
                event::ESTABLISHED => r.established += 1,
                event::DISCONNECTED => {
                    r.disconnected += 1;
                    self.destroy(id)?;
                }
                event::REJECTED | event::UNREACHABLE | event::CONNECT_ERROR => {
                    r.failed += 1;
                    self.destroy(id)?;
                }
                _ => {}
            }
        }
        self.cm.destroy_id(lid)?;
        Ok(r)
    }
}

/// An rdma_cm id number, as the lines name it (`rdma_cm#N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RdmaCmId(u32);

impl std::fmt::Display for RdmaCmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&id_name(self.0))
    }
}

impl<C: Channel> Route for Session<'_, C> {
    type Id = RdmaCmId;
    type Error = ViaError;
    /// The stat and this client's counters where the run started.
    type Mark = (Value, ClientStats);

    fn gid(&self) -> Gid {
        self.view.gid
    }

    fn now(&self) -> Time {
        self.clock.now()
    }

    fn next(&mut self, until: Time) -> Result<Option<RouteEvent<RdmaCmId>>, ViaError> {
        let deadline = after(until.since(self.clock.now()));
        match self.cm.next_event(deadline)? {
            None => Ok(None),
            Some(e) => Ok(Some(self.route_event(&e)?)),
        }
    }

    fn listen(&mut self, port: u16) -> Result<RdmaCmId, ViaError> {
        let uid = self.uid();
        let lid = self.cm.create_id(uid, ps::TCP)?;
        self.cm.bind_ip(lid, wildcard(self.view.gid, port))?;
        self.cm.listen(lid, 0)?;
        Ok(RdmaCmId(lid))
    }

    fn stop_listening(&mut self, listener: RdmaCmId) -> Result<(), ViaError> {
        self.cm.destroy_id(listener.0)?;
        Ok(())
    }

    fn accept(&mut self, id: RdmaCmId, private_data: &[u8]) -> Result<Answer, ViaError> {
        let qpn = self.qpn()?;
        let peer = self.requests.remove(&id.0).unwrap_or(0);
        self.conns.insert(id.0, (qpn, peer));
        let uid = self.uid();
        Self::answered(self.cm.accept(id.0, uid, &params(qpn, private_data)))
    }

    fn reject(&mut self, id: RdmaCmId, private_data: &[u8]) -> Result<Answer, ViaError> {
        self.requests.remove(&id.0);
        Self::answered(self.cm.reject(id.0, private_data))
    }

    fn connect(
        &mut self,
        _rep: &mut dyn Report,
        a: &ConnectArgs<'_>,
    ) -> Result<Attempt<RdmaCmId>, ViaError> {
        let uid = self.uid();
        let id = self.cm.create_id(uid, ps::TCP)?;
        let e = match self.attempt_connect(id, a)? {
            Ok(e) => e,
            Err(f) => return Ok((RdmaCmId(id), Err(f))),
        };
        let src_port = self
            .cm
            .query_route(id)?
            .src
            .map_or(0, |s: SocketAddr| s.port());
        let c = conn_of(&e);
        Ok((
            RdmaCmId(id),
            Ok(Connected {
                remote_qpn: c.qp_num,
                data: pd_text(&c.private_data, false),
                src_port,
            }),
        ))
    }

    /// Destroying sends what the CM sends for it (REJ(TIMEOUT) for a REQ).
    fn abandon(&mut self, id: RdmaCmId) -> Result<(), ViaError> {
        let _ = self.cm.destroy_id(id.0);
        Ok(())
    }

    fn disconnect(&mut self, id: RdmaCmId) -> Result<(), ViaError> {
        self.cm.disconnect(id.0)?;
        Ok(())
    }

    /// Destroys the id and gives its QPN back.
    fn destroy(&mut self, id: RdmaCmId) -> Result<(), ViaError> {
        self.requests.remove(&id.0);
        if let Some((qpn, _)) = self.conns.remove(&id.0) {
            self.qpns.release(qpn);
        }
        self.cm.destroy_id(id.0)?;
        Ok(())
    }

    /// The service sends what the commands queued.
    fn flush(&mut self) -> Result<(), ViaError> {
        Ok(())
    }

    fn pause(&mut self, d: Duration) -> Result<(), ViaError> {
        std::thread::sleep(d);
        Ok(())
    }

    fn mark(&mut self, _server: bool) -> Result<(Value, ClientStats), ViaError> {
        Ok((self.control.stat()?, self.cm.stats()))
    }

    /// This process's commands and the service's device MADs over a run.
    fn work(&mut self, since: (Value, ClientStats)) -> Result<(String, Value), ViaError> {
        let (before, c0) = since;
        let after = match self.last_stat.take() {
            Some(v) => v,
            None => self.control.stat()?,
        };
        let c = self.cm.stats();
        let d = |k: &str| num(&after, &["device", k]).saturating_sub(num(&before, &["device", k]));
        let (commands, events, empty, waits) = (
            c.commands - c0.commands,
            c.events - c0.events,
            c.empty_reads - c0.empty_reads,
            c.waits - c0.waits,
        );
        let (rx, tx) = (d("rx_mads"), d("tx_mads"));
        Ok((
            format!(
                "service commands {commands} events {events} (empty reads {empty}, waits {waits}); device rx {rx} tx {tx}"
            ),
            json!({"event": "service", "commands": commands, "events": events,
                "empty_reads": empty, "waits": waits, "rx_mads": rx, "tx_mads": tx}),
        ))
    }

    /// The report's pacing is the service agent's, from the stat after the run.
    fn cmtime_client(&mut self, o: &ClientOptions) -> Result<CmtimeReport, ViaError> {
        let mut run = Burst::new(o);
        run.run(self)?;
        let after = self.control.stat()?;
        let r = run.report(pacing_of(&after));
        self.last_stat = Some(after);
        Ok(r)
    }

    fn cmtime_server(&mut self, o: &ServerOptions) -> Result<ServerReport, ViaError> {
        let r = self.serve(o)?;
        self.last_stat = Some(self.control.stat()?);
        Ok(r)
    }
}

// ------------------------------------------------------------------ cmtime's burst

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// RESOLVE_IP written, ADDR_RESOLVED awaited.
    Resolving,
    /// RESOLVE_ROUTE written, ROUTE_RESOLVED awaited.
    Routing,
    /// CONNECT written, CONNECT_RESPONSE awaited.
    Connecting,
    Established,
    Failed,
    Disconnecting,
    Disconnected,
}

#[derive(Debug)]
struct Conn {
    id: u32,
    phase: Phase,
    qpn: Option<u32>,
    /// Time spent in this connection's setup calls.
    calls: Duration,
    connect_at: Instant,
    disconnect_at: Instant,
    /// The peer disconnected while it was established.
    peer_left: bool,
}

/// One client burst: every connection's state, the steps' times.
#[derive(Debug)]
struct Burst {
    o: ClientOptions,
    conns: Vec<Conn>,
    index: HashMap<u32, usize>,
    steps: [StepTimes; 4],
    failures: BTreeMap<Failure, u32>,
    established: u32,
    disconnected: u32,
    /// Connections not yet established or failed (establish phase), or not yet
    /// disconnected (disconnect phase).
    pending: usize,
    last_connect: Instant,
    last_established: Instant,
    last_disconnected: Instant,
}

impl Burst {
    fn new(o: &ClientOptions) -> Burst {
        let now = Instant::now();
        Burst {
            o: *o,
            conns: Vec::with_capacity(o.connections as usize),
            index: HashMap::with_capacity(o.connections as usize),
            steps: [StepTimes::default(); 4],
            failures: BTreeMap::new(),
            established: 0,
            disconnected: 0,
            pending: 0,
            last_connect: now,
            last_established: now,
            last_disconnected: now,
        }
    }

    fn fail(&mut self, i: usize, f: Failure) {
        let c = &mut self.conns[i];
        if matches!(
            c.phase,
            Phase::Resolving | Phase::Routing | Phase::Connecting
        ) {
            c.phase = Phase::Failed;
            *self.failures.entry(f).or_default() += 1;
            self.pending -= 1;
        }
    }

    /// Moves a connection on by one of its events.
    fn on_event<C: Channel>(
        &mut self,
        s: &mut Session<'_, C>,
        e: &EventResp,
    ) -> Result<(), ViaError> {
        let Some(&i) = self.index.get(&e.id) else {
            return Ok(());
        };
        let id = e.id;
        match (e.event, self.conns[i].phase) {
            (event::ADDR_RESOLVED, Phase::Resolving) => {
                let t = Instant::now();
                s.cm.resolve_route(id, RESOLVE_MS)?;
                let c = &mut self.conns[i];
                c.calls += t.elapsed();
                c.phase = Phase::Routing;
            }
            (event::ROUTE_RESOLVED, Phase::Routing) => {
                let qpn = s.qpn()?;
                let t = Instant::now();
                s.cm.connect(id, &params(qpn, &[]))?;
                let now = Instant::now();
                let c = &mut self.conns[i];
                c.calls += now - t;
                c.qpn = Some(qpn);
                c.connect_at = t;
                c.phase = Phase::Connecting;
                self.steps[Step::Connect as usize].add(c.calls);
                self.last_connect = now;
            }
            (event::CONNECT_RESPONSE, Phase::Connecting) => {
                // A refused RTU (the peer gave up meanwhile) leaves the connection
                // connecting: its REJECTED follows, or the phase times out.
                if s.cm.complete(id).is_ok() {
                    let now = Instant::now();
                    let c = &mut self.conns[i];
                    c.phase = Phase::Established;
                    self.steps[Step::Establish as usize].add(now - c.connect_at);
                    self.last_established = now;
                    self.established += 1;
                    self.pending -= 1;
                }
            }
            (event::DISCONNECTED, Phase::Established) => self.conns[i].peer_left = true,
            (event::DISCONNECTED, Phase::Disconnecting) => {
                let now = Instant::now();
                let c = &mut self.conns[i];
                c.phase = Phase::Disconnected;
                self.steps[Step::Disconnect as usize].add(now - c.disconnect_at);
                self.last_disconnected = now;
                self.disconnected += 1;
                self.pending -= 1;
            }
            _ => {
                if let Some(f) = attempt_failure(e)? {
                    self.fail(i, f);
                }
            }
        }
        Ok(())
    }

    /// Handles the events already queued, without waiting.
    fn drain<C: Channel>(&mut self, s: &mut Session<'_, C>) -> Result<(), ViaError> {
        while let Some(e) = s.cm.get_event()? {
            self.on_event(s, &e)?;
        }
        Ok(())
    }

    /// Handles events until nothing is pending or `until`.
    fn serve<C: Channel>(
        &mut self,
        s: &mut Session<'_, C>,
        until: Instant,
    ) -> Result<(), ViaError> {
        while self.pending > 0 {
            let Some(e) = s.cm.next_event(until)? else {
                break;
            };
            self.on_event(s, &e)?;
        }
        Ok(())
    }

    fn run<C: Channel>(&mut self, s: &mut Session<'_, C>) -> Result<(), ViaError> {
        let n = self.o.connections as usize;
        let dst = gid_sockaddr(self.o.dest, self.o.port);
        let t0 = Instant::now();
        self.last_connect = t0;
        self.last_established = t0;
        // connect: every connection started; its own events move it on.
        for i in 0..n {
            let start = Instant::now();
            let uid = s.uid();
            let id = s.cm.create_id(uid, ps::TCP)?;
            s.cm.resolve_ip(id, None, dst, RESOLVE_MS)?;
            self.conns.push(Conn {
                id,
                phase: Phase::Resolving,
                qpn: None,
                calls: start.elapsed(),
                connect_at: start,
                disconnect_at: start,
                peer_left: false,
            });
            self.index.insert(id, i);
            self.pending += 1;
            if (i + 1) % DRAIN_EVERY == 0 {
                self.drain(s)?;
            }
        }
        // establish
        self.serve(s, after(self.o.timeout))?;
        self.steps[Step::Connect as usize].total = self.last_connect - t0;
        self.steps[Step::Establish as usize].total = self.last_established - t0;
        // Whatever is still on its way has timed out (destroyed below: REJ(TIMEOUT)).
        for i in 0..self.conns.len() {
            self.fail(i, Failure::Timeout);
        }
        if !self.o.hold.is_zero() {
            let until = after(self.o.hold);
            while let Some(e) = s.cm.next_event(until)? {
                self.on_event(s, &e)?;
            }
        }
        // disconnect
        let t1 = Instant::now();
        self.last_disconnected = t1;
        self.pending = 0;
        for i in 0..self.conns.len() {
            let c = &mut self.conns[i];
            if c.phase != Phase::Established {
                continue;
            }
            let id = c.id;
            c.disconnect_at = Instant::now();
            s.cm.disconnect(id)?;
            let c = &mut self.conns[i];
            if c.peer_left {
                // Its DISCONNECTED came already: the DREP went out with the DREQ's.
                c.phase = Phase::Disconnected;
                self.steps[Step::Disconnect as usize].add(c.disconnect_at.elapsed());
                self.disconnected += 1;
            } else {
                c.phase = Phase::Disconnecting;
                self.pending += 1;
            }
            if (i + 1) % DRAIN_EVERY == 0 {
                self.drain(s)?;
            }
        }
        self.serve(s, after(self.o.timeout))?;
        self.steps[Step::Disconnect as usize].total =
            self.last_disconnected.saturating_duration_since(t1);
        let stuck = self
            .conns
            .iter()
            .filter(|c| c.phase == Phase::Disconnecting)
            .count() as u32;
        if stuck > 0 {
            self.failures.insert(Failure::DisconnectTimeout, stuck);
        }
        // destroy, newest first (as the device path does).
        let t2 = Instant::now();
        for c in self.conns.iter().rev() {
            let t = Instant::now();
            s.cm.destroy_id(c.id)?;
            self.steps[Step::Destroy as usize].add(t.elapsed());
            if let Some(q) = c.qpn {
                s.qpns.release(q);
            }
        }
        self.steps[Step::Destroy as usize].total = t2.elapsed();
        Ok(())
    }

    fn report(&self, pacing: PacingCounters) -> CmtimeReport {
        let failed = self
            .failures
            .iter()
            .filter(|(f, _)| **f != Failure::DisconnectTimeout)
            .map(|(_, n)| n)
            .sum();
        CmtimeReport {
            connections: self.o.connections,
            established: self.established,
            failed,
            disconnected: self.disconnected,
            failures: self.failures.clone(),
            steps: self.steps,
            pacing,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_qpns_stay_in_the_range_once_each() {
        let mut q = SimQpns::new(16, 4, 2);
        let got: Vec<u32> = std::iter::from_fn(|| q.alloc()).collect();
        assert_eq!(got, vec![18, 19, 16, 17]);
        assert!(q.alloc().is_none(), "all in use");
        q.release(19);
        assert_eq!(q.alloc(), Some(19));
        let mut low = SimQpns::new(0, 3, 0);
        assert_eq!(low.alloc(), Some(2), "QPNs 0 and 1 are never given");
        assert_eq!(low.alloc(), None);
        let mut any = SimQpns::new(0x00FF_FFF0, 0, 0);
        assert!(any.owns(0x00FF_FFFF) && !any.owns(0x0100_0000));
        assert_eq!(any.alloc(), Some(0x00FF_FFF0));
        let big = SimQpns::new(16, 0x20000, u32::MAX);
        assert!(big.owns(16 + (u32::MAX % 0x20000)));
    }

    #[test]
    fn the_view_comes_from_the_stat() {
        let stat =
            json!({"pvcm": {"gid": "::ffff:10.99.0.11", "qpn_base": 16, "qpn_count": 131072}});
        let v = ServiceView::from_stat(&stat).unwrap();
        assert_eq!(v.gid.to_ipv4(), Some(Ipv4Addr::new(10, 99, 0, 11)));
        assert_eq!((v.qpn_base, v.qpn_count), (16, 0x20000));
        let old = json!({"files": 1});
        let e = ServiceView::from_stat(&old).unwrap_err();
        assert!(e.to_string().contains("older"), "{e}");
        let bad = json!({"pvcm": {"gid": "x", "qpn_base": 16, "qpn_count": 1}});
        assert!(ServiceView::from_stat(&bad).is_err());
        let big = json!({"pvcm": {"gid": "10.0.0.1", "qpn_base": 1u64 << 40, "qpn_count": 1}});
        assert!(ServiceView::from_stat(&big).is_err());
    }

    #[test]
    fn counter_deltas_and_pacing() {
        let a = json!({"counters": {"cm_tx_msgs": {"req": 3, "rej": 1}}, "pacing": {"sent": 4}});
        let b = json!({"counters": {"cm_tx_msgs": {"req": 5, "rej": 1}}, "pacing": {"sent": 9, "max_window": 64}});
        let d = counters_delta(&a, &b);
        assert_eq!(d["cm_tx_msgs"]["req"], 2);
        assert_eq!(d["cm_tx_msgs"]["rej"], 0);
        let p = pacing_of(&b);
        assert_eq!((p.sent, p.max_window, p.queued), (9, 64, 0));
        assert!(
            counters_text(&b).contains("rej 1, req 5"),
            "{}",
            counters_text(&b)
        );
    }

    #[test]
    fn any_timeout_is_an_instant() {
        let now = Instant::now();
        assert!(after(Duration::MAX) > now + Duration::from_secs(86400));
        assert!(after(Duration::from_secs(1e18 as u64)) > now);
        assert!(after(Duration::ZERO) >= now);
    }

    #[test]
    fn rejected_status_is_a_rej_reason() {
        assert_eq!(rej_reason(28).unwrap(), RejReason::ConsumerDefined);
        assert!(rej_reason(-110).is_err());
        assert!(rej_reason(34).is_err());
    }

    #[test]
    fn control_socket_errors() {
        let t = tempfile::tempdir().unwrap();
        let mut c = ControlSocket::new(&t.path().join("none.sock"));
        let e = c.stat().unwrap_err();
        assert!(
            matches!(&e, ViaError::Control { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
        assert!(e.hint().is_some());
        // A socket that answers something else.
        let p = t.path().join("x.sock");
        let l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let h = std::thread::spawn(move || {
            use std::io::Write as _;
            for _ in 0..2 {
                let (mut s, _) = l.accept().unwrap();
                let _ = writeln!(s, "hello");
            }
        });
        let e = ControlSocket::new(&p).stat().unwrap_err();
        assert!(e.to_string().contains("not the service's stat"), "{e}");
        let e = ControlSocket::new(&p).stat().unwrap_err();
        assert!(matches!(e, ViaError::ControlAnswer { .. }));
        h.join().unwrap();
    }
}
