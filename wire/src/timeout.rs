//! CM timeouts: 5-bit exponents meaning 4.096 us * 2^t (IBTA 12.6), and the
//! millisecond approximation the Linux CM uses for its timers.

use core::time::Duration;

/// The IBA time unit: 4.096 microseconds, in nanoseconds.
const UNIT_NS: u64 = 4096;

/// The largest exponent a 5-bit field holds.
pub const MAX_EXPONENT: u8 = 31;

/// `4.096 us * 2^t` for a 5-bit exponent `t` (values above 31 saturate to 31).
///
/// t = 31 is about 2.4 hours; t = 24 (Linux's MRA setting) about 68.7 s.
pub fn exponent_to_duration(t: u8) -> Duration {
    let t = t.min(MAX_EXPONENT);
    Duration::from_nanos(UNIT_NS << t)
}

/// The smallest exponent whose duration is at least `d` (31 if `d` exceeds every one).
pub fn duration_to_exponent(d: Duration) -> u8 {
    let ns = d.as_nanos();
    (0..=MAX_EXPONENT)
        .find(|t| u128::from(UNIT_NS << t) >= ns)
        .unwrap_or(MAX_EXPONENT)
}

/// The Linux core CM's approximation, `cm_convert_to_ms()`: `1 << max(t - 8, 0)` ms.
///
/// It rounds 4.096 us * 2^t (1.048576 ms at t = 8) down to a power-of-two number of
/// milliseconds; below t = 8 it gives 1 ms.
pub fn linux_ms(t: u8) -> u64 {
    1u64 << (t.min(MAX_EXPONENT).saturating_sub(8))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_values() {
        assert_eq!(exponent_to_duration(0), Duration::from_nanos(4096));
        assert_eq!(exponent_to_duration(8), Duration::from_nanos(1_048_576));
        // MRA service timeout Linux offers: 24 -> 68.719 s.
        assert_eq!(exponent_to_duration(24).as_millis(), 68_719);
        assert_eq!(exponent_to_duration(200), exponent_to_duration(31));
    }

    #[test]
    fn linux_approximation() {
        assert_eq!(linux_ms(0), 1);
        assert_eq!(linux_ms(8), 1);
        assert_eq!(linux_ms(20), 4096);
        assert_eq!(linux_ms(24), 65_536);
        assert_eq!(linux_ms(31), 1 << 23);
    }

    #[test]
    fn inverse() {
        for t in 0..=MAX_EXPONENT {
            assert_eq!(duration_to_exponent(exponent_to_duration(t)), t);
        }
        assert_eq!(duration_to_exponent(Duration::from_millis(1)), 8);
        assert_eq!(duration_to_exponent(Duration::from_secs(1_000_000)), 31);
        assert_eq!(duration_to_exponent(Duration::ZERO), 0);
    }
}
