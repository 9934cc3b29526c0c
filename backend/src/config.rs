//! The daemon's configuration: command line (clap) and `--config` file.
//!
//! One VM per vhost-user socket, in the conventions of rust-vmm's vhost-device crates:
//!
//! ```text
//! pvcm-backend --vm socket=/run/pvcm/a.sock,gid=::ffff:127.10.1.1,name=a \
//!              --vm socket=/run/pvcm/b.sock,gid=127.10.1.2 \
//!              --control /run/pvcm/ctl --metrics 127.0.0.1:9791 --pcap /tmp/cm.pcap
//! pvcm-backend stat --control /run/pvcm/ctl [--json]
//! ```
//!
//! A `--config FILE` holds the same options, one per line, without the leading dashes
//! (`vm socket=...,gid=...`, `policy default`, `# comments`); options on the command line
//! come after the file's (a later scalar option wins, VMs add up).
//!
//! Options are typed: clap parses each value (`value_parser`s here say what the option
//! takes, clap names the option and the value), and [`Config::from_args`] checks the
//! whole; a bad value is an error naming the option ([`ConfigError`] for the whole and for
//! `--config`); nothing here panics.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use clap::{Args, Parser, Subcommand};
use pvcm_wire::Gid;

use crate::backlog;
use crate::mux::{IdRange, Policy, VmConfig};

/// Default RoCEv2 UDP port.
pub const DEFAULT_PORT: u16 = pvcm_wire::roce::UDP_PORT;
/// Largest accepted backlog budget, per VM or host-wide (64 GiB).
pub const MAX_BACKLOG_BYTES: usize = 64 << 30;

/// A configuration error: what was wrong, in words for the operator (naming the option
/// and the values it takes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// One VM: its vhost-user socket and its port identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSpec {
    /// The vhost-user socket the backend listens on for this VM.
    pub socket: PathBuf,
    /// The mux's view of the VM (name, GID, CA GUID, QPN range, quota, ID range).
    pub vm: VmConfig,
    /// The VM arrives by live migration (docs/migration.md): its address is not bound
    /// and the VM not attached until its state is loaded (or its rings start without
    /// one, a fresh boot).
    pub incoming: bool,
    /// The interface of a link-local (fe80::/10) GID, given as `gid=fe80::1%IFACE`: the
    /// scope its socket binds in and link-local destinations are reached through.
    /// `None` for every other GID.
    pub iface: Option<String>,
}

impl VmSpec {
    /// The VM's IP address: IPv4 for an IPv4-mapped GID, else IPv6.
    pub fn addr(&self) -> IpAddr {
        gid_addr(self.vm.gid)
    }
}

/// A GID's IP address: IPv4 for an IPv4-mapped GID, else IPv6.
pub fn gid_addr(gid: Gid) -> IpAddr {
    match gid.to_ipv4() {
        Some(a) => IpAddr::V4(a),
        None => IpAddr::V6(gid.into()),
    }
}

/// A number in decimal or `0x` hex (`_` separators allowed).
fn number(v: &str) -> Option<u64> {
    let v = v.trim().replace('_', "");
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else {
        v.parse::<u64>().ok()
    }
}

fn parse_u64(key: &str, v: &str) -> Result<u64, ConfigError> {
    number(v).ok_or_else(|| {
        let v = v.trim().replace('_', "");
        ConfigError(format!("{key}={v:?}: {NOT_A_NUMBER}"))
    })
}

fn parse_u32(key: &str, v: &str) -> Result<u32, ConfigError> {
    let n = parse_u64(key, v)?;
    u32::try_from(n).map_err(|_| ConfigError(format!("{key}={v}: larger than 32 bits")))
}

/// Parses a VM's GID: an IPv4 address (taken as its IPv4-mapped GID, RoCEv2 over
/// IPv4), an IPv4-mapped GID (`::ffff:127.0.0.1`), or a unicast IPv6 address (RoCEv2
/// over IPv6). A link-local IPv6 GID (fe80::/10) names its interface after `%`
/// (`fe80::1%br0`); no other GID takes one. Refused: what cannot be a unicast RoCE
/// GID ([`Gid::roce_unicast_problem`]).
pub fn parse_gid(v: &str) -> Result<(Gid, Option<String>), ConfigError> {
    let (addr, iface) = match v.split_once('%') {
        Some((a, i)) => (a, Some(i)),
        None => (v, None),
    };
    let gid = Gid::from_str(addr).map_err(|_| {
        ConfigError(format!(
            "gid={v:?}: not a GID: give an IPv4 address (10.0.0.1), an IPv4-mapped GID \
             (::ffff:10.0.0.1) or an IPv6 address (2001:db8::1, fe80::1%IFACE)"
        ))
    })?;
    if let Some(why) = gid.roce_unicast_problem() {
        return err(format!(
            "gid={v}: {why} cannot be a VM's GID (a unicast RoCE address)"
        ));
    }
    match (gid.is_link_local(), iface) {
        (true, None) => err(format!(
            "gid={v}: a link-local GID is reachable through one interface only: name it, \
             e.g. gid={addr}%br0"
        )),
        (true, Some(i)) => {
            check_ifname(i).map_err(|e| ConfigError(format!("gid={v}: {e}")))?;
            Ok((gid, Some(i.to_string())))
        }
        (false, Some(_)) => err(format!(
            "gid={v}: only a link-local GID (fe80::/10) takes an interface (%IFACE)"
        )),
        (false, None) => Ok((gid, None)),
    }
}

