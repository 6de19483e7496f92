//! ROUND_ROBIN: weighted round robin with smooth interleaving. Equal weights
//! rotate; unequal weights follow a schedule precomputed off the request path
//! by earliest-deadline-first, as Envoy's EDF scheduler orders picks (2:1:1
//! gives a b c a, never a a b c), so a pick is one atomic increment and an
//! array read.

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

/// A pending pick of endpoint `idx`: its `k`-th turn is due at (2k-1)/(2w),
/// the middle of its k-th interval of length 1/w.
#[derive(PartialEq, Eq)]
struct Turn {
    num: u64,
    den: u64,
    idx: u32,
}

impl Ord for Turn {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Min-heap on the deadline, ties to the lower index.
        let a = u128::from(self.num) * u128::from(other.den);
        let b = u128::from(other.num) * u128::from(self.den);
        b.cmp(&a).then(other.idx.cmp(&self.idx))
    }
}

impl PartialOrd for Turn {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// One period of the weighted order: earliest deadline first (Envoy's EDF
/// scheduler) with deadlines in the middle of each interval, which spreads
/// each endpoint's turns evenly. O(total · log n) to build.
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
    let mut heap: std::collections::BinaryHeap<Turn> = w
        .iter()
        .enumerate()
        .map(|(i, w)| Turn {
            num: 1,
            den: 2 * w,
            idx: i as u32,
        })
        .collect();
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let Some(mut t) = heap.pop() else { break };
        out.push(t.idx);
        t.num += 2;
        heap.push(t);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smooth_interleaving() {
        assert_eq!(smooth_schedule(&[2, 1, 1]), vec![0, 1, 2, 0]);
        assert_eq!(smooth_schedule(&[5, 1, 1]), vec![0, 0, 0, 1, 2, 0, 0]);
        // 6:3:2:1: exact shares, and the heaviest never waits long.
        let s = smooth_schedule(&[6, 3, 2, 1]);
        let count = |i| s.iter().filter(|x| **x == i).count();
        assert_eq!((count(0), count(1), count(2), count(3)), (6, 3, 2, 1));
        let gaps: Vec<usize> = s
            .iter()
            .enumerate()
            .filter(|(_, x)| **x == 0)
            .map(|(i, _)| i)
            .collect();
        assert!(gaps.windows(2).all(|w| w[1] - w[0] <= 3), "{s:?}");
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
