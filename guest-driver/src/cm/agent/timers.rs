//! The agent's timers: arming, the retry and TimeWait deadlines, and what fires.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use pvcm_wire::cm::{CmMad, MsgResponse};
use pvcm_wire::mad::AttributeId;
use pvcm_wire::timeout::linux_ms;

use crate::cm::event::{Event, State};
use crate::time::Time;

use super::Agent;

impl Agent {
    /// Arms the timer a request's connection runs once the request is on its way.
    pub(super) fn arm_after_send(&mut self, slot: u32, now: Time) {
        let c = &self.conns[slot as usize];
        let wait = match c.state {
            State::ReqSent | State::DreqSent => c.timeout_ms,
            // A destroyed connection's one DREQ: its TimeWait starts now.
            State::Timewait => linux_ms(c.av_timeout),
            _ => return,
        };
        self.arm(slot, now.after_ms(wait));
    }

    pub(crate) fn arm(&mut self, slot: u32, at: Time) {
        self.timer_seq += 1;
        let seq = self.timer_seq;
        let c = &mut self.conns[slot as usize];
        if c.timer.is_none() {
            self.armed += 1;
        }
        c.timer = Some(seq);
        c.deadline = at;
        self.timers.push(Reverse((at.0, seq, slot)));
        if self.timers.len() > 64 && self.timers.len() > 4 * self.armed {
            self.compact_timers();
        }
    }

    pub(crate) fn disarm(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        if c.timer.take().is_some() {
            self.armed -= 1;
            c.deadline = Time::NEVER;
        }
    }

    pub(super) fn compact_timers(&mut self) {
        let live: Vec<Reverse<(u64, u64, u32)>> = self
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.live)
            .filter_map(|(i, c)| c.timer.map(|seq| Reverse((c.deadline.0, seq, i as u32))))
            .collect();
        self.timers = BinaryHeap::from(live);
    }

    /// A MAD the device has taken from its queue (its send completion). A request's
    /// response timer starts here, as Linux's MAD layer starts it when the send
    /// completes: a REQ, REP, DREQ or SIDR_REQ that waited behind others (a burst on a
    /// busy vCPU) is not retried before the peer could have answered it. Only the
    /// message the connection waits on counts (its current `msg`, byte for byte).
    pub fn mad_sent(&mut self, mad: &[u8], now: Time) {
        let Ok(m) = CmMad::new_checked(mad) else {
            return;
        };
        let local = match m.attr() {
            AttributeId::Req | AttributeId::Rep | AttributeId::Dreq => m.local_comm_id(),
            AttributeId::SidrReq => m.sidr_request_id(),
            _ => None,
        };
        let Some(slot) = local.and_then(|id| self.by_local(id)) else {
            return;
        };
        let c = &self.conns[slot as usize];
        let waits = matches!(
            c.state,
            State::ReqSent | State::RepSent | State::DreqSent | State::SidrReqSent
        );
        if !c.live || c.timer.is_none() || !waits || c.msg.as_ref().map(|b| &b[..]) != Some(mad) {
            return;
        }
        let at = now.after_ms(c.timeout_ms);
        if at > c.deadline {
            self.arm(slot, at);
        }
    }

    /// When `poll()` next has work: the earliest armed timer.
    pub fn next_deadline(&mut self) -> Option<Time> {
        while let Some(Reverse((t, seq, slot))) = self.timers.peek().copied() {
            let c = &self.conns[slot as usize];
            if c.live && c.timer == Some(seq) {
                return Some(Time(t));
            }
            self.timers.pop();
        }
        None
    }

    /// Runs every timer due at `now`: retries, give-ups, the silent MRA states, TimeWait
    /// ends.
    pub fn poll(&mut self, now: Time) {
        while let Some(Reverse((t, seq, slot))) = self.timers.peek().copied() {
            if t > now.0 {
                break;
            }
            self.timers.pop();
            let c = &self.conns[slot as usize];
            if !c.live || c.timer != Some(seq) {
                continue;
            }
            self.disarm(slot);
            self.fire(slot, now);
        }
        self.pace_flush(now);
    }

    pub(super) fn fire(&mut self, slot: u32, now: Time) {
        let state = self.conns[slot as usize].state;
        match state {
            State::ReqSent
            | State::MraReqRcvd
            | State::RepSent
            | State::MraRepRcvd
            | State::DreqSent
            | State::SidrReqSent => {
                let c = &mut self.conns[slot as usize];
                if c.retries_left > 0
                    && let Some(m) = c.msg
                {
                    c.retries_left -= 1;
                    let (dst, t) = (c.remote_gid, c.timeout_ms);
                    self.pace_timeout(slot);
                    self.push(dst, m, true);
                    self.arm(slot, now.after_ms(t));
                    return;
                }
                self.pace_timeout(slot);
                self.pace_release(slot);
                let id = self.id_of(slot);
                if state == State::DreqSent {
                    // Linux IB_CM_DREQ_ERROR -> rdma_cm DISCONNECTED (-ETIMEDOUT).
                    self.conns[slot as usize].dreq_timed_out = true;
                    self.report_disconnect(slot);
                    self.enter_timewait(slot, now);
                } else {
                    // REQ/REP/SIDR_REQ error -> rdma_cm UNREACHABLE.
                    if self.conns[slot as usize].app {
                        self.event(Event::Unreachable { id });
                    }
                    self.go_idle(slot);
                }
            }
            State::ReqRcvd => self.delay_mra(slot, MsgResponse::Req, State::MraReqSent),
            State::RepRcvd => self.delay_mra(slot, MsgResponse::Rep, State::MraRepSent),
            State::Timewait => {
                let id = self.id_of(slot);
                let app = self.conns[slot as usize].app;
                self.go_idle(slot);
                if app {
                    self.event(Event::TimewaitExit { id });
                }
            }
            _ => {}
        }
    }
}
