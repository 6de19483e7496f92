//! The retry budget: retries may be at most a share of requests plus a small
//! floor per second (Linkerd's budget shape), so that a failing backend
//! cannot multiply the load on the others. Counted per sidecar and cluster
//! over the current and the previous one-second window (so that a window's
//! first moments still see recent traffic), with atomics only.

use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderValue};
use minimesh_proto::v1::RetryOn;

use crate::clock;
use crate::routing::ClusterHandle;

/// Per-cluster retry budget.
#[derive(Debug)]
pub struct Budget {
    percent: u64,
    min_per_second: u64,
    window: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    prev_requests: AtomicU64,
    prev_retries: AtomicU64,
    /// Retries refused because the budget was spent.
    pub exhausted: AtomicU64,
    /// Retries made.
    pub retried: AtomicU64,
}

impl Budget {
    /// Retries up to `percent`% of requests plus `min_per_second` a second.
    pub fn new(percent: u32, min_per_second: u32) -> Budget {
        Budget {
            percent: u64::from(percent),
            min_per_second: u64::from(min_per_second),
            window: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            prev_requests: AtomicU64::new(0),
            prev_retries: AtomicU64::new(0),
            exhausted: AtomicU64::new(0),
            retried: AtomicU64::new(0),
        }
    }

    #[inline]
    fn roll(&self) {
        let now = clock::now_ms() / 1000;
        let w = self.window.load(Ordering::Relaxed);
        if w != now
            && self
                .window
                .compare_exchange(w, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let (req, ret) = if now == w + 1 {
                (
                    self.requests.swap(0, Ordering::Relaxed),
                    self.retries.swap(0, Ordering::Relaxed),
                )
            } else {
                self.requests.store(0, Ordering::Relaxed);
                self.retries.store(0, Ordering::Relaxed);
                (0, 0)
            };
            self.prev_requests.store(req, Ordering::Relaxed);
            self.prev_retries.store(ret, Ordering::Relaxed);
        }
    }

    /// True when built with these parameters.
    pub fn has_params(&self, percent: u32, min_per_second: u32) -> bool {
        self.percent == u64::from(percent) && self.min_per_second == u64::from(min_per_second)
    }

    /// Counts a request.
    #[inline]
    pub fn on_request(&self) {
        self.roll();
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes a retry from the budget; false when it is spent.
    pub fn try_retry(&self) -> bool {
        self.roll();
        let requests =
            self.requests.load(Ordering::Relaxed) + self.prev_requests.load(Ordering::Relaxed);
        let allowed = requests * self.percent / 100 + 2 * self.min_per_second;
        let prev = self.prev_retries.load(Ordering::Relaxed);
        if prev + self.retries.fetch_add(1, Ordering::Relaxed) < allowed {
            self.retried.fetch_add(1, Ordering::Relaxed);
            true
        } else {
            self.retries.fetch_sub(1, Ordering::Relaxed);
            self.exhausted.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}
/// Whether the cluster retries on `cond`.
#[inline]
pub(crate) fn on(cluster: &ClusterHandle, cond: RetryOn) -> bool {
    cluster.retry_on & cond as u32 != 0
}

/// The gRPC status header (or trailer).
pub(crate) const GRPC_STATUS: &str = "grpc-status";

/// True when a gRPC response's headers end the call with a status the
/// cluster retries: 14 UNAVAILABLE (`unavailable`), 1 CANCELLED (`cancelled`).
pub(crate) fn grpc_retriable(cluster: &ClusterHandle, headers: &HeaderMap) -> bool {
    match headers.get(GRPC_STATUS).map(HeaderValue::as_bytes) {
        Some(b"14") => on(cluster, RetryOn::Unavailable),
        Some(b"1") => on(cluster, RetryOn::Cancelled),
        _ => false,
    }
}
