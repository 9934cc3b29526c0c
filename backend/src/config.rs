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
pub use crate::files::SocketAccess;
use crate::mux::{IdRange, Policy, VmConfig};
pub use pvcm_log::LogFormat;

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
    /// The config file is not valid TOML.
    #[error("{0}")]
    Toml(String),
    /// An error in the config file.
    #[error("--config {}: {source}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// The error in it.
        source: Box<ConfigError>,
    },
    /// The command line (or a line of the line-based config file) is not valid; clap's
    /// message.
    #[error("{0}")]
    Cli(String),
}

impl ConfigError {
    fn bad(key: &str, value: &str, why: impl Into<String>) -> ConfigError {
        ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            why: why.into(),
        }
    }

    fn vm(vm: &str, e: ConfigError) -> ConfigError {
        ConfigError::Vm {
            vm: vm.to_string(),
            source: Box::new(e),
        }
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid(msg.into()))
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
    number(v).ok_or_else(|| ConfigError::bad(key, v.trim(), NOT_A_NUMBER))
}

fn parse_u32(key: &str, v: &str) -> Result<u32, ConfigError> {
    let n = parse_u64(key, v)?;
    u32::try_from(n).map_err(|_| ConfigError::bad(key, v, "larger than 32 bits"))
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
    let bad = |why: String| ConfigError::bad("gid", v, why);
    let gid = Gid::from_str(addr).map_err(|_| {
        bad(
            "not a GID: give an IPv4 address (10.0.0.1), an IPv4-mapped GID \
             (::ffff:10.0.0.1) or an IPv6 address (2001:db8::1, fe80::1%IFACE)"
                .into(),
        )
    })?;
    if let Some(why) = gid.roce_unicast_problem() {
        return Err(bad(format!(
            "{why} cannot be a VM's GID (a unicast RoCE address)"
        )));
    }
    match (gid.is_link_local(), iface) {
        (true, None) => Err(bad(format!(
            "a link-local GID is reachable through one interface only: name it, \
             e.g. gid={addr}%br0"
        ))),
        (true, Some(i)) => {
            check_ifname(i).map_err(bad)?;
            Ok((gid, Some(i.to_string())))
        }
        (false, Some(_)) => Err(bad(
            "only a link-local GID (fe80::/10) takes an interface (%IFACE)".into(),
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

/// The keys of a VM (`--vm`, `[[vm]]`).
pub const VM_KEYS: &str = "socket, gid, name, qpn-base, qpn-count, ca-guid, quota, id-range, \
                           incoming";

impl VmSpec {
    /// A VM from its `key=value` pairs: `--vm`'s, or a config file's `[[vm]]` table's.
    /// An error names the key (and the caller names the VM).
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<VmSpec, ConfigError> {
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
        for (k, v) in pairs {
            let (k, v) = (k.trim(), v.trim());
            let dup = |set: bool| {
                if set {
                    Err(ConfigError::Twice { key: k.to_string() })
                } else {
                    Ok(())
                }
            };
            match k {
                "socket" | "socket-path" => {
                    dup(socket.is_some())?;
                    if v.is_empty() {
                        return Err(ConfigError::bad(k, v, "empty"));
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
                        return Err(ConfigError::bad(k, v, "must be 1 to 48 bytes"));
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
                        IdRange::from_str(v).map_err(|e| ConfigError::bad(k, v, e.to_string()))?,
                    );
                }
                "incoming" => {
                    dup(incoming.is_some())?;
                    incoming = Some(match v {
                        "yes" | "true" | "1" => true,
                        "no" | "false" | "0" => false,
                        _ => return Err(ConfigError::bad(k, v, "expected yes or no")),
                    });
                }
                _ => {
                    return Err(ConfigError::UnknownKey {
                        key: k.to_string(),
                        expected: VM_KEYS.into(),
                    });
                }
            }
        }
        let Some(socket) = socket else {
            return Err(ConfigError::Missing {
                key: "socket",
                what: "PATH",
            });
        };
        let Some(gid) = gid else {
            return Err(ConfigError::Missing {
                key: "gid",
                what: "GID",
            });
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
            return err("qpn-base + qpn-count must stay within 24-bit QPNs (<= 0x1000000)");
        }
        if vm.qpn_count != 0 && vm.qpn_base < 2 {
            return Err(ConfigError::bad(
                "qpn-base",
                &vm.qpn_base.to_string(),
                "must be at least 2 (QP0 and QP1 are special)",
            ));
        }
        if let Some(g) = ca_guid {
            if g == 0 {
                return Err(ConfigError::bad("ca-guid", "0", "must not be 0"));
            }
            vm.ca_guid = g;
        }
        if let Some(q) = quota {
            if q == 0 {
                return Err(ConfigError::bad("quota", "0", "must be at least 1"));
            }
            vm.quota = Some(q);
        }
        if let (Some(q), Some(r)) = (vm.quota, id_range)
            && u64::from(q) * 2 > r.size()
        {
            return Err(ConfigError::bad(
                "quota",
                &q.to_string(),
                format!(
                    "id-range {r} holds {} IDs, and a quota needs twice its connections' \
                     IDs (freed IDs wait in quarantine)",
                    r.size()
                ),
            ));
        }
        vm.id_range = id_range;
        let incoming = incoming.unwrap_or(false);
        if incoming && id_range.is_none() {
            return err(
                "incoming=yes needs id-range=BASE/LEN (the range the VM's connections \
                 carry from the host it leaves)",
            );
        }
        Ok(VmSpec {
            socket,
            vm,
            incoming,
            iface,
        })
    }
}

impl VmSpec {
    /// The VM's `key=value` pairs, as `--vm` and a `[[vm]]` table take them: every key
    /// with its value, so that [`VmSpec::from_pairs`] gives this spec back.
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        let v = &self.vm;
        let gid = match &self.iface {
            Some(i) => format!("{}%{i}", v.gid),
            None => v.gid.to_string(),
        };
        let mut p = vec![
            ("name", v.name.clone()),
            ("socket", self.socket.display().to_string()),
            ("gid", gid),
            ("qpn-base", format!("{:#x}", v.qpn_base)),
            ("qpn-count", format!("{:#x}", v.qpn_count)),
            ("ca-guid", format!("{:#018x}", v.ca_guid)),
        ];
        if let Some(q) = v.quota {
            p.push(("quota", q.to_string()));
        }
        if let Some(r) = v.id_range {
            p.push(("id-range", r.to_string()));
        }
        if self.incoming {
            p.push(("incoming", "yes".into()));
        }
        p
    }

    /// The spec as one `--vm` argument (`name=a,socket=...,gid=...`).
    pub fn to_arg(&self) -> String {
        self.to_pairs()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// This VM with another quota (`None`: the host's default), checked by the rules
    /// every VM spec is checked by.
    pub fn with_quota(&self, quota: Option<u32>) -> Result<VmSpec, ConfigError> {
        let mut pairs: Vec<(&str, String)> = self
            .to_pairs()
            .into_iter()
            .filter(|(k, _)| *k != "quota")
            .collect();
        if let Some(q) = quota {
            pairs.push(("quota", q.to_string()));
        }
        VmSpec::from_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str())))
    }

    /// Whether `other` is the same VM but for its quota (a quota change, not a new VM).
    pub fn same_but_quota(&self, other: &VmSpec) -> bool {
        self.with_quota(None).ok() == other.with_quota(None).ok()
    }
}

/// Checks a set of VMs as one daemon serves them together: no socket, GID or name
/// twice, no two ID ranges sharing IDs, no VM socket at the control socket's path.
/// The configuration is checked by it at start, and every runtime change to the VMs.
pub fn check_vm_set(vms: &[VmSpec], control: Option<&Path>) -> Result<(), ConfigError> {
    for (i, a) in vms.iter().enumerate() {
        for b in &vms[..i] {
            let dup = |what, value: String| {
                Err(ConfigError::Duplicate {
                    what,
                    value,
                    first: b.vm.name.clone(),
                    second: a.vm.name.clone(),
                })
            };
            if a.socket == b.socket {
                return dup("socket", a.socket.display().to_string());
            }
            if a.vm.gid == b.vm.gid {
                return dup("GID", a.vm.gid.to_string());
            }
            if a.vm.name == b.vm.name {
                return dup("name", format!("{:?}", a.vm.name));
            }
            if let (Some(ra), Some(rb)) = (a.vm.id_range, b.vm.id_range)
                && ra.overlaps(&rb)
            {
                return Err(ConfigError::IdRangeOverlap {
                    a: b.vm.name.clone(),
                    ra: rb,
                    b: a.vm.name.clone(),
                    rb: ra,
                });
            }
        }
        if Some(a.socket.as_path()) == control {
            return Err(ConfigError::ControlIsVmSocket);
        }
    }
    Ok(())
}

/// Checks that no socket path (a VM's, the control socket's) is one of the state
/// directory's files ([`crate::state::STATE_FILES`]).
pub fn check_sockets_outside_state<'a>(
    sockets: impl IntoIterator<Item = &'a Path>,
    state_dir: Option<&Path>,
) -> Result<(), ConfigError> {
    let Some(dir) = state_dir else {
        return Ok(());
    };
    for path in sockets {
        if let Some(file) = crate::state::state_file_at(dir, path) {
            return Err(ConfigError::SocketInStateDir {
                path: path.to_path_buf(),
                dir: dir.to_path_buf(),
                file,
            });
        }
    }
    Ok(())
}