/// Checks an interface name as Linux's `dev_valid_name` does: 1 to 15 bytes, not `.`
/// or `..`, no `/`, `:` or white space.
pub fn check_ifname(name: &str) -> Result<(), String> {
    if name.is_empty()
        || name.len() > 15
        || name == "."
        || name == ".."
        || name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return Err(format!("{name:?} is not an interface name"));
    }
    Ok(())
}

impl FromStr for VmSpec {
    type Err = ConfigError;

    /// `socket=PATH,gid=GID[,name=N,qpn-base=N,qpn-count=N,ca-guid=N,quota=N,
    /// id-range=BASE/LEN,incoming=yes]`.
    fn from_str(s: &str) -> Result<VmSpec, ConfigError> {
        let mut id_range = None;
        let mut incoming = None;
        let mut socket = None;
        let mut gid = None;
        let mut iface = None;
        let mut name = None;
        let mut qpn_base = None;
        let mut qpn_count = None;
        let mut ca_guid = None;
        let mut quota = None;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return err(format!("--vm: {part:?} is not key=value"));
            };
            let (k, v) = (k.trim(), v.trim());
            let dup = |set: bool| {
                if set {
                    err(format!("--vm: {k} given twice"))
                } else {
                    Ok(())
                }
            };
            match k {
                "socket" | "socket-path" => {
                    dup(socket.is_some())?;
                    if v.is_empty() {
                        return err("--vm: socket= is empty");
                    }
                    socket = Some(PathBuf::from(v));
                }
                "gid" => {
                    dup(gid.is_some())?;
                    let (g, i) = parse_gid(v)?;
                    gid = Some(g);
                    iface = i;
                }
                "name" => {
                    dup(name.is_some())?;
                    if v.is_empty() || v.len() > 48 {
                        return err(format!("--vm: name={v:?} must be 1 to 48 bytes"));
                    }
                    name = Some(v.to_string());
                }
                "qpn-base" => {
                    dup(qpn_base.is_some())?;
                    qpn_base = Some(parse_u32(k, v)?);
                }
                "qpn-count" => {
                    dup(qpn_count.is_some())?;
                    qpn_count = Some(parse_u32(k, v)?);
                }
                "ca-guid" => {
                    dup(ca_guid.is_some())?;
                    ca_guid = Some(parse_u64(k, v)?);
                }
                "quota" => {
                    dup(quota.is_some())?;
                    quota = Some(parse_u32(k, v)?);
                }
                "id-range" => {
                    dup(id_range.is_some())?;
                    id_range = Some(
                        IdRange::from_str(v)
                            .map_err(|e| ConfigError(format!("--vm: id-range: {e}")))?,
                    );
                }
                "incoming" => {
                    dup(incoming.is_some())?;
                    incoming = Some(match v {
                        "yes" | "true" | "1" => true,
                        "no" | "false" | "0" => false,
                        _ => return err(format!("--vm: incoming={v:?}: expected yes or no")),
                    });
                }
                _ => {
                    return err(format!(
                        "--vm: unknown key {k:?} (expected socket, gid, name, qpn-base, \
                         qpn-count, ca-guid, quota, id-range, incoming)"
                    ));
                }
            }
        }
        let Some(socket) = socket else {
            return err(format!("--vm {s:?}: socket=PATH is required"));
        };
        let Some(gid) = gid else {
            return err(format!("--vm {s:?}: gid=GID is required"));
        };
        let ip = gid_addr(gid);
        let mut vm = VmConfig::new(name.unwrap_or_else(|| format!("vm-{ip}")), gid);
        if let Some(b) = qpn_base {
            vm.qpn_base = b;
        }
        if let Some(c) = qpn_count {
            vm.qpn_count = c;
        }
        if u64::from(vm.qpn_base) + u64::from(vm.qpn_count) > 1 << 24 {
            return err(format!(
                "--vm {s:?}: qpn-base + qpn-count must stay within 24-bit QPNs (<= 0x1000000)"
            ));
        }
        if vm.qpn_count != 0 && vm.qpn_base < 2 {
            return err(format!(
                "--vm {s:?}: qpn-base must be at least 2 (QP0 and QP1 are special)"
            ));
        }
        if let Some(g) = ca_guid {
            if g == 0 {
                return err(format!("--vm {s:?}: ca-guid must not be 0"));
            }
            vm.ca_guid = g;
        }
        if let Some(q) = quota {
            if q == 0 {
                return err(format!("--vm {s:?}: quota must be at least 1"));
            }
            vm.quota = Some(q);
        }
        vm.id_range = id_range;
        let incoming = incoming.unwrap_or(false);
        if incoming && id_range.is_none() {
            return err(format!(
                "--vm {s:?}: incoming=yes needs id-range=BASE/LEN (the range the VM's \
                 connections carry from the host it leaves)"
            ));
        }
        Ok(VmSpec {
            socket,
            vm,
            incoming,
            iface,
        })
    }
}

