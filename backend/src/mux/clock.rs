//! Injected time. The mux never reads a system clock itself: the I/O layers hand it
//! a [`Clock`], and tests hand it a [`ManualClock`] they advance by hand, so every
//! protocol timeout is tested in virtual time without sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A point in time: nanoseconds since the clock's own epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Time(pub u64);

impl Time {
    /// The clock's epoch.
    pub const ZERO: Time = Time(0);
    /// Further than any deadline.
    pub const NEVER: Time = Time(u64::MAX);

    /// `self + d`, saturating at [`Time::NEVER`].
    pub fn after(self, d: Duration) -> Time {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(ns))
    }

    /// Time from `earlier` to `self` (zero if `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// A monotonic time source.
pub trait Clock {
    /// The current time.
    fn now(&self) -> Time;
}

/// The host's monotonic clock.
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
        self.ns.fetch_add(ns, Ordering::Relaxed);
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
