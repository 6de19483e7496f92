//! Weighted sampling in O(1): Vose's alias method, built once per endpoint
//! change. Equal weights skip the table entirely.

use super::rng;

/// Draws indices with probability proportional to their weight.
pub enum WeightedIndex {
    /// All weights equal: a uniform draw.
    Uniform(usize),
    /// Alias table: column i keeps itself when a 32-bit draw is below its
    /// keep threshold (low half of `columns[i]`), otherwise yields its
    /// alias (high half). One word a column: one cache line a draw, which
    /// is what a draw costs at 10,000 endpoints.
    Alias {
        /// `alias << 32 | keep`, keep scaled to 2^32.
        columns: Vec<u64>,
    },
}

impl WeightedIndex {
    /// Builds the sampler for `weights` (each >= 1).
    pub fn new(weights: &[u32]) -> Self {
        let n = weights.len();
        if n == 0 || weights.iter().all(|w| *w == weights[0]) {
            return WeightedIndex::Uniform(n);
        }
        let total: u64 = weights.iter().map(|w| u64::from(*w)).sum();
        // Scaled so that the average column holds exactly 2^32.
        let mut scaled: Vec<u128> = weights
            .iter()
            .map(|w| (u128::from(*w) * n as u128) << 32)
            .map(|x| x / u128::from(total))
            .collect();
        let one: u128 = 1 << 32;
        let mut prob = vec![one as u64; n];
        let mut alias: Vec<u32> = (0..n as u32).collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) =
            (0..n).partition(|i| scaled[*i] < one);
        while let (Some(s), Some(&l)) = (small.pop(), large.last()) {
            prob[s] = scaled[s] as u64;
            alias[s] = l as u32;
            scaled[l] -= one - scaled[s];
            if scaled[l] < one {
                large.pop();
                small.push(l);
            }
        }
        // A draw r (32 bits) keeps the column when r < prob. A full column
        // (2^32, which 32 bits cannot hold) is its own alias, so the
        // threshold one below it changes nothing.
        let columns = prob
            .iter()
            .zip(&alias)
            .map(|(p, a)| u64::from(*a) << 32 | (*p).min(u64::from(u32::MAX)))
            .collect();
        WeightedIndex::Alias { columns }
    }

    /// Draws an index (the sampler must not be empty).
    #[inline]
    pub fn sample(&self) -> usize {
        match self {
            WeightedIndex::Uniform(n) => rng::below(*n),
            WeightedIndex::Alias { columns } => {
                let r = rng::next();
                let i = (((r >> 32) * columns.len() as u64) >> 32) as usize;
                let column = columns[i];
                if (r & 0xffff_ffff) < (column & 0xffff_ffff) {
                    i
                } else {
                    (column >> 32) as usize
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alias_follows_weights() {
        let w = WeightedIndex::new(&[6, 3, 2, 1]);
        let mut counts = [0u32; 4];
        for _ in 0..120_000 {
            counts[w.sample()] += 1;
        }
        for (i, expect) in [60_000, 30_000, 20_000, 10_000].iter().enumerate() {
            let got = f64::from(counts[i]);
            assert!(
                (got - *expect as f64).abs() < 0.03 * 120_000.0,
                "{counts:?}"
            );
        }
    }
}
