//! The one duration grammar of minimesh: rule fields (`perTryTimeout: 300ms`),
//! the control plane's and the sidecar's flags, and `minimesh bench`
//! scenarios all read durations with it, so that `1h` means the same
//! everywhere.
//!
//! A duration is a decimal number and a unit: `ms`, `s`, `m` or `h`
//! (`250ms`, `1.5s`, `2m`, `1h`), at most 30 days.

use std::time::Duration;

/// The longest duration accepted: longer is a typo, not a setting.
pub const MAX: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses a duration that may be zero (a flag where 0 means "never").
pub fn parse(s: &str) -> Result<Duration, String> {
    read(s, true)
}

/// Parses a duration that must be more than zero (a timeout, an interval).
pub fn parse_positive(s: &str) -> Result<Duration, String> {
    read(s, false)
}

fn read(s: &str, zero: bool) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => return Err(format!("{s:?} needs a unit (ms, s, m or h)")),
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 100ms, 5s, 1m"))?;
    let secs = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "{s:?} has unknown unit {unit:?} (use ms, s, m or h)"
            ))
        }
    };
    let low_ok = if zero { secs >= 0.0 } else { secs > 0.0 };
    if !secs.is_finite() || !low_ok || secs > MAX.as_secs_f64() {
        let low = if zero { "at least 0" } else { "positive" };
        return Err(format!("{s:?} must be {low} and at most 30 days"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_and_the_errors_say_why() {
        assert_eq!(parse("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse(" 2m "), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
        assert_eq!(parse("720h"), Ok(MAX));
        assert_eq!(
            parse("10"),
            Err("\"10\" needs a unit (ms, s, m or h)".into())
        );
        assert_eq!(
            parse("10d"),
            Err("\"10d\" has unknown unit \"d\" (use ms, s, m or h)".into())
        );
        assert_eq!(
            parse("x1s"),
            Err("\"x1s\" is not a duration like 100ms, 5s, 1m".into())
        );
        assert_eq!(
            parse("-1s"),
            Err("\"-1s\" must be at least 0 and at most 30 days".into())
        );
        assert_eq!(
            parse("721h"),
            Err("\"721h\" must be at least 0 and at most 30 days".into())
        );
        assert_eq!(parse_positive("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["0s", "0ms", "-1s", "721h"] {
            assert_eq!(
                parse_positive(bad),
                Err(format!("{bad:?} must be positive and at most 30 days"))
            );
        }
        assert_eq!(
            parse_positive("5"),
            Err("\"5\" needs a unit (ms, s, m or h)".into())
        );
    }
}
