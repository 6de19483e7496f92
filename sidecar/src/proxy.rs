//! Forwarding: a request routed to a cluster, its endpoint picked, and its
//! attempts made until one answers or the retries are spent. The listeners
//! that hand requests to it are in `listener.rs`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use crate::endpoint::EndpointState;
use crate::routing::routes::{Action as RouteAction, Matched, RequestView, RouteEntry};
use crate::routing::{ClusterHandle, Routing, Target};
use minimesh_proto::headers;

mod admission;
mod attempt;
mod edge;
pub(crate) mod path;
mod request;
mod respond;
mod tries;

use admission::admit;
use attempt::send;
pub(crate) use request::HOP_BY_HOP;
use request::{hash_key, request_authority, strip_mesh_headers, Authority, Prepared};
pub use respond::{local, Tracked};
use respond::{pass_on, rbac_denied, source_chain, unprocessed, Delivery};
use tries::{overflow, Sent, Tries};

use crate::retry::{Action, Standing};
pub use attempt::Upstream;
pub use edge::Edge;

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

/// Bounds on a client's request head, as Envoy's defaults
/// (`max_request_headers_kb`, `max_headers_count`): a larger head is
/// answered 431 and the connection closed.
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    /// Bytes of the request line and headers together (HTTP/1.1), or of the
    /// header list (HTTP/2).
    pub bytes: usize,
    /// Header fields (HTTP/1.1).
    pub count: usize,
}

impl Default for HeadLimits {
    fn default() -> HeadLimits {
        HeadLimits {
            bytes: 60 * 1024,
            count: 100,
        }
    }
}

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
    /// Fails a request whose body stops arriving for this long
    /// (`--client-body-timeout`); None: never.
    pub client_body_timeout: Option<Duration>,
    /// Bounds on a client's request head.
    pub head_limits: HeadLimits,
    /// The inbound listener: other sidecars call it, over mutual TLS when
    /// they can, and plaintext only while the mode is PERMISSIVE.
    pub inbound: bool,
    /// Outside clients call this listener (gateway mode): what they may
    /// send in and see come back. None for a sidecar's listeners.
    pub edge: Option<Edge>,
    /// An inbound listener's authorization policies, and the app's port
    /// they see requests on. None for the outbound listener.
    pub authz: Option<(Arc<crate::authz::Shared>, u16)>,
    /// The sidecar's mutual TLS (an inbound listener's mode and identity).
    pub tls: Arc<crate::tls::Tls>,
}

