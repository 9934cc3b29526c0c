//! The command line: the daemon's options and the subcommands (clap).
//!
//! The options other than `--vm` and `--config` are [`Options`], which a config file's
//! top level is read into as well ([`super::file`]): one list of keys, each with one
//! parser ([`super::values`]) for both.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use clap::{Args, Parser, Subcommand};
use serde::Deserialize;

use super::values::{
    Account, PortSpec, RxMode, de, parse_backlog_messages, parse_backlog_size, parse_bind_port,
    parse_ca_ack_delay, parse_metrics_addr, parse_mode, parse_path_mtu, parse_rx_coalesce,
    parse_seed,
};
use super::vm::VmSpec;
use super::{Config, LogFormat};
use crate::mux::Policy;

/// The daemon's options.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// A VM: `socket=PATH,gid=GID[,gid=GID...,name=N,qpn-base=N,qpn-count=N,ca-guid=N,
    /// quota=N,id-range=BASE/LEN,incoming=yes]` (repeatable; one vhost-user socket per
    /// VM). GID: an IPv4 address (10.0.0.1, its IPv4-mapped GID), an IPv6 address
    /// (2001:db8::1; RoCEv2 over IPv6), or a link-local one with its interface
    /// (fe80::1%br0). `gid` again: another address of the VM (at most 10; the first is
    /// its primary). Defaults: name vm-ADDRESS, qpn-base 0x10000, qpn-count 0x10000,
    /// ca-guid derived from the GID, quota 65536. `id-range` makes the VM migratable;
    /// `incoming=yes` waits for it to arrive.
    #[arg(long = "vm", value_name = "SPEC", value_parser = VmSpec::from_str)]
    pub vms: Vec<VmSpec>,
    /// A config file: TOML if its name ends in .toml (keys as the long options, one
    /// [[vm]] table per VM; see docs/daemon.md), else the line format (one option per
    /// line without the leading dashes). Options on the command line come after the
    /// file's.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The options a config file sets too.
    #[command(flatten)]
    pub options: Options,
}
/// The daemon's options but its VMs and `--config`, as the command line and a config
/// file's top level give them (the file's keys are the long options); `None` where not
/// given. [`Options::or`] puts the command line's over the file's.
#[derive(Debug, Clone, Default, Args, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct Options {
    /// Cache policy: default, mlx4-pre2020 or mlx4-post2020 (the last two reproduce
    /// mlx4's proxy for comparison) [default: default].
    #[arg(long, value_name = "POLICY", value_parser = Policy::from_str)]
    #[serde(deserialize_with = "de::parsed")]
    pub policy: Option<Policy>,
    /// Unix socket for `pvcm-backend stat` and `pvcm-backend vm` (VMs added, removed and
    /// their quotas changed at runtime); mode 0600 unless --control-mode widens it:
    /// whoever can connect can change the VMs [default: none].
    #[arg(long, value_name = "PATH")]
    #[serde(deserialize_with = "de::parsed")]
    pub control: Option<PathBuf>,
    /// Serve Prometheus text metrics over HTTP: a port (bound on 127.0.0.1) or an
    /// address:port (give 0.0.0.0:PORT or another address to serve beyond the host)
    /// [default: none].
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_addr)]
    #[serde(deserialize_with = "de::metrics_addr")]
    pub metrics: Option<SocketAddr>,
    /// Capture every frame sent and received to this pcap file (IPv4 and IPv6
    /// datagrams, LINKTYPE_RAW) [default: none].
    #[arg(long, value_name = "FILE")]
    #[serde(deserialize_with = "de::parsed")]
    pub pcap: Option<PathBuf>,
    /// Memory for messages kept per VM while its rx queue has no buffers (K, M, G
    /// suffixes; about 100,000 MADs at the default); past it they are dropped and
    /// counted (rx_backlog_full) [default: 32M].
    #[arg(long, value_name = "SIZE", value_parser = parse_backlog_size)]
    #[serde(deserialize_with = "de::backlog_size")]
    pub rx_backlog_bytes: Option<usize>,
    /// Memory for the rx backlogs of all VMs together; past it messages are dropped and
    /// counted (rx_host_budget) [default: 512M].
    #[arg(long, value_name = "SIZE", value_parser = parse_backlog_size)]
    #[serde(deserialize_with = "de::backlog_size")]
    pub rx_host_backlog_bytes: Option<usize>,
    /// The per-VM budget as a number of messages (older form of --rx-backlog-bytes).
    #[arg(long, value_name = "N", value_parser = parse_backlog_messages)]
    #[serde(deserialize_with = "de::backlog_messages")]
    pub rx_backlog: Option<u64>,
    /// The RoCEv2 UDP port: the soft port binds it on each VM address and sends to it;
    /// the packet port filters on it and sends to it [default: 4791].
    #[arg(long, value_name = "PORT", value_parser = parse_bind_port)]
    #[serde(deserialize_with = "de::bind_port")]
    pub bind_port: Option<u16>,
    /// How the soft RoCE port receives from IPv4 peers: `raw` checks each frame's ICRC
    /// over its IPv4 header as received and accepts every conformant sender (Linux rxe,
    /// hardware); it needs CAP_NET_RAW. `udp` needs no privilege but accepts only
    /// senders that write IP ID 0 (pvcm peers). `auto`: raw if permitted, else udp with
    /// a warning. IPv6 VMs are read through their own sockets in every mode (exact
    /// ICRC, any sender) [default: auto].
    #[arg(long, value_name = "MODE", value_enum)]
    #[serde(deserialize_with = "de::parsed")]
    pub wire_rx: Option<RxMode>,
    /// The wire port: `soft` (pvcm's own RoCEv2 port over UDP on the VMs' addresses),
    /// `umad:DEVICE[:PORT]` (a real RDMA device's QP1 through /dev/infiniband/umadN,
    /// e.g. umad:rxe0:1 or umad:mlx4_0:1; the kernel CM must not be loaded; see
    /// docs/umad.md) or `packet:DEV[:IFACE]` (VMs with their own NICs: their QP1 frames
    /// are diverted to network device DEV and read there, answers leave through the
    /// host's IP stack with the VM's address as source; IFACE is the interface of
    /// link-local IPv6 destinations; needs CAP_NET_RAW; see docs/packet-port.md).
    /// --wire-rx applies to the soft port only; --bind-port is the RoCEv2 UDP port of
    /// the soft and packet ports [default: soft].
    #[arg(long, value_name = "PORT", value_parser = PortSpec::from_str)]
    #[serde(deserialize_with = "de::parsed")]
    pub port: Option<PortSpec>,
    /// sysfs mount (the umad port reads the GID and P_Key tables there).
    #[arg(long, value_name = "DIR", hide = true)]
    #[serde(deserialize_with = "de::parsed")]
    pub sysfs: Option<PathBuf>,
    /// Seed of the mux's ID permutation (random unless given; for reproducible tests).
    #[arg(long, value_name = "N", hide = true, value_parser = parse_seed)]
    #[serde(deserialize_with = "de::seed")]
    pub seed: Option<u64>,
    /// Keep the mux's state (every connection's IDs and mapping, quarantine) in a
    /// journal in this directory, so that a restart, an upgrade or a crash of the daemon
    /// loses no connection: started again with the same options, it restores the state
    /// and the VMs reconnect (see docs/restart.md). The VM changes made at runtime
    /// (`pvcm-backend vm`) are kept there too (vms.toml) and applied over the config
    /// file at start. Without it, stopping the daemon releases every connection and
    /// forgets the runtime changes [default: none].
    #[arg(long, value_name = "DIR")]
    #[serde(deserialize_with = "de::parsed")]
    pub state_dir: Option<PathBuf>,
    /// With --state-dir: how long a restored VM may take to reconnect before its
    /// connections are released on its behalf, in seconds [default: 60].
    #[arg(long, value_name = "SECS", value_parser = parse_seed)]
    #[serde(deserialize_with = "de::seed")]
    pub reconnect_grace: Option<u64>,
    /// The owner of the VMs' vhost-user sockets: a user name or number (giving them to
    /// another user needs CAP_CHOWN) [default: the daemon's user].
    #[arg(long, value_name = "USER", value_parser = Account::from_str)]
    #[serde(deserialize_with = "de::parsed")]
    pub socket_owner: Option<Account>,
    /// The group of the VMs' vhost-user sockets: a group name or number, e.g. the
    /// VMM's group (kvm, libvirt-qemu) [default: the daemon's group].
    #[arg(long, value_name = "GROUP", value_parser = Account::from_str)]
    #[serde(deserialize_with = "de::parsed")]
    pub socket_group: Option<Account>,
    /// The permission bits of the VMs' vhost-user sockets, in octal; connecting needs
    /// write permission, so 0660 lets the owner and the group connect and nobody else
    /// [default: 0660].
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    #[serde(deserialize_with = "de::mode")]
    pub socket_mode: Option<u32>,
    /// The owner of the control socket: a user name or number [default: the daemon's
    /// user].
    #[arg(long, value_name = "USER", value_parser = Account::from_str)]
    #[serde(deserialize_with = "de::parsed")]
    pub control_owner: Option<Account>,
    /// The group of the control socket: a group name or number (with --control-mode
    /// 0660, its members may run `pvcm-backend stat`) [default: the daemon's group].
    #[arg(long, value_name = "GROUP", value_parser = Account::from_str)]
    #[serde(deserialize_with = "de::parsed")]
    pub control_group: Option<Account>,
    /// The permission bits of the control socket, in octal [default: 0600].
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    #[serde(deserialize_with = "de::mode")]
    pub control_mode: Option<u32>,
    /// Allow --socket-mode and --control-mode to give other users (the `o` bits)
    /// access: without it such a mode is refused, since it lets every local user
    /// connect (`--allow-world-access`, or `=true`/`=false`) [default: false].
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true"
    )]
    #[serde(deserialize_with = "de::parsed")]
    pub allow_world_access: Option<bool>,
    /// The log format on stderr: `text` (one line per event; colour only on a
    /// terminal, never with NO_COLOR set) or `json` (one JSON object per line). RUST_LOG
    /// sets the level [default: text].
    #[arg(long, value_name = "FORMAT", value_enum)]
    #[serde(deserialize_with = "de::value_enum")]
    pub log_format: Option<LogFormat>,
    /// The path MTU a VM uses where the port cannot tell its link's (the packet port):
    /// 256, 512, 1024, 2048 or 4096 bytes. The soft and umad ports take it from the
    /// network device behind the VM's address, as rdma_cm does [default: 1024].
    #[arg(long, value_name = "BYTES", value_parser = parse_path_mtu)]
    #[serde(deserialize_with = "de::path_mtu")]
    pub path_mtu: Option<u8>,
    /// The local CA ACK delay a VM puts in its REQs and REPs where the port cannot read
    /// the device's (the umad port reads it with `ibv_devinfo`): a 5-bit exponent
    /// (4.096 us x 2^N), the `local_ca_ack_delay` of the VM's RDMA function as
    /// `ibv_devinfo -v` shows it [default: 15, rdma_rxe's].
    #[arg(long, value_name = "N", value_parser = parse_ca_ack_delay)]
    #[serde(deserialize_with = "de::ca_ack_delay")]
    pub ca_ack_delay: Option<u8>,
    /// Receive coalescing, as a NIC's interrupt moderation: after a wakeup that read a
    /// batch of MADs (8 or more) from the wire, the host loop sleeps this long before
    /// it waits again, so that it reads fuller batches and the senders do not pay a
    /// wakeup every few frames. A wakeup that read fewer waits at once: a lone MAD is
    /// never delayed. 0 turns it off; at most 1000 [default: 50].
    #[arg(long, value_name = "USECS", value_parser = parse_rx_coalesce)]
    #[serde(deserialize_with = "de::rx_coalesce")]
    pub rx_coalesce_us: Option<u64>,
}

