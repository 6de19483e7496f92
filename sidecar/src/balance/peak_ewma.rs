//! PEAK_EWMA: power of two choices on latency-weighted load, as Finagle and
//! linkerd2-proxy do: each endpoint's cost is a peak-sensitive moving
//! average of its round-trip time times (active requests + 1). A slow
//! endpoint's cost jumps at once (the peak) and decays over `decay`, so it
//! keeps a small share and can recover, instead of "least response time"
//! snowballing all traffic onto one server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{rng, Endpoint};

/// RTT assumed for an endpoint with no samples yet (linkerd's default 30 ms).
pub const DEFAULT_RTT_US: f64 = 30_000.0;
/// Decay time of the average (10 s).
pub const DECAY_US: f64 = 10_000_000.0;

/// One endpoint's peak-sensitive moving average of its round-trip time.
#[derive(Debug, Default)]
pub struct Ewma {
    /// Microseconds (f64 bits; 0 = no sample).
    rtt_us: AtomicU64,
    /// When `rtt_us` was last updated (microseconds of the sidecar clock).
    stamp_us: AtomicU64,
}

impl Ewma {
    /// Folds one RTT sample in (on the response path).
    pub fn observe(&self, rtt_us: f64, now_us: u64) {
        let prev = f64::from_bits(self.rtt_us.load(Ordering::Relaxed));
        let last = self.stamp_us.swap(now_us, Ordering::Relaxed);
        let next = if prev <= 0.0 || rtt_us > prev {
            rtt_us // peak: jump up at once
        } else {
            let dt = now_us.saturating_sub(last) as f64;
            let w = (-dt / DECAY_US).exp();
            prev * w + rtt_us * (1.0 - w)
        };
        // Races between concurrent responses lose one sample at worst.
        self.rtt_us.store(next.to_bits(), Ordering::Relaxed);
    }

    /// The estimate at `now_us`, microseconds: [`DEFAULT_RTT_US`] before
    /// any sample, and decaying while no response comes, so that one bad
    /// spell does not exile an endpoint for good.
    #[inline]
    pub fn estimate(&self, now_us: u64) -> f64 {
        let rtt = f64::from_bits(self.rtt_us.load(Ordering::Relaxed));
        if rtt <= 0.0 {
            return DEFAULT_RTT_US;
        }
        let idle = now_us.saturating_sub(self.stamp_us.load(Ordering::Relaxed));
        if idle > 1_000_000 {
            rtt * (-(idle as f64) / DECAY_US).exp()
        } else {
            rtt
        }
    }
}

/// P2C on peak EWMA cost.
pub struct PeakEwma;

impl PeakEwma {
    /// An index.
    #[inline]
    pub fn pick<E: Endpoint>(endpoints: &[Arc<E>], now_us: u64) -> usize {
        let n = endpoints.len();
        if n == 1 {
            return 0;
        }
        let a = rng::below(n);
        let b = (a + 1 + rng::below(n - 1)) % n;
        let cost = |e: &E| e.rtt().estimate(now_us) * (f64::from(e.active()) + 1.0);
        if cost(&endpoints[a]) <= cost(&endpoints[b]) {
            a
        } else {
            b
        }
    }
}
