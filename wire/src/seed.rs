//! Seeds from the operating system, without blocking.
//!
//! `getrandom(2)` without flags blocks until the kernel's random pool is initialised.
//! A VM booted from a small initramfs with no entropy source (the test guests, the
//! network lab's guests that run pvcm-backend on a umad port) can wait minutes for that, and
//! a driver or daemon that asks for a seed at start would hang. The standard library's
//! hash keys come from the same OS source but without blocking (`GRND_INSECURE`, then
//! `GRND_NONBLOCK`, then `/dev/urandom`), which is what a seed for comm IDs, TIDs, PSNs
//! and the mux's ID permutation needs: unpredictable to a peer, not key material.

use std::hash::{BuildHasher, Hasher};

/// A 64-bit seed from the OS's random source; never blocks.
pub fn os_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    // The keys are random per process; the clock and PID separate seeds taken in one.
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    #[test]
    fn seeds_differ() {
        assert_ne!(super::os_seed(), super::os_seed());
    }
}
