//! One VM's configuration: `--vm socket=...,gid=...` on the command line, a `[[vm]]`
//! table in a config file, `pvcm-backend vm add`, and the VMs kept in the state
//! directory's `vms.toml`. Every form is read into a [`VmTable`] by serde (unknown keys
//! refused) and checked into a [`VmSpec`] by [`VmSpec::from_table`].

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use pvcm_wire::Gid;
use serde::Deserialize;
use serde::de::{Deserializer, Error as _};
use toml::Spanned;
use toml::de::{DeArray, DeTable, DeValue};

use super::ConfigError;
use super::located::{self, Located};
use super::values::{check_ifname, de};
use crate::mux::{DEFAULT_QUOTA, IdRange, MAX_GIDS, VmConfig};

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
    /// The interface of a link-local (fe80::/10) primary GID, given as
    /// `gid=fe80::1%IFACE`: the scope its socket binds in and link-local destinations
    /// are reached through. `None` for every other GID (a further GID is never
    /// link-local).
    pub iface: Option<String>,
}

impl VmSpec {
    /// The VM's primary IP address: IPv4 for an IPv4-mapped GID, else IPv6.
    pub fn addr(&self) -> IpAddr {
        gid_addr(self.vm.gid)
    }

    /// Every IP address of the VM, the primary first, each with its interface (only a
    /// link-local primary has one).
    pub fn addrs(&self) -> impl Iterator<Item = (IpAddr, Option<&str>)> + '_ {
        let iface = self.iface.as_deref();
        self.vm
            .gids()
            .enumerate()
            .map(move |(i, g)| (gid_addr(g), if i == 0 { iface } else { None }))
    }

    /// The VM's GIDs as `gid=` takes them (a link-local one with its `%IFACE`).
    fn gid_texts(&self) -> Vec<String> {
        self.vm
            .gids()
            .enumerate()
            .map(|(i, g)| match (&self.iface, i) {
                (Some(f), 0) => format!("{g}%{f}"),
                _ => g.to_string(),
            })
            .collect()
    }

    /// The VM's GIDs for a summary: `10.0.0.5` or `10.0.0.5 2001:db8::5`.
    pub fn gids_text(&self) -> String {
        self.gid_texts().join(" ")
    }
}

/// A GID's IP address: IPv4 for an IPv4-mapped GID, else IPv6.
pub fn gid_addr(gid: Gid) -> IpAddr {
    match gid.to_ipv4() {
        Some(a) => IpAddr::V4(a),
        None => IpAddr::V6(gid.into()),
    }
}

/// Parses a VM's GID: an IPv4 address (taken as its IPv4-mapped GID, RoCEv2 over
/// IPv4), an IPv4-mapped GID (`::ffff:127.0.0.1`), or a unicast IPv6 address (RoCEv2
/// over IPv6). A link-local IPv6 GID (fe80::/10) names its interface after `%`
/// (`fe80::1%br0`); no other GID takes one. Refused: what cannot be a unicast RoCE
/// GID ([`Gid::roce_unicast_problem`]).
pub fn parse_gid(v: &str) -> Result<(Gid, Option<String>), ConfigError> {
    gid_value(v).map_err(|why| ConfigError::BadValue {
        key: "gid".into(),
        value: v.to_string(),
        why,
    })
}

/// [`parse_gid`]'s work; the error says what is wrong with the value.
fn gid_value(v: &str) -> Result<(Gid, Option<String>), String> {
    let (addr, iface) = match v.split_once('%') {
        Some((a, i)) => (a, Some(i)),
        None => (v, None),
    };
    let gid = Gid::from_str(addr).map_err(|_| {
        "not a GID: give an IPv4 address (10.0.0.1), an IPv4-mapped GID \
         (::ffff:10.0.0.1) or an IPv6 address (2001:db8::1, fe80::1%IFACE)"
            .to_string()
    })?;
    if let Some(why) = gid.roce_unicast_problem() {
        return Err(format!(
            "{why} cannot be a VM's GID (a unicast RoCE address)"
        ));
    }
    match (gid.is_link_local(), iface) {
        (true, None) => Err(format!(
            "a link-local GID is reachable through one interface only: name it, \
             e.g. gid={addr}%br0"
        )),
        (true, Some(i)) => {
            check_ifname(i)?;
            Ok((gid, Some(i.to_string())))
        }
        (false, Some(_)) => {
            Err("only a link-local GID (fe80::/10) takes an interface (%IFACE)".into())
        }
        (false, None) => Ok((gid, None)),
    }
}

