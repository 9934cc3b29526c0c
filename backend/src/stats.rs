//! The daemon's figures: device- and wire-level counters next to the mux's, a
//! serialisable [`Snapshot`] of them, and its two renderings (the infiniband_cm-style
//! table of `pvcm-backend stat`, and Prometheus text).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use pvcm_wire::mad::AttributeId;
use serde::{Deserialize, Serialize};

use crate::mux::{DropReason, Group, Stats};

macro_rules! dev_drops {
    ($($(#[$m:meta])* $v:ident => $s:expr,)*) => {
        /// Why the device or the wire port dropped something, before or outside the mux.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DevDrop { $($(#[$m])* $v,)* }

        impl DevDrop {
            /// Every reason, in counter order.
            pub const ALL: &'static [DevDrop] = &[$(DevDrop::$v,)*];
            /// Number of reasons.
            pub const COUNT: usize = DevDrop::ALL.len();
            /// Snake-case name for tables and metrics.
            pub fn name(self) -> &'static str {
                match self { $(DevDrop::$v => $s,)* }
            }
        }
    };
}

dev_drops! {
    /// tx: a chain the queue could not walk (no descriptor, a broken link, a loop, a bad
    /// indirect table).
    BadChain => "bad_chain",
    /// tx: a descriptor outside guest memory.
    BadAddress => "bad_address",
    /// tx: a device-writable descriptor in a tx chain.
    WrongDirection => "wrong_direction",
    /// tx: a chain longer than header + the largest payload (304 bytes).
    ChainTooLong => "chain_too_long",
    /// tx: shorter than the 48-byte header, or than header + `len`.
    Truncated => "truncated",
    /// tx: `len` above 256.
    Oversize => "oversize",
    /// tx: a message type the device does not take (unknown, or device -> driver only).
    UnknownType => "unknown_type",
    /// tx: a MAD whose `len` is not 256.
    BadMadLength => "bad_mad_length",
    /// tx: a MAD of a management class other than CM.
    NotCm => "not_cm",
    /// tx: a MAD whose remote GID cannot be reached: not a unicast RoCE address
    /// (multicast, unspecified, ...), of the other IP family than the VM's own GID, or
    /// link-local with no interface to reach it through.
    BadRemoteGid => "bad_remote_gid",
    /// tx: a message while no VM session is attached.
    NotAttached => "not_attached",
    /// rx: the VM had no rx buffer and its backlog was full.
    RxBacklogFull => "rx_backlog_full",
    /// rx: the VM had no rx buffer and the host-wide backlog budget was spent.
    RxHostBudget => "rx_host_budget",
    /// rx: a message that waited for a VM's rx buffers when the VM reset its device or
    /// left: it named the old session's connections and went with it (the peer's retry
    /// reaches the new session).
    RxDiscarded => "rx_discarded",
    /// rx: an rx buffer that was too short, read-only or outside guest memory.
    RxBadBuffer => "rx_bad_buffer",
    /// wire: a datagram that is not 280 bytes (or a padded frame).
    WireBadLength => "wire_bad_length",
    /// wire: a BTH that is not a UD SEND only to QP1 of version 0 with the default P_Key.
    WireBadBth => "wire_bad_bth",
    /// wire: a DETH without the GSI Q_Key or source QP 1.
    WireBadDeth => "wire_bad_deth",
    /// wire: a bad invariant CRC.
    WireBadIcrc => "wire_bad_icrc",
    /// wire (raw and packet receive): an IPv4 header with options, a fragment, or a bad
    /// header checksum.
    WireBadIp => "wire_bad_ip",
    /// wire: a frame from a source that cannot be a RoCE peer: an unknown address
    /// family, or (packet port) a multicast, broadcast, unspecified or loopback source,
    /// or an IPv4-mapped or IPv4-compatible address inside an IPv6 header.
    WireBadSource => "wire_bad_source",
    /// wire: the socket (soft port) or the kernel (umad port) refused a frame.
    WireSendError => "wire_send_error",
    /// wire (umad port): a MAD of a class other than CM version 2.
    WireNotCm => "wire_not_cm",
    /// wire (umad port: a local GID index; packet port: a destination address): a MAD
    /// for a GID no VM owns (host counters).
    WireUnknownGid => "wire_unknown_gid",
    /// wire (packet port): a frame shorter than its Ethernet, IP or UDP header, or than
    /// the length its IP header gives.
    WireTruncated => "wire_truncated",
    /// wire (packet port): an IPv6 header followed by an extension header (hop-by-hop,
    /// routing, fragment, destination options, ...) instead of UDP.
    WireIpv6ExtHeader => "wire_ipv6_ext_header",
    /// wire (packet port): a frame on the device that is not RoCEv2 (not IPv4 or IPv6,
    /// not UDP, not to the RoCEv2 port): the kernel filter lets none through unless the
    /// device's traffic bypasses it.
    WireNotRoce => "wire_not_roce",
    /// wire: datagrams the kernel dropped before pvcm read them, its socket's receive
    /// queue full: the soft port's per-VM count (its sockets' drop counts, or in raw
    /// mode the datagrams that reached the VM's address less those the raw socket
    /// delivered), PACKET_STATISTICS drops of the packet port's socket (host
    /// counters). The peers' retries recover them; a growing count means the host loop
    /// falls behind.
    WireRxOverflow => "wire_rx_overflow",
    /// egress (packet port): a frame a VM transmitted to QP1 from its own NIC, stopped
    /// on the host (its tap's divert forwards it to DEV instead of the fabric) and
    /// counted here on the VM whose address is its source.
    VmQp1Egress => "vm_qp1_egress",
    /// egress (packet port): a frame a VM transmitted that its tap's divert could not
    /// classify and stopped (a UDP fragment other than the first, an IPv6
    /// extension-header chain it cannot walk, a second VLAN tag), counted on the VM
    /// whose address is its source.
    VmEgressUnclassified => "vm_egress_unclassified",
    /// egress (packet port): a frame transmitted on DEV whose source is no VM's address
    /// (host counters): not something a VM's divert stops (its source is the VM's),
    /// or a frame without an IP source (RoCEv1, a second VLAN tag).
    WireEgressUnknownSource => "wire_egress_unknown_source",
}

/// Message and frame counts of the I/O paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Io {
    /// Messages taken from the tx queue.
    TxMessages,
    /// Messages written into rx buffers.
    RxMessages,
    /// Frames sent on the wire.
    WireTxFrames,
    /// Datagrams received from the wire.
    WireRxFrames,
    /// SEND_ERROR messages queued for the guest.
    SendErrors,
    /// vhost-user sessions served.
    Sessions,
    /// Pauses of the VM's tx after rounds full of bad input (see the device's throttle).
    TxThrottles,
    /// Tx chains a restarted backend returned unsent because its journal shows their
    /// MADs left before the restart (see docs/restart.md).
    TxResumeSkipped,
}