impl FromStr for VmSpec {
    type Err = ConfigError;

    /// `socket=PATH,gid=GID[,name=N,qpn-base=N,qpn-count=N,ca-guid=N,quota=N,
    /// id-range=BASE/LEN,incoming=yes]`.
    fn from_str(s: &str) -> Result<VmSpec, ConfigError> {
        let mut pairs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some(kv) = part.split_once('=') else {
                return Err(ConfigError::vm(
                    &format!("--vm {s:?}"),
                    ConfigError::NotKeyValue(part.to_string()),
                ));
            };
            pairs.push(kv);
        }
        VmSpec::from_pairs(pairs).map_err(|e| ConfigError::vm(&format!("--vm {s:?}"), e))
    }
}

/// The daemon's options.
#[derive(Debug, Clone, Default, Args)]
pub struct ServeArgs {
    /// A VM: `socket=PATH,gid=GID[,name=N,qpn-base=N,qpn-count=N,ca-guid=N,quota=N,
    /// id-range=BASE/LEN,incoming=yes]` (repeatable; one vhost-user socket per VM).
    /// GID: an IPv4 address (10.0.0.1, its IPv4-mapped GID), an IPv6 address
    /// (2001:db8::1; RoCEv2 over IPv6), or a link-local one with its interface
    /// (fe80::1%br0). Defaults: name vm-ADDRESS, qpn-base 0x10000, qpn-count 0x10000,
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
    /// Cache policy: default, mlx4-pre2020 or mlx4-post2020 (the last two reproduce
    /// mlx4's proxy for comparison) [default: default].
    #[arg(long, value_name = "POLICY", value_parser = Policy::from_str)]
    pub policy: Option<Policy>,
    /// Unix socket for `pvcm-backend stat` and `pvcm-backend vm` (VMs added, removed and
    /// their quotas changed at runtime); mode 0600 unless --control-mode widens it:
    /// whoever can connect can change the VMs [default: none].
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Serve Prometheus text metrics over HTTP: a port (bound on 127.0.0.1) or an
    /// address:port (give 0.0.0.0:PORT or another address to serve beyond the host)
    /// [default: none].
    #[arg(long, value_name = "ADDR", value_parser = parse_metrics_addr)]
    pub metrics: Option<SocketAddr>,
    /// Capture every frame sent and received to this pcap file (IPv4 and IPv6
    /// datagrams, LINKTYPE_RAW) [default: none].
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,
    /// Memory for messages kept per VM while its rx queue has no buffers (K, M, G
    /// suffixes; about 100,000 MADs at the default); past it they are dropped and
    /// counted (rx_backlog_full) [default: 32M].
    #[arg(long, value_name = "SIZE", value_parser = parse_backlog_size)]
    pub rx_backlog_bytes: Option<usize>,
    /// Memory for the rx backlogs of all VMs together; past it messages are dropped and
    /// counted (rx_host_budget) [default: 512M].
    #[arg(long, value_name = "SIZE", value_parser = parse_backlog_size)]
    pub rx_host_backlog_bytes: Option<usize>,
    /// The per-VM budget as a number of messages (older form of --rx-backlog-bytes).
    #[arg(long, value_name = "N", value_parser = parse_backlog_messages)]
    pub rx_backlog: Option<u64>,
    /// The RoCEv2 UDP port: the soft port binds it on each VM address and sends to it;
    /// the packet port filters on it and sends to it [default: 4791].
    #[arg(long, value_name = "PORT", value_parser = parse_bind_port)]
    pub bind_port: Option<u16>,
    /// How the soft RoCE port receives from IPv4 peers: `raw` checks each frame's ICRC
    /// over its IPv4 header as received and accepts every conformant sender (Linux rxe,
    /// hardware); it needs CAP_NET_RAW. `udp` needs no privilege but accepts only
    /// senders that write IP ID 0 (pvcm peers). `auto`: raw if permitted, else udp with
    /// a warning. IPv6 VMs are read through their own sockets in every mode (exact
    /// ICRC, any sender) [default: auto].
    #[arg(long, value_name = "MODE", value_enum)]
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
    /// and the VMs reconnect (see docs/restart.md). The VM changes made at runtime
    /// (`pvcm-backend vm`) are kept there too (vms.toml) and applied over the config
    /// file at start. Without it, stopping the daemon releases every connection and
    /// forgets the runtime changes [default: none].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// With --state-dir: how long a restored VM may take to reconnect before its
    /// connections are released on its behalf, in seconds [default: 60].
    #[arg(long, value_name = "SECS", value_parser = parse_seed)]
    pub reconnect_grace: Option<u64>,
    /// The owner of the VMs' vhost-user sockets: a user name or number (giving them to
    /// another user needs CAP_CHOWN) [default: the daemon's user].
    #[arg(long, value_name = "USER", value_parser = Account::from_str)]
    pub socket_owner: Option<Account>,
    /// The group of the VMs' vhost-user sockets: a group name or number, e.g. the
    /// VMM's group (kvm, libvirt-qemu) [default: the daemon's group].
    #[arg(long, value_name = "GROUP", value_parser = Account::from_str)]
    pub socket_group: Option<Account>,
    /// The permission bits of the VMs' vhost-user sockets, in octal; connecting needs
    /// write permission, so 0660 lets the owner and the group connect and nobody else
    /// [default: 0660].
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
    pub socket_mode: Option<u32>,
    /// The owner of the control socket: a user name or number [default: the daemon's
    /// user].
    #[arg(long, value_name = "USER", value_parser = Account::from_str)]
    pub control_owner: Option<Account>,
    /// The group of the control socket: a group name or number (with --control-mode
    /// 0660, its members may run `pvcm-backend stat`) [default: the daemon's group].
    #[arg(long, value_name = "GROUP", value_parser = Account::from_str)]
    pub control_group: Option<Account>,
    /// The permission bits of the control socket, in octal [default: 0600].
    #[arg(long, value_name = "MODE", value_parser = parse_mode)]
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
    pub allow_world_access: Option<bool>,
    /// The log format on stderr: `text` (one line per event; colour only on a
    /// terminal, never with NO_COLOR set) or `json` (one JSON object per line). RUST_LOG
    /// sets the level [default: text].
    #[arg(long, value_name = "FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// The path MTU a VM uses where the port cannot tell its link's (the packet port):
    /// 256, 512, 1024, 2048 or 4096 bytes. The soft and umad ports take it from the
    /// network device behind the VM's address, as rdma_cm does [default: 1024].
    #[arg(long, value_name = "BYTES", value_parser = parse_path_mtu)]
    pub path_mtu: Option<u8>,
    /// The local CA ACK delay a VM puts in its REQs and REPs where the port cannot read
    /// the device's (the umad port reads it with `ibv_devinfo`): a 5-bit exponent
    /// (4.096 us x 2^N), the `local_ca_ack_delay` of the VM's RDMA function as
    /// `ibv_devinfo -v` shows it [default: 15, rdma_rxe's].
    #[arg(long, value_name = "N", value_parser = parse_ca_ack_delay)]
    pub ca_ack_delay: Option<u8>,
    /// Receive coalescing, as a NIC's interrupt moderation: after a wakeup that read a
    /// batch of MADs (8 or more) from the wire, the host loop sleeps this long before
    /// it waits again, so that it reads fuller batches and the senders do not pay a
    /// wakeup every few frames. A wakeup that read fewer waits at once: a lone MAD is
    /// never delayed. 0 turns it off; at most 1000 [default: 50].
    #[arg(long, value_name = "USECS", value_parser = parse_rx_coalesce)]
    pub rx_coalesce_us: Option<u64>,
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

/// A user or a group, by name or number, as `--socket-owner` and the like take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Account {
    /// A numeric ID.
    Id(u32),
    /// A name, looked up on the host when the configuration is checked.
    Name(String),
}

