//! Forwarding: a request routed to a cluster, its endpoint picked, and its
//! attempts made until one answers or the retries are spent. The listeners
//! that hand requests to it are in `listener.rs`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Either, Full};
use hyper::body::Incoming;
use tracing::{debug, info};

use crate::balance::xxhash::xxh64;
use crate::endpoint::{ActiveGuard, EndpointState};
use crate::h1::{encode, Outgoing};
use crate::routing::{ClusterHandle, HashPolicy, Routing};
use minimesh_proto::headers;

mod admission;
mod attempt;
mod request;
mod respond;

use admission::*;
use attempt::*;
use request::*;
use respond::*;
pub use respond::{local, Tracked};

use crate::outlier::{self, Outcome};
use crate::retry::{self, Attempted, GRPC_STATUS};
pub use attempt::Upstream;

pub use crate::pool::MAX_BUFFERED_BODY;
/// Base of the backoff before a retry on the same endpoint (Istio's 25 ms).
const RETRY_BACKOFF: Duration = Duration::from_millis(25);

/// Picks are timed one in this many (per event loop) for the pick-duration
/// histogram.
pub const PICK_SAMPLE: u32 = 16;

thread_local! {
    static PICK_COUNT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

pub use headers::{
    ENDPOINT as ENDPOINT_HEADER, ERROR as ERROR_HEADER, OVERFLOW as OVERFLOW_HEADER,
    UNPROCESSED as UNPROCESSED_HEADER,
};

/// Body sent upstream.
pub use crate::pool::UpstreamBody;
/// Body sent back to the caller.
pub type ResponseBody = Either<Tracked, Full<Bytes>>;

/// One listener's proxy: where its routing comes from and how it forwards.
pub struct Proxy {
    /// Routing table, swapped on config changes.
    pub routing: Arc<ArcSwap<Routing>>,
    /// False until the first complete config arrived.
    pub ready: Arc<AtomicBool>,
    /// Take the caller's address for source-IP hashing from the first
    /// `X-Forwarded-For` hop (a gateway behind a trusted load balancer).
    pub trust_forwarded_for: bool,
    /// Closes a client connection that sends no complete request head for
    /// this long (`--client-idle-timeout`); None: never.
    pub client_idle_timeout: Option<Duration>,
}

impl Proxy {
    /// Handles one request from `peer`.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let start = tokio::time::Instant::now();
        crate::clock::advance(start);
        if req.method() == Method::CONNECT {
            return Ok(local(
                StatusCode::METHOD_NOT_ALLOWED,
                "CONNECT is not supported",
            ));
        }
        // A guard, not a clone of the table's Arc: no shared counter to bump
        // per request; dropped once the cluster is cloned out.
        let routing = self.routing.load();
        let authority = request_authority(&req);
        let Some(cluster) = authority
            .as_ref()
            .and_then(|a| routing.lookup(a.as_str()))
            .or(routing.fallback.as_ref())
        else {
            if !self.ready.load(Ordering::Relaxed) {
                return Ok(unprocessed(local(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no config from the control plane yet",
                )));
            }
            let reason = match authority {
                Some(a) => format!("no route for host {}", a.as_str()),
                None => "request names no host".to_string(),
            };
            return Ok(local(StatusCode::NOT_FOUND, &reason));
        };
        let cluster = cluster.clone();
        drop(routing);
        let (hash, set_cookie) = match &cluster.hash {
            Some(policy) => hash_key(policy, &req, peer, self.trust_forwarded_for),
            None => (None, None),
        };
        // Built where it is awaited: a future of some kilobytes held in a
        // local first would be copied once more per request.
        let mut forwarded = match cluster.timeout {
            None => forward(&cluster, req, authority, hash, start).await,
            Some(t) => {
                match tokio::time::timeout(t, forward(&cluster, req, authority, hash, start)).await
                {
                    Ok(r) => r,
                    Err(_) => local(StatusCode::GATEWAY_TIMEOUT, "request timeout"),
                }
            }
        };
        if let Some(cookie) = set_cookie {
            forwarded.headers_mut().append(header::SET_COOKIE, cookie);
        }
        Ok(forwarded)
    }
}