impl Options {
    /// These options over `under`'s: each one given here, else `under`'s.
    pub fn or(self, under: Options) -> Options {
        Options {
            policy: self.policy.or(under.policy),
            control: self.control.or(under.control),
            metrics: self.metrics.or(under.metrics),
            pcap: self.pcap.or(under.pcap),
            rx_backlog_bytes: self.rx_backlog_bytes.or(under.rx_backlog_bytes),
            rx_host_backlog_bytes: self.rx_host_backlog_bytes.or(under.rx_host_backlog_bytes),
            rx_backlog: self.rx_backlog.or(under.rx_backlog),
            bind_port: self.bind_port.or(under.bind_port),
            wire_rx: self.wire_rx.or(under.wire_rx),
            port: self.port.or(under.port),
            sysfs: self.sysfs.or(under.sysfs),
            seed: self.seed.or(under.seed),
            state_dir: self.state_dir.or(under.state_dir),
            reconnect_grace: self.reconnect_grace.or(under.reconnect_grace),
            socket_owner: self.socket_owner.or(under.socket_owner),
            socket_group: self.socket_group.or(under.socket_group),
            socket_mode: self.socket_mode.or(under.socket_mode),
            control_owner: self.control_owner.or(under.control_owner),
            control_group: self.control_group.or(under.control_group),
            control_mode: self.control_mode.or(under.control_mode),
            allow_world_access: self.allow_world_access.or(under.allow_world_access),
            log_format: self.log_format.or(under.log_format),
            path_mtu: self.path_mtu.or(under.path_mtu),
            ca_ack_delay: self.ca_ack_delay.or(under.ca_ack_delay),
            rx_coalesce_us: self.rx_coalesce_us.or(under.rx_coalesce_us),
        }
    }
}

