//! The options' values: one parser per kind of value, which the command line (clap's
//! `value_parser`s) and the config file (serde's `deserialize_with`, [`de`]) both use, so
//! that a file takes exactly what the command line takes.
//!
//! A parser's error says what the value takes; the caller names the option or key (clap
//! on the command line, [`super::located`] for a file).

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;

use super::{ConfigError, MAX_BACKLOG_BYTES};
use crate::backlog;

pub(super) const NOT_A_NUMBER: &str = "not a number (decimal or 0x hex)";

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::Invalid(msg.into()))
}

/// A number in decimal or `0x` hex (`_` separators allowed).
pub(super) fn number(v: &str) -> Option<u64> {
    let v = v.trim().replace('_', "");
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else {
        v.parse::<u64>().ok()
    }
}

/// A 64-bit number (`ca-guid`).
pub(super) fn parse_u64(v: &str) -> Result<u64, ConfigError> {
    number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))
}

/// A 32-bit number (`qpn-base`, `qpn-count`, `quota`).
pub(super) fn parse_u32(v: &str) -> Result<u32, ConfigError> {
    let n = parse_u64(v)?;
    u32::try_from(n).map_err(|_| ConfigError::Invalid("larger than 32 bits".into()))
}

/// `--path-mtu`: bytes (256 ... 4096, a power of two) to the IBTA code.
pub(super) fn parse_path_mtu(v: &str) -> Result<u8, ConfigError> {
    match v.trim() {
        "256" => Ok(pvcm_wire::abi::MTU_256),
        "512" => Ok(pvcm_wire::abi::MTU_512),
        "1024" => Ok(pvcm_wire::abi::MTU_1024),
        "2048" => Ok(pvcm_wire::abi::MTU_2048),
        "4096" => Ok(pvcm_wire::abi::MTU_4096),
        _ => err("a path MTU in bytes: 256, 512, 1024, 2048 or 4096"),
    }
}

/// `--rx-coalesce-us`: 0 ... 1000 microseconds.
pub(super) fn parse_rx_coalesce(v: &str) -> Result<u64, ConfigError> {
    number(v)
        .filter(|n| *n <= 1000)
        .ok_or_else(|| ConfigError::Invalid("microseconds from 0 to 1000".into()))
}

/// `--ca-ack-delay`: 0 ... 31.
pub(super) fn parse_ca_ack_delay(v: &str) -> Result<u8, ConfigError> {
    number(v)
        .and_then(|n| u8::try_from(n).ok())
        .filter(|n| *n <= 31)
        .ok_or_else(|| ConfigError::Invalid("an exponent from 0 to 31".into()))
}

/// `--socket-mode`, `--control-mode`: permission bits in octal (`0660`, `660`, `0o660`).
/// A config file's integer reaches this as `0o...` ([`de::mode`]).
pub(super) fn parse_mode(v: &str) -> Result<u32, ConfigError> {
    let t = v.trim();
    let t = t.strip_prefix("0o").unwrap_or(t);
    match u32::from_str_radix(t, 8) {
        Ok(m) if !t.is_empty() && m <= 0o777 => Ok(m),
        _ => err("permission bits in octal, at most 0777 (e.g. 0660)"),
    }
}

/// `--metrics`: a bare port binds loopback only; an address:port is taken as given.
pub(super) fn parse_metrics_addr(m: &str) -> Result<SocketAddr, ConfigError> {
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

/// `--rx-backlog N`: a number of messages, 1 to what 64G holds.
pub(super) fn parse_backlog_messages(v: &str) -> Result<u64, ConfigError> {
    let n = number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))?;
    let max = (MAX_BACKLOG_BYTES / backlog::MSG_COST) as u64;
    if n == 0 || n > max {
        return err(format!("must be 1 to {max} messages"));
    }
    Ok(n)
}

/// `--rx-backlog-bytes`, `--rx-host-backlog-bytes`: a size with `K`/`M`/`G`, one
/// message's cost to 64G ([`backlog::parse_size`]).
pub(super) fn parse_backlog_size(v: &str) -> Result<usize, ConfigError> {
    match backlog::parse_size(v) {
        Some(b) if (backlog::MSG_COST..=MAX_BACKLOG_BYTES).contains(&b) => Ok(b),
        _ => err(format!(
            "a size from {} bytes (one message) to 64G, e.g. 32M",
            backlog::MSG_COST
        )),
    }
}

