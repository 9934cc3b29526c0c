//! JSON reports shared by the `pvcm-guest` commands and `pvcm-guestd stat`.

use serde_json::{Value, json};

use std::time::Duration;

use crate::cm::{CmCounters, Group, MESSAGES, PacingCounters, RejReason};
use crate::device::cmtime::{self, Failure, Step};

/// The CM counter table as JSON: `{group: {message: count}}`, zeros included.
pub fn cm_counters_json(c: &CmCounters) -> Value {
    let mut groups = serde_json::Map::new();
    for g in Group::ALL {
        let mut m = serde_json::Map::new();
        for a in MESSAGES {
            m.insert(a.name().to_string(), json!(c.get(g, a)));
        }
        groups.insert(g.name().to_string(), Value::Object(m));
    }
    Value::Object(groups)
}

/// The pacing counters as JSON.
pub fn pacing_json(p: &PacingCounters) -> Value {
    json!({
        "outstanding": p.outstanding, "queued": p.queued, "destinations": p.destinations,
        "sent": p.sent, "waited": p.waited, "answered": p.answered, "cancelled": p.cancelled,
        "decreases": p.decreases, "opened": p.opened, "max_outstanding": p.max_outstanding,
        "max_queued": p.max_queued, "min_window": p.min_window, "max_window": p.max_window,
    })
}

/// Milliseconds, rounded to the microsecond.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// A REJ reason for people and for JSON: `timeout(4)`; `reason` keeps the variant name
/// (`Timeout`) that scripts match.
pub fn rej_json(reason: RejReason) -> Value {
    json!({
        "reason": format!("{reason:?}"),
        "reason_name": reason.name(),
        "reason_code": reason.code(),
    })
}

/// A failure as JSON fields: `failure` (its kind) and, for a REJ, its reason.
pub fn failure_json(f: Failure) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("failure".into(), json!(f.kind()));
    if let Some(Value::Object(r)) = f.rej_reason().map(rej_json) {
        m.extend(r);
    }
    m
}

/// `base` with `extra`'s fields added.
pub fn with(mut base: Value, extra: serde_json::Map<String, Value>) -> Value {
    if let Value::Object(m) = &mut base {
        m.extend(extra);
    }
    base
}

/// A client run's report as JSON (text: its `Display`).
pub fn cmtime_report_json(r: &cmtime::CmtimeReport) -> Value {
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

/// A server run's report as JSON (text: its `Display`).
pub fn server_report_json(r: &cmtime::ServerReport) -> Value {
    json!({
        "accepted": r.accepted, "established": r.established,
        "disconnected": r.disconnected, "failed": r.failed, "resets": r.resets,
    })
}