impl FromStr for Account {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Account, ConfigError> {
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s
                .parse::<u32>()
                .ok()
                .filter(|&n| n != u32::MAX)
                .map(Account::Id)
                .ok_or_else(|| ConfigError::Invalid("an ID below 4294967295".into()));
        }
        if s.is_empty()
            || s.len() > 64
            || s.starts_with('-')
            || s.chars()
                .any(|c| c == ':' || c == '/' || c == ',' || c.is_whitespace() || c.is_control())
        {
            return err(
                "a user or group name (1 to 64 characters, no ':', '/', ',' or \
                        white space) or number",
            );
        }
        Ok(Account::Name(s.to_string()))
    }
}

impl Account {
    /// The user's ID: the number given, or the name looked up (NSS included); `None`
    /// when no such user exists.
    pub(crate) fn user_id(&self) -> Option<u32> {
        match self {
            Account::Id(n) => Some(*n),
            Account::Name(name) => crate::files::user_id(name),
        }
    }

    /// The group's ID: the number given, or the name looked up; `None` when no such
    /// group exists.
    pub(crate) fn group_id(&self) -> Option<u32> {
        match self {
            Account::Id(n) => Some(*n),
            Account::Name(name) => crate::files::group_id(name),
        }
    }
}

impl fmt::Display for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Account::Id(n) => write!(f, "{n}"),
            Account::Name(s) => f.write_str(s),
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
fn parse_path_mtu(v: &str) -> Result<u8, ConfigError> {
    match v.trim() {
        "256" => Ok(pvcm_wire::abi::MTU_256),
        "512" => Ok(pvcm_wire::abi::MTU_512),
        "1024" => Ok(pvcm_wire::abi::MTU_1024),
        "2048" => Ok(pvcm_wire::abi::MTU_2048),
        "4096" => Ok(pvcm_wire::abi::MTU_4096),
        _ => Err(ConfigError::Invalid(
            "a path MTU in bytes: 256, 512, 1024, 2048 or 4096".into(),
        )),
    }
}