impl Io {
    /// Every kind.
    pub const ALL: [Io; 8] = [
        Io::TxMessages,
        Io::RxMessages,
        Io::WireTxFrames,
        Io::WireRxFrames,
        Io::SendErrors,
        Io::Sessions,
        Io::TxThrottles,
        Io::TxResumeSkipped,
    ];

    /// Snake-case name.
    pub fn name(self) -> &'static str {
        match self {
            Io::TxMessages => "tx_messages",
            Io::RxMessages => "rx_messages",
            Io::WireTxFrames => "wire_tx_frames",
            Io::WireRxFrames => "wire_rx_frames",
            Io::SendErrors => "send_errors",
            Io::Sessions => "sessions",
            Io::TxThrottles => "tx_throttles",
            Io::TxResumeSkipped => "tx_resume_skipped",
        }
    }
}

/// Lock-free device counters of one VM port, and the mux's counts of the port's ended
/// vhost-user sessions.
#[derive(Debug)]
pub struct DevCounters {
    drops: [AtomicU64; DevDrop::COUNT],
    io: [AtomicU64; Io::ALL.len()],
    /// The mux's counters of the sessions that ended (entries stay 0): added to the
    /// current session's, a VM's counters never go back while the port is served.
    past: Mutex<Stats>,
}

impl Default for DevCounters {
    fn default() -> Self {
        DevCounters {
            drops: std::array::from_fn(|_| AtomicU64::new(0)),
            io: std::array::from_fn(|_| AtomicU64::new(0)),
            past: Mutex::new(Stats::default()),
        }
    }
}

