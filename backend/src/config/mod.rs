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
//! A `--config FILE` holds the same options: TOML (the long options as keys, one
//! `[[vm]]` table per VM) or, for a file whose name does not end in `.toml`, one option
//! per line without the leading dashes (`vm socket=...,gid=...`, `policy default`,
//! `# comments`). Options on the command line come after the file's (a later scalar
//! option wins, VMs add up).
//!
//! One path from both to [`Config`]: the command line is parsed by clap into
//! [`ServeArgs`], the file by serde into the same typed [`Options`] (unknown keys
//! refused) and [`VmSpec`]s (`file.rs`); [`Config::from_args`] puts the command line's
//! options over the file's ([`Options::or`]) and checks the whole. Each kind of value has
//! one parser for both (`values.rs`); a bad value is an error naming the option, or the
//! file, its line and the key ([`ConfigError`]); nothing here panics.
//!
//! The files: `cli.rs` (clap), `file.rs` (the config file), `vm.rs` (one VM),
//! `values.rs` (the values' parsers), `located.rs` (serde's errors with their key and
//! line).

mod cli;
mod file;
mod located;
mod values;
mod vm;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub use cli::{
    CheckConfigArgs, Cli, Command, DaemonArgs, Options, ServeArgs, StatArgs, VmArgs, VmOp,
    config_keys,
};
pub use pvcm_log::LogFormat;
pub use values::{Account, PortSpec, RxMode, check_ifname};
pub use vm::{VM_KEYS, VmSpec, check_sockets_outside_state, check_vm_set, gid_addr, parse_gid};
pub(crate) use vm::{toml_vms, vm_tables};

use crate::backlog;
pub use crate::files::SocketAccess;
use crate::mux::{IdRange, Policy};

/// Default RoCEv2 UDP port.
pub const DEFAULT_PORT: u16 = pvcm_wire::roce::UDP_PORT;
/// Largest accepted backlog budget, per VM or host-wide (64 GiB).
pub const MAX_BACKLOG_BYTES: usize = 64 << 30;

/// A configuration error: what was wrong, in words for the operator, naming the option
/// or the config file's key and the values it takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A value an option or key does not take.
    #[error("{key}={value:?}: {why}")]
    BadValue {
        /// The option or key (`qpn-base`, `bind-port`).
        key: String,
        /// The value given.
        value: String,
        /// What the key takes.
        why: String,
    },
    /// A value's problem on its own: the caller (clap, or the whole it belongs to) names
    /// the option.
    #[error("{0}")]
    Invalid(String),
    /// A key the option or the file does not have.
    #[error("unknown key {key:?} (expected {expected})")]
    UnknownKey {
        /// The key given.
        key: String,
        /// The keys there are.
        expected: String,
    },
    /// A key given twice in one VM.
    #[error("{key} given twice")]
    Twice {
        /// The key.
        key: String,
    },
    /// A required key is missing.
    #[error("{key}={what} is required")]
    Missing {
        /// The key.
        key: &'static str,
        /// What it takes.
        what: &'static str,
    },
    /// A part of a `--vm` spec that is not `key=value`.
    #[error("{0:?} is not key=value")]
    NotKeyValue(String),
    /// A config file's value of the wrong TOML type.
    #[error("{key}: expected {expected}, found {found}")]
    WrongType {
        /// The key, with its table (`vm #2: quota`).
        key: String,
        /// The type it takes.
        expected: &'static str,
        /// The type given.
        found: &'static str,
    },
    /// One VM's spec is wrong.
    #[error("{vm}: {source}")]
    Vm {
        /// The VM: `--vm "socket=..."`, or `[[vm]] #N` in a config file.
        vm: String,
        /// What is wrong with it.
        source: Box<ConfigError>,
    },
    /// No VM is configured.
    #[error(
        "no VM: give at least one --vm socket=PATH,gid=GID (or a [[vm]] table in the \
         config file)"
    )]
    NoVm,
    /// Two VMs share what must be theirs alone.
    #[error("two VMs use {what} {value}: VM {first:?} and VM {second:?}")]
    Duplicate {
        /// `socket`, `GID` or `name`.
        what: &'static str,
        /// The shared value.
        value: String,
        /// The VM named first (its name, or its table's place in the file).
        first: String,
        /// The VM that repeats it.
        second: String,
    },
    /// Two VMs' ID ranges share IDs.
    #[error("the ID ranges of VMs {a:?} ({ra}) and {b:?} ({rb}) overlap")]
    IdRangeOverlap {
        /// One VM.
        a: String,
        /// Its range.
        ra: IdRange,
        /// The other VM.
        b: String,
        /// Its range.
        rb: IdRange,
    },
    /// The control socket's path is a VM's socket.
    #[error("the control socket is also a VM socket")]
    ControlIsVmSocket,
    /// A socket's path is a file of the state directory.
    #[error(
        "socket {}: that is the state directory's file {file} (--state-dir {}): choose \
         another path for the socket",
        path.display(),
        dir.display()
    )]
    SocketInStateDir {
        /// The socket's path.
        path: PathBuf,
        /// The state directory.
        dir: PathBuf,
        /// The state file it names.
        file: &'static str,
    },
    /// An rx backlog budget outside its range.
    #[error("{which} rx backlog budget {bytes}: must be {min} bytes to 64G")]
    BacklogBudget {
        /// `per-VM` or `host`.
        which: &'static str,
        /// The budget given.
        bytes: usize,
        /// The smallest budget (one message).
        min: usize,
    },
    /// A socket mode that gives every local user access, without
    /// `--allow-world-access`.
    #[error(
        "{key}={mode:04o}: every local user could connect (the mode's \"other\" bits); \
         use a group (e.g. {key} = 0o660 with a socket group), or give \
         allow-world-access = true (--allow-world-access) if that is meant"
    )]
    WorldAccess {
        /// `socket-mode` or `control-mode`.
        key: &'static str,
        /// The mode given.
        mode: u32,
    },
    /// `--bind-port 0`.
    #[error("bind port must not be 0")]
    BindPortZero,
    /// `--state-dir` with a comparison policy.
    #[error(
        "--state-dir keeps the default policy's state; the {policy} policy is a comparison \
         policy without it: use --policy default"
    )]
    StateDirPolicy {
        /// The policy given.
        policy: &'static str,
    },
    /// A user or group name that does not resolve.
    #[error("{key}={name:?}: no such {what} on this host")]
    NoSuchAccount {
        /// The option (`socket-owner`, `control-group`).
        key: &'static str,
        /// `user` or `group`.
        what: &'static str,
        /// The name given.
        name: String,
    },
    /// The config file cannot be read.
    #[error("--config {}: {error}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error, in words.
        error: String,
    },
    /// The config file is not valid TOML (toml's message).
    #[error("{0}")]
    Toml(String),
    /// An error in the config file.
    #[error(
        "--config {}: {}{source}",
        path.display(),
        line.map_or(String::new(), |n| format!("line {n}: "))
    )]
    InFile {
        /// The file.
        path: PathBuf,
        /// The line the error is on, where it is on one.
        line: Option<usize>,
        /// The error in it.
        source: Box<ConfigError>,
    },
}

