//! Retries: the decision after each attempt ([`decide`], a pure function of
//! what the attempt came to, where the request stands and the cluster's
//! `retryOn`), and the retry budget: retries may be at most a share of
//! requests plus a small floor per second (Linkerd's budget shape), so that a
//! failing backend cannot multiply the load on the others. The budget is
//! counted per sidecar and cluster over the current and the previous
//! one-second window (so that a window's first moments still see recent
//! traffic), with atomics only.

use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderMap;
use minimesh_proto::v1::RetryOn;

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
    fn roll(&self, now_ms: u64) {
        let now = now_ms / 1000;
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

    /// Counts a request, at `now_ms` (the sidecar clock's milliseconds).
    #[inline]
    pub fn on_request(&self, now_ms: u64) {
        self.roll(now_ms);
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes a retry from the budget at `now_ms`; false when it is spent.
    pub fn try_retry(&self, now_ms: u64) -> bool {
        self.roll(now_ms);
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

impl Attempted {
    /// How a response reads, most specific first: its endpoint's sidecar
    /// speaking for a gone app (502/503 with the mesh's error header), the
    /// `grpc-status` of a gRPC call answered at once (HTTP/2), its status.
    /// The first reading that [`decide`]s a retry is the one acted on.
    pub fn readings(status: u16, headers: &HeaderMap, h2: bool) -> [Option<Attempted>; 3] {
        let gone =
            matches!(status, 502 | 503) && headers.contains_key(minimesh_proto::headers::ERROR);
        [
            gone.then(|| Attempted::AppGone {
                status,
                unprocessed: headers.contains_key(minimesh_proto::headers::UNPROCESSED),
            }),
            h2.then(|| grpc_status(headers).map(Attempted::GrpcStatus))
                .flatten(),
            Some(Attempted::Status(status)),
        ]
    }
}

/// Where a request stands when one of its attempts ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    /// Another attempt is allowed, and the body can be sent again.
    pub left: bool,
    /// GET, HEAD, OPTIONS, PUT, DELETE or TRACE: safe to send again after a
    /// failure that may have reached the app.
    pub idempotent: bool,
}

/// What follows an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Try again, on another endpoint when there is one.
    Retry,
    /// Stop: pass the response on, or answer the failure.
    Stop,
}

/// A cluster's retry conditions: bits of the wire `RetryOn`, and the status
/// codes `RETRIABLE_STATUS_CODES` retries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conditions {
    /// Bits of the wire `RetryOn`.
    pub bits: u32,
    /// Retriable status codes (a few; looked through in place).
    pub codes: Box<[u16]>,
}

impl Conditions {
    /// The conditions of a cluster's `retry_on` and `retriable_status_codes`.
    pub fn new(bits: u32, codes: &[u32]) -> Conditions {
        Conditions {
            bits,
            codes: codes
                .iter()
                .filter_map(|c| u16::try_from(*c).ok())
                .collect(),
        }
    }

    fn on(&self, c: RetryOn) -> bool {
        self.bits & c as u32 != 0
    }
}

/// What follows an attempt that came to `outcome`, for a request standing
/// at `at`, under the cluster's retry conditions.
pub fn decide(outcome: Attempted, at: Standing, retry_on: &Conditions) -> Action {
    if at.left && retriable(outcome, at.idempotent, retry_on) {
        Action::Retry
    } else {
        Action::Stop
    }
}

/// The reading of a response that [`decide`]s what follows it (the first
/// of [`Attempted::readings`] that retries, else the first), and that.
pub fn decide_response(
    status: u16,
    headers: &HeaderMap,
    h2: bool,
    at: Standing,
    retry_on: &Conditions,
) -> (Attempted, Action) {
    let readings = Attempted::readings(status, headers, h2);
    let mut all = readings.into_iter().flatten();
    let first = all.clone().next().unwrap_or(Attempted::Status(status));
    all.find(|r| decide(*r, at, retry_on) == Action::Retry)
        .map_or((first, Action::Stop), |r| (r, Action::Retry))
}