impl DevCounters {
    /// Counts one drop.
    pub fn drop(&self, r: DevDrop) {
        self.drops[r as usize].fetch_add(1, Ordering::Relaxed);
    }
    /// Counts `n` drops at once.
    pub fn drop_n(&self, r: DevDrop, n: u64) {
        if n != 0 {
            self.drops[r as usize].fetch_add(n, Ordering::Relaxed);
        }
    }
    /// Adds to an I/O count.
    pub fn add(&self, k: Io, n: u64) {
        self.io[k as usize].fetch_add(n, Ordering::Relaxed);
    }
    /// One drop count.
    pub fn dropped(&self, r: DevDrop) -> u64 {
        self.drops[r as usize].load(Ordering::Relaxed)
    }
    /// One I/O count.
    pub fn io(&self, k: Io) -> u64 {
        self.io[k as usize].load(Ordering::Relaxed)
    }
    /// Keeps the mux's counters of a session that ends (its `vm_stats` just before
    /// the mux folds them into the host's).
    pub fn end_session(&self, s: &Stats) {
        let mut p = self.past.lock().unwrap_or_else(PoisonError::into_inner);
        p.counters += &s.counters;
        p.drops += &s.drops;
        p.on_behalf += s.on_behalf;
    }

    /// The mux's figures of the current session (`current`; its entries as they are)
    /// plus the counters of every session that ended.
    pub fn lifetime(&self, mut current: Stats) -> Stats {
        let p = self.past.lock().unwrap_or_else(PoisonError::into_inner);
        current.counters += &p.counters;
        current.drops += &p.drops;
        current.on_behalf += p.on_behalf;
        current
    }

