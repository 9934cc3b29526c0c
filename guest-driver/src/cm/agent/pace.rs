//! The agent's side of pacing: requests sent through their destination's window.

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;

use crate::cm::pacing::{Pace, PacingCounters, Request, WindowInfo};
use crate::time::Time;

use super::Agent;

impl Agent {
    /// The pacing counters.
    pub fn pacing(&self) -> PacingCounters {
        self.pacer.counters()
    }

    /// One of a destination's windows (`None`: nothing outstanding or queued there).
    pub fn window(&self, dst: Gid, kind: Request) -> Option<WindowInfo> {
        self.pacer.window(dst, kind)
    }

    /// Sends a request (REQ, DREQ) of `slot` to `dst` through its destination's window
    /// for that kind: at once if a slot is free and nobody waits (true), else queued
    /// (false; the caller must not arm its timer: the send does).
    pub(crate) fn send_request(
        &mut self,
        slot: u32,
        dst: Gid,
        kind: Request,
        mad: [u8; MAD_LEN],
    ) -> bool {
        let pace = &mut self.conns[slot as usize].pace;
        let now = self.pacer.admit(pace, slot, dst, kind, mad);
        if now {
            self.push(dst, mad, false);
        }
        now
    }

    /// True if the connection's request waits in a queue (its timers must not run).
    pub(crate) fn pace_queued(&self, slot: u32) -> bool {
        matches!(self.conns[slot as usize].pace, Pace::Queued(_))
    }

    /// The peer answered the connection's request (see [`Pacer::answered`]).
    pub(crate) fn pace_answered(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        self.pacer.answered(&mut c.pace, slot, c.remote_gid);
    }

    /// The connection no longer needs its request (see [`Pacer::release`]).
    pub(crate) fn pace_release(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        self.pacer.release(&mut c.pace, slot, c.remote_gid);
    }

    /// The connection's request timed out, to be retried or given up (see
    /// [`Pacer::timeout`]).
    pub(super) fn pace_timeout(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        self.pacer.timeout(&mut c.pace, c.remote_gid);
    }

    /// Sends what the freed slots allow, in queue order, arming each sent connection's
    /// timer from `now`. Run at the end of every agent call.
    pub(crate) fn pace_flush(&mut self, now: Time) {
        for r in self.pacer.ready() {
            self.conns[r.slot as usize].pace = r.pace;
            self.push(r.dst, r.mad, false);
            self.arm_after_send(r.slot, now);
        }
    }
}