/// The host loop's receive coalescing without `--rx-coalesce-us`.
pub const DEFAULT_RX_COALESCE: std::time::Duration = std::time::Duration::from_micros(50);

/// `--rx-coalesce-us`: 0 ... 1000 microseconds.
fn parse_rx_coalesce(v: &str) -> Result<u64, ConfigError> {
    number(v)
        .filter(|n| *n <= 1000)
        .ok_or_else(|| ConfigError::Invalid("microseconds from 0 to 1000".into()))
}

/// `--ca-ack-delay`: 0 ... 31.
fn parse_ca_ack_delay(v: &str) -> Result<u8, ConfigError> {
    number(v)
        .and_then(|n| u8::try_from(n).ok())
        .filter(|n| *n <= 31)
        .ok_or_else(|| ConfigError::Invalid("an exponent from 0 to 31".into()))
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

    /// Validates parsed arguments (reading `--config` first if given).
    pub fn from_args(args: &ServeArgs) -> Result<Config, ConfigError> {
        let args = match &args.config {
            Some(file) => merge(read_config_file(file)?, args),
            None => args.clone(),
        };
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
        let vm_sockets = SocketAccess {
            owner: user("socket-owner", &args.socket_owner)?,
            group: group("socket-group", &args.socket_group)?,
            mode: args.socket_mode.unwrap_or(SocketAccess::VM_DEFAULT.mode),
        };
        let control_access = SocketAccess {
            owner: user("control-owner", &args.control_owner)?,
            group: group("control-group", &args.control_group)?,
            mode: args
                .control_mode
                .unwrap_or(SocketAccess::CONTROL_DEFAULT.mode),
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
        cfg.vm_sockets = vm_sockets;
        cfg.control_access = control_access;
        cfg.allow_world_access = args.allow_world_access.unwrap_or(false);
        cfg.log_format = args.log_format.unwrap_or_default();
        cfg.path_mtu = args.path_mtu.unwrap_or(DEFAULT_PATH_MTU);
        cfg.ca_ack_delay = args.ca_ack_delay.unwrap_or(DEFAULT_CA_ACK_DELAY);
        cfg.rx_coalesce = args
            .rx_coalesce_us
            .map_or(DEFAULT_RX_COALESCE, std::time::Duration::from_micros);
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
                "vm {}: socket {}, gid {}{}, qpn {:#x}+{:#x}, ca-guid {:#018x}, quota {}{}{}",
                v.vm.name,
                v.socket.display(),
                v.vm.gid,
                v.iface
                    .as_deref()
                    .map_or(String::new(), |i| format!("%{i}")),
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

/// `--socket-mode`, `--control-mode`: permission bits in octal (`0660`, `660`, `0o660`).
/// A config file's integer reaches this as `0o...` ([`toml_mode`]).
fn parse_mode(v: &str) -> Result<u32, ConfigError> {
    let t = v.trim();
    let t = t.strip_prefix("0o").unwrap_or(t);
    match u32::from_str_radix(t, 8) {
        Ok(m) if !t.is_empty() && m <= 0o777 => Ok(m),
        _ => err("permission bits in octal, at most 0777 (e.g. 0660)"),
    }
}

/// The options that take permission bits.
const MODE_KEYS: [&str; 2] = ["socket-mode", "control-mode"];

/// A mode key's TOML integer as the octal text [`parse_mode`] takes. TOML reads
/// `0o660` and `432` as the same number, so the integer's text in the file (`raw`)
/// decides: an octal literal is taken, any other integer is refused, since an operator
/// who writes `660` means octal and TOML would read it as decimal.
fn toml_mode(key: &str, n: i64, raw: Option<&str>) -> Result<String, ConfigError> {
    let raw = raw.map(str::trim).unwrap_or("");
    if raw.starts_with("0o") {
        return Ok(format!("0o{n:o}"));
    }
    Err(ConfigError::bad(
        key,
        raw,
        format!(
            "a TOML integer that is not an octal literal: write the permission bits in \
             octal, {key} = 0o660 or {key} = \"0660\" (a bare {raw} is read as decimal)"
        ),
    ))
}

/// The text of top-level key `key`'s value in a TOML document (`None` if the document
/// does not parse or has no such key).
fn toml_raw_value<'t>(text: &'t str, key: &str) -> Option<&'t str> {
    let spans: std::collections::BTreeMap<String, toml::Spanned<toml::Value>> =
        toml::from_str(text).ok()?;
    let span = spans.get(key)?.span();
    text.get(span)
}

/// `--metrics`: a bare port binds loopback only; an address:port is taken as given.
fn parse_metrics_addr(m: &str) -> Result<SocketAddr, ConfigError> {
    if let Ok(port) = m.parse::<u16>() {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    SocketAddr::from_str(m).map_err(|_| {
        ConfigError::Invalid(
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
    let n = number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))?;
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
    let n = number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))?;
    match u16::try_from(n) {
        Ok(p) if p != 0 => Ok(p),
        _ => err("must be 1 to 65535"),
    }
}

/// `--seed`: decimal or `0x` hex.
fn parse_seed(v: &str) -> Result<u64, ConfigError> {
    number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))
}