/// A VM's further GIDs after its `primary`, checked: none link-local, none twice (nor
/// the primary again), at most [`MAX_GIDS`] in all.
fn more_gids(primary: Gid, more: &[GidText]) -> Result<Vec<Gid>, ConfigError> {
    if more.len() >= MAX_GIDS {
        return Err(ConfigError::Invalid(format!(
            "{} GIDs: a VM has at most {MAX_GIDS}",
            more.len() + 1
        )));
    }
    let mut out: Vec<Gid> = Vec::with_capacity(more.len());
    for (g, _) in more {
        if g.is_link_local() {
            return Err(ConfigError::bad(
                "gid",
                &g.to_string(),
                "a link-local GID can only be a VM's first (primary) GID",
            ));
        }
        if *g == primary || out.contains(g) {
            return Err(ConfigError::bad(
                "gid",
                &g.to_string(),
                "given twice for this VM",
            ));
        }
        out.push(*g);
    }
    Ok(out)
}

/// A GID as `gid=` gives it: the GID and the interface of a link-local one.
type GidText = (Gid, Option<String>);

/// The keys of a VM (`--vm`, `[[vm]]`; `gid` may be given more than once).
pub const VM_KEYS: &str = "socket, gid, name, qpn-base, qpn-count, ca-guid, quota, id-range, \
                           incoming";

/// A VM's keys as given, each value parsed on its own; [`VmSpec::from_table`] checks
/// them together.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub(crate) struct VmTable {
    #[serde(alias = "socket-path", deserialize_with = "socket")]
    socket: Option<PathBuf>,
    #[serde(deserialize_with = "gids")]
    gid: Option<Vec<GidText>>,
    #[serde(deserialize_with = "name")]
    name: Option<String>,
    #[serde(deserialize_with = "de::u32_number")]
    qpn_base: Option<u32>,
    #[serde(deserialize_with = "de::u32_number")]
    qpn_count: Option<u32>,
    #[serde(deserialize_with = "de::u64_number")]
    ca_guid: Option<u64>,
    #[serde(deserialize_with = "de::u32_number")]
    quota: Option<u32>,
    #[serde(deserialize_with = "id_range")]
    id_range: Option<IdRange>,
    #[serde(deserialize_with = "incoming")]
    incoming: Option<bool>,
}

/// A VM key's value: its text without the white space around it.
fn text<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de::text(d).map(|t| t.trim().to_string())
}

fn socket<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
    match text(d)? {
        t if t.is_empty() => Err(D::Error::custom("empty")),
        t => Ok(Some(PathBuf::from(t))),
    }
}

/// `gid`: one GID (a string), or several (an array of strings, which a `--vm` spec's
/// repeated `gid=` also gives), each as [`parse_gid`] reads it.
fn gids<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<GidText>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    let texts = match OneOrMany::deserialize(d) {
        Ok(OneOrMany::One(t)) => vec![t],
        Ok(OneOrMany::Many(v)) => v,
        Err(_) => {
            return Err(D::Error::custom(
                "expected a GID (a string) or an array of GIDs",
            ));
        }
    };
    texts
        .iter()
        .map(|t| {
            gid_value(t.trim()).map_err(|why| D::Error::custom(format!("{:?}: {why}", t.trim())))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    match text(d)? {
        t if t.is_empty() || t.len() > 48 => Err(D::Error::custom("must be 1 to 48 bytes")),
        t => Ok(Some(t)),
    }
}

fn id_range<'de, D: Deserializer<'de>>(d: D) -> Result<Option<IdRange>, D::Error> {
    IdRange::from_str(&text(d)?)
        .map(Some)
        .map_err(D::Error::custom)
}

fn incoming<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    match text(d)?.as_str() {
        "yes" | "true" | "1" => Ok(Some(true)),
        "no" | "false" | "0" => Ok(Some(false)),
        _ => Err(D::Error::custom("expected yes or no")),
    }
}

