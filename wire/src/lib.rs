//! `pvcm-wire`: the bytes pvcm puts on and takes off the wire.
//!
//! A zero-copy codec in the style of smoltcp's `wire` module: per structure a `field`
//! module of byte ranges and bit fields, a `Packet<T: AsRef<[u8]>>` view with a checked
//! constructor, getters (setters when the buffer is mutable), and a `Repr` with
//! `parse`/`emit`. Nothing here does I/O and nothing panics on bad input: every
//! malformed buffer gives an [`Error`].
//!
//! - [`mad`]: the 24-byte MAD header, attribute IDs, methods.
//! - [`cm`]: every CM message of IBTA chapter 12 and [`cm::CmMad`], the generic view a
//!   proxy rewrites (comm IDs, TIDs, SIDR request IDs).
//! - [`roce`]: RoCEv2 framing of a CM MAD (BTH + DETH + MAD + ICRC) over UDP 4791.
//! - [`gid`]: GIDs and their IPv4-mapped form; [`timeout`]: CM timeout encodings;
//!   [`time`]: the injected clock the mux and the CM agent share.
//! - `testing` (cargo feature `test-util`): MAD builders for tests, benchmarks and fuzz
//!   targets.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod abi;
pub mod cm;
pub mod counters;
mod error;
pub mod field;
pub mod gid;
pub mod mad;
pub mod roce;
pub mod seed;
#[cfg(feature = "test-util")]
pub mod testing;
pub mod time;
pub mod timeout;

pub use error::{Error, Result};
pub use gid::Gid;