/// Reads a config file into arguments: TOML if its name ends in `.toml`, else the line
/// format. An error names the file (and the key, or the line's option).
fn read_config_file(path: &Path) -> Result<ServeArgs, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.to_path_buf(),
        error: e.to_string(),
    })?;
    let toml = path.extension().is_some_and(|e| e == "toml");
    let args = if toml {
        read_toml(&text)
    } else {
        read_lines(&text)
    };
    args.map_err(|e| ConfigError::InFile {
        path: path.to_path_buf(),
        source: Box::new(e),
    })
}

/// The line format: one option per line, as on the command line without the leading
/// dashes (`vm socket=...`, `policy default`, `rx-backlog=16`), `#` comments.
fn read_lines(text: &str) -> Result<ServeArgs, ConfigError> {
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
            return Err(ConfigError::Cli(format!(
                "line {}: a config file cannot include another",
                n + 1
            )));
        }
        argv.push(format!("--{k}"));
        if let Some(v) = v {
            argv.push(v.to_string());
        }
    }
    let cli = Cli::try_parse_from(&argv).map_err(|e| ConfigError::Cli(clap_message(&e)))?;
    Ok(cli.serve)
}

/// A clap error in one line, without its `error: ` prefix, usage and help hint.
fn clap_message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .collect();
    let line = parts.join(" ");
    match line.strip_prefix("error: ") {
        Some(l) => l.to_string(),
        None if line.is_empty() => "bad option".to_string(),
        None => line,
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

/// A TOML value's type, in words.
fn toml_type(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

/// A scalar TOML value as the text the command line would give: strings as they are,
/// integers in decimal, booleans as `true`/`false`.
fn toml_scalar(key: &str, v: &toml::Value) -> Result<String, ConfigError> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(n) => Ok(n.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        _ => Err(ConfigError::WrongType {
            key: key.to_string(),
            expected: "a string, an integer or a boolean",
            found: toml_type(v),
        }),
    }
}

/// The VMs of a TOML array of `[[vm]]` tables, each checked as `--vm` is; an error
/// names the table (`[[vm]] #2 (b)`) and the key.
pub(crate) fn toml_vms(vms: &[toml::Value]) -> Result<Vec<VmSpec>, ConfigError> {
    let mut out = Vec::new();
    for (i, t) in vms.iter().enumerate() {
        let label = format!("[[vm]] #{}", i + 1);
        let toml::Value::Table(t) = t else {
            return Err(ConfigError::WrongType {
                key: label,
                expected: "a table",
                found: toml_type(t),
            });
        };
        let mut pairs = Vec::new();
        for (k, v) in t {
            let v = toml_scalar(k, v).map_err(|e| ConfigError::vm(&label, e))?;
            pairs.push((k.as_str(), v));
        }
        let label = match t.get("name").and_then(toml::Value::as_str) {
            Some(n) => format!("{label} ({n})"),
            None => label,
        };
        let spec = VmSpec::from_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str())))
            .map_err(|e| ConfigError::vm(&label, e))?;
        out.push(spec);
    }
    Ok(out)
}

