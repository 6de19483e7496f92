//! LEAST_REQUEST: power of two choices. Two endpoints are drawn (by weight
//! when weights differ) and the one with the lower (active requests + 1)
//! per unit of weight wins: Envoy's least-request balancer with its default
//! active-request bias of 1.0, whose effective weight is weight / (active +
//! 1). The + 1 makes weights count when endpoints are idle: an endpoint of
//! small weight does not win every draw just because it has nothing in
//! flight (as one that fails every request at once has).

use std::sync::Arc;

use super::rng;
use super::weighted::WeightedIndex;
use super::Endpoint;

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
    pub fn pick<E: Endpoint>(&self, endpoints: &[Arc<E>]) -> usize {
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
        let la = u64::from(endpoints[a].active()) + 1;
        let lb = u64::from(endpoints[b].active()) + 1;
        // la / wa < lb / wb, without division.
        let (wa, wb) = (u64::from(self.weights[a]), u64::from(self.weights[b]));
        if la * wb < lb * wa || (la * wb == lb * wa && rng::next() & 1 == 0) {
            a
        } else {
            b
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balance::fake::Fake;

    fn endpoints(active: &[u32]) -> Vec<Arc<Fake>> {
        active
            .iter()
            .zip(1u8..)
            .map(|(&n, i)| Fake::at(0, i).with_active(n))
            .collect()
    }

    fn shares(picker: &LeastRequest, eps: &[Arc<Fake>], picks: usize) -> Vec<f64> {
        let mut n = vec![0usize; eps.len()];
        for _ in 0..picks {
            n[picker.pick(eps)] += 1;
        }
        n.iter().map(|&k| k as f64 / picks as f64).collect()
    }

    #[test]
    fn an_idle_endpoint_of_small_weight_does_not_win_every_draw() {
        // LOAD_AWARE has cut the third endpoint's weight to 1% (it fails every
        // request at once, so it never has a request in flight).
        let eps = endpoints(&[5, 5, 0]);
        let s = shares(&LeastRequest::new(&[100, 100, 1]), &eps, 20_000);
        assert!(
            s[2] < 0.01,
            "the weight-1 endpoint took {:.3} of picks",
            s[2]
        );
        // Equal weights: fewer in flight wins, as before.
        let s = shares(&LeastRequest::new(&[1, 1, 1]), &eps, 20_000);
        assert!(
            s[2] > 0.6,
            "the idle endpoint took only {:.3} of picks",
            s[2]
        );
        // Weights count between idle endpoints too: 3:1 draws, the heavier
        // endpoint wins every mixed pair.
        let eps = endpoints(&[0, 0]);
        let s = shares(&LeastRequest::new(&[3, 1]), &eps, 20_000);
        assert!(s[0] > 0.9, "the weight-3 endpoint took only {:.3}", s[0]);
    }
}
