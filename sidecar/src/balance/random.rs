//! RANDOM: weighted random choice.

use super::weighted::WeightedIndex;

/// Weighted random picker.
pub struct Random(WeightedIndex);

impl Random {
    /// Picker over `weights`.
    pub fn new(weights: &[u32]) -> Self {
        Random(WeightedIndex::new(weights))
    }

    /// An index.
    #[inline]
    pub fn pick(&self) -> usize {
        self.0.sample()
    }
}
