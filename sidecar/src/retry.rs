//! The retry budget: retries may be at most a share of requests plus a small
//! floor per second (Linkerd's budget shape), so that a failing backend
//! cannot multiply the load on the others. Counted per sidecar and cluster
//! over the current and the previous one-second window (so that a window's
//! first moments still see recent traffic), with atomics only.

use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderMap;
use minimesh_proto::v1::RetryOn;

use crate::clock;

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
/// What an attempt came to, as far as the retry decision goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempted {
    /// No answer within the per-try timeout.
    TimedOut,
    /// The endpoint's own sidecar answered for its app (503: the app is
    /// gone or restarting; 502: it died mid-request); `unprocessed`: it says
    /// the app never saw the request.
    AppGone {
        /// 502 or 503.
        status: u16,
        /// `x-minimesh-unprocessed` was set.
        unprocessed: bool,
    },
    /// A gRPC call answered at once with this `grpc-status` (no message).
    GrpcStatus(u32),
    /// An HTTP response with this status.
    Status(u16),
    /// No connection could be made.
    ConnectFailed,
    /// The endpoint refused the HTTP/2 stream: it processed nothing.
    RefusedStream,
    /// The connection or stream was reset or closed before a response.
    Reset,
}

/// Whether an attempt that came to `outcome` is tried again on another
/// endpoint, for a request that is `idempotent` or not, under the cluster's
/// `retry_on` bits (the wire `RetryOn`). Whether an attempt is left (and
/// the body can be sent again) is the caller's to check first.
pub fn decide(outcome: Attempted, idempotent: bool, retry_on: u32) -> bool {
    let on = |c: RetryOn| retry_on & c as u32 != 0;
    match outcome {
        // A hung replica may have processed the request: idempotent only.
        Attempted::TimedOut => {
            idempotent
                && (on(RetryOn::Reset) || on(RetryOn::GatewayError) || on(RetryOn::ServerError))
        }
        // The app never saw it (connect-failure, any method), or its
        // sidecar lost it in flight (reset, idempotent only); and whatever
        // the status itself allows.
        Attempted::AppGone {
            status,
            unprocessed,
        } => {
            (status == 503 && on(RetryOn::ConnectFailure) && (idempotent || unprocessed))
                || (status == 502 && on(RetryOn::Reset) && idempotent)
                || decide(Attempted::Status(status), idempotent, retry_on)
        }
        Attempted::Status(status) => {
            (on(RetryOn::ServerError) && (500..600).contains(&status))
                || (on(RetryOn::GatewayError) && (502..=504).contains(&status))
        }
        Attempted::GrpcStatus(14) => on(RetryOn::Unavailable),
        Attempted::GrpcStatus(1) => on(RetryOn::Cancelled),
        Attempted::GrpcStatus(_) => false,
        Attempted::ConnectFailed => on(RetryOn::ConnectFailure),
        Attempted::RefusedStream => on(RetryOn::RefusedStream),
        Attempted::Reset => idempotent && on(RetryOn::Reset),
    }
}

/// The gRPC status header (or trailer).
pub(crate) const GRPC_STATUS: &str = "grpc-status";

/// The `grpc-status` a response's headers end the call with, if any.
pub(crate) fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    headers
        .get(GRPC_STATUS)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::{decide, Attempted::*};
    use minimesh_proto::retry_on::{parse, DEFAULT};

    #[test]
    fn the_retry_decision_table() {
        let bits = |s: &str| parse(s).expect("tokens");
        let (default, none) = (bits(DEFAULT), 0);
        let all =
            bits("connect-failure,refused-stream,unavailable,cancelled,5xx,gateway-error,reset");
        let gateway = bits("gateway-error");
        let gone = |status, unprocessed| AppGone {
            status,
            unprocessed,
        };
        // (outcome, idempotent, retry_on) -> retried elsewhere
        let table = [
            (ConnectFailed, false, default, true),
            (ConnectFailed, true, none, false),
            (RefusedStream, false, default, true),
            (Reset, true, default, true),
            (Reset, false, all, false),
            (TimedOut, true, default, true),
            (TimedOut, false, all, false),
            (gone(503, true), false, default, true),
            (gone(503, false), false, default, false),
            (gone(503, false), true, default, true),
            (gone(502, false), true, default, true),
            (gone(502, false), false, default, false),
            (gone(502, false), false, all, true),
            (Status(500), true, default, false),
            (Status(500), false, all, true),
            (Status(503), true, gateway, true),
            (Status(500), true, gateway, false),
            (Status(404), true, all, false),
            (GrpcStatus(14), false, default, true),
            (GrpcStatus(1), false, default, true),
            (GrpcStatus(2), false, all, false),
            (GrpcStatus(14), false, none, false),
        ];
        for (outcome, idempotent, retry_on, want) in table {
            assert_eq!(
                decide(outcome, idempotent, retry_on),
                want,
                "{outcome:?} idempotent={idempotent} retry_on={retry_on:#b}"
            );
        }
    }
}