/// The daemon's options.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A VM: `socket=PATH,gid=GID[,name=N,qpn-base=N,qpn-count=N,ca-guid=N,quota=N,
    /// id-range=BASE/LEN,incoming=yes]` (repeatable; one vhost-user socket per VM).
    /// GID: an IPv4 address (10.0.0.1, its IPv4-mapped GID), an IPv6 address
    /// (2001:db8::1; RoCEv2 over IPv6), or a link-local one with its interface
    /// (fe80::1%br0). `id-range` makes the VM migratable; `incoming=yes` waits for it
    /// to arrive.
    #[arg(long = "vm", value_name = "SPEC", value_parser = VmSpec::from_str)]
    pub vms: Vec<VmSpec>,
    /// A file of options, one per line without the leading dashes (`vm socket=...`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Cache policy: default, mlx4-pre2020 or mlx4-post2020.
    #[arg(long, value_name = "POLICY", value_parser = Policy::from_str)]
    pub policy: Option<Policy>,
    /// Unix socket for `pvcm-backend stat`.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Serve Prometheus text metrics over HTTP: a port (bound on 127.0.0.1) or an
    /// address:port (give 0.0.0.0:PORT or another address to serve beyond the host).
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_addr)]
    pub metrics: Option<SocketAddr>,
    /// Capture every frame sent and received to this pcap file (IPv4 and IPv6
    /// datagrams, LINKTYPE_RAW).
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,
    /// Memory for messages kept per VM while its rx queue has no buffers (K, M, G
    /// suffixes; default 32M, about 100,000 MADs); past it they are dropped and counted
    /// (rx_backlog_full).
    #[arg(long, value_name = "SIZE", value_parser = parse_backlog_size)]
    pub rx_backlog_bytes: Option<usize>,
    /// Memory for the rx backlogs of all VMs together (default 512M); past it messages
    /// are dropped and counted (rx_host_budget).
    #[arg(long, value_name = "SIZE", value_parser = parse_backlog_size)]
    pub rx_host_backlog_bytes: Option<usize>,
    /// The per-VM budget as a number of messages (older form of --rx-backlog-bytes).
    #[arg(long, value_name = "N", value_parser = parse_backlog_messages)]
    pub rx_backlog: Option<u64>,
    /// The RoCEv2 UDP port (4791): the soft port binds it on each VM address and sends
    /// to it; the packet port filters on it and sends to it.
    #[arg(long, value_name = "PORT", value_parser = parse_bind_port)]
    pub bind_port: Option<u16>,
    /// How the soft RoCE port receives from IPv4 peers: `raw` checks each frame's ICRC
    /// over its IPv4 header as received and accepts every conformant sender (Linux rxe,
    /// hardware); it needs CAP_NET_RAW. `udp` needs no privilege but accepts only
    /// senders that write IP ID 0 (pvcm peers). `auto` (default): raw if permitted,
    /// else udp with a warning. IPv6 VMs are read through their own sockets in every
    /// mode (exact ICRC, any sender).
    #[arg(long, value_name = "MODE", value_enum)]
    pub wire_rx: Option<RxMode>,
    /// The wire port: `soft` (default: pvcm's own RoCEv2 port over UDP on the VMs'
    /// addresses), `umad:DEVICE[:PORT]` (a real RDMA device's QP1 through
    /// /dev/infiniband/umadN, e.g. umad:rxe0:1 or umad:mlx4_0:1; the kernel CM must not
    /// be loaded; see docs/umad.md) or `packet:DEV[:IFACE]` (VMs with their own NICs:
    /// their QP1 frames are diverted to network device DEV and read there, answers
    /// leave through the host's IP stack with the VM's address as source; IFACE is the
    /// interface of link-local IPv6 destinations; needs CAP_NET_RAW; see
    /// docs/packet-port.md). --wire-rx applies to the soft port only; --bind-port is
    /// the RoCEv2 UDP port of the soft and packet ports.
    #[arg(long, value_name = "PORT", value_parser = PortSpec::from_str)]
    pub port: Option<PortSpec>,
    /// sysfs mount (the umad port reads the GID and P_Key tables there).
    #[arg(long, value_name = "DIR", hide = true)]
    pub sysfs: Option<PathBuf>,
    /// Seed of the mux's ID permutation (random unless given; for reproducible tests).
    #[arg(long, value_name = "N", hide = true, value_parser = parse_seed)]
    pub seed: Option<u64>,
    /// Keep the mux's state (every connection's IDs and mapping, quarantine) in a
    /// journal in this directory, so that a restart, an upgrade or a crash of the daemon
    /// loses no connection: started again with the same options, it restores the state
    /// and the VMs reconnect (see docs/restart.md). Without it, stopping the daemon
    /// releases every connection.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// With --state-dir: how long a restored VM may take to reconnect before its
    /// connections are released on its behalf (seconds; default 60).
    #[arg(long, value_name = "SECS", value_parser = parse_seed)]
    pub reconnect_grace: Option<u64>,
}

