//! ROUND_ROBIN: smooth weighted round robin. Equal weights rotate; unequal
//! weights follow a precomputed smooth schedule (nginx's smooth WRR order,
//! which interleaves like Envoy's EDF scheduler: 2:1:1 gives a b a c, never
//! a a b c), so a pick is one atomic increment and an array read.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Longest schedule kept; weights are scaled down to fit.
const MAX_SCHEDULE: u64 = 1 << 16;

/// Round-robin picker.
pub struct RoundRobin {
    next: AtomicUsize,
    n: usize,
    schedule: Option<Vec<u32>>,
}

impl RoundRobin {
    /// Picker over `weights`.
    pub fn new(weights: &[u32]) -> Self {
        let n = weights.len();
        // Start at a random offset so that sidecars started together do not
        // all hit the first endpoint first.
        let start = if n > 0 { super::rng::below(n) } else { 0 };
        let schedule = if n == 0 || weights.iter().all(|w| *w == weights[0]) {
            None
        } else {
            Some(smooth_schedule(weights))
        };
        RoundRobin {
            next: AtomicUsize::new(start),
            n,
            schedule,
        }
    }

    /// An index.
    #[inline]
    pub fn pick(&self) -> usize {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        match &self.schedule {
            None => i % self.n,
            Some(s) => s[i % s.len()] as usize,
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// One period of the smooth weighted round-robin order.
fn smooth_schedule(weights: &[u32]) -> Vec<u32> {
    let mut w: Vec<u64> = weights.iter().map(|w| u64::from(*w)).collect();
    let g = w.iter().fold(0, |g, x| gcd(g, *x)).max(1);
    w.iter_mut().for_each(|x| *x /= g);
    let mut total: u64 = w.iter().sum();
    let cap = MAX_SCHEDULE.max(w.len() as u64);
    if total > cap {
        // Scale down, keeping every endpoint in the schedule at least once.
        w.iter_mut().for_each(|x| *x = (*x * cap / total).max(1));
        total = w.iter().sum();
    }
    let mut current = vec![0i64; w.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for i in 0..w.len() {
            current[i] += w[i] as i64;
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total as i64;
        out.push(best as u32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smooth_interleaving() {
        assert_eq!(smooth_schedule(&[2, 1, 1]), vec![0, 1, 2, 0]);
        assert_eq!(smooth_schedule(&[5, 1, 1]), vec![0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn equal_weights_rotate() {
        let rr = RoundRobin::new(&[1, 1, 1]);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[rr.pick()] += 1;
        }
        assert_eq!(seen, [100, 100, 100]);
    }

    #[test]
    fn huge_weights_are_bounded() {
        let s = smooth_schedule(&[1_000_000, 1, 999_999]);
        assert!(s.len() as u64 <= MAX_SCHEDULE + 3);
        assert!(s.contains(&1));
    }
}
