//! Request latency histograms: the one definition of their buckets, shared
//! by the sidecar that records them, the load reports that carry them and
//! the control plane that reads percentiles from them.
//!
//! Two scales:
//!
//! - **Fine** (load reports, `minimesh top`): log-linear buckets over
//!   microseconds, as HDR histograms have them. Below 32 µs a bucket is one
//!   microsecond wide; above, each power of two is cut into 32 equal
//!   buckets, so a bucket is at most 1/32 of its lower bound wide and its
//!   midpoint is within 1.6% of any value in it. That is what makes a
//!   percentile read from a histogram within 5% of the real one, with room
//!   for the sampling noise of a few hundred requests. Latencies from
//!   [`MAX_US`] up share the last bucket.
//! - **Coarse** ([`PROMETHEUS_BOUNDS_MS`]): the bounds of the Prometheus
//!   latency histograms, few enough for a dashboard to sum over.

/// Sub-buckets per power of two, as a power of two (32).
const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;

/// The largest power of two the fine histogram resolves: 2^27 µs, about
/// 134 s, past any request timeout worth having.
const TOP_BIT: u32 = 27;

/// Latencies of this many microseconds or more go to the last bucket.
pub const MAX_US: u64 = 1 << TOP_BIT;

/// Buckets of the fine histogram.
pub const BUCKETS: usize = (SUB + (TOP_BIT as u64 - SUB_BITS as u64) * SUB) as usize;

/// The fine bucket of a latency in microseconds.
#[inline]
pub fn bucket(us: u64) -> usize {
    if us < SUB {
        return us as usize;
    }
    if us >= MAX_US {
        return BUCKETS - 1;
    }
    let bit = 63 - us.leading_zeros(); // >= SUB_BITS
    let shift = bit - SUB_BITS;
    let sub = (us >> shift) - SUB; // 0..16
    (SUB + u64::from(shift) * SUB + sub) as usize
}

/// The values of fine bucket `i`, in microseconds: `[low, high)`.
pub fn bounds(i: usize) -> (u64, u64) {
    let i = i as u64;
    if i < SUB {
        return (i, i + 1);
    }
    let shift = (i - SUB) / SUB;
    let sub = (i - SUB) % SUB;
    let low = (SUB + sub) << shift;
    (low, low + (1 << shift))
}

/// The value a percentile in fine bucket `i` is read as, in microseconds:
/// the bucket's midpoint.
pub fn value(i: usize) -> f64 {
    let (low, high) = bounds(i);
    if high - low == 1 {
        low as f64
    } else {
        (low + high) as f64 / 2.0
    }
}

/// Quantile `q` (0..=1) of a fine histogram whose counts start at bucket
/// `first`, in microseconds; None without samples.
pub fn quantile(first: usize, counts: &[u64], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    // The rank of the sample that is the quantile, 1-based: the smallest
    // value with at least q of the samples at or below it.
    let rank = ((total as f64 * q).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (k, n) in counts.iter().enumerate() {
        seen += n;
        if seen >= rank {
            return Some(value(first + k));
        }
    }
    None
}

/// A fine histogram that holds only the range of buckets its latencies
/// span: the counts of consecutive buckets from `first` on. What a load
/// report carries, and what the control plane sums reports into.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Span {
    /// The bucket of `counts[0]`.
    pub first: usize,
    /// Counts of buckets `first..first + counts.len()`.
    pub counts: Vec<u64>,
}

impl Span {
    /// Whether `counts` from bucket `first` on fit in the histogram.
    pub fn fits(first: usize, counts: &[u64]) -> bool {
        first.saturating_add(counts.len()) <= BUCKETS
    }

