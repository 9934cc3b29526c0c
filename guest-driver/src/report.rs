//! JSON reports shared by the `pvcm-guest` commands and `pvcm-guestd stat`.

use serde_json::{Value, json};

use crate::cm::{CmCounters, Group, MESSAGES, PacingCounters};

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
