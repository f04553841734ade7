//! Durations and sizes as operators write them on the command line:
//! `500ms`, `5s`, `2m`, `1h`, `7d`, or a bare number of seconds; `10GiB`,
//! `500MB`, or a bare number of bytes.

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

/// Bytes, or a whole number with a binary (KiB, MiB, GiB, TiB) or decimal
/// (KB, MB, GB, TB) unit; case does not matter. For clap's `value_parser`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| format!("expected a size like 10GiB or 500MB, got '{text}'"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        "tib" | "t" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!("unknown size unit '{other}' in '{text}'; use KiB, MiB, GiB, TiB, KB, MB, GB or TB"));
        }
    };
    number.checked_mul(scale).ok_or_else(|| format!("'{text}' is more bytes than fit in 64 bits"))
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