/// `pvcm-backend stat` options.
#[derive(Debug, Clone, Args)]
pub struct StatArgs {
    /// The daemon's control socket.
    #[arg(long, value_name = "PATH")]
    pub control: PathBuf,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print the counters of a running daemon.
    Stat(StatArgs),
}

/// The `pvcm-backend` command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pvcm-backend",
    version,
    about = "pvcm host daemon: para-virtual IB CM devices for VMs over vhost-user, \
             multiplexed onto one RoCEv2 port (soft, or a device's QP1 via umad)",
    args_conflicts_with_subcommands = true,
    args_override_self = true
)]
pub struct Cli {
    /// The subcommand (none: run the daemon).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// The daemon's options.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// The daemon's validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The VMs, in order.
    pub vms: Vec<VmSpec>,
    /// Cache policy.
    pub policy: Policy,
    /// Control socket.
    pub control: Option<PathBuf>,
    /// Prometheus endpoint.
    pub metrics: Option<SocketAddr>,
    /// Capture file.
    pub pcap: Option<PathBuf>,
    /// Per-VM rx backlog budget, bytes.
    pub rx_backlog_bytes: usize,
    /// Host-wide rx backlog budget, bytes.
    pub rx_host_backlog_bytes: usize,
    /// UDP port.
    pub bind_port: u16,
    /// How the soft port receives.
    pub wire_rx: RxMode,
    /// The wire port.
    pub port: PortSpec,
    /// sysfs mount, for the umad port.
    pub sysfs: PathBuf,
    /// Mux seed (None: random).
    pub seed: Option<u64>,
    /// The state journal's directory (None: state in memory only).
    pub state_dir: Option<PathBuf>,
    /// How long a restored VM may take to reconnect.
    pub reconnect_grace: std::time::Duration,
}

impl Config {
    /// A configuration with these VMs and defaults for everything else.
    pub fn new(vms: Vec<VmSpec>) -> Config {
        Config {
            vms,
            policy: Policy::Default,
            control: None,
            metrics: None,
            pcap: None,
            rx_backlog_bytes: backlog::DEFAULT_VM_BYTES,
            rx_host_backlog_bytes: backlog::DEFAULT_HOST_BYTES,
            bind_port: DEFAULT_PORT,
            wire_rx: RxMode::Auto,
            port: PortSpec::Soft,
            sysfs: PathBuf::from("/sys"),
            seed: None,
            state_dir: None,
            reconnect_grace: std::time::Duration::from_secs(60),
        }
    }