impl Proxy {
    /// Handles one request from `peer`: routed here, forwarded by the
    /// future returned, which holds no reference to the proxy.
    //
    // Routing is a plain function, and the future hyper keeps for the
    // request is `forward`'s alone: a future awaited inside another is
    // copied into it, and each level of a few KiB cost a request hundreds
    // of instructions (BENCHMARKS.md, "The gateway's request path").
    pub fn handle(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl std::future::Future<Output = Result<Response<ResponseBody>, Infallible>> {
        self.handle_to(req, peer, None, None)
    }

    /// Handles one request from `peer` as [`Proxy::handle`] does; on a
    /// captured connection, `dst` is where the app sent it: a Service
    /// address routes the request to that Service port's cluster, whatever
    /// its Host says (which goes to the endpoint unchanged). `caller` is
    /// the SPIFFE ID of the connection's mutual TLS peer (None: plaintext),
    /// what an inbound listener's authorization policies see.
    pub fn handle_to(
        &self,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        dst: Option<SocketAddr>,
        caller: Option<&str>,
    ) -> impl std::future::Future<Output = Result<Response<ResponseBody>, Infallible>> {
        if let Some(edge) = &self.edge {
            edge.inward(&mut req);
        }
        if let Err(reason) = path::normalize_request(&mut req) {
            let answer = answer_to(self.edge, local(StatusCode::BAD_REQUEST, reason));
            return futures_util::future::Either::Right(std::future::ready(Ok(answer)));
        }
        if let Some(denied) = self.authorize(&req, caller) {
            return futures_util::future::Either::Right(std::future::ready(Ok(denied)));
        }
        match self.route(req, peer, dst) {
            Ok(routed) => futures_util::future::Either::Left(forward(self.edge, routed)),
            Err(answer) => {
                let answer = answer_to(self.edge, answer);
                futures_util::future::Either::Right(std::future::ready(Ok(answer)))
            }
        }
    }

    /// An inbound listener's authorization: None when the request may go
    /// on, else the answer (403 `RBAC: access denied`, as Istio's).
    #[inline]
    fn authorize(
        &self,
        req: &Request<Incoming>,
        caller: Option<&str>,
    ) -> Option<Response<ResponseBody>> {
        let (authz, port) = self.authz.as_ref()?;
        let r = crate::authz::Request {
            peer: caller,
            method: req.method().as_str(),
            path: req.uri().path(),
            port: *port,
        };
        match authz.check(&r) {
            crate::authz::Verdict::Allow => None,
            crate::authz::Verdict::Unknown => Some(local(
                StatusCode::SERVICE_UNAVAILABLE,
                "authorization policies not received yet",
            )),
            _ => Some(rbac_denied()),
        }
    }

    /// Routes a request from `peer` to its cluster; Err is the answer
    /// when it goes nowhere.
    // Err is no larger than Ok (a request), and boxing it would allocate
    // for every request answered here.
    #[allow(clippy::result_large_err)]
    fn route(
        &self,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        dst: Option<SocketAddr>,
    ) -> Result<Routed, Response<ResponseBody>> {
        let start = tokio::time::Instant::now();
        crate::clock::advance(start);
        if req.method() == Method::CONNECT {
            return Err(local(
                StatusCode::METHOD_NOT_ALLOWED,
                "CONNECT is not supported",
            ));
        }
        // A guard, not a clone of the table's Arc: no shared counter to bump
        // per request; dropped once the cluster is cloned out.
        let routing = self.routing.load();
        let mut authority = request_authority(&req);
        let target = routing.target(dst.as_ref(), authority.as_ref().map(Authority::as_str));
        let (cluster, route) = match target {
            Some(Target::Cluster(c)) => (c.clone(), None),
            Some(Target::Routes(table)) => {
                let found = {
                    let view = RequestView {
                        method: req.method(),
                        path: req.uri().path(),
                        query: req.uri().query(),
                        headers: req.headers(),
                    };
                    table.find(&view).map(|(r, m)| (r.clone(), m))
                };
                let Some((entry, matched)) = found else {
                    let host = authority.as_ref().map_or("", Authority::as_str);
                    let reason = format!("no route of host {host} matches the request");
                    return Err(local(StatusCode::NOT_FOUND, &reason));
                };
                let (c, d) = routed_to(&routing, &entry, matched, &mut req, &mut authority)?;
                (c, Some((entry, d)))
            }
            None => {
                if !self.ready.load(Ordering::Relaxed) {
                    return Err(unprocessed(local(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no config from the control plane yet",
                    )));
                }
                let reason = match authority {
                    Some(a) => format!("no route for host {}", a.as_str()),
                    None => "request names no host".to_string(),
                };
                return Err(local(StatusCode::NOT_FOUND, &reason));
            }
        };
        drop(routing);
        let (hash, set_cookie) = match &cluster.hash {
            Some(policy) => hash_key(policy, &req, peer, self.trust_forwarded_for),
            None => (None, None),
        };
        let retries = match route.as_ref().and_then(|(r, _)| r.retry.as_ref()) {
            Some(r) => r.attempts,
            None => cluster.retry_attempts,
        };
        // Prepared here, while hyper waits: see `Prepared::encode_h1`.
        let req = Prepared::new(
            &cluster,
            retries,
            req,
            authority,
            (start, self.client_body_timeout),
        );
        Ok(Routed {
            cluster,
            req,
            hash,
            set_cookie,
            start,
            route,
            // An edge without debug headers would strip the endpoint's
            // name again: it is not added.
            named: self.edge.is_none_or(|e| e.debug_headers),
        })
    }
}

/// The cluster a request that met `entry` goes to, with the route's
/// changes made to it (headers, path, authority); Err is the answer when
/// the route answers it itself (a redirect, a fixed status, an injected
/// abort) or its destination is not in the config.
#[allow(clippy::result_large_err)]
fn routed_to(
    routing: &Routing,
    entry: &Arc<RouteEntry>,
    matched: Matched,
    req: &mut Request<Incoming>,
    authority: &mut Option<Authority>,
) -> Result<(Arc<ClusterHandle>, usize), Response<ResponseBody>> {
    match &entry.action {
        RouteAction::Forward(_) => {}
        RouteAction::Redirect(r) => {
            let scheme = req.uri().scheme_str().unwrap_or("http");
            let host = authority.as_ref().map_or("", Authority::as_str);
            let (status, location) =
                r.location(scheme, host, req.uri().path(), req.uri().query(), matched);
            let mut answer = Response::new(Either::Right(Full::new(Bytes::new())));
            *answer.status_mut() = status;
            if let Ok(v) = HeaderValue::from_str(&location) {
                answer.headers_mut().insert(header::LOCATION, v);
            }
            return Err(answer);
        }
        RouteAction::Direct(status) => {
            let mut answer = Response::new(Either::Right(Full::new(Bytes::new())));
            *answer.status_mut() = *status;
            return Err(answer);
        }
    }
    if let Some(abort) = entry
        .fault
        .and_then(|f| f.abort(crate::balance::rng::next()))
    {
        return Err(local(abort, "fault filter abort"));
    }
    let Some((d, dest)) = entry.pick(crate::balance::rng::next()) else {
        let reason = format!("route {} has no destination with weight", entry.name);
        return Err(local(StatusCode::SERVICE_UNAVAILABLE, &reason));
    };
    let Some(cluster) = dest.cluster.and_then(|i| routing.handle(i)) else {
        let reason = format!(
            "route {}: its destination is not in the mesh's config",
            entry.name
        );
        return Err(local(StatusCode::SERVICE_UNAVAILABLE, &reason));
    };
    entry.request_headers.apply(req.headers_mut());
    dest.request_headers.apply(req.headers_mut());
    if let Some(rw) = &entry.rewrite {
        if let Some(path) = rw.path(req.uri().path(), matched) {
            let pq = match req.uri().query() {
                Some(q) => format!("{path}?{q}"),
                None => path,
            };
            let mut parts = req.uri().clone().into_parts();
            if let Ok(pq) = pq.parse() {
                parts.path_and_query = Some(pq);
                if let Ok(uri) = http::Uri::from_parts(parts) {
                    *req.uri_mut() = uri;
                }
            }
        }
        if let Some(a) = &rw.authority {
            req.headers_mut().insert(header::HOST, a.clone());
            if req.uri().authority().is_some() {
                let mut parts = req.uri().clone().into_parts();
                if let Ok(na) = http::uri::Authority::try_from(a.as_bytes()) {
                    parts.authority = Some(na);
                    if let Ok(uri) = http::Uri::from_parts(parts) {
                        *req.uri_mut() = uri;
                    }
                }
            }
            *authority = Some(Authority::Host(a.clone()));
        }
    }
    Ok((cluster.clone(), d))
}

/// A request routed to its cluster, for [`forward`].
struct Routed {
    cluster: Arc<ClusterHandle>,
    req: Prepared,
    /// The consistent-hash key, for a cluster that hashes.
    hash: Option<u64>,
    /// The cookie to set, for a cluster hashing on a cookie the request
    /// did not carry.
    set_cookie: Option<HeaderValue>,
    start: tokio::time::Instant,
    /// The response names the endpoint that answered ([`ENDPOINT_HEADER`]).
    named: bool,
    /// The route it took, where its Service port has routes, and the
    /// index of the destination it picked.
    route: Option<(Arc<RouteEntry>, usize)>,
}

/// The answer to a request: `routed`'s, forwarded to its cluster (each
/// attempt picks an endpoint, sends, and [`retry::decide`]s what follows
/// from what it came to), or the one routing gave. The cluster's
/// `timeout` bounds every wait until the response head: reading a body to
/// buffer, each attempt, each backoff.
#[allow(clippy::manual_async_fn)]
fn forward(
    edge: Option<Edge>,
    mut routed: Routed,
) -> impl std::future::Future<Output = Result<Response<ResponseBody>, Infallible>> {
    async move {
        // The fields are used where they are, not moved to locals: each would
        // take a second place in the future (rust-lang/rust#62958).
        let cluster = &routed.cluster;
        let hash = routed.hash;
        let start = routed.start;
        let named = routed.named;
        let route = routed.route.as_ref().map(|(r, _)| &**r);
        let timeout = match route.and_then(|r| r.timeout) {
            Some(t) => t,
            None => cluster.timeout,
        };
        let deadline = timeout.map(|t| start + t);
        let route_retry = route.and_then(|r| r.retry.as_ref());
        let per_try_timeout = route_retry
            .and_then(|r| r.per_try_timeout)
            .or(cluster.per_try_timeout);
        let retry_on = route_retry
            .and_then(|r| r.retry_on.as_ref())
            .unwrap_or(&cluster.retry_on);
        let timed_out = || local(StatusCode::GATEWAY_TIMEOUT, "request timeout");
        let mut answer = 'answer: {
            let req = &mut routed.req;
            if let Some(d) = route.and_then(|r| r.fault?.delay(crate::balance::rng::next())) {
                match deadline {
                    Some(end) if end <= tokio::time::Instant::now() + d => {
                        Box::pin(tokio::time::sleep_until(end)).await;
                        break 'answer timed_out();
                    }
                    _ => Box::pin(tokio::time::sleep(d)).await,
                }
            }
            if req.body_unread() {
                let read = match deadline {
                    None => Ok(req.read_body().await),
                    Some(d) => tokio::time::timeout_at(d, req.read_body()).await,
                };
                match read {
                    Ok(Ok(())) => {}
                    Ok(Err(answer)) => break 'answer answer,
                    Err(_) => break 'answer timed_out(),
                }
            }
            let mut inflight = match admit(cluster) {
                Ok(guard) => guard,
                Err(max) => {
                    let reason = format!(
                        "cluster {} has {max} requests in flight (connectionPool limit)",
                        cluster.name
                    );
                    let r = unprocessed(local(StatusCode::SERVICE_UNAVAILABLE, &reason));
                    break 'answer overflow(r, "max requests", max);
                }
            };
            cluster.budget.on_request(crate::clock::now_ms());
            let mut tries = Tries::default();
            for attempt in 0..req.attempts {
                if attempt > 0 {
                    if let Some(refused) = tries.retry_refused(cluster) {
                        break 'answer refused;
                    }
                }
                let Some(ep) = pick(cluster, hash, tries.tried()) else {
                    let reason = format!("no healthy endpoints in cluster {}", cluster.name);
                    break 'answer tries.fail(StatusCode::SERVICE_UNAVAILABLE, &reason);
                };
                if attempt > 0 && tries.has_tried(&ep) {
                    // No other endpoint to go to: back off before one already
                    // tried (unless the request's time runs out first).
                    let backoff = RETRY_BACKOFF * (1 << (attempt - 1).min(4));
                    let wake = tokio::time::Instant::now() + backoff;
                    if let Some(d) = deadline.filter(|d| *d <= wake) {
                        Box::pin(tokio::time::sleep_until(d)).await;
                        break 'answer timed_out();
                    }
                    Box::pin(tokio::time::sleep_until(wake)).await;
                }
                let started = req.attempt_started();
                let Some(up) = req.attempt(&ep) else {
                    break 'answer tries.fail(StatusCode::BAD_GATEWAY, "request body already sent");
                };
                let guard = ep.start();
                // The send future is built where it is awaited: held in a local
                // first, it would be copied once more.
                let sent = match attempt_ends(per_try_timeout, deadline) {
                    None => send(&ep, &cluster.pool, up, &mut || tries.admit_resend(cluster)).await,
                    Some((end, whole)) => {
                        let resend = &mut || tries.admit_resend(cluster);
                        match tokio::time::timeout_at(end, send(&ep, &cluster.pool, up, resend))
                            .await
                        {
                            Ok(sent) => sent,
                            Err(_) if whole => break 'answer timed_out(),
                            Err(_) => Sent::TimedOut,
                        }
                    }
                };
                if let Sent::Failed(e) = &sent {
                    if e.is_client_body() {
                        // The caller's body broke (malformed chunked encoding,
                        // the caller went away, or stopped sending): its
                        // error, not the endpoint's.
                        let reason = format!("reading the request body: {}", source_chain(e));
                        let status = if e.is_client_body_stalled() {
                            StatusCode::REQUEST_TIMEOUT
                        } else {
                            StatusCode::BAD_REQUEST
                        };
                        break 'answer local(status, &reason);
                    }
                }
                let sent = match sent {
                    // The app behind the inbound listener speaks for itself
                    // only: a mesh header it sets could make callers back off
                    // its endpoint or retry a request it processed.
                    Sent::Answered(mut resp) if cluster.local_app => {
                        strip_mesh_headers(resp.headers_mut());
                        Sent::Answered(resp)
                    }
                    sent => sent,
                };
                let at = Standing {
                    left: attempt + 1 < req.attempts && req.body.resendable(),
                    idempotent: req.idempotent,
                };
                let (outcome, action) = sent.decide(req.h2, at, retry_on);
                let sent = match (sent, action) {
                    (Sent::Answered(resp), Action::Stop) => {
                        let held = (guard, inflight.take());
                        let delivery = Delivery {
                            started,
                            delivered: tries.delivered(),
                            named,
                        };
                        break 'answer pass_on(cluster, &ep, resp, held, delivery);
                    }
                    (sent, _) => sent,
                };
                tries.failed(cluster, ep, outcome, &sent);
                drop(guard);
                if action == Action::Stop {
                    break 'answer tries.give_up(outcome, &sent, req.attempts);
                }
            }
            tries.exhausted(req.attempts)
        };
        if let Some(cookie) = routed.set_cookie {
            answer.headers_mut().append(header::SET_COOKIE, cookie);
        }
        if let Some((r, d)) = &routed.route {
            r.response_headers.apply(answer.headers_mut());
            if let RouteAction::Forward(dests) = &r.action {
                if let Some(dest) = dests.get(*d) {
                    dest.response_headers.apply(answer.headers_mut());
                }
            }
        }
        Ok(answer_to(edge, answer))
    }
}

