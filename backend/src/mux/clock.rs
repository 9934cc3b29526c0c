//! Injected time: the shared [`pvcm_wire::time`] types. The mux never reads a system
//! clock itself; tests hand it a [`ManualClock`] and run every timeout in virtual time.

pub use pvcm_wire::time::{Clock, ManualClock, SystemClock, Time};
