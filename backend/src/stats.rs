//! The daemon's figures: device- and wire-level counters next to the mux's, a
//! serialisable [`Snapshot`] of them, and its two renderings (the infiniband_cm-style
//! table of `pvcm-backend stat`, and Prometheus text).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Lock-free device counters of one VM port.
#[derive(Debug)]
pub struct DevCounters {
    drops: [AtomicU64; DevDrop::COUNT],
    io: [AtomicU64; Io::ALL.len()],
}

impl Default for DevCounters {
    fn default() -> Self {
        DevCounters {
            drops: std::array::from_fn(|_| AtomicU64::new(0)),
            io: std::array::from_fn(|_| AtomicU64::new(0)),
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
    /// Adds every count of `other` to these.
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

/// One VM's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmFigures {
    /// The VM's name.
    pub name: String,
    /// Its GID.
    pub gid: String,
    /// Its vhost-user socket.
    pub socket: String,
    /// A vhost-user session is attached now.
    pub attached: bool,
    /// Its figures (the mux's for the current session, the device's since start).
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

    /// Prometheus text exposition (version 0.0.4). Host totals carry `vm="_host"`.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        let all = self
            .vms
            .iter()
            .map(|v| (v.name.as_str(), &v.figures))
            .chain(std::iter::once(("_host", &self.host)))
            .collect::<Vec<_>>();
        let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
        let _ = writeln!(
            out,
            "# HELP pvcm_cm_messages_total CM MADs per infiniband_cm group and message type."
        );
        let _ = writeln!(out, "# TYPE pvcm_cm_messages_total counter");
        for (vm, f) in &all {
            for (g, msgs) in &f.cm {
                for (m, v) in msgs {
                    let _ = writeln!(
                        out,
                        "pvcm_cm_messages_total{{vm=\"{}\",group=\"{g}\",msg=\"{m}\"}} {v}",
                        esc(vm)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP pvcm_drops_total Dropped MADs, frames and messages by reason."
        );
        let _ = writeln!(out, "# TYPE pvcm_drops_total counter");
        for (vm, f) in &all {
            for (layer, m) in [("mux", &f.drops), ("device", &f.device_drops)] {
                for (r, v) in m {
                    let _ = writeln!(
                        out,
                        "pvcm_drops_total{{vm=\"{}\",layer=\"{layer}\",reason=\"{r}\"}} {v}",
                        esc(vm)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP pvcm_io_total Messages and frames through the device and the wire port."
        );
        let _ = writeln!(out, "# TYPE pvcm_io_total counter");
        for (vm, f) in &all {
            for (k, v) in &f.io {
                let _ = writeln!(out, "pvcm_io_total{{vm=\"{}\",kind=\"{k}\"}} {v}", esc(vm));
            }
        }
        let _ = writeln!(
            out,
            "# HELP pvcm_on_behalf_total CM MADs the mux sent itself on a VM's behalf."
        );
        let _ = writeln!(out, "# TYPE pvcm_on_behalf_total counter");
        for (vm, f) in &all {
            let _ = writeln!(
                out,
                "pvcm_on_behalf_total{{vm=\"{}\"}} {}",
                esc(vm),
                f.on_behalf
            );
        }
        let _ = writeln!(out, "# HELP pvcm_entries Connection entries at the mux.");
        let _ = writeln!(out, "# TYPE pvcm_entries gauge");
        for (vm, f) in &all {
            let _ = writeln!(
                out,
                "pvcm_entries{{vm=\"{}\",state=\"live\"}} {}",
                esc(vm),
                f.live
            );
        }
        let _ = writeln!(
            out,
            "pvcm_entries{{vm=\"_host\",state=\"quarantined\"}} {}",
            self.host.quarantined
        );
        let _ = writeln!(
            out,
            "# HELP pvcm_vm_attached 1 while the VM's vhost-user session is up."
        );
        let _ = writeln!(out, "# TYPE pvcm_vm_attached gauge");
        for v in &self.vms {
            let _ = writeln!(
                out,
                "pvcm_vm_attached{{vm=\"{}\"}} {}",
                esc(&v.name),
                u8::from(v.attached)
            );
        }
        let _ = writeln!(
            out,
            "# HELP pvcm_wire_rx_mode 1 for the wire port's receive mode in effect, with the \
             configured one."
        );
        let _ = writeln!(out, "# TYPE pvcm_wire_rx_mode gauge");
        let _ = writeln!(
            out,
            "pvcm_wire_rx_mode{{mode=\"{}\",configured=\"{}\"}} 1",
            esc(&self.wire_rx),
            esc(&self.wire_rx_configured)
        );
        if let Some(b) = self.wire_rx_buffer {
            let _ = writeln!(
                out,
                "# HELP pvcm_wire_rx_buffer_bytes The shared receive socket's buffer: \
                 state=\"wanted\" asked for, state=\"effective\" in effect."
            );
            let _ = writeln!(out, "# TYPE pvcm_wire_rx_buffer_bytes gauge");
            for (state, v) in [("wanted", b.wanted), ("effective", b.effective)] {
                let _ = writeln!(out, "pvcm_wire_rx_buffer_bytes{{state=\"{state}\"}} {v}");
            }
        }
        let _ = writeln!(
            out,
            "# HELP pvcm_degraded 1 for each setting in effect in a lesser form than \
             configured."
        );
        let _ = writeln!(out, "# TYPE pvcm_degraded gauge");
        for d in &self.degraded {
            let _ = writeln!(
                out,
                "pvcm_degraded{{setting=\"{}\",configured=\"{}\",effective=\"{}\"}} 1",
                esc(&d.setting),
                esc(&d.configured),
                esc(&d.effective)
            );
        }
        out
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
        assert!(p.contains(
            "pvcm_drops_total{vm=\"_host\",layer=\"device\",reason=\"wire_bad_icrc\"} 2"
        ));
        let j = serde_json::to_string(&snap).unwrap();
        let back: Snapshot = serde_json::from_str(&j).unwrap();
        assert_eq!(back, snap);
    }
}