    /// Adds every device count of `other` to these (not the mux's: the host's own
    /// figures have those).
    pub fn absorb(&self, other: &DevCounters) {
        for (a, b) in self.drops.iter().zip(&other.drops) {
            a.fetch_add(b.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        for (a, b) in self.io.iter().zip(&other.io) {
            a.fetch_add(b.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

/// Figures of one VM or of the host, by name. Every counter is present (zeros too), so
/// scripts can index without checking.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Figures {
    /// infiniband_cm groups (`cm_rx_duplicates`, `cm_rx_msgs`, `cm_tx_msgs`,
    /// `cm_tx_retries`) -> message type (`REQ`, `MRA`, ...) -> count.
    pub cm: BTreeMap<String, BTreeMap<String, u64>>,
    /// The mux's drops by reason.
    pub drops: BTreeMap<String, u64>,
    /// The device's and wire port's drops by reason.
    pub device_drops: BTreeMap<String, u64>,
    /// Message and frame counts.
    pub io: BTreeMap<String, u64>,
    /// MADs the mux sent itself on the VM's behalf (counted in `cm` too): answers from
    /// what it holds after the VM's side is gone, and a detached VM's cleanup.
    #[serde(default)]
    pub on_behalf: u64,
    /// Live entries.
    pub live: u64,
    /// Quarantined entries.
    pub quarantined: u64,
}

impl Figures {
    /// Figures from the mux's stats and (summed) device counters.
    pub fn new(s: &Stats, dev: &[&DevCounters]) -> Figures {
        let mut cm = BTreeMap::new();
        for g in Group::ALL {
            let mut m = BTreeMap::new();
            for a in AttributeId::CM_MESSAGES {
                m.insert(a.name().to_string(), s.counters.get(g, a));
            }
            cm.insert(g.name().to_string(), m);
        }
        let drops = DropReason::ALL
            .iter()
            .map(|r| (r.name().to_string(), s.drops.get(*r)))
            .collect();
        let device_drops = DevDrop::ALL
            .iter()
            .map(|r| {
                let n = dev.iter().map(|d| d.dropped(*r)).sum();
                (r.name().to_string(), n)
            })
            .collect();
        let io = Io::ALL
            .iter()
            .map(|k| (k.name().to_string(), dev.iter().map(|d| d.io(*k)).sum()))
            .collect();
        Figures {
            cm,
            drops,
            device_drops,
            io,
            on_behalf: s.on_behalf,
            live: s.live,
            quarantined: s.quarantined,
        }
    }

    /// One infiniband_cm counter (`group` e.g. `cm_tx_msgs`, `msg` e.g. `REQ`).
    pub fn cm(&self, group: &str, msg: &str) -> u64 {
        self.cm
            .get(group)
            .and_then(|m| m.get(msg))
            .copied()
            .unwrap_or(0)
    }

    /// One drop counter, mux or device, by name.
    pub fn dropped(&self, reason: &str) -> u64 {
        self.drops.get(reason).copied().unwrap_or(0)
            + self.device_drops.get(reason).copied().unwrap_or(0)
    }

    /// One I/O count by name.
    pub fn io(&self, k: &str) -> u64 {
        self.io.get(k).copied().unwrap_or(0)
    }

    /// The table: groups with one line per non-zero message type, drops, entries.
    pub fn render(&self, out: &mut String) {
        for (g, msgs) in &self.cm {
            let _ = writeln!(out, "  {g}:");
            for (m, v) in msgs {
                if *v != 0 {
                    let _ = writeln!(out, "    {m:<12} {v}");
                }
            }
        }
        let nonzero = |m: &BTreeMap<String, u64>| m.iter().any(|(_, v)| *v != 0);
        if nonzero(&self.drops) || nonzero(&self.device_drops) {
            let _ = writeln!(out, "  drops:");
            for (r, v) in self.drops.iter().chain(self.device_drops.iter()) {
                if *v != 0 {
                    let _ = writeln!(out, "    {r:<20} {v}");
                }
            }
        }
        let _ = writeln!(out, "  io:");
        for (k, v) in &self.io {
            let _ = writeln!(out, "    {k:<20} {v}");
        }
        if self.on_behalf != 0 {
            let _ = writeln!(out, "  sent on the VM's behalf: {}", self.on_behalf);
        }
        let _ = writeln!(
            out,
            "  entries: {} live, {} quarantined",
            self.live, self.quarantined
        );
    }
}

/// The reloads of the configuration since the daemon started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reloads {
    /// Reloads that loaded (the VMs changed by the difference).
    pub ok: u64,
    /// Reloads that did not (the file did not read or check; nothing changed).
    pub failed: u64,
    /// When the last one ended, seconds since the Unix epoch (0: none yet).
    pub last_unix_seconds: u64,
    /// Whether the last one loaded.
    pub last_ok: bool,
    /// The options the last one found changed that take effect at the next start only.
    pub restart_needed: Vec<String>,
}

/// One VM's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmFigures {
    /// The VM's name.
    pub name: String,
    /// Its primary GID.
    pub gid: String,
    /// Its vhost-user socket.
    pub socket: String,
    /// A vhost-user session is attached now.
    pub attached: bool,
    /// Its quota of live connections in effect (its own, or the host's default).
    #[serde(default)]
    pub quota: u64,
    /// Its figures since the daemon started serving it: counters of every session
    /// (the mux's) and of the device; entries of the current session.
    pub figures: Figures,
}

/// A setting in effect in a lesser form than the configuration asked for (logged at
/// WARN when the port opened).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Degraded {
    /// The setting: `wire_rx` (the receive mode), `wire_rx_buffer` (the receive
    /// socket's buffer, bytes).
    pub setting: String,
    /// What the configuration asked for.
    pub configured: String,
    /// What is in effect.
    pub effective: String,
    /// Why, and what to do about it.
    pub why: String,
}

/// The receive buffer of the wire port's shared receive socket (the soft port's raw
/// socket, the packet port's packet socket): asked for and in effect, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RxBuffer {
    /// What the port asks for.
    pub wanted: u64,
    /// What the kernel gave (without its bookkeeping share).
    pub effective: u64,
}

/// Everything `pvcm-backend stat` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The mux policy.
    pub policy: String,
    /// The soft port's receive mode in effect (`raw` or `udp`; see `--wire-rx`).
    #[serde(default)]
    pub wire_rx: String,
    /// The receive mode the configuration asked for (`auto`, `raw`, `udp`; other ports:
    /// the same as `wire_rx`).
    #[serde(default)]
    pub wire_rx_configured: String,
    /// The shared receive socket's buffer, if the port has such a socket.
    #[serde(default)]
    pub wire_rx_buffer: Option<RxBuffer>,
    /// Settings in effect in a lesser form than configured (empty: none).
    #[serde(default)]
    pub degraded: Vec<Degraded>,
    /// The reloads of the configuration (SIGHUP, `pvcm-backend reload`).
    #[serde(default)]
    pub reloads: Reloads,
    /// Per VM.
    pub vms: Vec<VmFigures>,
    /// The host: every VM's, the proxy's own, and those of VMs that left.
    pub host: Figures,
}

impl Snapshot {
    /// The VM of this name.
    pub fn vm(&self, name: &str) -> Option<&VmFigures> {
        self.vms.iter().find(|v| v.name == name)
    }

