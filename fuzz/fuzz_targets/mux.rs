//! The mux under arbitrary sequences of guest MADs, wire MADs, attaches, detaches,
//! restarts and clock steps (virtual time, `ManualClock`).
//!
//! The model and every check are `backend/tests/common/model.rs`, the one the property
//! test `backend/tests/mux_prop.rs` runs; here the operations are decoded from bytes
//! (`arbitrary`, derived under `cfg(fuzzing)`), with a table size and optionally a tiny
//! quota chosen by the input too. A failed check panics.

#![no_main]
#![allow(clippy::unwrap_used, dead_code)]

#[path = "../../backend/tests/common/mod.rs"]
mod common;
#[path = "../../backend/tests/common/model.rs"]
mod model;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use model::{Config, Op};

#[derive(Debug, Arbitrary)]
struct Input {
    seed: u64,
    table_bits: u8,
    quota: Option<u8>,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let config = Config {
        seed: input.seed,
        table_bits: input.table_bits,
        quota: input.quota,
        coverage: false,
    };
    model::run(&config, &input.ops);
});