impl VmSpec {
    /// A VM from its keys, checked together: socket and GID given, the QPN window within
    /// 24 bits and above QP1, a quota that fits its ID range, an ID range for an
    /// incoming VM. An error names the key (and the caller names the VM).
    pub(crate) fn from_table(t: VmTable) -> Result<VmSpec, ConfigError> {
        let Some(socket) = t.socket else {
            return Err(ConfigError::Missing {
                key: "socket",
                what: "PATH",
            });
        };
        let Some(((gid, iface), more)) = t.gid.as_deref().and_then(<[_]>::split_first) else {
            return Err(ConfigError::Missing {
                key: "gid",
                what: "GID",
            });
        };
        let (gid, iface) = (*gid, iface.clone());
        let ip = gid_addr(gid);
        let mut vm = VmConfig::new(t.name.unwrap_or_else(|| format!("vm-{ip}")), gid);
        vm.more_gids = more_gids(gid, more)?;
        if let Some(b) = t.qpn_base {
            vm.qpn_base = b;
        }
        if let Some(c) = t.qpn_count {
            vm.qpn_count = c;
        }
        if u64::from(vm.qpn_base) + u64::from(vm.qpn_count) > 1 << 24 {
            return Err(ConfigError::Invalid(
                "qpn-base + qpn-count must stay within 24-bit QPNs (<= 0x1000000)".into(),
            ));
        }
        if vm.qpn_count != 0 && vm.qpn_base < 2 {
            return Err(ConfigError::bad(
                "qpn-base",
                &vm.qpn_base.to_string(),
                "must be at least 2 (QP0 and QP1 are special)",
            ));
        }
        if let Some(g) = t.ca_guid {
            if g == 0 {
                return Err(ConfigError::bad("ca-guid", "0", "must not be 0"));
            }
            vm.ca_guid = g;
        }
        if let Some(q) = t.quota {
            if q == 0 {
                return Err(ConfigError::bad("quota", "0", "must be at least 1"));
            }
            vm.quota = Some(q);
        }
        if let Some(r) = t.id_range {
            let q = vm.quota.unwrap_or(DEFAULT_QUOTA);
            if u64::from(q) * 2 > r.size() {
                let why = format!(
                    "id-range {r} holds {} IDs, and a quota needs twice its connections' \
                     IDs (freed IDs wait in quarantine)",
                    r.size()
                );
                return Err(match vm.quota {
                    Some(q) => ConfigError::bad("quota", &q.to_string(), why),
                    None => ConfigError::bad(
                        "id-range",
                        &r.to_string(),
                        format!(
                            "{why}; the default quota is {DEFAULT_QUOTA}: give quota={} or \
                             less, or a longer range",
                            r.size() / 2
                        ),
                    ),
                });
            }
        }
        vm.id_range = t.id_range;
        let incoming = t.incoming.unwrap_or(false);
        if incoming && t.id_range.is_none() {
            return Err(ConfigError::Invalid(
                "incoming=yes needs id-range=BASE/LEN (the range the VM's connections \
                 carry from the host it leaves)"
                    .into(),
            ));
        }
        Ok(VmSpec {
            socket,
            vm,
            incoming,
            iface,
        })
    }

    /// The keys that give this spec back through [`VmSpec::from_table`].
    fn to_table(&self) -> VmTable {
        let v = &self.vm;
        let more = v.more_gids.iter().map(|g| (*g, None));
        VmTable {
            socket: Some(self.socket.clone()),
            gid: Some(
                std::iter::once((v.gid, self.iface.clone()))
                    .chain(more)
                    .collect(),
            ),
            name: Some(v.name.clone()),
            qpn_base: Some(v.qpn_base),
            qpn_count: Some(v.qpn_count),
            ca_guid: Some(v.ca_guid),
            quota: v.quota,
            id_range: v.id_range,
            incoming: Some(self.incoming),
        }
    }

    /// The VM's `key=value` pairs, as `--vm` and a `[[vm]]` table take them: every key
    /// with its value (`gid` once per GID, the primary first), so that reading them
    /// gives this spec back.
    pub fn to_pairs(&self) -> Vec<(&'static str, String)> {
        let v = &self.vm;
        let mut p = vec![
            ("name", v.name.clone()),
            ("socket", self.socket.display().to_string()),
        ];
        p.extend(self.gid_texts().into_iter().map(|g| ("gid", g)));
        p.extend([
            ("qpn-base", format!("{:#x}", v.qpn_base)),
            ("qpn-count", format!("{:#x}", v.qpn_count)),
            ("ca-guid", format!("{:#018x}", v.ca_guid)),
        ]);
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
        VmSpec::from_table(VmTable {
            quota,
            ..self.to_table()
        })
    }

    /// Whether `other` is the same VM but for its quota (a quota change, not a new VM).
    pub fn same_but_quota(&self, other: &VmSpec) -> bool {
        self.with_quota(None).ok() == other.with_quota(None).ok()
    }
}

impl FromStr for VmSpec {
    type Err = ConfigError;