/// A VM as a TOML `[[vm]]` table (every value a string, as [`toml_vms`] reads it).
pub(crate) fn toml_vm(spec: &VmSpec) -> toml::Table {
    spec.to_pairs()
        .into_iter()
        .map(|(k, v)| (k.to_string(), toml::Value::String(v)))
        .collect()
}

/// The TOML format: top-level keys are the long options (`policy = "default"`,
/// `bind-port = 4791`, `rx-backlog-bytes = "32M"`), one `[[vm]]` table per VM with the
/// `--vm` keys (`socket`, `gid`, `name`, `qpn-base`, ...). Each value goes through the
/// option's own parser, so the file takes exactly what the command line takes; an error
/// names the key.
fn read_toml(text: &str) -> Result<ServeArgs, ConfigError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Toml(e.to_string().trim_end().to_string()))?;
    let mut args = ServeArgs::default();
    for (key, value) in &table {
        match key.as_str() {
            "vm" => {
                let toml::Value::Array(vms) = value else {
                    return Err(ConfigError::WrongType {
                        key: "vm".into(),
                        expected: "an array of tables ([[vm]])",
                        found: toml_type(value),
                    });
                };
                args.vms = toml_vms(vms)?;
            }
            "config" => {
                return Err(ConfigError::bad(
                    "config",
                    &toml_scalar(key, value)?,
                    "a config file cannot include another",
                ));
            }
            k if MODE_KEYS.contains(&k) && value.is_integer() => {
                let n = value.as_integer().unwrap_or_default();
                let octal = toml_mode(key, n, toml_raw_value(text, key))?;
                let one = toml_option(key, &toml::Value::String(octal))?;
                args = merge(args, &one);
            }
            _ => {
                let one = toml_option(key, value)?;
                args = merge(args, &one);
            }
        }
    }
    Ok(args)
}

/// One top-level key of a TOML config file, parsed as the long option of its name.
fn toml_option(key: &str, value: &toml::Value) -> Result<ServeArgs, ConfigError> {
    use clap::error::ErrorKind;
    let unknown = || ConfigError::UnknownKey {
        key: key.to_string(),
        expected: format!("[[vm]] or {}", config_keys().join(", ")),
    };
    if !config_keys().iter().any(|k| k == key) || key == "vm" {
        return Err(unknown());
    }
    let text = toml_scalar(key, value)?;
    // `--key=value` as one argument, so a value starting with '-' stays a value.
    let argv = ["pvcm-backend".to_string(), format!("--{key}={text}")];
    match Cli::try_parse_from(argv) {
        Ok(cli) => Ok(cli.serve),
        Err(e) => match e.kind() {
            ErrorKind::UnknownArgument => Err(unknown()),
            _ => {
                let why = std::error::Error::source(&e)
                    .map(ToString::to_string)
                    .unwrap_or_else(|| clap_message(&e));
                Err(ConfigError::bad(key, &text, why))
            }
        },
    }
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
        socket_owner: cli.socket_owner.clone().or(file.socket_owner),
        socket_group: cli.socket_group.clone().or(file.socket_group),
        socket_mode: cli.socket_mode.or(file.socket_mode),
        control_owner: cli.control_owner.clone().or(file.control_owner),
        control_group: cli.control_group.clone().or(file.control_group),
        control_mode: cli.control_mode.or(file.control_mode),
        allow_world_access: cli.allow_world_access.or(file.allow_world_access),
        log_format: cli.log_format.or(file.log_format),
        path_mtu: cli.path_mtu.or(file.path_mtu),
        ca_ack_delay: cli.ca_ack_delay.or(file.ca_ack_delay),
        rx_coalesce_us: cli.rx_coalesce_us.or(file.rx_coalesce_us),
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
        let cli = Cli::try_parse_from(argv).map_err(|e| ConfigError::Cli(e.to_string()))?;
        Config::from_args(&cli.serve)
    }

    #[test]
    fn users_and_groups_resolve_by_name_and_number() {
        assert_eq!(Account::Name("root".into()).user_id(), Some(0));
        assert_eq!(Account::Name("root".into()).group_id(), Some(0));
        assert_eq!(Account::Id(4242).user_id(), Some(4242));
        assert_eq!(Account::Name("no-such-group-pvcm".into()).group_id(), None);
        assert_eq!(Account::Name("no-such-user-pvcm".into()).user_id(), None);
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
            assert!(e.to_string().contains(want), "{s}: {e}");
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
        assert!(e.to_string().contains("--metrics"), "{e}");
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
            assert!(e.to_string().contains(want), "{args:?}: {e}");
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
            assert!(e.to_string().contains(want), "{args:?}: {e}");
        }
        // A bad value in the file names the file.
        std::fs::write(&f, "vm socket=/tmp/p,gid=127.2.0.1\nbind-port 70000\n").unwrap();
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
        assert!(
            e.to_string().contains("--config") && e.to_string().contains("--bind-port"),
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
        assert!(e.to_string().contains("--config"), "{e}");
        let e = parse(&["--config", "/nonexistent/pvcm.conf"]).unwrap_err();
        assert!(e.to_string().contains("/nonexistent"), "{e}");
    }

    const TOML: &str = r#"
# a host with two VMs
policy = "default"
port = "soft"
wire-rx = "udp"
bind-port = 0x12b7
control = "/run/pvcm/control.sock"
metrics = 9791
rx-backlog-bytes = "4M"
rx-host-backlog-bytes = 1073741824
state-dir = "/var/lib/pvcm"
reconnect-grace = 30
socket-group = 0
socket-mode = "0640"
control-mode = "0660"
log-format = "json"