async fn forward(
    cluster: &ClusterHandle,
    req: Request<Incoming>,
    authority: Option<Authority>,
    hash: Option<u64>,
    start: tokio::time::Instant,
) -> Response<ResponseBody> {
    let (mut parts, body) = req.into_parts();
    let h2 = cluster.upstream_h2(parts.version);
    // HTTP/2 carries `te: trailers` on (gRPC servers look for it); every
    // other TE is hop-by-hop and dropped.
    let te_trailers = h2
        && parts.headers.get_all(header::TE).iter().any(|v| {
            v.as_bytes()
                .split(|b| *b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
        });
    strip_hop_by_hop(&mut parts.headers);
    if !parts.headers.contains_key(header::HOST) {
        if let Some(v) = authority.and_then(|a| match a {
            Authority::Host(h) => Some(h),
            Authority::Uri(a) => HeaderValue::from_str(a.as_str()).ok(),
        }) {
            parts.headers.insert(header::HOST, v);
        }
    }
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());

    // Buffer small bodies so that a retry can resend them.
    let hint = body.size_hint();
    // The first attempt of a request with no body starts when the request
    // did: no second clock read. Later ones (or after reading a body) read it.
    let mut at_start = body.is_end_stream().then_some(start);
    let (buffered, streaming) = if body.is_end_stream() {
        (Some(Bytes::new()), None)
    } else if hint.upper().is_some_and(|u| u <= MAX_BUFFERED_BODY) {
        match Box::pin(body.collect()).await {
            Ok(c) => (Some(c.to_bytes()), None),
            Err(e) => {
                return local(
                    StatusCode::BAD_REQUEST,
                    &format!("reading request body: {e}"),
                )
            }
        }
    } else {
        (None, Some(body))
    };
    // A streamed body is recorded over HTTP/2 while it is short, so those
    // requests may be retried too (see `crate::h2::Recording`).
    let attempts = if buffered.is_some() || h2 {
        1 + cluster.retry_attempts
    } else {
        1
    };
    let mut body = RequestBody {
        buffered,
        streaming,
        tape: None,
    };
    let idempotent = crate::h1::idempotent(&parts.method);
    // Whether an attempt may have reached an app. Until one has, a failure
    // is answered with UNPROCESSED_HEADER.
    let mut delivered = false;
    let fail = |status, reason: &str, delivered: bool| {
        let r = local(status, reason);
        if delivered {
            r
        } else {
            unprocessed(r)
        }
    };
    let mut last: Option<Arc<EndpointState>> = None;
    let mut last_error = String::new();
    let mut inflight = match admit(cluster) {
        Ok(g) => g,
        Err(max) => {
            let reason = format!(
                "cluster {} has {max} requests in flight (connectionPool limit)",
                cluster.name
            );
            let mut r = unprocessed(local(StatusCode::SERVICE_UNAVAILABLE, &reason));
            if let Ok(v) = HeaderValue::from_str(&format!("max requests {max}")) {
                r.headers_mut()
                    .insert(HeaderName::from_static(OVERFLOW_HEADER), v);
            }
            return r;
        }
    };
    cluster.budget.on_request();
    let mut retry_slot: Option<InflightGuard> = None;
    let mut out: Option<Outgoing> = None;
    for attempt in 0..attempts {
        if attempt > 0 && retry_slot.is_none() {
            match admit_retry(cluster) {
                Ok(g) => retry_slot = g,
                Err(max) => {
                    let mut r = fail(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &format!(
                            "cluster {} has {max} retries in flight (connectionPool.http.maxRetries); last: {last_error}",
                            cluster.name
                        ),
                        delivered,
                    );
                    if let Ok(v) = HeaderValue::from_str(&format!("max retries {max}")) {
                        r.headers_mut()
                            .insert(HeaderName::from_static(OVERFLOW_HEADER), v);
                    }
                    return r;
                }
            }
        }
        if attempt > 0 && !cluster.budget.try_retry() {
            return fail(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("retry budget exhausted; last: {last_error}"),
                delivered,
            );
        }
        // One pick in PICK_SAMPLE is timed: two clock reads cost more than
        // most picks, and the histogram's shape needs no more.
        let timed = PICK_COUNT.with(|c| {
            let n = c.get().wrapping_add(1);
            c.set(n);
            n % PICK_SAMPLE == 1 // the first pick of a loop, then every 16th
        });
        let t_pick = timed.then(std::time::Instant::now);
        let picked = cluster.balancer.pick(hash, last.as_ref()).cloned();
        if let Some(t) = t_pick {
            cluster.pick_ns.0.observe(t.elapsed().as_nanos() as u64);
        }
        let Some(ep) = picked else {
            return fail(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("no healthy endpoints in cluster {}", cluster.name),
                delivered,
            );
        };
        if attempt > 0 && last.as_ref().is_some_and(|l| Arc::ptr_eq(l, &ep)) {
            Box::pin(tokio::time::sleep(
                RETRY_BACKOFF * (1 << (attempt - 1).min(4)),
            ))
            .await;
        }
        let more = attempt + 1 < attempts;
        let up = if h2 {
            Attempt::H2(H2Attempt {
                parts: &parts,
                te_trailers,
                body: &mut body,
            })
        } else {
            // Encoded once, at the first attempt, and sent as is by the others.
            let up = out.get_or_insert_with(|| {
                encode(
                    &parts.method,
                    path,
                    &parts.headers,
                    ep.authority.as_str(),
                    body.h1(),
                )
            });
            if !up.resendable() {
                return fail(
                    StatusCode::BAD_GATEWAY,
                    "request body already sent",
                    delivered,
                );
            }
            Attempt::H1(up)
        };
        let guard = ep.start();
        let started = at_start.take().unwrap_or_else(tokio::time::Instant::now);
        // The send future is built where it is awaited (see `handle`).
        let sent = match cluster.per_try_timeout {
            None => Ok(send(&ep, &cluster.pool, up).await),
            Some(t) => tokio::time::timeout(t, send(&ep, &cluster.pool, up)).await,
        };
        // A streamed body can go again only if an HTTP/2 attempt recorded it whole.
        let more = more && body.resendable();
        let sent = match sent {
            // The app behind the inbound listener speaks for itself only:
            // a mesh header it sets could make callers back off its
            // endpoint or retry a request it processed.
            Ok(Ok(mut resp)) if cluster.local_app => {
                strip_mesh_headers(resp.headers_mut());
                Ok(resp)
            }
            Ok(result) => result,
            Err(_) => {
                // A replica that hangs is skipped like one that refuses
                // connections, with the same backoff, so that first attempts
                // stop going to it until it answers again.
                delivered = true;
                ep.mark_connect_failure();
                outlier_outcome(cluster, &ep, Outcome::TimedOut);
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!("{} did not answer within the per-try timeout", ep.addr);
                if more && retry::decide(Attempted::TimedOut, idempotent, cluster.retry_on) {
                    last = Some(ep);
                    drop(guard);
                    continue;
                }
                return local(StatusCode::GATEWAY_TIMEOUT, &last_error);
            }
        };
        match sent {
            Ok(resp)
                if more
                    && matches!(resp.status().as_u16(), 502 | 503)
                    && resp.headers().contains_key(ERROR_HEADER)
                    && retry::decide(
                        Attempted::AppGone {
                            status: resp.status().as_u16(),
                            unprocessed: resp.headers().contains_key(UNPROCESSED_HEADER),
                        },
                        idempotent,
                        cluster.retry_on,
                    ) =>
            {
                // The endpoint's own sidecar could not reach its app (503: a
                // dead or restarting replica; with UNPROCESSED_HEADER the app
                // never saw the request, so any method may go elsewhere), or
                // lost it with the request in flight (502: the app died
                // mid-request): try another endpoint, and skip this one for a
                // while as if it had refused the connection, or every request
                // would pay a retry.
                if !resp.headers().contains_key(UNPROCESSED_HEADER) {
                    delivered = true;
                }
                ep.back_off();
                outlier_outcome(cluster, &ep, Outcome::Status(resp.status()));
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!(
                    "{} answered {}: {}",
                    ep.addr,
                    resp.status().as_u16(),
                    resp.headers()
                        .get(ERROR_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                );
                last = Some(ep);
                drop(guard);
            }
            Ok(resp)
                if more
                    && h2
                    && retry::grpc_status(resp.headers()).is_some_and(|g| {
                        retry::decide(Attempted::GrpcStatus(g), idempotent, cluster.retry_on)
                    }) =>
            {
                // A gRPC call answered UNAVAILABLE or CANCELLED at once (no
                // message went back): Istio's `unavailable` and `cancelled`.
                delivered = true;
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!(
                    "{} answered grpc-status {}",
                    ep.addr,
                    resp.headers()
                        .get(GRPC_STATUS)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                );
                last = Some(ep);
                drop(guard);
            }
            Ok(resp)
                if more
                    && retry::decide(
                        Attempted::Status(resp.status().as_u16()),
                        idempotent,
                        cluster.retry_on,
                    ) =>
            {
                delivered = true;
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                outlier_outcome(cluster, &ep, Outcome::Status(resp.status()));
                last_error = format!("{} answered {}", ep.addr, resp.status());
                last = Some(ep);
                drop(guard);
            }
            Ok(mut resp) => {
                if matches!(resp.status().as_u16(), 502 | 503)
                    && resp.headers().contains_key(ERROR_HEADER)
                {
                    // The endpoint's own sidecar answered that its app is
                    // gone, on the last attempt: skip it as a retry would
                    // have, rather than mark it reachable for every request.
                    ep.back_off();
                } else {
                    ep.mark_reachable();
                }
                // Passed on only from the endpoint's own sidecar (never from
                // an app) and only when no earlier attempt may have been
                // processed.
                if resp.status() == StatusCode::SERVICE_UNAVAILABLE
                    && (delivered || cluster.local_app)
                {
                    resp.headers_mut().remove(UNPROCESSED_HEADER);
                }
                let now = tokio::time::Instant::now();
                let now_ms = crate::clock::advance(now);
                let elapsed = now.saturating_duration_since(started).as_micros() as u64;
                if cluster.balancer.policy() == crate::balance::Policy::PeakEwma {
                    crate::balance::peak_ewma::observe(&ep, elapsed as f64, now_ms * 1000);
                }
                let c = &ep.counters;
                c.observe_latency(elapsed);
                if resp.status().is_server_error() {
                    c.failed.fetch_add(1, Ordering::Relaxed);
                } else {
                    c.succeeded.fetch_add(1, Ordering::Relaxed);
                }
                outlier_outcome(cluster, &ep, Outcome::Status(resp.status()));
                let (mut rp, rb) = resp.into_parts();
                strip_hop_by_hop(&mut rp.headers);
                rp.headers
                    .insert(HeaderName::from_static(ENDPOINT_HEADER), ep.header.clone());
                return Response::from_parts(
                    rp,
                    Either::Left(Tracked {
                        inner: rb,
                        guard,
                        _inflight: inflight.take(),
                    }),
                );
            }
            Err(e) if e.is_connect() => {
                debug!(endpoint = %ep.addr, cluster = %cluster.name, error = %e, "connect failed; retrying elsewhere");
                ep.mark_connect_failure();
                outlier_outcome(cluster, &ep, Outcome::Failed);
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!("connect to {} failed: {}", ep.addr, source_chain(&e));
                last = Some(ep);
                drop(guard);
                // Over HTTP/2 the body is taken only once a connection is
                // made: a refused one leaves a streamed body to send elsewhere.
                if !body.resendable()
                    || !retry::decide(Attempted::ConnectFailed, idempotent, cluster.retry_on)
                {
                    break;
                }
            }
            Err(e)
                if more
                    && e.is_refused_stream()
                    && retry::decide(Attempted::RefusedStream, idempotent, cluster.retry_on) =>
            {
                // The endpoint refused the HTTP/2 stream: it processed
                // nothing, so any request may go elsewhere.
                outlier_outcome(cluster, &ep, Outcome::Failed);
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!("{} refused the stream: {}", ep.addr, source_chain(&e));
                last = Some(ep);
                drop(guard);
            }
            Err(e) if more && retry::decide(Attempted::Reset, idempotent, cluster.retry_on) => {
                // Reset or closed before a response (a replica killed with
                // the request in flight): safe to resend an idempotent request.
                delivered = true;
                outlier_outcome(cluster, &ep, Outcome::Failed);
                debug!(endpoint = %ep.addr, cluster = %cluster.name, error = %e, "request failed in flight; retrying elsewhere");
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!("{} failed: {}", ep.addr, source_chain(&e));
                last = Some(ep);
                drop(guard);
            }
            Err(e) => {
                outlier_outcome(cluster, &ep, Outcome::Failed);
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                return fail(
                    StatusCode::BAD_GATEWAY,
                    &format!("upstream {} failed: {}", ep.addr, source_chain(&e)),
                    delivered || !e.is_refused_stream(),
                );
            }
        }
    }
    let reason = match attempts {
        1 => last_error,
        n => format!("all {n} attempts failed; last: {last_error}"),
    };
    fail(StatusCode::SERVICE_UNAVAILABLE, &reason, delivered)
}

/// Counts an attempt's outcome towards its endpoint's outlier detection
/// (the cluster's, when it has one) and logs an ejection.
fn outlier_outcome(cluster: &ClusterHandle, ep: &EndpointState, outcome: Outcome) {
    let Some(od) = &cluster.outlier else {
        ep.outlier.reset_on_success(outcome);
        return;
    };
    let all = cluster.balancer.endpoints().iter().map(|e| &e.outlier);
    // The coarse clock, which every request advances: no clock call per
    // attempt (ejections are seconds long).
    let now = crate::clock::now_ms();
    if let Some(e) = outlier::count(od, all, &ep.outlier, outcome, now) {
        info!(endpoint = %ep.addr, cluster = %cluster.name, ejection_ms = e.ms, times = e.times, ?outcome, "endpoint ejected by outlier detection");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        h
    }

    fn names(h: &HeaderMap) -> Vec<&str> {
        h.keys().map(HeaderName::as_str).collect()
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_stripped() {
        let mut h = headers(&[
            ("host", "backend"),
            ("connection", "close, x-private"),
            ("x-private", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("x-keep", "1"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["host", "x-keep"]);
    }

    #[test]
    fn end_to_end_headers_pass_untouched() {
        let mut h = headers(&[("host", "backend"), ("x-user", "7"), ("accept", "*/*")]);
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