impl ConfigError {
    pub(crate) fn bad(key: &str, value: &str, why: impl Into<String>) -> ConfigError {
        ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            why: why.into(),
        }
    }

    pub(crate) fn vm(vm: &str, e: ConfigError) -> ConfigError {
        ConfigError::Vm {
            vm: vm.to_string(),
            source: Box::new(e),
        }
    }
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
    /// Who may connect to the VMs' vhost-user sockets.
    pub vm_sockets: SocketAccess,
    /// Who may connect to the control socket.
    pub control_access: SocketAccess,
    /// Whether a socket mode may give other users (the `o` bits) access.
    pub allow_world_access: bool,
    /// The log format.
    pub log_format: LogFormat,
    /// The path MTU (IBTA code) where the port cannot tell the link's.
    pub path_mtu: u8,
    /// The local CA ACK delay VMs report (5-bit exponent).
    pub ca_ack_delay: u8,
    /// How long the host loop sleeps after a busy wakeup (zero: never).
    pub rx_coalesce: std::time::Duration,
}

/// The path MTU (IBTA code) when neither the port nor `--path-mtu` tells: 1024 bytes,
/// rdma_cm's RoCE default.
pub const DEFAULT_PATH_MTU: u8 = pvcm_wire::abi::MTU_1024;
/// The local CA ACK delay (5-bit exponent) without `--ca-ack-delay`: 15, what rdma_rxe
/// reports (`RXE_LOCAL_CA_ACK_DELAY`).
pub const DEFAULT_CA_ACK_DELAY: u8 = 15;

