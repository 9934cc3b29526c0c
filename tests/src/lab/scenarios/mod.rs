//! The scenarios, and what their VM programs share.

pub mod churn;
pub mod cmtime;
pub mod ipoib;
pub mod rate;
pub mod rej_timeout;
pub mod teardown;
pub mod timewait;

use std::collections::BinaryHeap;
use std::time::Duration;

use pvcm_guest::cm::CmId;
use pvcm_guest::cm::rdma_cm::tcp_service_id;
use pvcm_guest::time::Time;

use super::opts::{LabOptions, ScenarioName};
use super::report::Report;
use super::stamp::Stamp;
use super::world::{self, LabError, LabResult, VmEnv};

/// Runs one scenario and returns its summary.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    validate(o)?;
    match o.scenario {
        ScenarioName::Teardown => teardown::run(o),
        ScenarioName::RejTimeout => rej_timeout::run(o),
        ScenarioName::Churn => churn::run(o),
        ScenarioName::TimewaitReuse => timewait::run(o),
        ScenarioName::IpoibCm => ipoib::run(o),
        ScenarioName::Cmtime => cmtime::run(o),
        ScenarioName::Rate => rate::run(o),
        ScenarioName::ServerExit => cmtime::run(o),
    }
}

fn validate(o: &LabOptions) -> LabResult<()> {
    let bad = |s: &str| Err(LabError::Usage(s.to_string()));
    if o.hosts < 1 || o.hosts > 200 {
        return bad("--hosts must be 1 to 200");
    }
    if o.vms_per_host < 1 || o.vms_per_host > world::MAX_VMS_PER_HOST {
        return bad("--vms-per-host must be 1 to 500");
    }
    if o.vms_per_host > world::VMS_PER_BLOCK && o.hosts > world::MAX_HOSTS_WITH_TWO_BLOCKS {
        return bad("more than 250 VMs per host: at most 120 hosts");
    }
    if o.procs < 1 || o.procs > 1000 {
        return bad("--procs must be 1 to 1000");
    }
    if o.queue_size == 0 || !o.queue_size.is_power_of_two() || o.queue_size > 1024 {
        return bad("--queue-size must be a power of two up to 1024");
    }
    for (n, p) in [
        ("--loss", o.faults.loss),
        ("--dup", o.faults.dup),
        ("--reorder", o.faults.reorder),
    ] {
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("{n} must be a probability (0 to 1)").into());
        }
    }
    if o.cm.response > 31 || o.cm.packet_life > 30 || o.cm.retries > 15 {
        return bad("CM timeouts: exponents up to 31 (packet life 30), retries up to 15");
    }
    if o.net == 0 || o.net == 255 {
        return bad("--net must be 1 to 254");
    }
    Ok(())
}

/// The service ID process `p` of every VM listens on (rdma_cm's TCP port space).
pub fn service_id(p: usize) -> u64 {
    tcp_service_id(20000 + p as u16)
}

/// The process a service ID belongs to.
pub fn proc_of(sid: u64) -> Option<usize> {
    let port = (sid & 0xFFFF) as usize;
    port.checked_sub(20000)
}

/// A stamp from this VM.
pub fn stamp(
    env: &VmEnv<'_>,
    dst_vm: usize,
    src_proc: usize,
    dst_proc: usize,
    plan: u8,
    serial: u32,
) -> Stamp {
    Stamp {
        run: env.run_id,
        src_vm: env.slot.global as u16,
        dst_vm: dst_vm as u16,
        src_proc: src_proc as u16,
        dst_proc: dst_proc as u16,
        plan,
        serial,
    }
}

/// The answer stamp to a request stamp.
pub fn reply(s: &Stamp) -> Stamp {
    Stamp {
        src_vm: s.dst_vm,
        dst_vm: s.src_vm,
        src_proc: s.dst_proc,
        dst_proc: s.src_proc,
        ..*s
    }
}

/// Application actions due later (a slow guest's answers).
#[derive(Debug, Default)]
pub struct Later {
    heap: BinaryHeap<std::cmp::Reverse<(Time, CmId)>>,
}

impl Later {
    /// Schedules an action on `id` at `at`.
    pub fn push(&mut self, at: Time, id: CmId) {
        self.heap.push(std::cmp::Reverse((at, id)));
    }

    /// The next action due at or before `now`.
    pub fn pop_due(&mut self, now: Time) -> Option<CmId> {
        match self.heap.peek() {
            Some(std::cmp::Reverse((t, _))) if *t <= now => self.heap.pop().map(|r| r.0.1),
            _ => None,
        }
    }

    /// How long until the next action (capped at `max`).
    pub fn wait(&self, now: Time, max: Duration) -> Duration {
        self.heap
            .peek()
            .map_or(max, |std::cmp::Reverse((t, _))| t.since(now).min(max))
    }

    /// Whether nothing is scheduled.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}
