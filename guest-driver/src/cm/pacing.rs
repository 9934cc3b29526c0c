//! Per-destination pacing of the requests the agent starts (REQ and DREQ): a congestion
//! window of requests sent and not yet answered, per destination GID, with the rest
//! queued in order. See [`Pacing`] for the policy.
//!
//! - A request takes a slot of its destination's window when it is first sent, and gives
//!   it back when it is answered (REQ: REP, REJ or MRA; DREQ: DREP, REJ, or the peer's
//!   own DREQ), when its retries run out, or when its connection is done with it (destroy,
//!   reset, TimeWait over). Retries of a request that holds a slot go out at once; a
//!   REQ the peer MRAed has given its slot back and its rare retries go out unpaced.
//! - A request that finds the window full (or requests already waiting) is queued behind
//!   them with its MAD; its timers do not run until it is sent. When slots free up the
//!   queue is drained in order, at the end of the agent call that freed them.
//! - Nothing is dropped or reordered silently: a queued request leaves the queue only by
//!   being sent, or because its connection no longer needs it (the application destroyed
//!   a connecting id: nothing goes on the wire, the REQ never left; the peer's DREQ
//!   crossed ours), counted in [`PacingCounters::cancelled`].
//! - Answers grow the window (slow start, then additive); a request's timeout halves it
//!   once per window of requests sent (requests sent before the last decrease do not
//!   decrease it again). A destination with nothing outstanding or queued is forgotten,
//!   its window with it (the next burst starts from `initial_window` again).

use core::fmt;
use std::collections::VecDeque;

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;
use pvcm_wire::timeout::linux_ms;

use super::agent::Agent;
use super::config::Pacing;
use super::event::State;
use crate::time::Time;

/// Where a connection's paced request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Pace {
    /// No paced request (none started, or it was answered).
    #[default]
    Idle,
    /// Waiting in its destination's queue, not sent yet.
    Queued,
    /// Sent, holding a slot of its destination's window; `epoch` is the window's epoch
    /// when it was (last) sent.
    Outstanding { epoch: u32 },
}

/// A request waiting for a slot.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    slot: u32,
    mad: [u8; MAD_LEN],
}

/// One destination's window.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    cwnd: u32,
    ssthresh: u32,
    /// Answers counted towards the next additive increase.
    acc: u32,
    outstanding: u32,
    /// Bumped by every decrease.
    epoch: u32,
    queue: VecDeque<Queued>,
}

impl Window {
    fn new(p: &Pacing) -> Window {
        let max = p.max_window.max(1);
        Window {
            cwnd: p.initial_window.clamp(p.min_window.max(1), max),
            ssthresh: p.slow_start.min(max),
            acc: 0,
            outstanding: 0,
            epoch: 0,
            queue: VecDeque::new(),
        }
    }

    fn idle(&self) -> bool {
        self.outstanding == 0 && self.queue.is_empty()
    }
}

/// What one destination's window looks like now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowInfo {
    /// Requests allowed outstanding.
    pub window: u32,
    /// Requests sent and not answered.
    pub outstanding: u32,
    /// Requests waiting for a slot.
    pub queued: u32,
}

/// Pacing counters, over all destinations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacingCounters {
    /// Requests sent and not answered now.
    pub outstanding: u64,
    /// Requests waiting for a slot now.
    pub queued: u64,
    /// Destinations with a window now.
    pub destinations: u64,
    /// Requests that took a window slot (first sends; retries excluded).
    pub sent: u64,
    /// Of those, requests that had to wait in a queue first.
    pub waited: u64,
    /// Answers that freed a slot (and grew the window).
    pub answered: u64,
    /// Queued requests withdrawn unsent because their connection no longer needed them.
    pub cancelled: u64,
    /// Timeouts that halved a window.
    pub decreases: u64,
    /// Most requests one destination had outstanding at once.
    pub max_outstanding: u64,
    /// Most requests one destination had queued at once.
    pub max_queued: u64,
    /// Largest window a destination reached.
    pub max_window: u64,
    /// Smallest window a destination had (0: no destination yet).
    pub min_window: u64,
}

impl fmt::Display for PacingCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pacing outstanding {} queued {} sent {} waited {} answered {} cancelled {} \
             decreases {} max_outstanding {} max_queued {} window min {} max {}",
            self.outstanding,
            self.queued,
            self.sent,
            self.waited,
            self.answered,
            self.cancelled,
            self.decreases,
            self.max_outstanding,
            self.max_queued,
            self.min_window,
            self.max_window
        )
    }
}

impl PacingCounters {
    fn saw_window(&mut self, w: u32) {
        let w = u64::from(w);
        self.max_window = self.max_window.max(w);
        self.min_window = if self.min_window == 0 {
            w
        } else {
            self.min_window.min(w)
        };
    }
}

impl Agent {
    /// The pacing counters.
    pub fn pacing(&self) -> PacingCounters {
        let mut c = self.pace_counters;
        c.outstanding = self
            .windows
            .values()
            .map(|w| u64::from(w.outstanding))
            .sum();
        c.queued = self.windows.values().map(|w| w.queue.len() as u64).sum();
        c.destinations = self.windows.len() as u64;
        c
    }

    /// The window of one destination (`None`: nothing outstanding or queued there).
    pub fn window(&self, dst: Gid) -> Option<WindowInfo> {
        self.windows.get(&dst).map(|w| WindowInfo {
            window: w.cwnd,
            outstanding: w.outstanding,
            queued: w.queue.len() as u32,
        })
    }