/// The long options a config file may set (every one but `--config`, `--help` and
/// `--version`), as its keys.
pub fn config_keys() -> Vec<String> {
    use clap::CommandFactory;
    Cli::command()
        .get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| !matches!(*l, "config" | "help" | "version"))
        .map(str::to_string)
        .collect()
}

/// `pvcm-backend stat` options.
#[derive(Debug, Clone, Args)]
pub struct StatArgs {
    /// The daemon: its control socket, or its config file.
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Print JSON instead of the table (docs/operations.md describes it).
    #[arg(long)]
    pub json: bool,
}

/// `pvcm-backend check-config` options.
#[derive(Debug, Clone, Args)]
pub struct CheckConfigArgs {
    /// The config file (TOML if its name ends in .toml, else the line format).
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
}

/// Subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print the counters of a running daemon.
    Stat(StatArgs),
    /// Check a config file as the daemon would read it (users and groups resolved),
    /// print what it configures, and exit 0; or print the first error, naming the key,
    /// and exit 2.
    CheckConfig(CheckConfigArgs),
    /// List, add or remove a running daemon's VMs, or change a VM's quota, through its
    /// control socket (docs/operations.md). Changes last until the next restart; with
    /// --state-dir they survive it.
    Vm(VmArgs),
    /// Make a running daemon read its configuration again (as SIGHUP does) and wait for
    /// the result: exit 0 when it loaded (the VMs changed by the difference; options
    /// that take effect at the next start only are named), 1 when it did not (the file
    /// does not read or check, or the VMs break a rule: nothing changed), saying why.
    /// systemctl reload runs it.
    Reload(DaemonArgs),
}

