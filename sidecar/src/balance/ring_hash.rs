//! Ring hash (Envoy's `RING_HASH`): each endpoint owns points on a 64-bit
//! ring in proportion to its weight; a key goes to the first point at or
//! after its hash. Removing an endpoint moves only the keys it owned.

use std::sync::Arc;

use super::xxhash::xxh64;

/// Most ring entries, as Envoy's `maximum_ring_size` default.
pub const MAX_RING: u64 = 8 * 1024 * 1024;

/// Rings are kept to this many entries (12 MiB) unless `minimumRingSize`
/// itself asks for more: with the default 1024 points per endpoint that is
/// every ring up to 1,024 endpoints; larger ones get fewer points each.
pub const SOFT_RING: u64 = 1 << 20;

/// A built ring; a clone shares it.
#[derive(Clone)]
pub struct RingHash {
    /// Point hashes, sorted.
    hashes: Arc<[u64]>,
    /// Endpoint index of each point.
    owners: Arc<[u32]>,
    /// `index[k]`: first point whose hash has top bits >= k; one more entry
    /// at the end. Turns the lookup into a scan of one or two points.
    index: Arc<[u32]>,
    shift: u32,
}

impl RingHash {
    /// Builds a ring of at least `min_size` entries (capped at [`MAX_RING`])
    /// over endpoints named by `keys` with `weights`.
    pub fn new(keys: &[String], weights: &[u32], min_size: u64) -> Self {
        let n = keys.len();
        if n == 0 {
            return RingHash {
                hashes: Arc::new([]),
                owners: Arc::new([]),
                index: Arc::new([0, 0]),
                shift: 63,
            };
        }
        // Every endpoint gets `min_size` points per unit of weight, whatever
        // the other endpoints: so removing one endpoint leaves every other
        // endpoint's points, and the keys they own, where they were (Envoy
        // spreads a fixed total instead, which moves some keys between
        // survivors). The ring therefore holds at least `min_size` entries,
        // and at most MAX_RING: beyond it points are scaled down.
        let total_weight: f64 = weights.iter().map(|w| f64::from(*w)).sum();
        let cap = min_size.clamp(SOFT_RING, MAX_RING) as f64;
        let per_unit = (min_size.max(1) as f64).min(cap / total_weight);
        let mut ring = Vec::new();
        let mut buf = String::new();
        for (i, key) in keys.iter().enumerate() {
            let points = ((f64::from(weights[i]) * per_unit) as u64).max(1);
            for k in 0..points {
                buf.clear();
                buf.push_str(key);
                buf.push('_');
                buf.push_str(&k.to_string());
                ring.push((xxh64(buf.as_bytes(), 0), i as u32));
            }
        }
        ring.sort_unstable();
        // About four points a bucket: the index costs a third of the ring.
        let bits = (usize::BITS - ring.len().leading_zeros())
            .saturating_sub(2)
            .clamp(1, 22);
        let shift = 64 - bits;
        let mut index = Vec::with_capacity((1 << bits) + 1);
        let mut p = 0usize;
        for k in 0..(1u64 << bits) {
            while p < ring.len() && (ring[p].0 >> shift) < k {
                p += 1;
            }
            index.push(p as u32);
        }
        index.push(ring.len() as u32);
        RingHash {
            hashes: ring.iter().map(|(h, _)| *h).collect(),
            owners: ring.iter().map(|(_, o)| *o).collect(),
            index: index.into(),
            shift,
        }
    }

    /// Where the ring is, to tell shared rings apart.
    #[cfg(test)]
    pub(crate) fn id(&self) -> *const () {
        self.hashes.as_ptr().cast()
    }

    /// The endpoint for `hash`; `step` > 0 walks on to later ring entries
    /// (used to find another endpoint when the first cannot serve).
    #[inline]
    pub fn pick(&self, hash: u64, step: usize) -> usize {
        let len = self.hashes.len();
        let bucket = (hash >> self.shift) as usize;
        let (lo, hi) = (self.index[bucket] as usize, self.index[bucket + 1] as usize);
        let i = lo + self.hashes[lo..hi].partition_point(|h| *h < hash);
        self.owners[(i + step) % len] as usize
    }

    /// Entries in the ring.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// True for an empty ring.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}