    /// Validates parsed arguments (reading `--config` first if given).
    pub fn from_args(args: &ServeArgs) -> Result<Config, ConfigError> {
        let args = match &args.config {
            Some(file) => merge(read_config_file(file)?, args),
            None => args.clone(),
        };
        let mut cfg = Config::new(args.vms);
        if let Some(p) = args.policy {
            cfg.policy = p;
        }
        cfg.control = args.control;
        cfg.metrics = args.metrics;
        cfg.pcap = args.pcap;
        // The value parsers checked the ranges: the product stays within 64G.
        if let Some(n) = args.rx_backlog {
            cfg.rx_backlog_bytes = n as usize * backlog::MSG_COST;
        }
        if let Some(b) = args.rx_backlog_bytes {
            cfg.rx_backlog_bytes = b;
        }
        if let Some(b) = args.rx_host_backlog_bytes {
            cfg.rx_host_backlog_bytes = b;
        }
        if let Some(p) = args.bind_port {
            cfg.bind_port = p;
        }
        if let Some(m) = args.wire_rx {
            cfg.wire_rx = m;
        }
        if let Some(p) = args.port {
            cfg.port = p;
        }
        if let Some(d) = args.sysfs {
            cfg.sysfs = d;
        }
        cfg.seed = args.seed;
        cfg.state_dir = args.state_dir;
        if let Some(g) = args.reconnect_grace {
            cfg.reconnect_grace = std::time::Duration::from_secs(g);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the whole: at least one VM, no socket or GID twice.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.vms.is_empty() {
            return err("no VM: give at least one --vm socket=PATH,gid=GID");
        }
        for (i, a) in self.vms.iter().enumerate() {
            for b in &self.vms[..i] {
                if a.socket == b.socket {
                    return err(format!("two VMs use socket {}", a.socket.display()));
                }
                if a.vm.gid == b.vm.gid {
                    return err(format!("two VMs use GID {}", a.vm.gid));
                }
                if a.vm.name == b.vm.name {
                    return err(format!("two VMs are named {:?}", a.vm.name));
                }
            }
            if Some(&a.socket) == self.control.as_ref() {
                return err("the control socket is also a VM socket");
            }
        }
        for (what, b) in [
            ("per-VM", self.rx_backlog_bytes),
            ("host", self.rx_host_backlog_bytes),
        ] {
            if !(backlog::MSG_COST..=MAX_BACKLOG_BYTES).contains(&b) {
                return err(format!(
                    "{what} rx backlog budget {b}: must be {} bytes to 64G",
                    backlog::MSG_COST
                ));
            }
        }
        if self.bind_port == 0 {
            return err("bind port must not be 0");
        }
        if self.state_dir.is_some() && self.policy.is_legacy() {
            return err(format!(
                "--state-dir keeps the default policy's state; the {} policy is a comparison \
                 policy without it: use --policy default",
                self.policy.name()
            ));
        }
        Ok(())
    }
}

/// `--metrics`: a bare port binds loopback only; an address:port is taken as given.
fn parse_metrics_addr(m: &str) -> Result<SocketAddr, ConfigError> {
    if let Ok(port) = m.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    SocketAddr::from_str(m).map_err(|_| {
        ConfigError(
            "a port (bound on 127.0.0.1, e.g. 9791) or an address:port (e.g. 127.0.0.1:9791)"
                .into(),
        )
    })
}

const NOT_A_NUMBER: &str = "not a number (decimal or 0x hex)";

// The value parsers' messages say what the option takes; clap names the option and the
// value given ("invalid value '0' for '--rx-backlog <N>': must be ...").

/// `--rx-backlog N`: a number of messages, 1 to what 64G holds.
fn parse_backlog_messages(v: &str) -> Result<u64, ConfigError> {
    let n = number(v).ok_or_else(|| ConfigError(NOT_A_NUMBER.into()))?;
    let max = (MAX_BACKLOG_BYTES / backlog::MSG_COST) as u64;
    if n == 0 || n > max {
        return err(format!("must be 1 to {max} messages"));
    }
    Ok(n)
}

/// `--rx-backlog-bytes`, `--rx-host-backlog-bytes`: a size with `K`/`M`/`G`, one
/// message's cost to 64G ([`backlog::parse_size`]).
fn parse_backlog_size(v: &str) -> Result<usize, ConfigError> {
    match backlog::parse_size(v) {
        Some(b) if (backlog::MSG_COST..=MAX_BACKLOG_BYTES).contains(&b) => Ok(b),
        _ => err(format!(
            "a size from {} bytes (one message) to 64G, e.g. 32M",
            backlog::MSG_COST
        )),
    }
}

/// `--bind-port`: a UDP port, 1 to 65535.
fn parse_bind_port(v: &str) -> Result<u16, ConfigError> {
    let n = number(v).ok_or_else(|| ConfigError(NOT_A_NUMBER.into()))?;
    match u16::try_from(n) {
        Ok(p) if p != 0 => Ok(p),
        _ => err("must be 1 to 65535"),
    }
}

/// `--seed`: decimal or `0x` hex.
fn parse_seed(v: &str) -> Result<u64, ConfigError> {
    number(v).ok_or_else(|| ConfigError(NOT_A_NUMBER.into()))
}

/// Reads a config file into arguments (one option per line, `#` comments).
fn read_config_file(path: &Path) -> Result<ServeArgs, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("--config {}: {e}", path.display())))?;
    let mut argv = vec!["pvcm-backend".to_string()];
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = match line.split_once(|c: char| c.is_whitespace() || c == '=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (line, None),
        };
        let k = k.trim_start_matches('-');
        if k == "config" {
            return err(format!(
                "--config {}:{}: a config file cannot include another",
                path.display(),
                n + 1
            ));
        }
        argv.push(format!("--{k}"));
        if let Some(v) = v {
            argv.push(v.to_string());
        }
    }
    let cli = Cli::try_parse_from(&argv).map_err(|e| {
        ConfigError(format!(
            "--config {}: {}",
            path.display(),
            e.render()
                .to_string()
                .lines()
                .next()
                .unwrap_or("bad option")
        ))
    })?;
    Ok(cli.serve)
}

