//! Per-destination pacing of the requests the agent starts (REQ and DREQ): a congestion
//! window of requests sent and not yet answered, per destination GID, with the rest
//! queued in order. [`Pacing`] is the policy, [`Pacer`] the windows, queues and
//! counters; the agent tells the pacer what happened to a connection's request and the
//! pacer says what may go on the wire. The pacer knows connections only by their slot
//! and the [`Pace`] the agent keeps for each, and never touches the agent.
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
//! - Above the destinations' windows, a VM-wide window per kind bounds what a request
//!   may find outstanding to the other destinations ([`Pacing::vm_window`]): a VM that
//!   starts connects to hundreds of peers at once sends them a window's worth at a time,
//!   while a burst to one peer meets only that peer's window. A window held back only by
//!   it goes first, in order, when it frees a slot.
//! - Answers grow the window (slow start, then additive); a request's timeout halves it
//!   once per window of requests sent (requests sent before the last decrease do not
//!   decrease it again). A destination with nothing outstanding or queued is forgotten,
//!   its window with it (the next burst starts from `initial_window` again).

use core::fmt;
use std::collections::VecDeque;

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;

use super::FastMap;

/// The window a destination starts with, by default.
pub const DEFAULT_INITIAL_WINDOW: u32 = 32;
/// The most requests outstanding per destination, by default.
pub const DEFAULT_MAX_WINDOW: u32 = 1024;
/// The window never shrinks below this (or below the ceiling, if that is smaller).
pub const MIN_WINDOW: u32 = 4;
/// The most requests of one kind outstanding from the VM to all destinations together,
/// by default.
pub const DEFAULT_VM_WINDOW: u32 = 64;

/// Per-destination pacing of the requests the agent starts (REQ and DREQ): a congestion
/// window of requests sent and not yet answered, so a burst of connects or disconnects
/// never overruns the peer's QP1 receive queue (a Linux peer keeps at most ~128 MAD sends
/// outstanding itself, and rdma_rxe's QP1 receive queue holds 512).
///
/// The window starts at `initial_window`, grows by one per answer up to `slow_start`
/// (slow start: it doubles per round trip), then by one per window's worth of answers
/// (additive increase), never beyond `max_window`. A request's timeout halves it (once
/// per window: timeouts of requests sent before the last decrease do not count again),
/// never below `min_window`. Requests beyond the window wait in order, their timers not
/// running.
///
/// [`Pacing::new`] derives a consistent policy from the two numbers an operator sets;
/// the fields stay public for tests that need an unusual one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// The window a destination starts with.
    pub initial_window: u32,
    /// The window never shrinks below this.
    pub min_window: u32,
    /// The window never grows beyond this.
    pub max_window: u32,
    /// Slow-start threshold a destination starts with (later: half the window at the
    /// last timeout).
    pub slow_start: u32,
    /// A request of one kind (REQ, DREQ) goes to a destination only while fewer than
    /// this many are outstanding to all the *other* destinations together. A VM that
    /// connects to hundreds of peers at once would otherwise send each of them its
    /// initial window at once, unproven, while those peers usually sit behind a few hosts
    /// whose QP1 receive queues all the requests share. A burst to one peer meets only
    /// that peer's window; a silent destination's opened window neither counts nor is
    /// held back (there is no queue to protect).
    pub vm_window: u32,
}

impl Pacing {
    /// The policy for a ceiling of `max_window` requests outstanding per destination
    /// (default [`DEFAULT_MAX_WINDOW`]; `Some(0)`: no pacing, `None` returned) and a
    /// start of `initial_window` (default [`DEFAULT_INITIAL_WINDOW`]). Slow start runs
    /// up to the ceiling; the start and the floor ([`MIN_WINDOW`]) are cut to the
    /// ceiling, and the start is at least the floor.
    pub fn new(max_window: Option<u32>, initial_window: Option<u32>) -> Option<Pacing> {
        let max = max_window.unwrap_or(DEFAULT_MAX_WINDOW);
        if max == 0 {
            return None;
        }
        let min = MIN_WINDOW.min(max);
        Some(Pacing {
            initial_window: initial_window
                .unwrap_or(DEFAULT_INITIAL_WINDOW)
                .clamp(min.max(1), max),
            min_window: min,
            max_window: max,
            slow_start: max,
            vm_window: DEFAULT_VM_WINDOW.max(min),
        })
    }
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            initial_window: DEFAULT_INITIAL_WINDOW,
            min_window: MIN_WINDOW,
            max_window: DEFAULT_MAX_WINDOW,
            slow_start: DEFAULT_MAX_WINDOW,
            vm_window: DEFAULT_VM_WINDOW,
        }
    }
}