    /// The `pvcm-backend stat` table.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for v in &self.vms {
            let _ = writeln!(
                out,
                "vm {} ({}, {}){}",
                v.name,
                v.gid,
                v.socket,
                if v.attached { "" } else { " [detached]" }
            );
            v.figures.render(&mut out);
        }
        let configured =
            if self.wire_rx_configured.is_empty() || self.wire_rx_configured == self.wire_rx {
                String::new()
            } else {
                format!(" (configured {})", self.wire_rx_configured)
            };
        let buffer = self.wire_rx_buffer.map_or(String::new(), |b| {
            format!(", rx buffer {} of {} bytes", b.effective, b.wanted)
        });
        let _ = writeln!(
            out,
            "host (policy {}, wire rx {}{configured}{buffer}, all VMs summed)",
            self.policy, self.wire_rx
        );
        for d in &self.degraded {
            let _ = writeln!(
                out,
                "  DEGRADED {}: configured {}, in effect {}: {}",
                d.setting, d.configured, d.effective, d.why
            );
        }
        self.host.render(&mut out);
        out
    }

    /// Prometheus text exposition (version 0.0.4), in node_exporter's manner: per-VM
    /// families carry a `vm` label, the host's totals have families of their own
    /// (`pvcm_host_*`), counters never go back while the daemon runs; then the build
    /// and the process (`process_*`, from `/proc/self`).
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        self.prometheus_figures(&mut out);
        self.prometheus_reloads(&mut out);
        self.prometheus_state(&mut out);
        if let Some(p) = Process::read() {
            p.render(&mut out);
        }
        out
    }

    /// The figures' families: each per VM (`pvcm_*`, a `vm` label) and for the host
    /// (`pvcm_host_*`).
    fn prometheus_figures(&self, out: &mut String) {
        let vms: Vec<(String, &Figures)> = self
            .vms
            .iter()
            .map(|v| (format!("vm=\"{}\",", esc(&v.name)), &v.figures))
            .collect();
        let host = [(String::new(), &self.host)];
        for (prefix, rows) in [("pvcm", &vms[..]), ("pvcm_host", &host[..])] {
            let whose = if prefix == "pvcm" {
                "per VM"
            } else {
                "host-wide"
            };
            family(
                out,
                &format!("{prefix}_cm_messages_total"),
                "counter",
                &format!("CM MADs per infiniband_cm group and message type, {whose}."),
            );
            for (l, f) in rows {
                for (g, msgs) in &f.cm {
                    for (m, v) in msgs {
                        let _ = writeln!(
                            out,
                            "{prefix}_cm_messages_total{{{l}group=\"{g}\",msg=\"{m}\"}} {v}"
                        );
                    }
                }
            }
            family(
                out,
                &format!("{prefix}_drops_total"),
                "counter",
                &format!("Dropped MADs, frames and messages by layer and reason, {whose}."),
            );
            for (l, f) in rows {
                for (layer, m) in [("mux", &f.drops), ("device", &f.device_drops)] {
                    for (r, v) in m {
                        let _ = writeln!(
                            out,
                            "{prefix}_drops_total{{{l}layer=\"{layer}\",reason=\"{r}\"}} {v}"
                        );
                    }
                }
            }
            family(
                out,
                &format!("{prefix}_io_total"),
                "counter",
                &format!("Messages and frames through the device and the wire port, {whose}."),
            );
            for (l, f) in rows {
                for (k, v) in &f.io {
                    let _ = writeln!(out, "{prefix}_io_total{{{l}kind=\"{k}\"}} {v}");
                }
            }
            family(
                out,
                &format!("{prefix}_on_behalf_total"),
                "counter",
                &format!("CM MADs the mux sent itself on a VM's behalf, {whose}."),
            );
            for (l, f) in rows {
                let labels = match l.trim_end_matches(',') {
                    "" => String::new(),
                    l => format!("{{{l}}}"),
                };
                let _ = writeln!(out, "{prefix}_on_behalf_total{labels} {}", f.on_behalf);
            }
            family(
                out,
                &format!("{prefix}_entries"),
                "gauge",
                &format!("Connection entries at the mux by state, {whose}."),
            );
            for (l, f) in rows {
                for (state, v) in [("live", f.live), ("quarantined", f.quarantined)] {
                    let _ = writeln!(out, "{prefix}_entries{{{l}state=\"{state}\"}} {v}");
                }
            }
        }
    }

    /// The reloads' families.
    fn prometheus_reloads(&self, out: &mut String) {
        let r = &self.reloads;
        family(
            out,
            "pvcm_reloads_total",
            "counter",
            "Reloads of the configuration file (SIGHUP, pvcm-backend reload), by result.",
        );
        for (result, v) in [("ok", r.ok), ("failed", r.failed)] {
            let _ = writeln!(out, "pvcm_reloads_total{{result=\"{result}\"}} {v}");
        }
        family(
            out,
            "pvcm_reload_last_timestamp_seconds",
            "gauge",
            "When the last reload ended, seconds since the Unix epoch (0: none yet).",
        );
        let _ = writeln!(
            out,
            "pvcm_reload_last_timestamp_seconds {}",
            r.last_unix_seconds
        );
        family(
            out,
            "pvcm_reload_last_success",
            "gauge",
            "1 if the last reload loaded, 0 if it did not or none happened yet.",
        );
        let _ = writeln!(out, "pvcm_reload_last_success {}", u8::from(r.last_ok));
    }

    /// What is in effect: each VM's session and quota, the receive mode and buffer, the
    /// degraded settings, the build.
    fn prometheus_state(&self, out: &mut String) {
        family(
            out,
            "pvcm_vm_attached",
            "gauge",
            "1 while the VM's vhost-user session is up.",
        );
        for v in &self.vms {
            let _ = writeln!(
                out,
                "pvcm_vm_attached{{vm=\"{}\"}} {}",
                esc(&v.name),
                u8::from(v.attached)
            );
        }
        family(
            out,
            "pvcm_vm_quota_connections",
            "gauge",
            "The VM's quota of live connections in effect (its own or the host's default).",
        );
        for v in &self.vms {
            let _ = writeln!(
                out,
                "pvcm_vm_quota_connections{{vm=\"{}\"}} {}",
                esc(&v.name),
                v.quota
            );
        }
        family(
            out,
            "pvcm_wire_rx_mode",
            "gauge",
            "1 for the wire port's receive mode in effect, with the configured one.",
        );
        let _ = writeln!(
            out,
            "pvcm_wire_rx_mode{{mode=\"{}\",configured=\"{}\"}} 1",
            esc(&self.wire_rx),
            esc(&self.wire_rx_configured)
        );
        if let Some(b) = self.wire_rx_buffer {
            family(
                out,
                "pvcm_wire_rx_buffer_bytes",
                "gauge",
                "The shared receive socket's buffer: state=\"wanted\" asked for, \
                 state=\"effective\" in effect.",
            );
            for (state, v) in [("wanted", b.wanted), ("effective", b.effective)] {
                let _ = writeln!(out, "pvcm_wire_rx_buffer_bytes{{state=\"{state}\"}} {v}");
            }
        }
        family(
            out,
            "pvcm_degraded",
            "gauge",
            "1 for each setting in effect in a lesser form than configured.",
        );
        for d in &self.degraded {
            let _ = writeln!(
                out,
                "pvcm_degraded{{setting=\"{}\",configured=\"{}\",effective=\"{}\"}} 1",
                esc(&d.setting),
                esc(&d.configured),
                esc(&d.effective)
            );
        }
        family(
            out,
            "pvcm_build_info",
            "gauge",
            "1, labelled with the daemon's version, mux policy and platform.",
        );
        let _ = writeln!(
            out,
            "pvcm_build_info{{version=\"{}\",policy=\"{}\",os=\"{}\",arch=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            esc(&self.policy),
            std::env::consts::OS,
            std::env::consts::ARCH
        );
    }
}

