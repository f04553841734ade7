//! Durations as operators write them on the command line: `500ms`, `5s`,
//! `2m`, `1h`, `7d`, or a bare number of seconds.

use std::time::Duration;

/// Parses `500ms`, `5s`, `2m`, `1h`, `7d` or a bare number of seconds; for
/// clap's `value_parser`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("'{text}' is not a duration (use e.g. 500ms, 5s, 2m, 1h, 7d)"))?;
    let per = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        other => return Err(format!("unknown unit '{other}' in '{text}' (use ms, s, m, h or d)")),
    };
    n.checked_mul(per).map(Duration::from_secs).ok_or_else(|| format!("'{text}' is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse_and_nonsense_is_named() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(parse_duration("5x").unwrap_err().contains("unknown unit 'x'"));
        assert!(parse_duration("soon").unwrap_err().contains("not a duration"));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("99999999999999999999d").is_err());
    }
}