/// Whether `outcome` may be retried at all under `retry_on`.
fn retriable(outcome: Attempted, idempotent: bool, retry_on: &Conditions) -> bool {
    let on = |c: RetryOn| retry_on.on(c);
    match outcome {
        // A hung replica may have processed the request: idempotent only.
        Attempted::TimedOut => {
            idempotent
                && (on(RetryOn::Reset) || on(RetryOn::GatewayError) || on(RetryOn::ServerError))
        }
        // The app never saw it (connect-failure, any method), or its
        // sidecar lost it in flight (reset, idempotent only); and whatever
        // the status itself allows.
        // The mesh default's retriable 503 stands for "not processed": not
        // when the endpoint's sidecar says its app may have seen a request
        // that cannot go twice (`5xx` and `gateway-error` still retry it,
        // as asked).
        Attempted::AppGone {
            status,
            unprocessed,
        } => {
            let safe = idempotent || unprocessed;
            (status == 503 && on(RetryOn::ConnectFailure) && safe)
                || (status == 502 && on(RetryOn::Reset) && idempotent)
                || status_retriable(status, retry_on, safe)
        }
        Attempted::Status(status) => status_retriable(status, retry_on, true),
        Attempted::GrpcStatus(14) => on(RetryOn::Unavailable),
        Attempted::GrpcStatus(1) => on(RetryOn::Cancelled),
        Attempted::GrpcStatus(_) => false,
        Attempted::ConnectFailed => on(RetryOn::ConnectFailure),
        Attempted::RefusedStream => on(RetryOn::RefusedStream),
        Attempted::Reset => idempotent && on(RetryOn::Reset),
    }
}