/// The answer as it leaves: through the edge, for a gateway's clients.
fn answer_to(edge: Option<Edge>, answer: Response<ResponseBody>) -> Response<ResponseBody> {
    match edge {
        Some(edge) => edge.outward(answer),
        None => answer,
    }
}

/// When an attempt starting now ends, at its own timeout (`per_try`) or
/// the request's `deadline`, whichever comes first; true when it is the
/// request's. None: it may wait as long as it takes.
fn attempt_ends(
    per_try: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
) -> Option<(tokio::time::Instant, bool)> {
    let own = per_try.map(|t| tokio::time::Instant::now() + t);
    match (own, deadline) {
        (Some(o), Some(d)) => Some(if d <= o { (d, true) } else { (o, false) }),
        (Some(o), None) => Some((o, false)),
        (None, Some(d)) => Some((d, true)),
        (None, None) => None,
    }
}

/// Picks an endpoint of `cluster` other than those in `avoid` where it can. One
/// pick in [`PICK_SAMPLE`] is timed: two clock reads cost more than most
/// picks, and the histogram's shape needs no more.
#[inline]
fn pick(
    cluster: &ClusterHandle,
    hash: Option<u64>,
    avoid: &[Arc<EndpointState>],
) -> Option<Arc<EndpointState>> {
    let timed = PICK_COUNT.with(|c| {
        let n = c.get().wrapping_add(1);
        c.set(n);
        n % PICK_SAMPLE == 1 // the first pick of a loop, then every 16th
    });
    let t = timed.then(std::time::Instant::now);
    let picked = cluster
        .balancer
        .pick(hash, avoid, crate::clock::now_ms())
        .cloned();
    if let Some(t) = t {
        cluster.pick_ns.0.observe(t.elapsed().as_nanos() as u64);
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{HeaderMap, HeaderName};
    use request::strip_hop_by_hop;

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
        // Every Connection field names hop-by-hop headers, not the first only.
        let mut h = headers(&[
            ("host", "backend"),
            ("connection", "keep-alive"),
            ("connection", "x-secret"),
            ("x-secret", "1"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["host"]);
        // A non-ASCII token in the list does not hide the names beside it.
        let mut h = headers(&[("host", "backend"), ("x-secret", "1")]);
        h.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-secret, ke\xc8p-alive").unwrap(),
        );
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["host"]);
    }

    #[test]
    fn every_mesh_header_is_stripped_repeated_or_not() {
        let mut h = headers(&[
            ("host", "backend"),
            ("x-minimesh-endpoint", "10.0.0.1:8080"),
            ("x-minimesh-error", "a"),
            ("x-minimesh-error", "b"),
            ("x-minimesh-made-up", "1"),
            ("x-keep", "1"),
        ]);
        strip_mesh_headers(&mut h);
        assert_eq!(names(&h), ["host", "x-keep"]);
        assert_eq!(h.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_attempt_ends_at_its_own_timeout_or_the_requests_whichever_is_first() {
        let now = tokio::time::Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(attempt_ends(None, None), None);
        assert_eq!(
            attempt_ends(Some(ms(200)), None),
            Some((now + ms(200), false))
        );
        assert_eq!(
            attempt_ends(None, Some(now + ms(300))),
            Some((now + ms(300), true))
        );
        assert_eq!(
            attempt_ends(Some(ms(200)), Some(now + ms(300))),
            Some((now + ms(200), false))
        );
        assert_eq!(
            attempt_ends(Some(ms(1000)), Some(now + ms(300))),
            Some((now + ms(300), true))
        );
        // Level: the request's, which ends it for good.
        assert_eq!(
            attempt_ends(Some(ms(300)), Some(now + ms(300))),
            Some((now + ms(300), true))
        );
    }

    #[test]
    fn end_to_end_headers_pass_untouched() {
        let mut h = headers(&[("host", "backend"), ("x-user", "7"), ("accept", "*/*")]);
        let before = h.clone();
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }
}
