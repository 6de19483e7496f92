//! Latency sampling the way fake-service describes its percentiles: half the
//! requests at p50, then spread up to p90 and p99, each jittered by the variance.

use std::cell::Cell;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Latency distribution.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    /// Median.
    pub p50: Duration,
    /// 90th percentile.
    pub p90: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// ± percent.
    pub variance: f64,
}

thread_local! {
    static RNG: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    (t ^ (&t as *const u64 as u64)) | 1
}

/// Uniform in [0, 1).
pub fn uniform() -> f64 {
    RNG.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

impl Timing {
    /// One latency.
    pub fn sample(&self) -> Duration {
        let u = uniform();
        let lerp = |a: Duration, b: Duration, t: f64| {
            a.as_secs_f64() + (b.as_secs_f64() - a.as_secs_f64()) * t
        };
        let base = if u < 0.5 {
            self.p50.as_secs_f64()
        } else if u < 0.9 {
            lerp(self.p50, self.p90, (u - 0.5) / 0.4)
        } else if u < 0.99 {
            lerp(self.p90, self.p99, (u - 0.9) / 0.09)
        } else {
            self.p99.as_secs_f64()
        };
        let jitter = if self.variance > 0.0 {
            1.0 + (uniform() * 2.0 - 1.0) * self.variance / 100.0
        } else {
            1.0
        };
        Duration::from_secs_f64((base * jitter).max(0.0))
    }
}

/// RFC 3339 UTC timestamp with microseconds.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_700_000_000)),
            "2023-11-14T22:13:20.000000Z"
        );
    }

    #[test]
    fn percentiles_hold() {
        let t = Timing {
            p50: Duration::from_millis(10),
            p90: Duration::from_millis(50),
            p99: Duration::from_millis(100),
            variance: 0.0,
        };
        let mut v: Vec<Duration> = (0..10_000).map(|_| t.sample()).collect();
        v.sort();
        assert_eq!(v[4_000], Duration::from_millis(10));
        assert!(v[9_000] >= Duration::from_millis(45) && v[9_000] <= Duration::from_millis(55));
    }
}