/// `--path-mtu`: bytes (256 ... 4096, a power of two) to the IBTA code.
/// The host loop's receive coalescing without `--rx-coalesce-us`.
pub const DEFAULT_RX_COALESCE: std::time::Duration = std::time::Duration::from_micros(50);

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
            vm_sockets: SocketAccess::VM_DEFAULT,
            control_access: SocketAccess::CONTROL_DEFAULT,
            allow_world_access: false,
            log_format: LogFormat::Text,
            path_mtu: DEFAULT_PATH_MTU,
            ca_ack_delay: DEFAULT_CA_ACK_DELAY,
            rx_coalesce: DEFAULT_RX_COALESCE,
        }
    }

    /// The options (their long names) that differ between this configuration, the one
    /// running, and `new`, besides the VMs: a reload applies the VMs only, so these take
    /// effect at the next start.
    pub fn restart_options(&self, new: &Config) -> Vec<&'static str> {
        fn differs<T: fmt::Debug>(a: &T, b: &T) -> bool {
            format!("{a:?}") != format!("{b:?}")
        }
        let (a, b) = (self, new);
        let mut out = Vec::new();
        let mut check = |name: &'static str, changed: bool| {
            if changed {
                out.push(name);
            }
        };
        check("policy", differs(&a.policy, &b.policy));
        check("control", differs(&a.control, &b.control));
        check("metrics", differs(&a.metrics, &b.metrics));
        check("pcap", differs(&a.pcap, &b.pcap));
        check("rx-backlog-bytes", a.rx_backlog_bytes != b.rx_backlog_bytes);
        check(
            "rx-host-backlog-bytes",
            a.rx_host_backlog_bytes != b.rx_host_backlog_bytes,
        );
        check("bind-port", a.bind_port != b.bind_port);
        check("wire-rx", differs(&a.wire_rx, &b.wire_rx));
        check("port", differs(&a.port, &b.port));
        check("sysfs", a.sysfs != b.sysfs);
        check("seed", a.seed != b.seed);
        check("state-dir", a.state_dir != b.state_dir);
        check("reconnect-grace", a.reconnect_grace != b.reconnect_grace);
        check(
            "socket-owner/group/mode",
            differs(&a.vm_sockets, &b.vm_sockets),
        );
        check(
            "control-owner/group/mode",
            differs(&a.control_access, &b.control_access),
        );
        check(
            "allow-world-access",
            a.allow_world_access != b.allow_world_access,
        );
        check("log-format", differs(&a.log_format, &b.log_format));
        check("path-mtu", a.path_mtu != b.path_mtu);
        check("ca-ack-delay", a.ca_ack_delay != b.ca_ack_delay);
        check("rx-coalesce-us", a.rx_coalesce != b.rx_coalesce);
        out
    }

    /// The configuration of a command line: its `--config` file's (if given), with the
    /// command line's options over the file's and its VMs after the file's, checked.
    pub fn from_args(args: &ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => file::read(path)?,
            None => file::FileConfig::default(),
        };
        let mut vms = file.vms;
        vms.extend(args.vms.iter().cloned());
        Config::build(vms, args.options.clone().or(file.options))
    }

    /// The configuration of these VMs and options: defaults where an option is not
    /// given, users and groups looked up, checked.
    fn build(vms: Vec<VmSpec>, o: Options) -> Result<Config, ConfigError> {
        let user = |key, a: &Option<Account>| match a {
            Some(a) => a.user_id().map(Some).ok_or_else(|| no_such(key, "user", a)),
            None => Ok(None),
        };
        let group = |key, a: &Option<Account>| match a {
            Some(a) => a
                .group_id()
                .map(Some)
                .ok_or_else(|| no_such(key, "group", a)),
            None => Ok(None),
        };
        let d = Config::new(Vec::new());
        let cfg = Config {
            vm_sockets: SocketAccess {
                owner: user("socket-owner", &o.socket_owner)?,
                group: group("socket-group", &o.socket_group)?,
                mode: o.socket_mode.unwrap_or(d.vm_sockets.mode),
            },
            control_access: SocketAccess {
                owner: user("control-owner", &o.control_owner)?,
                group: group("control-group", &o.control_group)?,
                mode: o.control_mode.unwrap_or(d.control_access.mode),
            },
            vms,
            policy: o.policy.unwrap_or(d.policy),
            control: o.control,
            metrics: o.metrics,
            pcap: o.pcap,
            // The value parsers checked the ranges: the product stays within 64G.
            rx_backlog_bytes: o.rx_backlog_bytes.unwrap_or_else(|| {
                o.rx_backlog
                    .map_or(d.rx_backlog_bytes, |n| n as usize * backlog::MSG_COST)
            }),
            rx_host_backlog_bytes: o.rx_host_backlog_bytes.unwrap_or(d.rx_host_backlog_bytes),
            bind_port: o.bind_port.unwrap_or(d.bind_port),
            wire_rx: o.wire_rx.unwrap_or(d.wire_rx),
            port: o.port.unwrap_or(d.port),
            sysfs: o.sysfs.unwrap_or(d.sysfs),
            seed: o.seed,
            state_dir: o.state_dir,
            reconnect_grace: o
                .reconnect_grace
                .map_or(d.reconnect_grace, std::time::Duration::from_secs),
            allow_world_access: o.allow_world_access.unwrap_or(d.allow_world_access),
            log_format: o.log_format.unwrap_or(d.log_format),
            path_mtu: o.path_mtu.unwrap_or(d.path_mtu),
            ca_ack_delay: o.ca_ack_delay.unwrap_or(d.ca_ack_delay),
            rx_coalesce: o
                .rx_coalesce_us
                .map_or(d.rx_coalesce, std::time::Duration::from_micros),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the whole: at least one VM, no socket or GID twice.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.vms.is_empty() {
            return Err(ConfigError::NoVm);
        }
        check_vm_set(&self.vms, self.control.as_deref())?;
        check_sockets_outside_state(self.socket_paths(), self.state_dir.as_deref())?;
        for (which, bytes) in [
            ("per-VM", self.rx_backlog_bytes),
            ("host", self.rx_host_backlog_bytes),
        ] {
            if !(backlog::MSG_COST..=MAX_BACKLOG_BYTES).contains(&bytes) {
                return Err(ConfigError::BacklogBudget {
                    which,
                    bytes,
                    min: backlog::MSG_COST,
                });
            }
        }
        if self.bind_port == 0 {
            return Err(ConfigError::BindPortZero);
        }
        if self.state_dir.is_some() && self.policy.is_legacy() {
            return Err(ConfigError::StateDirPolicy {
                policy: self.policy.name(),
            });
        }
        for (key, a) in [
            ("socket-mode", self.vm_sockets),
            ("control-mode", self.control_access),
        ] {
            if a.mode > 0o777 {
                return Err(ConfigError::bad(
                    key,
                    &format!("{:o}", a.mode),
                    "permission bits, at most 0777",
                ));
            }
            if a.mode & 0o007 != 0 && !self.allow_world_access {
                return Err(ConfigError::WorldAccess { key, mode: a.mode });
            }
        }
        Ok(())
    }

    /// Every socket the daemon listens on: the VMs', then the control socket.
    pub fn socket_paths(&self) -> impl Iterator<Item = &Path> {
        self.vms
            .iter()
            .map(|v| v.socket.as_path())
            .chain(self.control.as_deref())
    }

    /// What the configuration sets up, in a few lines (`pvcm-backend check-config`).
    pub fn summary(&self) -> String {
        use fmt::Write;
        let mut s = String::new();
        let access = |a: &SocketAccess| {
            format!(
                "mode {:04o}, owner {}, group {}",
                a.mode,
                a.owner.map_or("the daemon's".into(), |u| u.to_string()),
                a.group.map_or("the daemon's".into(), |g| g.to_string())
            )
        };
        let _ = writeln!(
            s,
            "port {}, policy {}, wire rx {}, RoCEv2 UDP port {}, rx coalescing {} us",
            self.port,
            self.policy.name(),
            self.wire_rx.name(),
            self.bind_port,
            self.rx_coalesce.as_micros()
        );
        for v in &self.vms {
            let _ = writeln!(
                s,
                "vm {}: socket {}, gid {}, qpn {:#x}+{:#x}, ca-guid {:#018x}, quota {}{}{}",
                v.vm.name,
                v.socket.display(),
                v.gids_text(),
                v.vm.qpn_base,
                v.vm.qpn_count,
                v.vm.ca_guid,
                v.vm.quota.map_or("default".into(), |q| q.to_string()),
                v.vm.id_range
                    .map_or(String::new(), |r| format!(", id-range {r}")),
                if v.incoming { ", incoming" } else { "" }
            );
        }
        let _ = writeln!(s, "vm sockets: {}", access(&self.vm_sockets));
        match &self.control {
            Some(c) => {
                let _ = writeln!(
                    s,
                    "control {}: {}",
                    c.display(),
                    access(&self.control_access)
                );
            }
            None => s.push_str("control: none\n"),
        }
        let _ = writeln!(
            s,
            "metrics {}, pcap {}, state-dir {}",
            self.metrics.map_or("none".into(), |m| m.to_string()),
            self.pcap
                .as_ref()
                .map_or("none".into(), |p| p.display().to_string()),
            self.state_dir
                .as_ref()
                .map_or("none".into(), |p| p.display().to_string())
        );
        let _ = writeln!(
            s,
            "rx backlog {} bytes per VM, {} bytes per host",
            self.rx_backlog_bytes, self.rx_host_backlog_bytes
        );
        s
    }
}

fn no_such(key: &'static str, what: &'static str, a: &Account) -> ConfigError {
    ConfigError::NoSuchAccount {
        key,
        what,
        name: a.to_string(),
    }
}

#[cfg(test)]
mod tests;
