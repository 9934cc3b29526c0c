//! Injected time for the guest side: the shared [`pvcm_wire::time`] types.
//!
//! Nothing in the CM agent reads a system clock: every input that can move time (a MAD
//! from the device, an API call, a timer poll) carries a [`Time`].

pub use pvcm_wire::time::{Clock, ManualClock, SystemClock, Time};