/// Which of a destination's two windows a request goes through. Connects and
/// disconnects are paced apart, as Linux never delays one for the other: a DREQ a Linux
/// peer leaves unanswered until its application disconnects (minutes, maybe) must not
/// hold up connects, nor a connect burst a disconnect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Request {
    /// REQ.
    Connect,
    /// DREQ.
    Disconnect,
}

/// Where a connection's paced request stands (kept by the agent per connection, changed
/// only by the [`Pacer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Pace {
    /// No paced request (none started, or it was answered).
    #[default]
    Idle,
    /// Waiting in its destination's queue, not sent yet.
    Queued(Request),
    /// Sent, holding a slot of its destination's window; `epoch` is the window's epoch
    /// and `heard` its count of answers when it was sent.
    Outstanding {
        kind: Request,
        epoch: u32,
        heard: u32,
    },
    /// Timed out: its slot is free and its retries go out unpaced; an answer still
    /// tells the window its destination lives.
    Retrying(Request),
}
/// A request waiting for a slot.
#[derive(Debug, Clone)]
struct Queued {
    slot: u32,
    mad: [u8; MAD_LEN],
}

/// A queued request the window lets go now: the agent sends it and starts its timer.
#[derive(Debug, Clone)]
pub(crate) struct Ready {
    /// The connection's slot.
    pub slot: u32,
    /// The destination.
    pub dst: Gid,
    /// The request, as it was queued.
    pub mad: [u8; MAD_LEN],
    /// The connection's pace from now on.
    pub pace: Pace,
}

/// One destination's window.
#[derive(Debug, Clone)]
struct Window {
    cwnd: u32,
    ssthresh: u32,
    /// Answers counted towards the next additive increase.
    acc: u32,
    outstanding: u32,
    /// Bumped by every decrease, and when the window opens or starts again.
    epoch: u32,
    /// Answers heard (also to requests that had timed out): a request that times out
    /// with this count unchanged since it was sent met a silent destination.
    heard: u32,
    /// Opened to the ceiling because the destination answered nothing at all.
    open: bool,
    queue: VecDeque<Queued>,
}

impl Window {
    fn new(p: &Pacing) -> Window {
        let mut w = Window {
            cwnd: 0,
            ssthresh: 0,
            acc: 0,
            outstanding: 0,
            epoch: 0,
            heard: 0,
            open: false,
            queue: VecDeque::new(),
        };
        w.start(p);
        w
    }

