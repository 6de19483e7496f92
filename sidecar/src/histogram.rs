//! A fixed-bucket histogram of atomics: observing is a few comparisons and
//! one atomic add, so it can sit on the request path; exported in the
//! Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Request latency bucket bounds in milliseconds (also the bounds of the
/// load reports' latency histogram).
pub const LATENCY_BUCKET_BOUNDS_MS: [u64; 13] =
    [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000];
/// Pick-duration bucket bounds in nanoseconds.
pub const PICK_BUCKET_BOUNDS_NS: [u64; 8] = [25, 50, 100, 250, 500, 1000, 5000, 50000];

/// Counts per bucket (one more than bounds: +Inf), sum and count.
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    bounds: &'static [u64; N],
    buckets: [AtomicU64; N],
    overflow: AtomicU64,
    sum: AtomicU64,
}

impl<const N: usize> Histogram<N> {
    /// An empty histogram with these (ascending) bounds.
    pub fn new(bounds: &'static [u64; N]) -> Self {
        Histogram {
            bounds,
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            overflow: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }

    /// Records a value in the unit of the bounds.
    #[inline]
    pub fn observe(&self, v: u64) {
        self.sum.fetch_add(v, Ordering::Relaxed);
        match self.bounds.iter().position(|b| v <= *b) {
            Some(i) => self.buckets[i].fetch_add(1, Ordering::Relaxed),
            None => self.overflow.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Non-cumulative counts per bucket, +Inf last.
    pub fn counts(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        v.push(self.overflow.load(Ordering::Relaxed));
        v
    }

    /// Writes `name_bucket`, `name_sum`, `name_count` lines; `scale` turns
    /// the unit of the bounds into seconds.
    pub fn encode(&self, out: &mut String, name: &str, labels: &str, scale: f64) {
        let mut cumulative = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{}\"}} {cumulative}",
                *b as f64 * scale
            );
        }
        cumulative += self.overflow.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}",
            self.sum.load(Ordering::Relaxed) as f64 * scale
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}
