//! Per-endpoint state shared by every request and kept across config
//! updates: active requests, passive failure marks and counters, all atomics
//! behind methods. The balancers see it only through [`Endpoint`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use http::HeaderValue;

use crate::balance::peak_ewma::Ewma;
use crate::balance::Endpoint;
use crate::clock;
use crate::histogram::{Fine, Histogram};

/// How long an endpoint that refused a connection is skipped, doubling on
/// each consecutive failure up to [`MAX_BACKOFF_MS`]. Short enough that a
/// restarted replica is back within a second, long enough that a dead one
/// costs at most one failed connect (retried elsewhere) per window.
pub const BASE_BACKOFF_MS: u64 = 250;
/// Upper bound of the failure backoff.
pub const MAX_BACKOFF_MS: u64 = 10_000;

/// Counters exported per endpoint (and reported to the control plane):
/// written by the request path through its methods, read by the metrics
/// collector and the load reporter. Each event loop counts into a shard of
/// its own (on cache lines of its own), and readers sum the shards: under
/// full load no counter's cache line moves between cores per request.
#[derive(Debug)]
pub struct Counters {
    shards: Box<[Shard]>,
    /// Connect failures (rare: not sharded).
    connect_failures: AtomicU64,
}

/// One event loop's counts.
#[derive(Debug)]
#[repr(align(128))]
struct Shard {
    /// Requests sent.
    issued: AtomicU64,
    /// Responses with a status below 500.
    succeeded: AtomicU64,
    /// 5xx responses and transport failures.
    failed: AtomicU64,
    /// Sum of latencies in microseconds.
    latency_us_sum: AtomicU64,
    /// Latency to response headers, microseconds (Prometheus).
    latency_us: Histogram<13>,
    /// Latency to response headers, fine buckets (load reports).
    latency_fine: Fine,
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            issued: AtomicU64::new(0),
            succeeded: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            latency_us_sum: AtomicU64::new(0),
            latency_us: Histogram::new(&crate::histogram::LATENCY_BUCKET_BOUNDS_US),
            latency_fine: Fine::default(),
        }
    }
}

impl Counters {
    /// This event loop's shard.
    #[inline]
    fn here(&self) -> &Shard {
        &self.shards[crate::upstream::event_loop() as usize % self.shards.len()]
    }

    fn sum(&self, read: impl Fn(&Shard) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .map(|s| read(s).load(Ordering::Relaxed))
            .sum()
    }

