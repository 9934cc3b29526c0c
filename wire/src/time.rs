//! Injected time, shared by the host mux and the guest CM agent.
//!
//! Neither reads a system clock itself: every input that can move time carries a
//! [`Time`] or comes with a [`Clock`]. The I/O layers use a [`SystemClock`]; tests use a
//! [`ManualClock`] they advance by hand, so every protocol timeout runs in virtual time
//! without sleeping. (Not wire format, but a dependency-free leaf both sides share.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A point in time: nanoseconds since the clock's own epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(pub u64);

impl Time {
    /// The clock's epoch.
    pub const ZERO: Time = Time(0);
    /// Later than any deadline.
    pub const NEVER: Time = Time(u64::MAX);

    /// `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Time {
        Time(ms.saturating_mul(1_000_000))
    }

    /// `self + d`, saturating at [`Time::NEVER`].
    pub fn after(self, d: Duration) -> Time {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(ns))
    }

    /// `self + ms` milliseconds, saturating at [`Time::NEVER`].
    pub fn after_ms(self, ms: u64) -> Time {
        Time(self.0.saturating_add(ms.saturating_mul(1_000_000)))
    }

    /// Time from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// Whole milliseconds since the epoch.
    pub fn as_millis(self) -> u64 {
        self.0 / 1_000_000
    }
}

/// A monotonic time source.
pub trait Clock {
    /// The current time.
    fn now(&self) -> Time;
}

/// The machine's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    epoch: Instant,
}

impl SystemClock {
    /// A clock whose epoch is now.
    pub fn new() -> SystemClock {
        SystemClock {
            epoch: Instant::now(),
        }
    }

    /// A clock whose epoch is `epoch` (e.g. the system's boot, so that times stay
    /// comparable across processes).
    pub fn with_epoch(epoch: Instant) -> SystemClock {
        SystemClock { epoch }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Time {
        Time(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to; clones share the same time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    ns: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock at [`Time::ZERO`].
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // Saturating: a clock that reached NEVER stays there.
        let _ = self
            .ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_add(ns))
            });
    }

    /// Moves the clock forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance(Duration::from_millis(ms))
    }

    /// Sets the clock to `t` (never backwards).
    pub fn set(&self, t: Time) {
        self.ns.fetch_max(t.0, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Time {
        Time(self.ns.load(Ordering::Relaxed))
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Time {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_is_shared_and_monotonic() {
        let c = ManualClock::new();
        let d = c.clone();
        assert_eq!(c.now(), Time::ZERO);
        d.advance_ms(5);
        assert_eq!(c.now(), Time::from_millis(5));
        c.set(Time::from_millis(3));
        assert_eq!(d.now(), Time::from_millis(5), "never backwards");
        c.set(Time(u64::MAX - 1));
        c.advance(Duration::from_secs(1));
        assert_eq!(c.now(), Time::NEVER);
    }

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Time::NEVER.after_ms(1), Time::NEVER);
        assert_eq!(Time::NEVER.after(Duration::MAX), Time::NEVER);
        assert_eq!(
            Time::from_millis(7).since(Time::from_millis(9)),
            Duration::ZERO
        );
        assert_eq!(Time::from_millis(7).as_millis(), 7);
        assert_eq!(Time::ZERO.after_ms(2), Time(2_000_000));
    }

    #[test]
    fn system_clock_moves_forward() {
        let c = SystemClock::new();
        let a = c.now();
        assert!(c.now() >= a);
        fn via<C: Clock>(c: C) -> Time {
            c.now()
        }
        let r = &c;
        assert!(via(r) >= a);
    }
}
