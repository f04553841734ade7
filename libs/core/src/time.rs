//! Durations and the wall clock as the stores and the bus count time:
//! whole epoch milliseconds.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whole milliseconds of `duration`, saturating: how the databases and the
/// bus count time.
pub fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// This host's wall clock in epoch milliseconds (0 before 1970). Fencing
/// and deadlines compare against the database's clock instead
/// (`berth_store::Store::now_ms`); this is for what only this host sees.
pub fn wall_clock_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_milliseconds_saturate_past_what_a_column_holds() {
        assert_eq!(millis(Duration::from_micros(2_999)), 2);
        assert_eq!(millis(Duration::MAX), i64::MAX);
    }
}