    /// Counts a response that reached the caller: its latency to headers,
    /// in microseconds, and whether it was a server error.
    #[inline]
    pub fn count_response(&self, server_error: bool, latency_us: u64) {
        let s = self.here();
        s.latency_us_sum.fetch_add(latency_us, Ordering::Relaxed);
        s.latency_us.observe(latency_us);
        s.latency_fine.observe(latency_us);
        if server_error {
            s.failed.fetch_add(1, Ordering::Relaxed);
        } else {
            s.succeeded.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts an attempt that failed (a transport failure, or a response
    /// that was retried elsewhere).
    #[inline]
    pub fn count_failure(&self) {
        self.here().failed.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    fn count_issued(&self) {
        self.here().issued.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests sent.
    pub fn issued(&self) -> u64 {
        self.sum(|s| &s.issued)
    }

    /// Responses under 500.
    pub fn succeeded(&self) -> u64 {
        self.sum(|s| &s.succeeded)
    }

    /// 5xx responses and failed attempts.
    pub fn failed(&self) -> u64 {
        self.sum(|s| &s.failed)
    }

    /// Refused or failed connections.
    pub fn connect_failures(&self) -> u64 {
        self.connect_failures.load(Ordering::Relaxed)
    }

    /// Sum of the counted responses' latencies, microseconds.
    pub fn latency_sum_us(&self) -> u64 {
        self.sum(|s| &s.latency_us_sum)
    }

    /// The Prometheus latency histogram, in seconds: sum, count and
    /// non-cumulative buckets (see [`Histogram::snapshot`]).
    pub fn latency_snapshot(&self) -> crate::histogram::Snapshot {
        crate::histogram::snapshot_all(self.shards.iter().map(|s| &s.latency_us), 1e6)
    }

    /// Takes the fine latency counts since the last call (see
    /// [`Fine::drain`]), for a load report.
    pub fn drain_latency(&self) -> (u32, Vec<u64>) {
        crate::histogram::drain_all(self.shards.iter().map(|s| &s.latency_fine))
    }
}

impl Counters {
    /// Counters sharded over `loops` event loops (one shard each, so that
    /// a request's counting touches only its loop's cache lines).
    fn on_loops(loops: usize) -> Self {
        let loops = loops.max(1);
        Counters {
            shards: (0..loops).map(|_| Shard::default()).collect(),
            connect_failures: AtomicU64::new(0),
        }
    }
}

/// One endpoint of one cluster. Its identity is plain data; everything that
/// changes (load, backoff, health, outlier state, latency estimate, pool) is
/// behind methods, each kind written by one module.
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
    active: AtomicU32,
    /// Consecutive connect failures.
    consecutive_failures: AtomicU32,
    /// Skip until this [`clock::now_ms`] value.
    fail_until_ms: AtomicU64,
    counters: Counters,
    /// Outlier detection's counts and ejection ([`crate::outlier`]).
    outlier: crate::outlier::State,
    /// When the endpoint joined its cluster ([`clock::precise_ms`]); 0 for
    /// endpoints present when the sidecar first heard of the cluster (no
    /// slow start at startup).
    joined_ms: AtomicU64,
    /// Failing its active health check.
    hc_unhealthy: AtomicBool,
    /// Consecutive health-check outcomes that disagree with the current state.
    hc_streak: AtomicU32,
    /// PEAK_EWMA's latency estimate.
    rtt: Ewma,
    /// Upstream connections to this endpoint; closed when it leaves every cluster.
    pool: crate::pool::ConnPool,
}

impl EndpointState {
    /// New state for `addr`, joined now (slow start applies), served by one
    /// event loop.
    pub fn new(addr: SocketAddr, pod: String) -> Arc<Self> {
        Self::joined(addr, pod, 1)
    }

    /// New state for `addr`, joined now (slow start applies), its counters
    /// and idle connections kept per event loop (`loops`).
    pub fn joined(addr: SocketAddr, pod: String, loops: usize) -> Arc<Self> {
        Self::joined_at(addr, pod, clock::precise_ms(), loops)
    }

    /// New state for an endpoint present when its cluster first arrived:
    /// no slow start.
    pub fn present_from_start(addr: SocketAddr, pod: String, loops: usize) -> Arc<Self> {
        Self::joined_at(addr, pod, 0, loops)
    }

    fn joined_at(addr: SocketAddr, pod: String, joined_ms: u64, loops: usize) -> Arc<Self> {
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
            counters: Counters::on_loops(loops),
            outlier: Default::default(),
            joined_ms: AtomicU64::new(joined_ms),
            hc_unhealthy: AtomicBool::new(false),
            hc_streak: AtomicU32::new(0),
            rtt: Ewma::default(),
            pool: crate::pool::ConnPool::with_loops(loops),
        })
    }

    /// Its counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Its outlier-detection state ([`crate::outlier`] counts into it).
    pub fn outlier(&self) -> &crate::outlier::State {
        &self.outlier
    }

    /// Its upstream connections.
    pub fn pool(&self) -> &crate::pool::ConnPool {
        &self.pool
    }

    /// True while the endpoint is skipped: backing off after a connect
    /// failure, ejected, or failing its health check.
    #[inline]
    pub fn is_failing(&self) -> bool {
        Endpoint::is_failing(self, clock::now_ms())
    }

    /// True while ejected by outlier detection.
    pub fn is_ejected(&self) -> bool {
        self.outlier.is_ejected(clock::now_ms())
    }

    /// True while failing its active health check.
    pub fn is_health_check_failing(&self) -> bool {
        self.hc_unhealthy.load(Ordering::Relaxed)
    }

    /// Records one active health check's outcome; the endpoint changes state
    /// after `threshold(currently_failing)` outcomes in a row that disagree
    /// with it. Returns the new state (true: failing) when it changed.
    pub fn record_health_check(
        &self,
        ok: bool,
        threshold: impl FnOnce(bool) -> u32,
    ) -> Option<bool> {
        let failing = self.hc_unhealthy.load(Ordering::Relaxed);
        if ok != failing {
            // The outcome agrees with the current state.
            self.hc_streak.store(0, Ordering::Relaxed);
            return None;
        }
        let streak = self.hc_streak.fetch_add(1, Ordering::Relaxed) + 1;
        if streak < threshold(failing).max(1) {
            return None;
        }
        self.hc_unhealthy.store(!failing, Ordering::Relaxed);
        self.hc_streak.store(0, Ordering::Relaxed);
        Some(!failing)
    }

    /// Folds a response's round-trip time, and the requests that were in
    /// flight to the endpoint when it was sent, into PEAK_EWMA's estimate.
    #[inline]
    pub fn observe_rtt(&self, rtt_us: f64, ahead: u32, now_us: u64) {
        self.rtt.observe(rtt_us, ahead, now_us);
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

    /// Requests in flight.
    #[inline]
    pub fn active(&self) -> u32 {
        self.active.load(Ordering::Relaxed)
    }

    /// Counts a request in flight until the guard is dropped.
    #[inline]
    pub fn start(self: &Arc<Self>) -> ActiveGuard {
        let ahead = self.active.fetch_add(1, Ordering::Relaxed);
        self.counters.count_issued();
        ActiveGuard(self.clone(), ahead)
    }
}

impl Endpoint for EndpointState {
    #[inline]
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    #[inline]
    fn active(&self) -> u32 {
        self.active.load(Ordering::Relaxed)
    }

    #[inline]
    fn is_failing(&self, now_ms: u64) -> bool {
        self.fail_until_ms.load(Ordering::Relaxed) > now_ms
            || self.outlier.is_ejected(now_ms)
            || self.hc_unhealthy.load(Ordering::Relaxed)
    }

    #[inline]
    fn backoff_until_ms(&self) -> u64 {
        self.fail_until_ms.load(Ordering::Relaxed)
    }

    #[inline]
    fn joined_ms(&self) -> u64 {
        self.joined_ms.load(Ordering::Relaxed)
    }

    #[inline]
    fn rtt(&self) -> &Ewma {
        &self.rtt
    }
}

/// Decrements the endpoint's active count when dropped.
#[derive(Debug)]
pub struct ActiveGuard(Arc<EndpointState>, u32);

impl ActiveGuard {
    /// The endpoint counted.
    pub fn endpoint(&self) -> &Arc<EndpointState> {
        &self.0
    }

    /// The requests that were in flight to the endpoint when this one
    /// started.
    pub fn ahead(&self) -> u32 {
        self.1
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}
