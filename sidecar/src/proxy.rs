//! HTTP proxying: the listeners (outbound, inbound, gateway all share this
//! code) and the forwarding path with retries.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::balance::xxhash::xxh64;
use crate::endpoint::{ActiveGuard, EndpointState};
use crate::h1::{encode, Outgoing};
use crate::routing::{ClusterHandle, HashPolicy, Routing};
use minimesh_proto::headers;
use minimesh_proto::v1::RetryOn;

/// Request bodies up to this size are buffered so that a retry can resend
/// them; larger or unknown-length bodies stream through without retries.
pub const MAX_BUFFERED_BODY: u64 = 64 * 1024;
/// Base of the backoff before a retry on the same endpoint (Istio's 25 ms).
const RETRY_BACKOFF: Duration = Duration::from_millis(25);

/// Picks are timed one in this many (per event loop) for the pick-duration
/// histogram.
pub const PICK_SAMPLE: u32 = 16;

thread_local! {
    static PICK_COUNT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Removes every mesh header (`x-minimesh-*`) from `headers`, allocating
/// only when there is one.
fn strip_mesh_headers(headers: &mut HeaderMap) {
    let is_mesh = |name: &HeaderName| name.as_str().starts_with(headers::PREFIX);
    if !headers.keys().any(is_mesh) {
        return;
    }
    let names: Vec<HeaderName> = headers.keys().filter(|n| is_mesh(n)).cloned().collect();
    for name in names {
        headers.remove(name);
    }
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

/// The request's hash for a consistent-hash cluster, and the cookie to set
/// when the policy hashes on a cookie the request does not carry. A request
/// without the key gets no hash: it is balanced at random, never refused.
fn hash_key(
    policy: &HashPolicy,
    req: &Request<Incoming>,
    peer: SocketAddr,
    trust_forwarded_for: bool,
) -> (Option<u64>, Option<HeaderValue>) {
    match policy {
        HashPolicy::SourceIp if trust_forwarded_for => {
            let hop = req
                .headers()
                .get("x-forwarded-for")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(',').next())
                .map(str::trim)
                .filter(|h| !h.is_empty());
            match hop {
                Some(h) => (Some(xxh64(h.as_bytes(), 0)), None),
                None => (Some(xxh64(peer.ip().to_string().as_bytes(), 0)), None),
            }
        }
        HashPolicy::Header(name) => (
            req.headers().get(name).map(|v| xxh64(v.as_bytes(), 0)),
            None,
        ),
        HashPolicy::SourceIp => (Some(xxh64(peer.ip().to_string().as_bytes(), 0)), None),
        HashPolicy::Query(param) => {
            let value = req.uri().query().and_then(|q| {
                q.split('&').find_map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    (k == param).then_some(v)
                })
            });
            (value.map(|v| xxh64(v.as_bytes(), 0)), None)
        }
        HashPolicy::Cookie { name, path, ttl } => {
            let found = req
                .headers()
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .find_map(|c| {
                    let (k, v) = c.trim().split_once('=')?;
                    (k == name).then_some(v)
                });
            if let Some(v) = found {
                return (Some(xxh64(v.as_bytes(), 0)), None);
            }
            let value = format!("{:016x}", crate::balance::rng::next());
            let mut cookie = format!("{name}={value}");
            if !path.is_empty() {
                cookie.push_str(&format!("; Path={path}"));
            }
            if let Some(t) = ttl {
                cookie.push_str(&format!("; Max-Age={}", t.as_secs().max(1)));
            }
            cookie.push_str("; HttpOnly");
            (
                Some(xxh64(value.as_bytes(), 0)),
                HeaderValue::from_str(&cookie).ok(),
            )
        }
    }
}

/// Where a request is going: the URI's authority (absolute form, HTTP/2),
/// else the Host header. Either is a reference-counted clone, not a copy.
enum Authority {
    Uri(http::uri::Authority),
    Host(HeaderValue),
}