/// Which running daemon a command asks (`stat`, `vm`, `reload`): its control socket,
/// given, or named by the `control` key of its config file.
#[derive(Debug, Clone, Args)]
#[group(required = true, multiple = false)]
pub struct DaemonArgs {
    /// The daemon's control socket.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// The daemon's config file, whose `control` key names the socket.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

impl DaemonArgs {
    /// The control socket's path.
    pub fn control_socket(&self) -> Result<PathBuf, String> {
        match (&self.control, &self.config) {
            (Some(c), _) => Ok(c.clone()),
            (None, Some(file)) => Config::from_args(&ServeArgs {
                config: Some(file.clone()),
                ..ServeArgs::default()
            })
            .map_err(|e| e.to_string())
            .and_then(|cfg| {
                cfg.control.ok_or_else(|| {
                    format!(
                        "{} names no control socket (control = PATH)",
                        file.display()
                    )
                })
            }),
            (None, None) => Err("--control or --config is needed".to_string()),
        }
    }
}

/// `pvcm-backend vm` options.
#[derive(Debug, Clone, Args)]
pub struct VmArgs {
    /// The daemon: its control socket, or its config file.
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// What to do.
    #[command(subcommand)]
    pub op: VmOp,
}

/// `pvcm-backend vm` operations.
#[derive(Debug, Clone, Subcommand)]
pub enum VmOp {
    /// Print the daemon's VMs as JSON: each VM's spec, quota, whether a session is
    /// attached, and whether it came from the config file or at runtime.
    List,
    /// Add a VM: `socket=PATH,gid=GID[,name=N,quota=N,id-range=BASE/LEN,...]`, the keys
    /// of --vm. Its socket listens when this returns.
    Add {
        /// The VM, as --vm takes it.
        #[arg(value_name = "SPEC")]
        spec: String,
    },
    /// Remove a VM: its session ends and its connections are released on its behalf,
    /// as when the VM dies; its socket is removed.
    Remove {
        /// The VM's name.
        #[arg(value_name = "NAME")]
        name: String,
    },
    /// Set a VM's quota of live connections. Below what it holds now, its connections
    /// stay and new ones are refused (over_quota) until it is below.
    Quota {
        /// The VM's name.
        #[arg(value_name = "NAME")]
        name: String,
        /// The quota (at least 1), or `default` for the host's default.
        #[arg(value_name = "N")]
        quota: String,
    },
}

/// The `pvcm-backend` command line.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pvcm-backend",
    version,
    about = "pvcm host daemon: para-virtual IB CM devices for VMs over vhost-user, \
             multiplexed onto one RoCEv2 port (soft, a device's QP1 via umad, or QP1 \
             frames diverted from the VMs' own NICs)",
    after_help = "Without a subcommand, runs the daemon. Exit codes: 0 after SIGTERM or \
                  SIGINT; 2 for a bad option or config file; 1 when the daemon cannot \
                  start (a socket cannot be bound, a device cannot be opened). Under \
                  systemd (Type=notify) it reports READY=1 once every socket listens. \
                  SIGHUP reads the config file again and applies the difference in its \
                  VMs (a file that does not check changes nothing); `pvcm-backend vm` \
                  adds, removes and changes VMs of the running daemon. See \
                  docs/daemon.md and docs/operations.md.",
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