/// The file's options, then the command line's on top.
fn merge(file: ServeArgs, cli: &ServeArgs) -> ServeArgs {
    let mut vms = file.vms;
    vms.extend(cli.vms.iter().cloned());
    ServeArgs {
        vms,
        config: None,
        policy: cli.policy.or(file.policy),
        control: cli.control.clone().or(file.control),
        metrics: cli.metrics.or(file.metrics),
        pcap: cli.pcap.clone().or(file.pcap),
        rx_backlog: cli.rx_backlog.or(file.rx_backlog),
        rx_backlog_bytes: cli.rx_backlog_bytes.or(file.rx_backlog_bytes),
        rx_host_backlog_bytes: cli.rx_host_backlog_bytes.or(file.rx_host_backlog_bytes),
        bind_port: cli.bind_port.or(file.bind_port),
        wire_rx: cli.wire_rx.or(file.wire_rx),
        port: cli.port.clone().or(file.port),
        sysfs: cli.sysfs.clone().or(file.sysfs),
        seed: cli.seed.or(file.seed),
        state_dir: cli.state_dir.clone().or(file.state_dir),
        reconnect_grace: cli.reconnect_grace.or(file.reconnect_grace),
    }
}

/// How the soft port receives frames (see `port::soft`'s docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum RxMode {
    /// Raw if `CAP_NET_RAW` allows it, else udp with a warning.
    #[default]
    Auto,
    /// A raw IPv4 socket: the ICRC is checked over the header as received.
    Raw,
    /// The per-VM UDP sockets: only senders that write IP ID 0 pass the ICRC.
    Udp,
}

impl RxMode {
    /// The mode's name, as the CLI takes it.
    pub fn name(self) -> &'static str {
        match self {
            RxMode::Auto => "auto",
            RxMode::Raw => "raw",
            RxMode::Udp => "udp",
        }
    }
}

impl std::str::FromStr for RxMode {
    type Err = String;

    fn from_str(s: &str) -> Result<RxMode, String> {
        match s {
            "auto" => Ok(RxMode::Auto),
            "raw" => Ok(RxMode::Raw),
            "udp" => Ok(RxMode::Udp),
            _ => Err(format!("{s:?} is not a receive mode (auto, raw, udp)")),
        }
    }
}

/// Which port the daemon runs (`--port`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PortSpec {
    /// The soft RoCEv2 port (UDP on the VMs' addresses).
    #[default]
    Soft,
    /// A device port's QP1 through ib_umad.
    Umad {
        /// The RDMA device (`rxe0`, `mlx4_0`).
        device: String,
        /// The port number (1-based).
        port: u8,
    },
    /// The packet port: QP1 frames to the VMs' own addresses read from a network device
    /// (AF_PACKET), sent through the host's IP stack with the VM's address as source.
    Packet {
        /// The device the QP1 frames are diverted to (`pvcm-qp1`).
        dev: String,
        /// The interface link-local IPv6 destinations are reached through.
        iface: Option<String>,
    },
}

impl fmt::Display for PortSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortSpec::Soft => f.write_str("soft"),
            PortSpec::Umad { device, port } => write!(f, "umad:{device}:{port}"),
            PortSpec::Packet { dev, iface: None } => write!(f, "packet:{dev}"),
            PortSpec::Packet {
                dev,
                iface: Some(i),
            } => write!(f, "packet:{dev}:{i}"),
        }
    }
}