impl Authority {
    fn as_str(&self) -> &str {
        match self {
            Authority::Uri(a) => a.as_str(),
            // Only visible ASCII is kept (see request_authority).
            Authority::Host(h) => h.to_str().unwrap_or_default(),
        }
    }
}

fn request_authority(req: &Request<Incoming>) -> Option<Authority> {
    if let Some(a) = req.uri().authority() {
        return Some(Authority::Uri(a.clone()));
    }
    req.headers()
        .get(header::HOST)
        .filter(|h| h.to_str().is_ok())
        .map(|h| Authority::Host(h.clone()))
}

static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names, compared as
    // strings (a length test, then at most one memcmp), instead of a hash
    // lookup per hop-by-hop name. (Comparing with HOP_BY_HOP's HeaderNames
    // cost twice the instructions.)
    let hop = |k: &HeaderName| {
        matches!(
            k.as_str(),
            "connection"
                | "keep-alive"
                | "proxy-connection"
                | "proxy-authorization"
                | "te"
                | "trailer"
                | "upgrade"
                | "transfer-encoding"
        )
    };
    if !headers.keys().any(hop) {
        return;
    }
    if let Some(conn) = headers.get(header::CONNECTION).cloned() {
        if let Ok(list) = conn.to_str() {
            for name in list.split(',') {
                if let Ok(n) = HeaderName::from_bytes(name.trim().as_bytes()) {
                    headers.remove(n);
                }
            }
        }
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
    headers.remove(header::TRANSFER_ENCODING);
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
                if more
                    && idempotent
                    && (on(cluster, RetryOn::Reset)
                        || on(cluster, RetryOn::GatewayError)
                        || on(cluster, RetryOn::ServerError))
                {
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
                    && ((on(cluster, RetryOn::ConnectFailure)
                        && resp.status() == StatusCode::SERVICE_UNAVAILABLE
                        && (idempotent || resp.headers().contains_key(UNPROCESSED_HEADER)))
                        || (on(cluster, RetryOn::Reset)
                            && idempotent
                            && resp.status() == StatusCode::BAD_GATEWAY)) =>
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
            Ok(resp) if more && h2 && grpc_retriable(cluster, resp.headers()) => {
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
                    && ((on(cluster, RetryOn::ServerError) && resp.status().is_server_error())
                        || (on(cluster, RetryOn::GatewayError)
                            && matches!(resp.status().as_u16(), 502..=504))) =>
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
                if !body.resendable() || !on(cluster, RetryOn::ConnectFailure) {
                    break;
                }
            }
            Err(e) if more && e.is_refused_stream() && on(cluster, RetryOn::RefusedStream) => {
                // The endpoint refused the HTTP/2 stream: it processed
                // nothing, so any request may go elsewhere.
                outlier_outcome(cluster, &ep, Outcome::Failed);
                ep.counters.failed.fetch_add(1, Ordering::Relaxed);
                last_error = format!("{} refused the stream: {}", ep.addr, source_chain(&e));
                last = Some(ep);
                drop(guard);
            }
            Err(e) if more && idempotent && on(cluster, RetryOn::Reset) => {
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

/// Marks a response minimesh generates as one no endpoint has seen.
fn unprocessed(mut r: Response<ResponseBody>) -> Response<ResponseBody> {
    r.headers_mut().insert(
        HeaderName::from_static(UNPROCESSED_HEADER),
        HeaderValue::from_static("true"),
    );
    r
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A response minimesh answers itself, with the reason in a header and the body.
pub fn local(status: StatusCode, reason: &str) -> Response<ResponseBody> {
    let mut r = Response::new(Either::Right(Full::new(Bytes::from(format!(
        "minimesh: {reason}\n"
    )))));
    *r.status_mut() = status;
    let v = HeaderValue::from_str(reason).unwrap_or(HeaderValue::from_static("see body"));
    r.headers_mut()
        .insert(HeaderName::from_static(ERROR_HEADER), v);
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// An upstream response body that keeps its endpoint's active count (and
/// the cluster's in-flight count) until the body is done, then gives the
/// connection back to the endpoint's pool if the body was read to the end.
pub struct Tracked {
    inner: Upstream,
    guard: ActiveGuard,
    _inflight: Option<InflightGuard>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Upstream::H1(body) = &mut self.inner {
            if let Some(lease) = body.take_reusable() {
                self.guard.endpoint().pool.put(lease);
            }
        }
    }
}

/// A response body from the endpoint, by the HTTP version it came in.
pub enum Upstream {
    /// Read from a pooled HTTP/1.1 connection.
    H1(crate::h1::ResponseBody),
    /// A stream of a shared HTTP/2 connection.
    H2(crate::h2::ResponseBody),
}

/// One attempt's request.
enum Attempt<'a> {
    H1(&'a mut Outgoing),
    H2(H2Attempt<'a>),
}

/// What an HTTP/2 attempt builds its request from, once it has a stream:
/// a refused connection leaves a streamed body for the next attempt.
struct H2Attempt<'a> {
    parts: &'a http::request::Parts,
    te_trailers: bool,
    body: &'a mut RequestBody,
}

/// A request's body over its attempts.
struct RequestBody {
    /// The whole body, read before the first attempt (known to be small).
    buffered: Option<Bytes>,
    /// The caller's body, until an attempt takes it.
    streaming: Option<Incoming>,
    /// What an HTTP/2 attempt recorded of the streamed body.
    tape: Option<Arc<std::sync::Mutex<crate::h2::Tape>>>,
}

impl RequestBody {
    /// True when another attempt has a body to send.
    fn resendable(&self) -> bool {
        self.buffered.is_some()
            || self.streaming.is_some()
            || self.tape.as_ref().is_some_and(|t| {
                t.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .replay()
                    .is_some()
            })
    }

    /// The body of an HTTP/1.1 request (encoded once for all its attempts).
    fn h1(&mut self) -> UpstreamBody {
        match (&self.buffered, self.streaming.take()) {
            (Some(b), _) => UpstreamBody::Buffered(b.clone()),
            (None, Some(s)) => UpstreamBody::Streaming(s),
            (None, None) => UpstreamBody::Buffered(Bytes::new()),
        }
    }

    /// The body of an HTTP/2 attempt: the buffered one, the caller's
    /// (recorded), or a replay of what an earlier attempt recorded.
    fn h2(&mut self) -> Option<crate::h2::RequestBody> {
        if let Some(b) = &self.buffered {
            return Some(Either::Left(Full::new(b.clone())));
        }
        if let Some(s) = self.streaming.take() {
            let tape = self.tape.insert(Default::default()).clone();
            return Some(Either::Right(crate::h2::Recording::new(s, tape)));
        }
        let tape = self.tape.as_ref()?;
        let replay = tape.lock().unwrap_or_else(|p| p.into_inner()).replay()?;
        Some(Either::Left(Full::new(replay)))
    }
}

async fn send(
    ep: &EndpointState,
    settings: &crate::pool::PoolSettings,
    up: Attempt<'_>,
) -> Result<Response<Upstream>, crate::pool::UpstreamError> {
    match up {
        Attempt::H1(out) => ep
            .pool
            .send(ep.addr, settings, out)
            .await
            .map(|r| r.map(Upstream::H1)),
        // Boxed: it would otherwise widen every request's future.
        Attempt::H2(a) => Box::pin(send_h2(ep, settings, a))
            .await
            .map(|r| r.map(Upstream::H2)),
    }
}

async fn send_h2(
    ep: &EndpointState,
    settings: &crate::pool::PoolSettings,
    a: H2Attempt<'_>,
) -> Result<Response<crate::h2::ResponseBody>, crate::pool::UpstreamError> {
    let pool = ep.pool.h2();
    let stream = pool.stream(ep.addr, settings, &ep.pool.open).await?;
    let body = a.body.h2().ok_or(crate::pool::UpstreamError::BodySent)?;
    let req = crate::h2::request(
        &a.parts.method,
        a.parts.uri.path_and_query(),
        &a.parts.headers,
        &ep.authority,
        a.te_trailers,
        body,
    );
    pool.send(ep.addr, settings, &ep.pool.open, stream, req)
        .await
}

/// The gRPC status header (or trailer).
const GRPC_STATUS: &str = "grpc-status";

/// True when a gRPC response's headers end the call with a status the
/// cluster retries: 14 UNAVAILABLE (`unavailable`), 1 CANCELLED (`cancelled`).
fn grpc_retriable(cluster: &ClusterHandle, headers: &HeaderMap) -> bool {
    match headers.get(GRPC_STATUS).map(HeaderValue::as_bytes) {
        Some(b"14") => on(cluster, RetryOn::Unavailable),
        Some(b"1") => on(cluster, RetryOn::Cancelled),
        _ => false,
    }
}

/// One request counted against a cluster's `max_requests`.
pub struct InflightGuard(Arc<std::sync::atomic::AtomicU32>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a request against the cluster's limit; None when it is full.
fn admit(cluster: &ClusterHandle) -> Result<Option<InflightGuard>, u32> {
    if cluster.max_requests == 0 {
        return Ok(None);
    }
    if cluster.inflight.fetch_add(1, Ordering::Relaxed) >= cluster.max_requests {
        cluster.inflight.fetch_sub(1, Ordering::Relaxed);
        return Err(cluster.max_requests);
    }
    Ok(Some(InflightGuard(cluster.inflight.clone())))
}

/// Counts a retry against the cluster's `max_retries`; Err when it is full.
fn admit_retry(cluster: &ClusterHandle) -> Result<Option<InflightGuard>, u32> {
    if cluster.max_retries == 0 {
        return Ok(None);
    }
    let n = &cluster.retries_inflight;
    if n.fetch_add(1, Ordering::Relaxed) >= cluster.max_retries {
        n.fetch_sub(1, Ordering::Relaxed);
        return Err(cluster.max_retries);
    }
    Ok(Some(InflightGuard(n.clone())))
}

#[inline]
fn on(cluster: &ClusterHandle, cond: RetryOn) -> bool {
    cluster.retry_on & cond as u32 != 0
}

/// What an attempt came to, for outlier detection.
#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// The endpoint answered with this status.
    Status(StatusCode),
    /// A local-origin failure: no connection, or the connection or stream
    /// reset or closed before the response.
    Failed,
    /// A local-origin failure: no response within the per-try timeout.
    TimedOut,
}

/// Counts an attempt's outcome towards its endpoint's outlier detection and
/// ejects the endpoint when it crosses a consecutive-error threshold. As
/// Envoy does it: unless the rule splits them off, local-origin failures count
/// as the 503 (504 for a timeout) Envoy maps them to, towards both the 5xx
/// and the gateway-error thresholds; split, they count only towards
/// `consecutiveLocalOriginFailures`, which any response resets.
fn outlier_outcome(cluster: &ClusterHandle, ep: &EndpointState, outcome: Outcome) {
    let status = match outcome {
        Outcome::Status(s) => s,
        Outcome::Failed => StatusCode::SERVICE_UNAVAILABLE,
        Outcome::TimedOut => StatusCode::GATEWAY_TIMEOUT,
    };
    let local = !matches!(outcome, Outcome::Status(_));
    if !status.is_server_error() {
        for c in [
            &ep.consecutive_5xx,
            &ep.consecutive_gateway,
            &ep.consecutive_local,
        ] {
            if c.load(Ordering::Relaxed) != 0 {
                c.store(0, Ordering::Relaxed);
            }
        }
        return;
    }
    let Some(od) = &cluster.outlier else { return };
    if od.ignore_503 && !local && status == StatusCode::SERVICE_UNAVAILABLE {
        // The default detector leaves overload alone: a 503 neither counts
        // nor resets (see ignore_503).
        return;
    }
    let tripped = if local && od.split_local_origin {
        let cl = ep.consecutive_local.fetch_add(1, Ordering::Relaxed) + 1;
        od.consecutive_local_origin > 0 && cl >= od.consecutive_local_origin
    } else {
        if !local && od.split_local_origin {
            // The endpoint answered: its connection works.
            ep.consecutive_local.store(0, Ordering::Relaxed);
        }
        let c5 = ep.consecutive_5xx.fetch_add(1, Ordering::Relaxed) + 1;
        let cg = if matches!(status.as_u16(), 502..=504) {
            ep.consecutive_gateway.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            ep.consecutive_gateway.store(0, Ordering::Relaxed);
            0
        };
        (od.consecutive_5xx > 0 && c5 >= od.consecutive_5xx)
            || (od.consecutive_gateway_errors > 0 && cg >= od.consecutive_gateway_errors)
    };
    if !tripped || ep.is_ejected() {
        return;
    }
    let eps = cluster.balancer.endpoints();
    let n = eps.len();
    let ejected = eps.iter().filter(|e| e.is_ejected()).count();
    // As Envoy: at least one endpoint may always be ejected.
    let max = (n * od.max_ejection_percent as usize / 100).max(1);
    let available_after = (n - ejected - 1) * 100 / n.max(1);
    if ejected >= max || available_after < od.min_health_percent as usize {
        return;
    }
    let times = ep.ejections.fetch_add(1, Ordering::Relaxed) + 1;
    let ms = (od.base_ejection_ms * u64::from(times)).min(300_000);
    ep.ejected_until_ms
        .store(crate::clock::precise_ms() + ms, Ordering::Relaxed);
    ep.consecutive_5xx.store(0, Ordering::Relaxed);
    ep.consecutive_gateway.store(0, Ordering::Relaxed);
    ep.consecutive_local.store(0, Ordering::Relaxed);
    info!(endpoint = %ep.addr, cluster = %cluster.name, ejection_ms = ms, times, ?outcome, "endpoint ejected by outlier detection");
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match &mut self.inner {
            Upstream::H1(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Upstream::H2(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Upstream::H1(b) => b.is_end_stream(),
            Upstream::H2(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Upstream::H1(b) => b.size_hint(),
            Upstream::H2(b) => b.size_hint(),
        }
    }
}

/// The event loops that share a listener address, and how many connections
/// each serves. The kernel spreads new connections over their SO_REUSEPORT
/// sockets by a hash of the addresses, blind to load: 64 keep-alive
/// connections over two loops typically land 36 to 28, and the busier loop
/// caps the whole proxy. So a loop that accepts a connection while another
/// serves fewer hands it over (least connections), as nginx's workers even
/// out by accepting while idle.
pub struct Loops {
    open: Vec<AtomicUsize>,
    handoff: Vec<std::sync::Mutex<Option<mpsc::UnboundedSender<Handoff>>>>,
}

type Handoff = (std::net::TcpStream, SocketAddr);

impl Loops {
    /// `n` loops (at least one).
    pub fn new(n: usize) -> Arc<Loops> {
        Arc::new(Loops {
            open: (0..n.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            handoff: (0..n.max(1)).map(|_| std::sync::Mutex::new(None)).collect(),
        })
    }

    /// How many loops.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Never: there is at least one loop.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Connections loop `i` serves now.
    pub fn open(&self, i: usize) -> usize {
        self.open.get(i).map_or(0, |o| o.load(Ordering::Relaxed))
    }

    /// The loop with the fewest connections, `me` on a tie.
    fn least(&self, me: usize) -> usize {
        let mut best = me;
        for (i, o) in self.open.iter().enumerate() {
            if o.load(Ordering::Relaxed) < self.open[best].load(Ordering::Relaxed) {
                best = i;
            }
        }
        best
    }

    fn sender(&self, i: usize) -> Option<mpsc::UnboundedSender<Handoff>> {
        self.handoff[i]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Counts a connection against its loop until the connection ends.
struct Open(Arc<Loops>, usize);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open[self.1].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Serves one client connection on this loop, counted against it until it
/// ends, and drained with the others at shutdown.
fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    proxy: &Arc<Proxy>,
    graceful: &hyper_util::server::graceful::GracefulShutdown,
    loops: &Arc<Loops>,
    me: usize,
) {
    loops.open[me].fetch_add(1, Ordering::Relaxed);
    let open = Open(loops.clone(), me);
    let _ = stream.set_nodelay(true);
    let idle = proxy.client_idle_timeout;
    let proxy = proxy.clone();
    let svc = hyper::service::service_fn(move |req| proxy.clone().handle(req, peer));
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    // hyper's header read timeout runs from when a connection starts waiting
    // for a request head: it closes idle keep-alive connections and clients
    // that send headers too slowly alike.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(idle);
    let conn = builder
        .serve_connection(TokioIo::new(stream), svc)
        .into_owned();
    let conn = graceful.watch(conn);
    tokio::spawn(async move {
        let _open = open;
        if let Err(e) = conn.await {
            debug!(%peer, error = %e, "connection ended");
        }
    });
}

/// Hands a connection loop `me` accepted to the loop serving the fewest,
/// counted against that loop until it takes it; or gives it back to serve
/// here (this loop is the least loaded, or the other one has stopped). None
/// if the connection was handed over, or lost in the move.
fn hand_over(
    loops: &Loops,
    me: usize,
    stream: TcpStream,
    peer: SocketAddr,
) -> Option<(TcpStream, SocketAddr)> {
    let to = loops.least(me);
    let Some(tx) = (to != me).then(|| loops.sender(to)).flatten() else {
        return Some((stream, peer));
    };
    let std = stream.into_std().ok()?;
    loops.open[to].fetch_add(1, Ordering::Relaxed);
    match tx.send((std, peer)) {
        Ok(()) => None,
        Err(mpsc::error::SendError((std, _))) => {
            loops.open[to].fetch_sub(1, Ordering::Relaxed);
            TcpStream::from_std(std).ok().map(|s| (s, peer))
        }
    }
}

/// Accepts connections on `listener` (HTTP/1.1 and HTTP/2 cleartext), as
/// loop `me` of `loops`, until `shutdown` turns true, then lets requests in
/// flight finish (up to `drain`).
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    proxy: Arc<Proxy>,
    mut shutdown: watch::Receiver<bool>,
    drain: Duration,
    loops: Arc<Loops>,
    me: usize,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let local_addr: Option<SocketAddr> = listener.local_addr().ok();
    let (tx, mut handed) = mpsc::unbounded_channel::<Handoff>();
    *loops.handoff[me].lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    info!(listener = name, addr = ?local_addr, "listening");
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match hand_over(&loops, me, stream, peer) {
                    Some(mine) => mine,
                    None => continue,
                },
                Err(e) => {
                    warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            Some((std, peer)) = handed.recv() => {
                // Counted by the loop that handed it over until now.
                loops.open[me].fetch_sub(1, Ordering::Relaxed);
                match TcpStream::from_std(std) {
                    Ok(s) => (s, peer),
                    Err(e) => {
                        warn!(listener = name, error = %e, "cannot take a handed-over connection");
                        continue;
                    }
                }
            },
            _ = shutdown.changed() => break,
        };
        serve_connection(stream, peer, &proxy, &graceful, &loops, me);
    }
    loops.handoff[me]
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    drop(listener);
    // Connections handed over but not yet taken are served, and drained
    // with the rest.
    handed.close();
    while let Ok((std, peer)) = handed.try_recv() {
        loops.open[me].fetch_sub(1, Ordering::Relaxed);
        if let Ok(stream) = TcpStream::from_std(std) {
            serve_connection(stream, peer, &proxy, &graceful, &loops, me);
        }
    }
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(
            listener = name,
            "requests still in flight after the drain time; closing"
        );
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