    /// Sends a request (REQ, DREQ) of `slot` to `dst` through its destination's window:
    /// at once if a slot is free and nobody waits (true), else queued (false; the
    /// caller must not arm its timer: the send does).
    pub(crate) fn send_request(&mut self, slot: u32, dst: Gid, mad: [u8; MAD_LEN]) -> bool {
        let Some(p) = self.cfg.pacing else {
            self.push(dst, mad, false);
            return true;
        };
        let w = self.windows.entry(dst).or_insert_with(|| Window::new(&p));
        let c = &mut self.pace_counters;
        c.saw_window(w.cwnd);
        if w.queue.is_empty() && w.outstanding < w.cwnd {
            w.outstanding += 1;
            c.sent += 1;
            c.max_outstanding = c.max_outstanding.max(u64::from(w.outstanding));
            let epoch = w.epoch;
            self.conns[slot as usize].pace = Pace::Outstanding { epoch };
            self.push(dst, mad, false);
            true
        } else {
            w.queue.push_back(Queued { slot, mad });
            c.waited += 1;
            c.max_queued = c.max_queued.max(w.queue.len() as u64);
            self.conns[slot as usize].pace = Pace::Queued;
            false
        }
    }

    /// True if the connection's request waits in a queue (its timers must not run).
    pub(crate) fn pace_queued(&self, slot: u32) -> bool {
        self.conns[slot as usize].pace == Pace::Queued
    }

    /// The peer answered the connection's request: its slot is free and the window
    /// grows. A request still queued is withdrawn (the answer made it moot).
    pub(crate) fn pace_answered(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        let (pace, dst) = (c.pace, c.remote_gid);
        match pace {
            Pace::Idle => {}
            Pace::Queued => self.pace_release(slot),
            Pace::Outstanding { .. } => {
                c.pace = Pace::Idle;
                let Some(p) = self.cfg.pacing else { return };
                let Some(w) = self.windows.get_mut(&dst) else {
                    return;
                };
                w.outstanding = w.outstanding.saturating_sub(1);
                if w.cwnd < w.ssthresh {
                    w.cwnd += 1;
                } else {
                    w.acc += 1;
                    if w.acc >= w.cwnd {
                        w.acc = 0;
                        w.cwnd += 1;
                    }
                }
                w.cwnd = w.cwnd.min(p.max_window.max(1));
                self.pace_counters.answered += 1;
                self.pace_counters.saw_window(w.cwnd);
                self.pace_dirty.push(dst);
            }
        }
    }

    /// The connection no longer needs its request: an outstanding one frees its slot
    /// (no growth), a queued one leaves the queue unsent (counted as cancelled).
    pub(crate) fn pace_release(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        let (pace, dst) = (c.pace, c.remote_gid);
        c.pace = Pace::Idle;
        let Some(w) = self.windows.get_mut(&dst) else {
            return;
        };
        match pace {
            Pace::Idle => return,
            Pace::Queued => {
                let before = w.queue.len();
                w.queue.retain(|q| q.slot != slot);
                self.pace_counters.cancelled += (before - w.queue.len()) as u64;
            }
            Pace::Outstanding { .. } => w.outstanding = w.outstanding.saturating_sub(1),
        }
        self.pace_dirty.push(dst);
    }

    /// The connection's request timed out and is about to be retried: the first such
    /// timeout of a window halves it. The retry counts as sent now.
    pub(crate) fn pace_timeout(&mut self, slot: u32) {
        let c = &self.conns[slot as usize];
        let Pace::Outstanding { epoch } = c.pace else {
            return;
        };
        let dst = c.remote_gid;
        let (Some(p), Some(w)) = (self.cfg.pacing, self.windows.get_mut(&dst)) else {
            return;
        };
        if epoch == w.epoch {
            w.ssthresh = (w.cwnd / 2).max(p.min_window.max(1));
            w.cwnd = w.ssthresh;
            w.acc = 0;
            w.epoch = w.epoch.wrapping_add(1);
            self.pace_counters.decreases += 1;
            self.pace_counters.saw_window(w.cwnd);
        }
        let epoch = w.epoch;
        self.conns[slot as usize].pace = Pace::Outstanding { epoch };
    }

    /// Sends what the freed slots allow, in queue order, arming each sent connection's
    /// timer from `now`; forgets idle destinations. Run at the end of every agent call.
    pub(crate) fn pace_flush(&mut self, now: Time) {
        while let Some(dst) = self.pace_dirty.pop() {
            let Some(w) = self.windows.get_mut(&dst) else {
                continue;
            };
            let mut sent = Vec::new();
            while w.outstanding < w.cwnd {
                let Some(q) = w.queue.pop_front() else { break };
                w.outstanding += 1;
                sent.push((q.slot, q.mad, w.epoch));
            }
            let c = &mut self.pace_counters;
            c.sent += sent.len() as u64;
            c.max_outstanding = c.max_outstanding.max(u64::from(w.outstanding));
            if w.idle() {
                self.windows.remove(&dst);
            }
            for (slot, mad, epoch) in sent {
                self.conns[slot as usize].pace = Pace::Outstanding { epoch };
                self.push(dst, mad, false);
                self.arm_after_send(slot, now);
            }
        }
    }

    /// Arms the timer a request's connection runs once the request is on its way.
    fn arm_after_send(&mut self, slot: u32, now: Time) {
        let c = &self.conns[slot as usize];
        let wait = match c.state {
            State::ReqSent | State::DreqSent => c.timeout_ms,
            // A destroyed connection's one DREQ: its TimeWait starts now.
            State::Timewait => linux_ms(c.av_timeout),
            _ => return,
        };
        self.arm(slot, now.after_ms(wait));
    }
}