/// What the metrics listener does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET /metrics` or `HEAD /metrics` (a query string allowed): the figures.
    Metrics,
    /// Any other path: 404.
    NotFound,
    /// Any other method, or not HTTP: 405.
    BadMethod,
}

/// Routes an HTTP request by its head (the request line first).
pub fn metrics_route(head: &[u8]) -> Route {
    let line = head
        .split(|&b| b == b'\r' || b == b'\n')
        .next()
        .unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next());
    if method != b"GET" && method != b"HEAD" {
        return Route::BadMethod;
    }
    let Some(target) = target else {
        return Route::BadMethod;
    };
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    if path == b"/metrics" {
        Route::Metrics
    } else {
        Route::NotFound
    }
}

/// A label value, escaped for the text format.
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A family's HELP and TYPE lines.
fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// The standard process figures (the Prometheus client libraries' `process_*`), from
/// `/proc/self`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Process {
    /// User and system CPU time, seconds.
    pub cpu_seconds: f64,
    /// Resident set size, bytes.
    pub resident_bytes: u64,
    /// Virtual memory size, bytes.
    pub virtual_bytes: u64,
    /// Open file descriptors.
    pub open_fds: u64,
    /// The soft limit on open file descriptors.
    pub max_fds: Option<u64>,
    /// Start time, seconds since the Unix epoch.
    pub start_time_seconds: f64,
}

