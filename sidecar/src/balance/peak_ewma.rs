//! PEAK_EWMA: power of two choices on each endpoint's expected time to
//! answer, after Finagle's and linkerd2-proxy's peak EWMA. The round-trip
//! time is a peak-sensitive moving average: a slow endpoint's jumps at once
//! (the peak) and decays over `decay`, so it keeps a small share and can
//! recover, instead of "least response time" snowballing all traffic onto
//! one server.
//!
//! What a request waits for also depends on the requests already there,
//! and how much depends on the server: one that queues answers each later
//! by a service time, one that serves requests side by side barely later
//! at all. Finagle prices every endpoint as if it queued (round-trip time ×
//! (requests in flight + 1)), which shuns a fast endpoint for concurrency it
//! handles and so keeps feeding a slow one. Each endpoint here learns its
//! own answer: a moving least-squares fit of its latency against the
//! requests in flight when each was sent. The cost of sending it one more
//! is its round-trip time scaled by what the fit predicts at the requests in
//! flight now against what it predicts at those usually in flight. An
//! endpoint that queues is priced by its queue as before; one that does
//! not, by its latency. Until an endpoint's in-flight count has varied
//! enough to fit, it is priced as if it queued.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{rng, Endpoint};

/// RTT assumed for an endpoint with no samples yet (linkerd's default 30 ms).
pub const DEFAULT_RTT_US: f64 = 30_000.0;
/// Decay time of the average (10 s).
pub const DECAY_US: f64 = 10_000_000.0;
/// Weight of one response in the fit's moving averages: about the last 32.
const FIT_WEIGHT: f64 = 1.0 / 32.0;
/// The fit is used once the requests in flight at sending have varied this
/// much (their variance) ...
const FIT_MIN_SPREAD: f64 = 0.25;
/// ... over at least this many responses.
const FIT_MIN_SAMPLES: u64 = 16;

/// An `f64` in an atomic.
#[derive(Debug, Default)]
struct F64(AtomicU64);

impl F64 {
    #[inline]
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    #[inline]
    fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    /// Moves the average towards `x` by `w`.
    #[inline]
    fn blend(&self, x: f64, w: f64) {
        self.set(self.get() * (1.0 - w) + x * w);
    }
}

/// One endpoint's latency: the peak-sensitive moving average of its
/// round-trip time, and the fit of its latency against the requests in
/// flight when each request was sent. Updated on the response path without
/// locks: racing responses may lose a sample, never corrupt one.
#[derive(Debug, Default)]
pub struct Ewma {
    /// Microseconds (0 = no sample).
    rtt_us: F64,
    /// When `rtt_us` was last updated (microseconds of the sidecar clock).
    stamp_us: AtomicU64,
    /// Moving averages of k (requests in flight at sending), L (latency,
    /// µs), k² and k·L.
    k: F64,
    l: F64,
    kk: F64,
    kl: F64,
    /// Responses folded into the fit.
    samples: AtomicU64,
}

/// What the fit says: latency ≈ `base` + `per_request` × k, and the k
/// usually seen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit {
    /// Latency with nothing ahead, µs.
    pub base: f64,
    /// Latency each request in flight adds, µs.
    pub per_request: f64,
    /// The requests in flight usually seen at sending.
    pub usual: f64,
}

impl Ewma {
    /// Folds one response in: its round-trip time, and the requests that
    /// were in flight to the endpoint when it was sent (`ahead`).
    pub fn observe(&self, rtt_us: f64, ahead: u32, now_us: u64) {
        let prev = self.rtt_us.get();
        let last = self.stamp_us.swap(now_us, Ordering::Relaxed);
        let next = if prev <= 0.0 || rtt_us > prev {
            rtt_us // peak: jump up at once
        } else {
            let dt = now_us.saturating_sub(last) as f64;
            let w = (-dt / DECAY_US).exp();
            prev * w + rtt_us * (1.0 - w)
        };
        self.rtt_us.set(next);
        // The fit: an exact mean over the first responses, then moving.
        let n = self.samples.fetch_add(1, Ordering::Relaxed) + 1;
        let w = (1.0 / n as f64).max(FIT_WEIGHT);
        let k = f64::from(ahead);
        self.k.blend(k, w);
        self.l.blend(rtt_us, w);
        self.kk.blend(k * k, w);
        self.kl.blend(k * rtt_us, w);
    }

    /// The estimate at `now_us`, microseconds: [`DEFAULT_RTT_US`] before
    /// any sample, and decaying while no response comes, so that one bad
    /// spell does not exile an endpoint for good.
    #[inline]
    pub fn estimate(&self, now_us: u64) -> f64 {
        let rtt = self.rtt_us.get();
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

    /// The fit, once the requests in flight have varied enough to make one.
    #[inline]
    pub fn fit(&self) -> Option<Fit> {
        if self.samples.load(Ordering::Relaxed) < FIT_MIN_SAMPLES {
            return None;
        }
        let (k, l) = (self.k.get(), self.l.get());
        let spread = self.kk.get() - k * k;
        if spread < FIT_MIN_SPREAD || l <= 0.0 {
            return None;
        }
        // Least squares, kept within what a server can do: latency does
        // not fall with load, and one request cannot add more than the
        // latency itself; nor is the base below a tenth of the latency.
        let per_request = ((self.kl.get() - k * l) / spread).clamp(0.0, l);
        let base = (l - per_request * k).max(l * 0.1);
        Some(Fit {
            base,
            per_request,
            usual: k,
        })
    }

    /// The cost of sending the endpoint one more request now, with
    /// `active` in flight: its round-trip time, scaled by what the fit
    /// predicts at `active` against what it predicts at the usual count
    /// (without a fit: × (`active` + 1), as if it queued).
    #[inline]
    pub fn cost(&self, active: u32, now_us: u64) -> f64 {
        let rtt = self.estimate(now_us);
        let active = f64::from(active);
        match self.fit() {
            None => rtt * (active + 1.0),
            Some(f) => rtt * (f.base + f.per_request * active) / (f.base + f.per_request * f.usual),
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
        let cost = |e: &E| e.rtt().cost(e.active(), now_us);
        if cost(&endpoints[a]) <= cost(&endpoints[b]) {
            a
        } else {
            b
        }
    }
}
