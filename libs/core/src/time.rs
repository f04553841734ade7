//! Durations as the stores and the bus count time.

use std::time::Duration;

/// Whole milliseconds of `duration`, saturating: how the databases and the
/// bus count time.
pub fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
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