/// Linux's USER_HZ: the unit of the times in `/proc/PID/stat`, 100 on every architecture.
const USER_HZ: f64 = 100.0;

impl Process {
    /// This process's figures; `None` where `/proc` cannot tell.
    pub fn read() -> Option<Process> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot = std::fs::read_to_string("/proc/stat").ok()?;
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        Process::parse(&stat, &boot, &status, &limits, open_fds)
    }

    /// The figures from the texts of `/proc/self/stat`, `/proc/stat`, `/proc/self/status`
    /// and `/proc/self/limits`.
    pub fn parse(
        stat: &str,
        boot: &str,
        status: &str,
        limits: &str,
        open_fds: u64,
    ) -> Option<Process> {
        // The command name (field 2) may hold spaces and parentheses: fields start after
        // its last ')'. Then field 3 (state) is index 0 here.
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        let (utime, stime, start) = (field(14)?, field(15)?, field(22)?);
        let vsize = field(23)?;
        let btime = boot
            .lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<u64>().ok())?;
        let kib = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        let max_fds = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse::<u64>().ok());
        Some(Process {
            cpu_seconds: (utime + stime) as f64 / USER_HZ,
            resident_bytes: kib("VmRSS:")? * 1024,
            virtual_bytes: vsize,
            open_fds,
            max_fds,
            start_time_seconds: btime as f64 + start as f64 / USER_HZ,
        })
    }

    /// The `process_*` families.
    pub fn render(&self, out: &mut String) {
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            family(out, name, kind, help);
            let _ = writeln!(out, "{name} {v}");
        };
        one(
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            format!("{}", self.cpu_seconds),
        );
        one(
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            self.resident_bytes.to_string(),
        );
        one(
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            self.virtual_bytes.to_string(),
        );
        one(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            self.open_fds.to_string(),
        );
        if let Some(m) = self.max_fds {
            one(
                "process_max_fds",
                "gauge",
                "Maximum number of open file descriptors.",
                m.to_string(),
            );
        }
        one(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            format!("{}", self.start_time_seconds),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_and_renderings() {
        let mut s = Stats::default();
        s.counters.bump(Group::TxMsgs, AttributeId::Req);
        s.counters.bump(Group::TxMsgs, AttributeId::Req);
        s.drops.bump(DropReason::UnknownGid);
        s.live = 3;
        let d = DevCounters::default();
        d.drop(DevDrop::WireBadIcrc);
        d.add(Io::TxMessages, 5);
        let f = Figures::new(&s, &[&d, &d]);
        assert_eq!(f.cm("cm_tx_msgs", "req"), 2);
        assert_eq!(f.cm("cm_rx_msgs", "req"), 0);
        assert_eq!(f.dropped("unknown_gid"), 1);
        assert_eq!(f.dropped("wire_bad_icrc"), 2);
        assert_eq!(f.io("tx_messages"), 10);
        let snap = Snapshot {
            policy: "default".into(),
            wire_rx: "udp".into(),
            wire_rx_configured: "auto".into(),
            wire_rx_buffer: Some(RxBuffer {
                wanted: 64 << 20,
                effective: 4 << 20,
            }),
            reloads: Reloads::default(),
            degraded: vec![Degraded {
                setting: "wire_rx".into(),
                configured: "auto".into(),
                effective: "udp".into(),
                why: "no CAP_NET_RAW".into(),
            }],
            vms: vec![VmFigures {
                name: "a\"b".into(),
                gid: "::ffff:127.0.0.1".into(),
                socket: "/x".into(),
                attached: true,
                quota: 4096,
                figures: f.clone(),
            }],
            host: f,
        };
        let t = snap.render();
        assert!(t.contains("cm_tx_msgs:\n    req          2\n"), "{t}");
        assert!(!t.contains("    rtu"), "{t}");
        assert!(t.contains("wire_bad_icrc        2"), "{t}");
        assert!(t.contains("3 live"), "{t}");
        assert!(
            t.contains("wire rx udp (configured auto), rx buffer 4194304 of 67108864 bytes"),
            "{t}"
        );
        assert!(
            t.contains("DEGRADED wire_rx: configured auto, in effect udp: no CAP_NET_RAW"),
            "{t}"
        );
        let p = snap.prometheus();
        assert!(p.contains("pvcm_wire_rx_mode{mode=\"udp\",configured=\"auto\"} 1"));
        assert!(p.contains("pvcm_wire_rx_buffer_bytes{state=\"effective\"} 4194304"));
        assert!(p.contains(
            "pvcm_degraded{setting=\"wire_rx\",configured=\"auto\",effective=\"udp\"} 1"
        ));
        assert!(
            p.contains("pvcm_cm_messages_total{vm=\"a\\\"b\",group=\"cm_tx_msgs\",msg=\"req\"} 2"),
            "{p}"
        );
        assert!(p.contains("pvcm_host_drops_total{layer=\"device\",reason=\"wire_bad_icrc\"} 2"));
        assert!(
            !p.contains("_host\""),
            "host totals in the per-VM families: {p}"
        );
        assert!(p.contains("\npvcm_host_on_behalf_total 0\n"), "{p}");
        assert!(
            p.contains("pvcm_vm_quota_connections{vm=\"a\\\"b\"} 4096"),
            "{p}"
        );
        assert!(p.contains(&format!(
            "pvcm_build_info{{version=\"{}\",",
            env!("CARGO_PKG_VERSION")
        )));
        assert!(p.contains("\nprocess_open_fds "), "{p}");
        assert!(p.contains("\nprocess_start_time_seconds "), "{p}");
        // Every family has one HELP and one TYPE, before its samples.
        let mut seen = std::collections::HashSet::new();
        for l in p.lines().filter(|l| l.starts_with("# TYPE ")) {
            let name = l.split(' ').nth(2).unwrap();
            assert!(seen.insert(name), "{name} twice: {p}");
        }
        let j = serde_json::to_string(&snap).unwrap();
        let back: Snapshot = serde_json::from_str(&j).unwrap();
        assert_eq!(back, snap);
    }

    #[test]
    fn vm_counters_keep_ended_sessions() {
        let d = DevCounters::default();
        let mut s = Stats::default();
        s.counters.bump(Group::TxMsgs, AttributeId::Req);
        s.drops.bump(DropReason::UnknownGid);
        s.on_behalf = 2;
        s.live = 5;
        d.end_session(&s);
        let now = d.lifetime(Stats {
            live: 1,
            ..Stats::default()
        });
        assert_eq!(now.counters.get(Group::TxMsgs, AttributeId::Req), 1);
        assert_eq!(now.drops.get(DropReason::UnknownGid), 1);
        assert_eq!((now.on_behalf, now.live), (2, 1));
        d.end_session(&s);
        let later = d.lifetime(s.clone());
        assert_eq!(later.counters.get(Group::TxMsgs, AttributeId::Req), 3);
        assert_eq!((later.on_behalf, later.live), (6, 5));
    }

    #[test]
    fn metrics_paths() {
        assert_eq!(
            metrics_route(b"GET /metrics HTTP/1.1\r\n\r\n"),
            Route::Metrics
        );
        assert_eq!(
            metrics_route(b"HEAD /metrics?x=1 HTTP/1.1\r\n"),
            Route::Metrics
        );
        assert_eq!(metrics_route(b"GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(
            metrics_route(b"GET /metricsx HTTP/1.0\r\n"),
            Route::NotFound
        );
        assert_eq!(
            metrics_route(b"POST /metrics HTTP/1.1\r\n"),
            Route::BadMethod
        );
        assert_eq!(metrics_route(b""), Route::BadMethod);
        assert_eq!(metrics_route(b"GET"), Route::BadMethod);
    }

    #[test]
    fn process_figures_from_proc() {
        let stat = "4242 (pvcm (x) y) S 1 4242 4242 0 -1 4194560 1 0 0 0 250 50 0 0 20 0 9 0 \
                    1000 123456789 77 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0";
        let boot = "cpu  1 2 3\nbtime 1700000000\nprocesses 5\n";
        let status = "Name:\tpvcm\nVmRSS:\t    2048 kB\n";
        let limits = "Limit Soft Limit Hard Limit Units\n\
                      Max open files            1024                 524288               files\n";
        let p = Process::parse(stat, boot, status, limits, 12).unwrap();
        assert_eq!(p.cpu_seconds, 3.0);
        assert_eq!(p.resident_bytes, 2048 * 1024);
        assert_eq!(p.virtual_bytes, 123456789);
        assert_eq!(p.max_fds, Some(1024));
        assert_eq!(p.start_time_seconds, 1_700_000_010.0);
        assert!(Process::parse("garbage", boot, status, limits, 1).is_none());
        assert!(Process::read().is_some());
    }
}