[[vm]]
name = "vm1"
socket = "/run/pvcm/vm1.sock"
gid = "::ffff:192.0.2.11"
qpn-base = 16
qpn-count = 0x20000
ca-guid = "0x0002c90300a1b2c3"
quota = 4096

[[vm]]
name = "vm2"
socket = "/run/pvcm/vm2.sock"
gid = "2001:db8::12"
id-range = "0x80070000/16"
incoming = true
"#;

    fn toml_file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("backend.toml");
        std::fs::write(&f, text).unwrap();
        (dir, f)
    }

    #[test]
    fn a_toml_file_sets_every_kind_of_value() {
        let (_d, f) = toml_file(TOML);
        let c = parse(&["--config", f.to_str().unwrap()]).unwrap();
        assert_eq!(c.vms.len(), 2);
        let (a, b) = (&c.vms[0], &c.vms[1]);
        assert_eq!(a.vm.name, "vm1");
        assert_eq!((a.vm.qpn_base, a.vm.qpn_count), (16, 0x20000));
        assert_eq!(a.vm.ca_guid, 0x0002_c903_00a1_b2c3);
        assert_eq!(a.vm.quota, Some(4096));
        assert!(b.incoming && b.vm.id_range.is_some());
        assert_eq!(b.addr(), "2001:db8::12".parse::<IpAddr>().unwrap());
        assert_eq!(c.wire_rx, RxMode::Udp);
        assert_eq!(c.bind_port, 0x12b7);
        assert_eq!(c.metrics, Some("127.0.0.1:9791".parse().unwrap()));
        assert_eq!(
            (c.rx_backlog_bytes, c.rx_host_backlog_bytes),
            (4 << 20, 1 << 30)
        );
        assert_eq!(c.reconnect_grace, std::time::Duration::from_secs(30));
        assert_eq!(c.state_dir, Some(PathBuf::from("/var/lib/pvcm")));
        assert_eq!(
            c.vm_sockets,
            SocketAccess {
                owner: None,
                group: Some(0),
                mode: 0o640
            }
        );
        assert_eq!(c.control_access.mode, 0o660);
        assert_eq!(c.log_format, LogFormat::Json);
        // The command line comes after the file.
        let c = parse(&[
            "--config",
            f.to_str().unwrap(),
            "--vm",
            "socket=/tmp/c,gid=127.3.0.3",
            "--socket-mode",
            "600",
        ])
        .unwrap();
        assert_eq!(c.vms.len(), 3);
        assert_eq!(c.vm_sockets.mode, 0o600);
    }

    #[test]
    fn toml_errors_name_the_file_and_the_key() {
        let vm = "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n";
        for (text, want) in [
            (
                "bind-port = 70000\n".to_string() + vm,
                "bind-port=\"70000\"",
            ),
            ("bind-port = 70000\n".to_string() + vm, "must be 1 to 65535"),
            (
                "colour = \"blue\"\n".to_string() + vm,
                "unknown key \"colour\"",
            ),
            (
                "policy = \"mlx5\"\n".to_string() + vm,
                "policy=\"mlx5\": unknown policy",
            ),
            ("wire-rx = \"fast\"\n".to_string() + vm, "wire-rx=\"fast\""),
            ("wire-rx = \"fast\"\n".to_string() + vm, "auto, raw, udp"),
            (
                "metrics = [1, 2]\n".to_string() + vm,
                "metrics: expected a string",
            ),
            ("socket-mode = \"0999\"\n".to_string() + vm, "socket-mode"),
            (
                "socket-group = \"no-such-group-pvcm\"\n".to_string() + vm,
                "no such group",
            ),
            (
                "control-owner = \"no-such-user-pvcm\"\n".to_string() + vm,
                "control-owner",
            ),
            ("config = \"/etc/x\"\n".to_string() + vm, "cannot include"),
            ("vm = 3\n".to_string(), "vm: expected an array of tables"),
            ("policy = \n".to_string() + vm, "line 1"),
            (
                "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n[[vm]]\nname = \"b\"\n\
                 socket = \"/tmp/b\"\ngid = \"127.0.0.2\"\nqpn-base = \"zz\"\n"
                    .to_string(),
                "[[vm]] #2 (b): qpn-base=\"zz\": not a number",
            ),
            (
                "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\ncolor = 1\n".to_string(),
                "[[vm]] #1: unknown key \"color\"",
            ),
            (
                "[[vm]]\nsocket = \"/tmp/a\"\ngid = [1]\n".to_string(),
                "[[vm]] #1: gid: expected a string",
            ),
            (
                "[[vm]]\nsocket = \"/tmp/a\"\n".to_string(),
                "gid=GID is required",
            ),
            ("policy = \"default\"\n".to_string(), "no VM"),
        ] {
            let (_d, f) = toml_file(&text);
            let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(want), "{text}: {msg}");
            // Names are looked up once file and command line are merged: the key says it.
            if !matches!(e, ConfigError::NoVm | ConfigError::NoSuchAccount { .. }) {
                assert!(msg.contains("backend.toml"), "{text}: {msg}");
            }
        }
    }

    #[test]
    fn every_long_option_is_a_toml_key() {
        // A file that names every option but --vm and --config (and the hidden ones the
        // tests use) parses: the file takes what the command line takes.
        let mut text = String::new();
        for k in config_keys() {
            let v = match k.as_str() {
                "vm" => continue,
                "policy" => "\"default\"",
                "control" | "pcap" | "state-dir" | "sysfs" => "\"/tmp/pvcm-x\"",
                "metrics" => "9791",
                "rx-backlog-bytes" | "rx-host-backlog-bytes" => "\"1M\"",
                "wire-rx" => "\"auto\"",
                "port" => "\"soft\"",
                "socket-owner" | "socket-group" | "control-owner" | "control-group" => "0",
                "socket-mode" | "control-mode" => "\"0600\"",
                "log-format" => "\"text\"",
                "allow-world-access" => "true",
                "path-mtu" => "2048",
                _ => "7",
            };
            text.push_str(&format!("{k} = {v}\n"));
        }
        text.push_str("[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n");
        let (_d, f) = toml_file(&text);
        parse(&["--config", f.to_str().unwrap()]).unwrap();
    }

    #[test]
    fn path_values_where_the_port_cannot_tell_them() {
        let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1"]).unwrap();
        assert_eq!((c.path_mtu, c.ca_ack_delay), (pvcm_wire::abi::MTU_1024, 15));
        assert_eq!(c.rx_coalesce, std::time::Duration::from_micros(50));
        for (v, us) in [("0", 0), ("1000", 1000), ("20", 20)] {
            let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", "--rx-coalesce-us", v]).unwrap();
            assert_eq!(c.rx_coalesce, std::time::Duration::from_micros(us));
        }
        let c = parse(&[
            "--vm",
            "socket=/tmp/x,gid=127.1.0.1",
            "--path-mtu",
            "4096",
            "--ca-ack-delay",
            "10",
        ])
        .unwrap();
        assert_eq!((c.path_mtu, c.ca_ack_delay), (pvcm_wire::abi::MTU_4096, 10));
        for (opt, bad) in [
            ("--path-mtu", "1500"),
            ("--ca-ack-delay", "32"),
            ("--rx-coalesce-us", "1001"),
            ("--rx-coalesce-us", "2ms"),
        ] {
            let e = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", opt, bad])
                .unwrap_err()
                .to_string();
            assert!(e.contains(opt) && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn socket_access_options() {
        let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1"]).unwrap();
        assert_eq!(c.vm_sockets, SocketAccess::VM_DEFAULT);
        assert_eq!(c.vm_sockets.mode, 0o660);
        assert_eq!(c.control_access.mode, 0o600);
        let c = parse(&[
            "--vm",
            "socket=/tmp/x,gid=127.1.0.1",
            "--socket-owner",
            "root",
            "--socket-group",
            "root",
            "--socket-mode",
            "0o666",
            "--control-group",
            "0",
            "--control-mode",
            "0640",
            "--allow-world-access",
        ])
        .unwrap();
        assert_eq!(
            c.vm_sockets,
            SocketAccess {
                owner: Some(0),
                group: Some(0),
                mode: 0o666
            }
        );
        assert_eq!(
            c.control_access,
            SocketAccess {
                owner: None,
                group: Some(0),
                mode: 0o640
            }
        );
        for (args, want) in [
            (&["--socket-mode", "1777"][..], "at most 0777"),
            (&["--socket-mode", "rw"][..], "--socket-mode"),
            (&["--socket-group", "a:b"][..], "--socket-group"),
            (
                &["--socket-group", "no-such-group-pvcm"][..],
                "no such group",
            ),
            (&["--socket-owner", "no-such-user-pvcm"][..], "no such user"),
            (&["--log-format", "xml"][..], "--log-format"),
            (&["--socket-mode", "0666"][..], "every local user"),
            (&["--control-mode", "0o601"][..], "allow-world-access"),
            (
                &["--socket-mode", "0606", "--allow-world-access=false"][..],
                "socket-mode=0606",
            ),
        ] {
            let mut a = vec!["--vm", "socket=/a,gid=127.0.0.1"];
            a.extend_from_slice(args);
            let e = parse(&a).unwrap_err();
            assert!(e.to_string().contains(want), "{args:?}: {e}");
        }
    }

    #[test]
    fn toml_modes_read_as_operators_write_them() {
        let vm = "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n";
        let mode = |line: &str| {
            let (_d, f) = toml_file(&format!("{line}\n{vm}"));
            parse(&["--config", f.to_str().unwrap()])
        };
        for line in [
            "socket-mode = 0o660",
            "socket-mode = \"0660\"",
            "socket-mode = \"660\"",
            "socket-mode = \"0o660\"",
            "socket-mode = 0o6_60",
        ] {
            let c = mode(line).unwrap_or_else(|e| panic!("{line}: {e}"));
            assert_eq!(c.vm_sockets.mode, 0o660, "{line}");
        }
        let c = mode("control-mode = 0o600").unwrap();
        assert_eq!(c.control_access.mode, 0o600);
        // An integer that is not an octal literal is refused, and the error says how
        // to write it.
        for line in [
            "socket-mode = 432",
            "socket-mode = 660",
            "control-mode = 0x1b0",
            "control-mode = 600",
        ] {
            let e = mode(line).unwrap_err().to_string();
            let key = line.split(' ').next().unwrap();
            assert!(
                e.contains(key) && e.contains("octal") && e.contains("= 0o660"),
                "{line}: {e}"
            );
        }
        // World access only when allowed, in the file as on the command line.
        let e = mode("socket-mode = 0o666").unwrap_err().to_string();
        assert!(e.contains("allow-world-access"), "{e}");
        let c = mode("socket-mode = 0o666\nallow-world-access = true").unwrap();
        assert_eq!(c.vm_sockets.mode, 0o666);
        assert!(mode("control-mode = \"0602\"\nallow-world-access = false").is_err());
    }
}