    /// Adds counts of buckets from `first` on (they must [fit](Span::fits);
    /// those past the last bucket are dropped).
    pub fn add(&mut self, first: usize, counts: &[u64]) {
        let counts = &counts[..counts.len().min(BUCKETS.saturating_sub(first))];
        if counts.is_empty() {
            return;
        }
        if self.counts.is_empty() {
            self.first = first;
            self.counts = counts.to_vec();
            return;
        }
        let start = self.first.min(first);
        let end = (self.first + self.counts.len()).max(first + counts.len());
        if start < self.first {
            let mut grown = vec![0; self.first - start];
            grown.extend_from_slice(&self.counts);
            self.counts = grown;
            self.first = start;
        }
        self.counts.resize(end - start, 0);
        for (k, n) in counts.iter().enumerate() {
            self.counts[first - start + k] += n;
        }
    }

    /// Records one latency in microseconds.
    pub fn observe(&mut self, us: u64) {
        self.add(bucket(us), &[1]);
    }

    /// Quantile `q` in microseconds; None without samples.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        quantile(self.first, &self.counts, q)
    }
}

/// Latency bucket bounds (ms) of the Prometheus histograms
/// (`minimesh_request_duration_seconds`), the coarse scale.
pub const PROMETHEUS_BOUNDS_MS: [u64; 13] =
    [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_tile_the_range_without_gaps() {
        let mut next = 0;
        for i in 0..BUCKETS {
            let (low, high) = bounds(i);
            assert_eq!(low, next, "bucket {i}");
            assert!(high > low);
            assert_eq!(bucket(low), i);
            assert_eq!(bucket(high - 1), i);
            next = high;
        }
        assert_eq!(next, MAX_US);
        assert_eq!(bucket(MAX_US), BUCKETS - 1);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn every_value_reads_back_within_five_percent() {
        // Every value from 32 µs to the top, sampled densely.
        let mut us = 32u64;
        while us < MAX_US {
            let read = value(bucket(us));
            let err = (read - us as f64).abs() / us as f64;
            assert!(err <= 0.016, "{us} µs reads {read} ({:.2}%)", err * 100.0);
            us += 1 + us / 97;
        }
        for us in 0..32 {
            assert_eq!(value(bucket(us)), us as f64);
        }
    }

    #[test]
    fn quantiles_of_a_known_distribution() {
        // 136..=168 ms, evenly: p50 152, p99 168 (within 5%).
        let mut counts = vec![0u64; BUCKETS];
        for ms in 136..=168u64 {
            counts[bucket(ms * 1000)] += 100;
        }
        let first = counts.iter().position(|n| *n > 0).expect("samples");
        let dense = &counts[first..];
        let p50 = quantile(first, dense, 0.5).expect("p50") / 1000.0;
        let p99 = quantile(first, dense, 0.99).expect("p99") / 1000.0;
        assert!((p50 - 152.0).abs() / 152.0 < 0.05, "{p50}");
        assert!((p99 - 168.0).abs() / 168.0 < 0.05, "{p99}");
        assert_eq!(quantile(0, &[], 0.5), None);
        assert_eq!(quantile(0, &[0, 0], 0.5), None);
        // One sample: every quantile is it.
        assert_eq!(quantile(bucket(5), &[1], 0.0), Some(5.0));
        assert_eq!(quantile(bucket(5), &[1], 1.0), Some(5.0));
    }

    #[test]
    fn spans_grow_both_ways_and_sum() {
        let mut s = Span::default();
        s.add(10, &[]);
        assert_eq!(s, Span::default());
        s.add(10, &[1, 2]);
        s.add(8, &[5]);
        s.add(11, &[1, 0, 3]);
        assert_eq!(s.first, 8);
        assert_eq!(s.counts, vec![5, 0, 1, 3, 0, 3]);
        s.observe(8);
        assert_eq!(s.counts[0], 6);
        // Past the last bucket: cut, never out of bounds.
        assert!(!Span::fits(BUCKETS - 1, &[1, 1]));
        s.add(BUCKETS - 1, &[1, 1]);
        assert_eq!(s.first + s.counts.len(), BUCKETS);
        s.add(BUCKETS + 5, &[1]);
        assert_eq!(s.first + s.counts.len(), BUCKETS);
    }
}
