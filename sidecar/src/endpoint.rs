//! Per-endpoint state shared by every request and kept across config
//! updates: active requests, passive failure marks and counters, all atomics.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use http::HeaderValue;

use crate::clock;

/// How long an endpoint that refused a connection is skipped, doubling on
/// each consecutive failure up to [`MAX_BACKOFF_MS`]. Short enough that a
/// restarted replica is back within a second, long enough that a dead one
/// costs at most one failed connect (retried elsewhere) per window.
pub const BASE_BACKOFF_MS: u64 = 250;
/// Upper bound of the failure backoff.
pub const MAX_BACKOFF_MS: u64 = 10_000;

/// Counters exported per endpoint (and later reported to the control plane).
#[derive(Debug)]
pub struct Counters {
    /// Requests sent.
    pub issued: AtomicU64,
    /// Responses with a status below 500.
    pub succeeded: AtomicU64,
    /// 5xx responses and transport failures.
    pub failed: AtomicU64,
    /// Connect failures.
    pub connect_failures: AtomicU64,
    /// Sum of latencies in microseconds.
    pub latency_us_sum: AtomicU64,
    /// Latency to response headers, microseconds (Prometheus).
    pub latency_us: crate::histogram::Histogram<13>,
    /// Latency to response headers, fine buckets (load reports).
    pub latency_fine: crate::histogram::Fine,
}

impl Counters {
    /// Records a response's latency, in microseconds, everywhere it is
    /// counted.
    #[inline]
    pub fn observe_latency(&self, us: u64) {
        self.latency_us_sum.fetch_add(us, Ordering::Relaxed);
        self.latency_us.observe(us);
        self.latency_fine.observe(us);
    }
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            issued: AtomicU64::new(0),
            succeeded: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            latency_us_sum: AtomicU64::new(0),
            latency_us: crate::histogram::Histogram::new(
                &crate::histogram::LATENCY_BUCKET_BOUNDS_US,
            ),
            latency_fine: Default::default(),
        }
    }
}

/// One endpoint of one cluster.
#[derive(Debug)]
pub struct EndpointState {
    /// Where it listens.
    pub addr: SocketAddr,
    /// `addr` as a URI authority, for upstream request URIs.
    pub authority: http::uri::Authority,
    /// `addr` as a header value, for `x-minimesh-endpoint`.
    pub header: HeaderValue,
    /// Pod name, for metrics and debugging.
    pub pod: String,
    /// Requests in flight.
    pub active: AtomicU32,
    /// Consecutive connect failures.
    pub consecutive_failures: AtomicU32,
    /// Skip until this [`clock::now_ms`] value.
    pub fail_until_ms: AtomicU64,
    /// Counters.
    pub counters: Counters,
    /// Outlier detection's counts and ejection ([`crate::outlier`]).
    pub outlier: crate::outlier::State,
    /// When the endpoint joined its cluster ([`clock::precise_ms`]); 0 for
    /// endpoints present when the sidecar first heard of the cluster (no
    /// slow start at startup).
    pub joined_ms: AtomicU64,
    /// Failing its active health check.
    pub hc_unhealthy: std::sync::atomic::AtomicBool,
    /// Consecutive health-check outcomes that disagree with the current state.
    pub hc_streak: AtomicU32,
    /// PEAK_EWMA round-trip estimate in microseconds (f64 bits; 0 = no sample).
    pub ewma_rtt_us: AtomicU64,
    /// When `ewma_rtt_us` was last updated ([`clock::now_ms`] × 1000).
    pub ewma_stamp_us: AtomicU64,
    /// Upstream connections to this endpoint; closed when it leaves every cluster.
    pub pool: crate::pool::ConnPool,
}

impl EndpointState {
    /// New state for `addr`.
    pub fn new(addr: SocketAddr, pod: String) -> Arc<Self> {
        let text = addr.to_string();
        Arc::new(EndpointState {
            addr,
            authority: http::uri::Authority::try_from(text.as_str())
                .unwrap_or(http::uri::Authority::from_static("invalid")),
            header: HeaderValue::from_str(&text).unwrap_or(HeaderValue::from_static("invalid")),
            pod,
            active: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            fail_until_ms: AtomicU64::new(0),
            counters: Counters::default(),
            outlier: Default::default(),
            joined_ms: AtomicU64::new(clock::precise_ms()),
            hc_unhealthy: std::sync::atomic::AtomicBool::new(false),
            hc_streak: AtomicU32::new(0),
            ewma_rtt_us: AtomicU64::new(0),
            ewma_stamp_us: AtomicU64::new(0),
            pool: Default::default(),
        })
    }

    /// True while the endpoint is backing off after a connect failure.
    #[inline]
    pub fn is_failing(&self) -> bool {
        let now = clock::now_ms();
        self.fail_until_ms.load(Ordering::Relaxed) > now
            || self.outlier.is_ejected(now)
            || self.hc_unhealthy.load(Ordering::Relaxed)
    }

    /// True while ejected by outlier detection.
    pub fn is_ejected(&self) -> bool {
        self.outlier.is_ejected(clock::now_ms())
    }

    /// Records a refused connection (or an attempt that timed out): the
    /// endpoint is skipped at once, and again after each backoff that ends in
    /// another failure.
    pub fn mark_connect_failure(&self) {
        self.counters
            .connect_failures
            .fetch_add(1, Ordering::Relaxed);
        self.back_off();
    }

    /// Skips the endpoint for the current backoff (250 ms, doubling on each
    /// consecutive failure): a refused connection, a timed-out attempt, or
    /// its own sidecar reporting its app unreachable.
    pub fn back_off(&self) {
        if self.is_failing() {
            // Requests that raced onto the same outage: one failure, not many,
            // or the backoff would reach its maximum within one outage.
            return;
        }
        let n = self
            .consecutive_failures
            .fetch_add(1, Ordering::Relaxed)
            .min(16);
        let backoff = (BASE_BACKOFF_MS << n).min(MAX_BACKOFF_MS);
        self.fail_until_ms
            .store(clock::precise_ms() + backoff, Ordering::Relaxed);
    }

    /// Records a response: the endpoint is reachable again.
    #[inline]
    pub fn mark_reachable(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
            self.fail_until_ms.store(0, Ordering::Relaxed);
        }
    }

    /// Counts a request in flight until the guard is dropped.
    #[inline]
    pub fn start(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.counters.issued.fetch_add(1, Ordering::Relaxed);
        ActiveGuard(self.clone())
    }
}

/// Decrements the endpoint's active count when dropped.
#[derive(Debug)]
pub struct ActiveGuard(Arc<EndpointState>);

impl ActiveGuard {
    /// The endpoint counted.
    pub fn endpoint(&self) -> &Arc<EndpointState> {
        &self.0
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}
