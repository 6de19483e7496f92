//! Maglev (Envoy's `MAGLEV`): a lookup table of prime size filled from each
//! endpoint's permutation, weighted by letting heavier endpoints take more
//! turns. A pick is one array read; removing an endpoint moves few keys.

use super::xxhash::xxh64;

/// A built table; a clone shares it.
#[derive(Clone)]
pub struct Maglev {
    table: std::sync::Arc<[u32]>,
}

impl Maglev {
    /// Builds a table of `size` entries (a prime, validated by the control
    /// plane) over endpoints named by `keys` with `weights`.
    pub fn new(keys: &[String], weights: &[u32], size: u64) -> Self {
        let n = keys.len();
        let m = size.max(1) as usize;
        if n == 0 {
            return Maglev {
                table: Vec::new().into(),
            };
        }
        let offsets: Vec<u64> = keys.iter().map(|k| xxh64(k.as_bytes(), 0) % size).collect();
        let skips: Vec<u64> = keys
            .iter()
            .map(|k| xxh64(k.as_bytes(), 1) % (size.max(2) - 1) + 1)
            .collect();
        let max_w = f64::from(weights.iter().copied().max().unwrap_or(1).max(1));
        let mut next = vec![0u64; n];
        let mut credit = vec![0.0f64; n];
        let mut table = vec![u32::MAX; m];
        let mut filled = 0;
        'fill: loop {
            for i in 0..n {
                credit[i] += f64::from(weights[i]) / max_w;
                while credit[i] >= 1.0 {
                    credit[i] -= 1.0;
                    // Next free slot in i's permutation.
                    loop {
                        let slot = ((offsets[i] + next[i] * skips[i]) % size) as usize;
                        next[i] += 1;
                        if table[slot] == u32::MAX {
                            table[slot] = i as u32;
                            filled += 1;
                            break;
                        }
                    }
                    if filled == m {
                        break 'fill;
                    }
                }
            }
        }
        Maglev {
            table: table.into(),
        }
    }

    /// Where the table is, to tell shared tables apart.
    #[cfg(test)]
    pub(crate) fn id(&self) -> *const () {
        self.table.as_ptr().cast()
    }

    /// The endpoint for `hash`; `step` > 0 moves to later table entries.
    #[inline]
    pub fn pick(&self, hash: u64, step: usize) -> usize {
        let len = self.table.len();
        self.table[((hash % len as u64) as usize + step) % len] as usize
    }
}
