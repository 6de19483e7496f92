//! LEAST_REQUEST: power of two choices. Two endpoints are drawn (by weight
//! when weights differ) and the one with fewer active requests per unit of
//! weight wins, as Envoy's least-request balancer does with its default
//! active-request bias of 1.0.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::rng;
use super::weighted::WeightedIndex;
use crate::endpoint::EndpointState;

/// P2C picker.
pub struct LeastRequest {
    sampler: WeightedIndex,
    weights: Vec<u32>,
}

impl LeastRequest {
    /// Picker over `weights`.
    pub fn new(weights: &[u32]) -> Self {
        LeastRequest {
            sampler: WeightedIndex::new(weights),
            weights: weights.to_vec(),
        }
    }

    /// An index.
    #[inline]
    pub fn pick(&self, endpoints: &[Arc<EndpointState>]) -> usize {
        let n = endpoints.len();
        if n == 1 {
            return 0;
        }
        let a = self.sampler.sample();
        let mut b = self.sampler.sample();
        if a == b {
            // Distinct second choice: uniform over the others.
            b = (a + 1 + rng::below(n - 1)) % n;
        }
        let la = u64::from(endpoints[a].active.load(Ordering::Relaxed));
        let lb = u64::from(endpoints[b].active.load(Ordering::Relaxed));
        // la / wa < lb / wb, without division.
        let (wa, wb) = (u64::from(self.weights[a]), u64::from(self.weights[b]));
        if la * wb < lb * wa || (la * wb == lb * wa && rng::next() & 1 == 0) {
            a
        } else {
            b
        }
    }
}