impl std::str::FromStr for PortSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<PortSpec, String> {
        if s == "soft" {
            return Ok(PortSpec::Soft);
        }
        if let Some(rest) = s.strip_prefix("packet:") {
            let (dev, iface) = match rest.split_once(':') {
                Some((d, i)) => (d, Some(i)),
                None => (rest, None),
            };
            check_ifname(dev).map_err(|e| format!("{s:?}: DEV: {e}"))?;
            if let Some(i) = iface {
                check_ifname(i).map_err(|e| format!("{s:?}: IFACE: {e}"))?;
            }
            return Ok(PortSpec::Packet {
                dev: dev.to_string(),
                iface: iface.map(str::to_string),
            });
        }
        let Some(rest) = s.strip_prefix("umad:") else {
            return Err(format!(
                "{s:?} is not a port (soft, umad:DEVICE[:PORT], e.g. umad:rxe0:1, or \
                 packet:DEV[:IFACE], e.g. packet:pvcm-qp1)"
            ));
        };
        let (device, port) = match rest.split_once(':') {
            Some((d, p)) => (
                d,
                p.parse::<u8>()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| format!("{s:?}: port {p:?} is not a number from 1 to 255"))?,
            ),
            None => (rest, 1),
        };
        if device.is_empty() || device.contains('/') || device.starts_with('.') {
            return Err(format!("{s:?}: {device:?} is not an RDMA device name"));
        }
        Ok(PortSpec::Umad {
            device: device.to_string(),
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        let mut argv = vec!["pvcm-backend"];
        argv.extend_from_slice(args);
        let cli = Cli::try_parse_from(argv).map_err(|e| ConfigError(e.to_string()))?;
        Config::from_args(&cli.serve)
    }

    #[test]
    fn vm_spec_full() {
        let s: VmSpec = "socket=/tmp/a.sock,gid=::ffff:127.10.1.1,name=a,qpn-base=0x100,\
                         qpn-count=256,ca-guid=0x1122,quota=10"
            .parse()
            .unwrap();
        assert_eq!(s.socket, PathBuf::from("/tmp/a.sock"));
        assert_eq!(s.addr(), IpAddr::V4(Ipv4Addr::new(127, 10, 1, 1)));
        assert_eq!(s.vm.name, "a");
        assert_eq!((s.vm.qpn_base, s.vm.qpn_count), (0x100, 256));
        assert_eq!(s.vm.ca_guid, 0x1122);
        assert_eq!(s.vm.quota, Some(10));
        let d: VmSpec = "socket=/tmp/b,gid=127.0.0.9".parse().unwrap();
        assert_eq!(d.vm.name, "vm-127.0.0.9");
        assert_eq!(d.vm.gid, Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 9)));
        assert_eq!(d.iface, None);
        let v6: VmSpec = "socket=/tmp/c,gid=2001:db8::7".parse().unwrap();
        assert_eq!(v6.vm.name, "vm-2001:db8::7");
        assert_eq!(v6.addr(), "2001:db8::7".parse::<IpAddr>().unwrap());
        assert_eq!(v6.iface, None);
        let ll: VmSpec = "socket=/tmp/d,gid=fe80::5054:ff:fe00:1%br0"
            .parse()
            .unwrap();
        assert_eq!(ll.iface.as_deref(), Some("br0"));
        assert!(ll.vm.gid.is_link_local());
    }

    #[test]
    fn vm_spec_errors() {
        for (s, want) in [
            ("gid=127.0.0.1", "socket=PATH is required"),
            ("socket=/a", "gid=GID is required"),
            ("socket=/a,gid=fe80::1", "link-local"),
            ("socket=/a,gid=fe80::1%", "not an interface"),
            ("socket=/a,gid=fe80::1%a/b", "not an interface"),
            ("socket=/a,gid=2001:db8::1%br0", "only a link-local"),
            ("socket=/a,gid=10.0.0.1%br0", "only a link-local"),
            ("socket=/a,gid=banana", "not a GID"),
            ("socket=/a,gid=0.0.0.0", "unspecified"),
            ("socket=/a,gid=::", "unspecified"),
            ("socket=/a,gid=::1", "loopback"),
            ("socket=/a,gid=ff02::1", "multicast"),
            ("socket=/a,gid=224.0.0.1", "multicast"),
            ("socket=/a,gid=::10.0.0.1", "IPv4-compatible"),
            ("socket=/a,gid=127.0.0.1,color=red", "unknown key"),
            ("socket=/a,gid=127.0.0.1,qpn-base=zz", "not a number"),
            (
                "socket=/a,gid=127.0.0.1,qpn-base=0xffffff,qpn-count=2",
                "24-bit",
            ),
            ("socket=/a,gid=127.0.0.1,qpn-base=0x1ffffffff", "32 bits"),
            ("socket=/a,gid=127.0.0.1,quota=0", "quota"),
            ("socket=/a,gid=127.0.0.1,socket=/b", "twice"),
            ("socket=/a,gid=127.0.0.1,banana", "key=value"),
        ] {
            let e = VmSpec::from_str(s).unwrap_err();
            assert!(e.0.contains(want), "{s}: {e}");
        }
    }

    #[test]
    fn metrics_binds_loopback_unless_told_otherwise() {
        let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", "--metrics", "9791"]).unwrap();
        assert_eq!(c.metrics, Some("127.0.0.1:9791".parse().unwrap()));
        let c = parse(&[
            "--vm",
            "socket=/tmp/x,gid=127.1.0.1",
            "--metrics",
            "0.0.0.0:9791",
        ])
        .unwrap();
        assert_eq!(c.metrics, Some("0.0.0.0:9791".parse().unwrap()));
        let e = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", "--metrics", "x"]).unwrap_err();
        assert!(e.0.contains("--metrics"), "{e}");
    }

    #[test]
    fn cli_values() {
        let c = parse(&[
            "--vm",
            "socket=/tmp/x,gid=127.1.0.1",
            "--vm",
            "socket=/tmp/y,gid=127.1.0.2",
            "--policy",
            "mlx4-post2020",
            "--rx-backlog",
            "8",
            "--bind-port",
            "4792",
            "--metrics",
            "127.0.0.1:9000",
        ])
        .unwrap();
        assert_eq!(c.vms.len(), 2);
        assert_eq!(c.policy, Policy::Mlx4Post2020);
        assert_eq!(
            (c.rx_backlog_bytes, c.bind_port),
            (8 * backlog::MSG_COST, 4792)
        );
        assert!(c.metrics.is_some());
        for (args, want) in [
            (
                &["--policy", "x", "--vm", "socket=/a,gid=127.0.0.1"][..],
                "--policy",
            ),
            (
                &["--vm", "socket=/a,gid=127.0.0.1", "--rx-backlog", "0"][..],
                "rx-backlog",
            ),
            (
                &["--vm", "socket=/a,gid=127.0.0.1", "--bind-port", "70000"][..],
                "bind-port",
            ),
            (
                &["--vm", "socket=/a,gid=127.0.0.1", "--metrics", "x"][..],
                "--metrics",
            ),
            (&[][..], "no VM"),
            (
                &[
                    "--vm",
                    "socket=/a,gid=127.0.0.1",
                    "--vm",
                    "socket=/a,gid=127.0.0.2",
                ][..],
                "socket",
            ),
            (
                &[
                    "--vm",
                    "socket=/a,gid=127.0.0.1",
                    "--vm",
                    "socket=/b,gid=127.0.0.1",
                ][..],
                "GID",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.0.contains(want), "{args:?}: {e}");
        }
    }

    #[test]
    fn typed_values_from_the_command_line_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pvcm.conf");
        std::fs::write(
            &f,
            "vm socket=/tmp/p,gid=127.2.0.1\nrx-backlog-bytes 4M\nrx-host-backlog-bytes=1G\n\
             bind-port 0x12b8\nseed 0x10\nmetrics 9000\ncontrol /tmp/ctl\n",
        )
        .unwrap();
        let c = parse(&["--config", f.to_str().unwrap()]).unwrap();
        assert_eq!(c.rx_backlog_bytes, 4 << 20);
        assert_eq!(c.rx_host_backlog_bytes, 1 << 30);
        assert_eq!((c.bind_port, c.seed), (0x12b8, Some(16)));
        assert_eq!(c.metrics, Some("127.0.0.1:9000".parse().unwrap()));
        assert_eq!(c.control, Some(PathBuf::from("/tmp/ctl")));
        // The command line wins over the file.
        let c = parse(&[
            "--config",
            f.to_str().unwrap(),
            "--rx-host-backlog-bytes",
            "2G",
            "--seed",
            "7",
            "--metrics",
            "0.0.0.0:9001",
        ])
        .unwrap();
        assert_eq!(c.rx_host_backlog_bytes, 2 << 30);
        assert_eq!(c.seed, Some(7));
        assert_eq!(c.metrics, Some("0.0.0.0:9001".parse().unwrap()));
        for (args, want) in [
            (&["--rx-backlog-bytes", "12Q"][..], "--rx-backlog-bytes"),
            (&["--rx-host-backlog-bytes", "100"][..], "a size from"),
            (&["--rx-host-backlog-bytes", "65G"][..], "64G"),
            (&["--bind-port", "0"][..], "must be 1 to 65535"),
            (&["--bind-port", "x"][..], "not a number"),
            (&["--seed", "banana"][..], "--seed"),
            (&["--rx-backlog", "0x"][..], "not a number"),
        ] {
            let mut a = vec!["--vm", "socket=/a,gid=127.0.0.1"];
            a.extend_from_slice(args);
            let e = parse(&a).unwrap_err();
            assert!(e.0.contains(want), "{args:?}: {e}");
        }
        // A bad value in the file names the file.
        std::fs::write(&f, "vm socket=/tmp/p,gid=127.2.0.1\nbind-port 70000\n").unwrap();
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
        assert!(
            e.0.contains("--config") && e.0.contains("--bind-port"),
            "{e}"
        );
    }

    #[test]
    fn config_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pvcm.conf");
        std::fs::write(
            &f,
            "# two VMs\nvm socket=/tmp/p,gid=127.2.0.1,name=p\n\npolicy mlx4-pre2020\n\
             rx-backlog=16\n",
        )
        .unwrap();
        let c = parse(&[
            "--config",
            f.to_str().unwrap(),
            "--vm",
            "socket=/tmp/q,gid=127.2.0.2",
            "--rx-backlog",
            "32",
        ])
        .unwrap();
        assert_eq!(c.vms.len(), 2);
        assert_eq!(c.vms[0].vm.name, "p");
        assert_eq!(c.policy, Policy::Mlx4Pre2020);
        assert_eq!(c.rx_backlog_bytes, 32 * backlog::MSG_COST);
        std::fs::write(&f, "colour blue\n").unwrap();
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
        assert!(e.0.contains("--config"), "{e}");
        let e = parse(&["--config", "/nonexistent/pvcm.conf"]).unwrap_err();
        assert!(e.0.contains("/nonexistent"), "{e}");
    }
}
