//! Histograms of atomics: observing is a few comparisons and one atomic
//! add, so they can sit on the request path. [`Histogram`] has fixed bounds
//! and is exported by the metrics module; [`Fine`] has the
//! log-linear buckets of the load reports and is drained by each report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use minimesh_proto::latency;

/// Request latency bucket bounds of the Prometheus histograms, in
/// microseconds (the unit latencies are measured in, so that the sum of a
/// sub-millisecond request is not rounded away).
pub const LATENCY_BUCKET_BOUNDS_US: [u64; 13] = {
    let mut bounds = latency::PROMETHEUS_BOUNDS_MS;
    let mut i = 0;
    while i < bounds.len() {
        bounds[i] *= 1000;
        i += 1;
    }
    bounds
};
/// Pick-duration bucket bounds in nanoseconds.
pub const PICK_BUCKET_BOUNDS_NS: [u64; 8] = [25, 50, 100, 250, 500, 1000, 5000, 50000];

/// A histogram read for the metrics encoder: sum, count and
/// non-cumulative `(upper bound, count)` buckets, +Inf last.
pub type Snapshot = (f64, u64, Vec<(f64, u64)>);

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

    /// Sum, count and non-cumulative `(upper bound, count)` buckets (+Inf
    /// last), for the metrics encoder, in seconds: `per_second` is how many
    /// of the bounds' unit make a second (a division, so that 1,000 µs is
    /// exactly 0.001).
    pub fn snapshot(&self, per_second: f64) -> Snapshot {
        let mut buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .zip(&self.buckets)
            .map(|(b, n)| (*b as f64 / per_second, n.load(Ordering::Relaxed)))
            .collect();
        buckets.push((f64::INFINITY, self.overflow.load(Ordering::Relaxed)));
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.sum.load(Ordering::Relaxed) as f64 / per_second;
        (sum, count, buckets)
    }
}

/// Latencies in the fine buckets of [`minimesh_proto::latency`], counted
/// since the last [`Fine::drain`]. The buckets (6 KiB) are allocated at the
/// first observation, so an endpoint never called costs nothing.
#[derive(Debug, Default)]
pub struct Fine {
    buckets: OnceLock<Box<[AtomicU64]>>,
}

impl Fine {
    /// Records a latency in microseconds.
    #[inline]
    pub fn observe(&self, us: u64) {
        let buckets = self
            .buckets
            .get_or_init(|| (0..latency::BUCKETS).map(|_| AtomicU64::new(0)).collect());
        buckets[latency::bucket(us)].fetch_add(1, Ordering::Relaxed);
    }

    /// Takes the counts since the last drain: the first non-empty bucket
    /// and the counts from it to the last non-empty one (empty: none).
    pub fn drain(&self) -> (u32, Vec<u64>) {
        let Some(buckets) = self.buckets.get() else {
            return (0, Vec::new());
        };
        let mut first = None;
        let mut counts = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            if b.load(Ordering::Relaxed) == 0 {
                if first.is_some() {
                    counts.push(0);
                }
                continue;
            }
            let n = b.swap(0, Ordering::Relaxed);
            first.get_or_insert(i);
            counts.push(n);
        }
        while counts.last() == Some(&0) {
            counts.pop();
        }
        (first.unwrap_or(0) as u32, counts)
    }
}

/// [`Histogram::snapshot`] of several histograms (one per event loop)
/// summed.
pub fn snapshot_all<'a, const N: usize>(
    all: impl IntoIterator<Item = &'a Histogram<N>>,
    per_second: f64,
) -> Snapshot {
    let mut total: Option<Snapshot> = None;
    for h in all {
        let (sum, count, buckets) = h.snapshot(per_second);
        match &mut total {
            None => total = Some((sum, count, buckets)),
            Some((s, c, b)) => {
                *s += sum;
                *c += count;
                for (into, (_, n)) in b.iter_mut().zip(buckets) {
                    into.1 += n;
                }
            }
        }
    }
    total.unwrap_or((0.0, 0, Vec::new()))
}

/// [`Fine::drain`] of several fine histograms (one per event loop) summed.
pub fn drain_all<'a>(all: impl IntoIterator<Item = &'a Fine>) -> (u32, Vec<u64>) {
    let drained: Vec<(u32, Vec<u64>)> = all
        .into_iter()
        .map(Fine::drain)
        .filter(|(_, counts)| !counts.is_empty())
        .collect();
    if drained.len() <= 1 {
        return drained.into_iter().next().unwrap_or((0, Vec::new()));
    }
    // Each drain starts and ends on a non-empty bucket: so does the sum.
    let first = drained.iter().map(|(f, _)| *f as usize).min().unwrap_or(0);
    let end = drained
        .iter()
        .map(|(f, c)| *f as usize + c.len())
        .max()
        .unwrap_or(first);
    let mut counts = vec![0; end - first];
    for (f, c) in &drained {
        for (into, n) in counts[*f as usize - first..].iter_mut().zip(c) {
            *into += n;
        }
    }
    (first as u32, counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_buckets_are_in_seconds_and_keep_sub_millisecond_sums() {
        let h = Histogram::new(&LATENCY_BUCKET_BOUNDS_US);
        for us in [300, 1_500, 20_000_000] {
            h.observe(us);
        }
        let (sum, count, buckets) = h.snapshot(1e6);
        assert_eq!(count, 3);
        assert!((sum - 20.0018).abs() < 1e-9, "{sum}");
        assert_eq!(buckets[0], (0.001, 1));
        assert_eq!(buckets[1], (0.002, 1));
        assert_eq!(buckets[12], (10.0, 0));
        assert_eq!(buckets[13], (f64::INFINITY, 1));
    }

    #[test]
    fn fine_drains_what_it_saw_once() {
        let f = Fine::default();
        assert_eq!(f.drain(), (0, vec![]));
        for us in [150_000, 150_001, 160_000] {
            f.observe(us);
        }
        let (first, counts) = f.drain();
        assert_eq!(first as usize, latency::bucket(150_000));
        assert_eq!(counts.iter().sum::<u64>(), 3);
        assert_eq!(counts.first(), Some(&2));
        assert_eq!(counts.last(), Some(&1));
        assert_eq!(
            counts.len(),
            latency::bucket(160_000) - latency::bucket(150_000) + 1
        );
        assert_eq!(f.drain(), (0, vec![]));
    }

    #[test]
    fn shards_sum_as_one() {
        let (one, shards) = (
            Fine::default(),
            [Fine::default(), Fine::default(), Fine::default()],
        );
        let (h1, hs) = (
            Histogram::new(&LATENCY_BUCKET_BOUNDS_US),
            [
                Histogram::new(&LATENCY_BUCKET_BOUNDS_US),
                Histogram::new(&LATENCY_BUCKET_BOUNDS_US),
            ],
        );
        // Shard 0 empty, the others overlapping and apart.
        for (i, us) in [150_000u64, 150_001, 3_000, 9_000_000, 160_000]
            .iter()
            .enumerate()
        {
            one.observe(*us);
            shards[1 + i % 2].observe(*us);
            h1.observe(*us);
            hs[i % 2].observe(*us);
        }
        assert_eq!(drain_all(&shards), one.drain());
        assert_eq!(drain_all(&shards), (0, vec![]));
        assert_eq!(snapshot_all(&hs, 1e6), h1.snapshot(1e6));
        // One shard: its own drain.
        let solo = [Fine::default()];
        solo[0].observe(42);
        assert_eq!(drain_all(&solo), (latency::bucket(42) as u32, vec![1]));
    }
}