    /// The window a fresh destination has: `initial_window`, slow start to
    /// `slow_start`.
    fn start(&mut self, p: &Pacing) {
        let max = p.max_window.max(1);
        self.cwnd = p.initial_window.clamp(p.min_window.max(1), max);
        self.ssthresh = p.slow_start.min(max);
        self.acc = 0;
        self.open = false;
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
    /// Timeouts that halved a window (the destination answered others meanwhile).
    pub decreases: u64,
    /// Timeouts that opened a window to its ceiling (the destination answered nothing).
    pub opened: u64,
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
             decreases {} opened {} max_outstanding {} max_queued {} window min {} max {}",
            self.outstanding,
            self.queued,
            self.sent,
            self.waited,
            self.answered,
            self.cancelled,
            self.decreases,
            self.opened,
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

/// The windows of every destination, their queues and the counters (see the module
/// docs). With no policy every request goes out at once and nothing is counted.
#[derive(Debug)]
pub(crate) struct Pacer {
    policy: Option<Pacing>,
    windows: FastMap<(Gid, Request), Window>,
    /// Windows that freed a slot since the last [`Pacer::ready`].
    dirty: Vec<(Gid, Request)>,
    /// Requests outstanding to all destinations whose windows are not open (silent), per
    /// kind (index: [`kind_index`]).
    total: [u32; 2],
    /// Windows with requests queued only because the VM-wide window was full, in the
    /// order they filled it, per kind: they go first when it frees a slot.
    blocked: [VecDeque<Gid>; 2],
    counters: PacingCounters,
}

/// The index of a request kind in the pacer's per-kind arrays.
fn kind_index(k: Request) -> usize {
    match k {
        Request::Connect => 0,
        Request::Disconnect => 1,
    }
}

impl Pacer {
    pub(crate) fn new(policy: Option<Pacing>) -> Pacer {
        Pacer {
            policy,
            windows: FastMap::default(),
            dirty: Vec::new(),
            total: [0; 2],
            blocked: [VecDeque::new(), VecDeque::new()],
            counters: PacingCounters::default(),
        }
    }

    /// The counters, with the current outstanding, queued and destinations.
    pub(crate) fn counters(&self) -> PacingCounters {
        let mut c = self.counters;
        c.outstanding = self
            .windows
            .values()
            .map(|w| u64::from(w.outstanding))
            .sum();
        c.queued = self.windows.values().map(|w| w.queue.len() as u64).sum();
        c.destinations = self.windows.len() as u64;
        c
    }

    /// One window of a destination (`None`: nothing outstanding or queued there).
    pub(crate) fn window(&self, dst: Gid, kind: Request) -> Option<WindowInfo> {
        self.windows.get(&(dst, kind)).map(|w| WindowInfo {
            window: w.cwnd,
            outstanding: w.outstanding,
            queued: w.queue.len() as u32,
        })
    }

    /// No destination has anything outstanding or queued.
    pub(crate) fn is_idle(&self) -> bool {
        self.windows.is_empty()
    }

    /// A connection starts a request to `dst`: true if it may go now (a slot was free
    /// and nobody waits; it holds the slot), false if it was queued with its MAD (its
    /// timer must not run: [`Pacer::ready`] hands it back when it may go).
    pub(crate) fn admit(
        &mut self,
        pace: &mut Pace,
        slot: u32,
        dst: Gid,
        kind: Request,
        mad: [u8; MAD_LEN],
    ) -> bool {
        let Some(p) = self.policy else {
            return true;
        };
        let w = self
            .windows
            .entry((dst, kind))
            .or_insert_with(|| Window::new(&p));
        let c = &mut self.counters;
        c.saw_window(w.cwnd);
        let k = kind_index(kind);
        let vm_full = !w.open
            && (self.total[k].saturating_sub(w.outstanding) >= p.vm_window.max(1)
                || !self.blocked[k].is_empty());
        if w.queue.is_empty() && w.outstanding < w.cwnd && !vm_full {
            w.outstanding += 1;
            if !w.open {
                self.total[k] += 1;
            }
            c.sent += 1;
            c.max_outstanding = c.max_outstanding.max(u64::from(w.outstanding));
            *pace = Pace::Outstanding {
                kind,
                epoch: w.epoch,
                heard: w.heard,
            };
            true
        } else {
            if w.outstanding < w.cwnd && w.queue.is_empty() {
                // Only the VM-wide window holds it back.
                self.blocked[k].push_back(dst);
            }
            w.queue.push_back(Queued { slot, mad });
            c.waited += 1;
            c.max_queued = c.max_queued.max(w.queue.len() as u64);
            *pace = Pace::Queued(kind);
            false
        }
    }

    /// The peer answered the connection's request: its slot is free and the window
    /// grows; after a silence the window starts again from `initial_window` (the
    /// destination is back, its queue's state unknown). A request still queued is
    /// withdrawn (the answer made it moot).
    pub(crate) fn answered(&mut self, pace: &mut Pace, slot: u32, dst: Gid) {
        let (kind, held) = match *pace {
            Pace::Idle => return,
            Pace::Queued(_) => return self.release(pace, slot, dst),
            Pace::Outstanding { kind, .. } => (kind, true),
            Pace::Retrying(kind) => (kind, false),
        };
        *pace = Pace::Idle;
        let Some(p) = self.policy else { return };
        let Some(w) = self.windows.get_mut(&(dst, kind)) else {
            return;
        };
        w.heard = w.heard.wrapping_add(1);
        let k = kind_index(kind);
        if w.open {
            w.start(&p);
            w.epoch = w.epoch.wrapping_add(1);
            self.counters.saw_window(w.cwnd);
            // It counts towards the VM's window again.
            self.total[k] += w.outstanding;
        }
        if !held {
            return;
        }
        w.outstanding = w.outstanding.saturating_sub(1);
        self.total[k] = self.total[k].saturating_sub(1);
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
        self.counters.answered += 1;
        self.counters.saw_window(w.cwnd);
        self.dirty.push((dst, kind));
    }

    /// The connection no longer needs its request: an outstanding one frees its slot
    /// (no growth), a queued one leaves the queue unsent (counted as cancelled).
    pub(crate) fn release(&mut self, pace: &mut Pace, slot: u32, dst: Gid) {
        let was = std::mem::take(pace);
        let kind = match was {
            Pace::Idle | Pace::Retrying(_) => return,
            Pace::Queued(kind) | Pace::Outstanding { kind, .. } => kind,
        };
        let Some(w) = self.windows.get_mut(&(dst, kind)) else {
            return;
        };
        if let Pace::Queued(_) = was {
            let before = w.queue.len();
            w.queue.retain(|q| q.slot != slot);
            self.counters.cancelled += (before - w.queue.len()) as u64;
        } else {
            w.outstanding = w.outstanding.saturating_sub(1);
            if !w.open {
                let k = kind_index(kind);
                self.total[k] = self.total[k].saturating_sub(1);
            }
        }
        self.dirty.push((dst, kind));
    }

    /// The connection's request timed out (to be retried, or given up). It gives its
    /// slot back: the destination had a whole response time to answer it, and its
    /// retries go out unpaced, as Linux's. What the timeout says about the destination:
    ///
    /// - It answered other requests since this one was sent: it lives but lost this one
    ///   (an overrun queue, or a lossy path). The first such timeout of a window halves
    ///   it, never below `min_window`.
    /// - It answered nothing since: it is silent (gone, or not there yet), and there is
    ///   no queue a window could protect. The window opens to `max_window`, so a dead
    ///   destination fails every waiting request within about one retry budget, as
    ///   Linux, which sends them all at once. Its first answer starts the window again.
    pub(crate) fn timeout(&mut self, pace: &mut Pace, dst: Gid) {
        let Pace::Outstanding { kind, epoch, heard } = *pace else {
            return;
        };
        *pace = Pace::Retrying(kind);
        let (Some(p), Some(w)) = (self.policy, self.windows.get_mut(&(dst, kind))) else {
            return;
        };
        w.outstanding = w.outstanding.saturating_sub(1);
        let k = kind_index(kind);
        if !w.open {
            self.total[k] = self.total[k].saturating_sub(1);
        }
        if heard == w.heard {
            if !w.open {
                // Nobody's queue to protect: it no longer counts towards the VM's
                // window, nor does the VM's window hold it back.
                self.total[k] = self.total[k].saturating_sub(w.outstanding);
                w.open = true;
                w.cwnd = p.max_window.max(1);
                w.epoch = w.epoch.wrapping_add(1);
                self.counters.opened += 1;
                self.counters.saw_window(w.cwnd);
            }
        } else if epoch == w.epoch {
            w.ssthresh = (w.cwnd / 2).max(p.min_window.max(1));
            w.cwnd = w.ssthresh;
            w.acc = 0;
            w.epoch = w.epoch.wrapping_add(1);
            self.counters.decreases += 1;
            self.counters.saw_window(w.cwnd);
        }
        self.dirty.push((dst, kind));
    }

    /// The queued requests the freed slots let go now, in queue order per window, each
    /// holding its slot already; forgets idle windows. Windows the VM-wide window held
    /// back go first, in the order they were held back.
    pub(crate) fn ready(&mut self) -> Vec<Ready> {
        let mut out = Vec::new();
        let Some(p) = self.policy else {
            self.dirty.clear();
            return out;
        };
        let vm_window = p.vm_window.max(1);
        loop {
            let key = match [Request::Connect, Request::Disconnect]
                .into_iter()
                .find(|&k| {
                    self.total[kind_index(k)] < vm_window && !self.blocked[kind_index(k)].is_empty()
                }) {
                Some(k) => match self.blocked[kind_index(k)].pop_front() {
                    Some(dst) => (dst, k),
                    None => continue,
                },
                None => match self.dirty.pop() {
                    Some(key) => key,
                    None => break,
                },
            };
            let Some(w) = self.windows.get_mut(&key) else {
                continue;
            };
            let k = kind_index(key.1);
            let before = out.len();
            while w.outstanding < w.cwnd && !w.queue.is_empty() {
                if !w.open && self.total[k].saturating_sub(w.outstanding) >= vm_window {
                    if !self.blocked[k].contains(&key.0) {
                        self.blocked[k].push_back(key.0);
                    }
                    break;
                }
                let Some(q) = w.queue.pop_front() else { break };
                w.outstanding += 1;
                if !w.open {
                    self.total[k] += 1;
                }
                out.push(Ready {
                    slot: q.slot,
                    dst: key.0,
                    mad: q.mad,
                    pace: Pace::Outstanding {
                        kind: key.1,
                        epoch: w.epoch,
                        heard: w.heard,
                    },
                });
            }
            let c = &mut self.counters;
            c.sent += (out.len() - before) as u64;
            c.max_outstanding = c.max_outstanding.max(u64::from(w.outstanding));
            if w.idle() {
                self.windows.remove(&key);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_constructor_derives_the_default_and_cuts_to_the_ceiling() {
        assert_eq!(Pacing::new(None, None), Some(Pacing::default()));
        assert_eq!(Pacing::new(Some(0), Some(8)), None);
        let p = Pacing::new(Some(2), None).unwrap_or_default();
        assert_eq!(
            (p.initial_window, p.min_window, p.max_window, p.slow_start),
            (2, 2, 2, 2)
        );
        let p = Pacing::new(Some(256), Some(1)).unwrap_or_default();
        assert_eq!((p.initial_window, p.min_window, p.slow_start), (4, 4, 256));
    }

    /// Fills one destination's window, then the destination answers one request and
    /// the rest time out, again and again: the window halves each time, never below the
    /// floor, and never opens (the destination is not silent).
    #[test]
    fn timeouts_of_a_live_destination_halve_the_window_down_to_the_floor() {
        let mut pacer = Pacer::new(Some(Pacing::default()));
        let (dst, kind, mad) = (Gid::ZERO, Request::Connect, [0; MAD_LEN]);
        // One request that stays outstanding keeps the window from being forgotten.
        let mut keep = Pace::Idle;
        assert!(pacer.admit(&mut keep, 999, dst, kind, mad));
        let mut windows = Vec::new();
        for _ in 0..8 {
            let w = pacer.window(dst, kind).map_or(0, |w| w.window);
            let mut paces = vec![Pace::Idle; w as usize - 1];
            for (slot, pace) in paces.iter_mut().enumerate() {
                assert!(pacer.admit(pace, slot as u32, dst, kind, mad));
            }
            pacer.answered(&mut paces[0], 0, dst);
            for pace in &mut paces[1..] {
                pacer.timeout(pace, dst);
            }
            assert!(pacer.ready().is_empty());
            windows.push(pacer.window(dst, kind).map_or(0, |w| w.window));
        }
        assert_eq!(windows[..4], [16, 8, 4, 4], "{windows:?}");
        assert_eq!(pacer.counters().opened, 0);
        assert_eq!(pacer.counters().min_window, u64::from(MIN_WINDOW));
    }

    fn gid(i: u32) -> Gid {
        Gid::from_ipv4(std::net::Ipv4Addr::from(0x0a00_0000 + i))
    }

    #[test]
    fn the_vm_window_bounds_requests_to_all_destinations_together() {
        let p = Pacing {
            vm_window: 4,
            ..Pacing::default()
        };
        let mut pacer = Pacer::new(Some(p));
        let mad = [0; MAD_LEN];
        // One connect to each of ten peers: four go, six wait, each peer's own window
        // far from full.
        let mut paces = [Pace::Idle; 10];
        let sent: Vec<bool> = paces
            .iter_mut()
            .enumerate()
            .map(|(i, pace)| pacer.admit(pace, i as u32, gid(i as u32), Request::Connect, mad))
            .collect();
        assert_eq!(
            sent,
            [
                true, true, true, true, false, false, false, false, false, false
            ]
        );
        assert_eq!(pacer.counters().outstanding, 4);
        // Disconnects have a VM-wide window of their own.
        let mut d = Pace::Idle;
        assert!(pacer.admit(&mut d, 100, gid(0), Request::Disconnect, mad));
        // Each answer lets the oldest waiting peer go, one at a time, in order.
        for (answered, next) in [(0usize, 4u32), (1, 5)] {
            pacer.answered(&mut paces[answered], answered as u32, gid(answered as u32));
            let r = pacer.ready();
            assert_eq!(r.iter().map(|r| r.slot).collect::<Vec<_>>(), [next]);
            paces[next as usize] = r[0].pace;
        }
        // A timeout gives its VM-wide slot back too; a destroyed waiter never goes.
        pacer.release(&mut paces[6], 6, gid(6));
        pacer.timeout(&mut paces[2], gid(2));
        let r = pacer.ready();
        assert_eq!(r.iter().map(|r| r.slot).collect::<Vec<_>>(), [7]);
        assert_eq!(pacer.counters().cancelled, 1);
        assert_eq!(
            pacer.counters().outstanding,
            5,
            "4 connects and the disconnect"
        );
    }

    #[test]
    fn the_default_vm_window_binds_only_a_burst_to_many_peers() {
        let p = Pacing::new(None, None).unwrap_or_default();
        assert_eq!(p.vm_window, DEFAULT_VM_WINDOW);
        // Many connects to one peer: its window (32 to start) binds, not the VM's.
        let mut pacer = Pacer::new(Some(p));
        let mad = [0; MAD_LEN];
        let mut paces = vec![Pace::Idle; 40];
        let n = paces
            .iter_mut()
            .enumerate()
            .map(|(i, pace)| pacer.admit(pace, i as u32, gid(0), Request::Connect, mad))
            .filter(|&sent| sent)
            .count();
        assert_eq!(n as u32, DEFAULT_INITIAL_WINDOW);
        // One connect to each of 100 more peers: the VM's window binds.
        let mut more = vec![Pace::Idle; 100];
        let n = more
            .iter_mut()
            .enumerate()
            .map(|(i, pace)| {
                let i = i as u32;
                pacer.admit(pace, 100 + i, gid(1 + i), Request::Connect, mad)
            })
            .filter(|&sent| sent)
            .count();
        assert_eq!(n as u32 + DEFAULT_INITIAL_WINDOW, DEFAULT_VM_WINDOW);
    }

    #[test]
    fn a_silent_destination_neither_counts_nor_waits_for_the_vm_window() {
        let p = Pacing {
            vm_window: 8,
            ..Pacing::default()
        };
        let mut pacer = Pacer::new(Some(p));
        let mad = [0; MAD_LEN];
        let (silent, live) = (gid(1), gid(2));
        // Eight connects to a destination that never answers fill the VM's window.
        let mut s = [Pace::Idle; 8];
        for (i, pace) in s.iter_mut().enumerate() {
            assert!(pacer.admit(pace, i as u32, silent, Request::Connect, mad));
        }
        let mut l = [Pace::Idle; 4];
        assert!(!pacer.admit(&mut l[0], 100, live, Request::Connect, mad));
        // Its first timeout opens its window: its requests no longer count, so the
        // live destination's waiting connect goes, and so do later ones.
        pacer.timeout(&mut s[0], silent);
        let r = pacer.ready();
        assert!(
            r.iter().any(|r| r.slot == 100),
            "{:?}",
            r.iter().map(|r| r.slot).collect::<Vec<_>>()
        );
        for (i, pace) in l[1..].iter_mut().enumerate() {
            assert!(pacer.admit(pace, 101 + i as u32, live, Request::Connect, mad));
        }
        // And the open window takes more than the VM's window on its own.
        let mut more = vec![Pace::Idle; 20];
        for (i, pace) in more.iter_mut().enumerate() {
            assert!(pacer.admit(pace, 200 + i as u32, silent, Request::Connect, mad));
        }
        // Its first answer starts it again: it counts once more.
        pacer.answered(&mut s[1], 1, silent);
        let mut late = Pace::Idle;
        assert!(!pacer.admit(&mut late, 300, gid(3), Request::Connect, mad));
    }
}