/// `--bind-port`: a UDP port, 1 to 65535.
pub(super) fn parse_bind_port(v: &str) -> Result<u16, ConfigError> {
    let n = number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))?;
    match u16::try_from(n) {
        Ok(p) if p != 0 => Ok(p),
        _ => err("must be 1 to 65535"),
    }
}

/// `--seed`, `--reconnect-grace`: decimal or `0x` hex.
pub(super) fn parse_seed(v: &str) -> Result<u64, ConfigError> {
    number(v).ok_or_else(|| ConfigError::Invalid(NOT_A_NUMBER.into()))
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

impl FromStr for RxMode {
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

impl FromStr for PortSpec {
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

/// The config file's side of the parsers: serde `deserialize_with` functions that take a
/// TOML string, integer or boolean as the text the command line would give and parse it
/// with the option's own parser. A value of another TOML type is refused here, and
/// [`super::located`] names its key and type.
pub(super) mod de {
    use std::fmt;
    use std::str::FromStr;

    use serde::de::{Deserialize, Deserializer, Error, Visitor};

    use super::*;

    /// A TOML scalar as given.
    enum Scalar {
        Text(String),
        Int(i128),
        Bool(bool),
    }

    impl Scalar {
        /// The text the command line would give: strings as they are, integers in
        /// decimal, booleans as `true`/`false`.
        fn into_text(self) -> String {
            match self {
                Scalar::Text(s) => s,
                Scalar::Int(n) => n.to_string(),
                Scalar::Bool(b) => b.to_string(),
            }
        }
    }

    impl<'de> Deserialize<'de> for Scalar {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Scalar;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a string, an integer or a boolean")
                }
                fn visit_str<E: Error>(self, v: &str) -> Result<Scalar, E> {
                    Ok(Scalar::Text(v.to_string()))
                }
                fn visit_i64<E: Error>(self, v: i64) -> Result<Scalar, E> {
                    Ok(Scalar::Int(v.into()))
                }
                fn visit_u64<E: Error>(self, v: u64) -> Result<Scalar, E> {
                    Ok(Scalar::Int(v.into()))
                }
                fn visit_bool<E: Error>(self, v: bool) -> Result<Scalar, E> {
                    Ok(Scalar::Bool(v))
                }
            }
            d.deserialize_any(V)
        }
    }

    /// The value's text.
    pub(in crate::config) fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        Scalar::deserialize(d).map(Scalar::into_text)
    }

    /// A value of a type that parses itself ([`FromStr`]: policies, paths, ports,
    /// accounts, receive modes, booleans).
    pub(in crate::config) fn parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: FromStr,
        T::Err: fmt::Display,
    {
        T::from_str(&text(d)?).map(Some).map_err(D::Error::custom)
    }

    /// A value of a clap `ValueEnum` (`log-format`).
    pub(in crate::config) fn value_enum<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: clap::ValueEnum,
    {
        let v = text(d)?;
        T::from_str(&v, false).map(Some).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(|t| t.to_possible_value())
                .map(|p| p.get_name().to_string())
                .collect();
            D::Error::custom(format!("expected one of {}", names.join(", ")))
        })
    }

    /// A mode: permission bits. A TOML integer is taken as the octal literal it must be
    /// written as (`0o660`; `file.rs` refuses any other integer literal).
    pub(in crate::config) fn mode<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<u32>, D::Error> {
        let text = match Scalar::deserialize(d)? {
            Scalar::Int(n) if n >= 0 => format!("0o{n:o}"),
            s => s.into_text(),
        };
        parse_mode(&text).map(Some).map_err(D::Error::custom)
    }

    /// Deserializers of the values a parser function parses, one per parser.
    macro_rules! by_parser {
        ($($name:ident -> $t:ty = $parse:path;)*) => {$(
            #[doc = concat!("A value [`", stringify!($parse), "`] parses.")]
            pub(in crate::config) fn $name<'de, D: Deserializer<'de>>(
                d: D,
            ) -> Result<Option<$t>, D::Error> {
                $parse(&text(d)?).map(Some).map_err(D::Error::custom)
            }
        )*};
    }

    by_parser! {
        metrics_addr -> std::net::SocketAddr = parse_metrics_addr;
        backlog_size -> usize = parse_backlog_size;
        backlog_messages -> u64 = parse_backlog_messages;
        bind_port -> u16 = parse_bind_port;
        seed -> u64 = parse_seed;
        path_mtu -> u8 = parse_path_mtu;
        ca_ack_delay -> u8 = parse_ca_ack_delay;
        rx_coalesce -> u64 = parse_rx_coalesce;
        u32_number -> u32 = parse_u32;
        u64_number -> u64 = parse_u64;
    }
}