    /// `socket=PATH,gid=GID[,gid=GID...,name=N,qpn-base=N,qpn-count=N,ca-guid=N,
    /// quota=N,id-range=BASE/LEN,incoming=yes]`.
    fn from_str(s: &str) -> Result<VmSpec, ConfigError> {
        let label = format!("--vm {s:?}");
        let table = spec_table(s).map_err(|e| ConfigError::vm(&label, e))?;
        let t: VmTable = located::from_table(Spanned::new(0..s.len(), table), || VM_KEYS.into())
            .map_err(|l| ConfigError::vm(&label, l.error))?;
        VmSpec::from_table(t).map_err(|e| ConfigError::vm(&label, e))
    }
}

/// A `--vm` spec's pairs as a table of strings, each key and value spanned in `s`; a
/// repeated `gid` becomes an array of them, as a `[[vm]]` table writes several.
fn spec_table(s: &str) -> Result<DeTable<'_>, ConfigError> {
    let mut table = DeTable::new();
    let mut at = 0;
    for part in s.split(',') {
        let start = at;
        at += part.len() + 1;
        if part.trim().is_empty() {
            continue;
        }
        let Some((k, v)) = part.split_once('=') else {
            return Err(ConfigError::NotKeyValue(part.trim().to_string()));
        };
        let span = |t: &str| {
            let from = start + (t.as_ptr() as usize - part.as_ptr() as usize);
            from..from + t.len()
        };
        let (k, v) = (k.trim(), v.trim());
        let key = if k == "socket-path" { "socket" } else { k };
        let value = Spanned::new(span(v), DeValue::String(v.into()));
        if key == "gid"
            && let Some(old) = table.get_mut(key)
        {
            let at = old.span();
            let first = std::mem::replace(old.get_mut(), DeValue::Array(DeArray::new()));
            let mut list = match first {
                DeValue::Array(a) => a,
                s => {
                    let mut a = DeArray::new();
                    a.push(Spanned::new(at.clone(), s));
                    a
                }
            };
            list.push(value);
            *old = Spanned::new(at.start..span(v).end, DeValue::Array(list));
            continue;
        }
        let old = table.insert(Spanned::new(span(k), key.into()), value);
        if old.is_some() {
            return Err(ConfigError::Twice { key: k.to_string() });
        }
    }
    Ok(table)
}

/// The VMs of a TOML `vm` key (a config file's `[[vm]]` tables, `vms.toml`'s), each
/// checked as `--vm` is; an error names the table (`[[vm]] #2 (b)`) and the key.
pub(crate) fn vm_tables(value: &Spanned<DeValue<'_>>) -> Result<Vec<VmSpec>, Located> {
    let DeValue::Array(items) = value.get_ref() else {
        return Err(Located::at(
            value.span(),
            ConfigError::WrongType {
                key: "vm".into(),
                expected: "an array of tables ([[vm]])",
                found: located::type_name(value.get_ref()),
            },
        ));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| vm_table(i, item))
        .collect()
}

/// The `i`th `[[vm]]` table.
fn vm_table(i: usize, item: &Spanned<DeValue<'_>>) -> Result<VmSpec, Located> {
    let label = format!("[[vm]] #{}", i + 1);
    let DeValue::Table(t) = item.get_ref() else {
        return Err(Located::at(
            item.span(),
            ConfigError::WrongType {
                key: label,
                expected: "a table",
                found: located::type_name(item.get_ref()),
            },
        ));
    };
    let label = match t.get("name").map(Spanned::get_ref) {
        Some(DeValue::String(n)) => format!("{label} ({n})"),
        _ => label,
    };
    let table = Spanned::new(item.span(), t.clone());
    let table: VmTable = located::from_table(table, || VM_KEYS.into())
        .map_err(|l| l.map(|e| ConfigError::vm(&label, e)))?;
    VmSpec::from_table(table).map_err(|e| Located::at(item.span(), ConfigError::vm(&label, e)))
}

/// VMs as a TOML array of `[[vm]]` tables (every value a string), as [`vm_tables`]
/// reads them.
pub(crate) fn toml_vms(specs: &[VmSpec]) -> toml::Value {
    toml::Value::Array(
        specs
            .iter()
            .map(|s| {
                let mut t = toml::Table::new();
                for (k, v) in s.to_pairs() {
                    let v = toml::Value::String(v);
                    match t.get_mut(k) {
                        // A second GID: the key's value becomes an array.
                        Some(toml::Value::Array(a)) => a.push(v),
                        Some(old) => *old = toml::Value::Array(vec![old.clone(), v]),
                        None => {
                            t.insert(k.to_string(), v);
                        }
                    }
                }
                toml::Value::Table(t)
            })
            .collect(),
    )
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
            if let Some(g) = a.vm.gids().find(|g| b.vm.holds(*g)) {
                return dup("GID", g.to_string());
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