/// Whether a response's `status` is retried under `retry_on` (its codes
/// only when `codes`).
fn status_retriable(status: u16, retry_on: &Conditions, codes: bool) -> bool {
    (retry_on.on(RetryOn::ServerError) && (500..600).contains(&status))
        || (retry_on.on(RetryOn::GatewayError) && (502..=504).contains(&status))
        || (codes && retry_on.on(RetryOn::RetriableStatusCodes) && retry_on.codes.contains(&status))
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
    use super::{decide, decide_response, Action, Attempted::*, Budget, Conditions, Standing};
    use http::{HeaderMap, HeaderValue};
    use minimesh_proto::headers;
    use minimesh_proto::retry_on::{parse, DEFAULT};
    use std::sync::atomic::Ordering;

    fn at(left: bool, idempotent: bool) -> Standing {
        Standing { left, idempotent }
    }

    #[test]
    fn the_retry_decision_table() {
        let bits = |s: &str| {
            let p = parse(s).expect("tokens");
            Conditions::new(p.bits, &p.codes)
        };
        let (default, none) = (bits(DEFAULT), Conditions::default());
        let all =
            bits("connect-failure,refused-stream,unavailable,cancelled,5xx,gateway-error,reset");
        let gateway = bits("gateway-error");
        let gone = |status, unprocessed| AppGone {
            status,
            unprocessed,
        };
        // (outcome, idempotent, retry_on) -> retried elsewhere
        let too_many = bits("retriable-status-codes,429");
        let table = [
            (ConnectFailed, false, &default, true),
            (ConnectFailed, true, &none, false),
            (RefusedStream, false, &default, true),
            (Reset, true, &default, true),
            (Reset, false, &all, false),
            (TimedOut, true, &default, true),
            (TimedOut, false, &all, false),
            (gone(503, true), false, &default, true),
            (gone(503, false), false, &default, false),
            (gone(503, false), true, &default, true),
            (gone(502, false), true, &default, true),
            (gone(502, false), false, &default, false),
            (gone(502, false), false, &all, true),
            (Status(500), true, &default, false),
            // Istio's default: a 503 goes to another endpoint, any method
            // (the server answered it without doing the work).
            (Status(503), false, &default, true),
            (Status(502), true, &default, false),
            (Status(429), true, &too_many, true),
            (Status(500), false, &all, true),
            (Status(503), true, &gateway, true),
            (Status(500), true, &gateway, false),
            (Status(404), true, &all, false),
            (GrpcStatus(14), false, &default, true),
            (GrpcStatus(1), false, &default, true),
            (GrpcStatus(2), false, &all, false),
            (GrpcStatus(14), false, &none, false),
        ];
        for (outcome, idempotent, retry_on, want) in table {
            let want = if want { Action::Retry } else { Action::Stop };
            assert_eq!(
                decide(outcome, at(true, idempotent), retry_on),
                want,
                "{outcome:?} idempotent={idempotent} retry_on={retry_on:?}"
            );
            // With no attempt left (or a body that cannot go again): stop.
            assert_eq!(
                decide(outcome, at(false, idempotent), &all),
                Action::Stop,
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn the_budget_is_a_share_of_requests_plus_a_floor_over_two_seconds() {
        // 20% of requests plus 10 a second, counted over this second and
        // the one before (so the floor is 20).
        let b = Budget::new(20, 10);
        let take = |now: u64| (0..1_000).take_while(|_| b.try_retry(now)).count();
        let requests = |now: u64, n: usize| (0..n).for_each(|_| b.on_request(now));
        assert_eq!(take(5_000), 20, "no requests yet: the floor");
        requests(5_100, 100);
        assert_eq!(take(5_200), 20, "100 requests: 20 more");
        // The next second still sees the last one's requests and retries.
        assert_eq!(take(6_000), 0);
        requests(6_500, 100);
        assert_eq!(take(6_900), 20, "200 requests over two seconds: 60 in all");
        // A quiet second between: nothing carries over.
        assert_eq!(take(8_000), 20);
        assert_eq!(b.retried.load(Ordering::Relaxed), 80);
        assert_eq!(b.exhausted.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn a_response_is_read_most_specific_first() {
        let conditions = |s: &str| {
            let p = parse(s).expect("tokens");
            Conditions::new(p.bits, &p.codes)
        };
        let (default, five) = (&conditions(DEFAULT), &conditions("5xx"));
        let no_503 = &conditions("connect-failure,reset");
        let h = |pairs: &[(&'static str, &'static str)]| {
            let mut m = HeaderMap::new();
            for (k, v) in pairs {
                m.insert(*k, HeaderValue::from_static(v));
            }
            m
        };
        let gone = h(&[(headers::ERROR, "app gone"), (headers::UNPROCESSED, "true")]);
        // Its sidecar says the app never saw it: retried, any method.
        assert_eq!(
            decide_response(503, &gone, false, at(true, false), default),
            (
                AppGone {
                    status: 503,
                    unprocessed: true
                },
                Action::Retry
            )
        );
        // The same from an app (no mesh header) is a plain 503: retried
        // by default (a retriable status code), not without it.
        assert_eq!(
            decide_response(503, &HeaderMap::new(), false, at(true, false), default),
            (Status(503), Action::Retry)
        );
        assert_eq!(
            decide_response(503, &HeaderMap::new(), false, at(true, true), no_503),
            (Status(503), Action::Stop)
        );
        assert_eq!(
            decide_response(503, &HeaderMap::new(), false, at(true, true), five),
            (Status(503), Action::Retry)
        );
        // A gRPC call answered UNAVAILABLE at once, over HTTP/2 only.
        let unavailable = h(&[("grpc-status", "14")]);
        assert_eq!(
            decide_response(200, &unavailable, true, at(true, false), default),
            (GrpcStatus(14), Action::Retry)
        );
        assert_eq!(
            decide_response(200, &unavailable, false, at(true, false), default),
            (Status(200), Action::Stop)
        );
        // Nothing retries: the most specific reading, stopped.
        assert_eq!(
            decide_response(200, &unavailable, true, at(false, false), default),
            (GrpcStatus(14), Action::Stop)
        );
    }
}
