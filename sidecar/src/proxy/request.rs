//! What the proxy reads from a request before it forwards it: the authority
//! it is routed by, the hash key of consistent-hash clusters, and the
//! headers that stop at this hop.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{header, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use minimesh_proto::headers;

use super::attempt::{Attempt, H2Attempt, RequestBody};
use super::respond::local;
use super::ResponseBody;
use crate::balance::xxhash::xxh64;
use crate::endpoint::EndpointState;
use crate::h1::{encode, Outgoing};
use crate::pool::MAX_BUFFERED_BODY;
use crate::routing::{ClusterHandle, HashPolicy};

/// The request's hash for a consistent-hash cluster, and the cookie to set
/// when the policy hashes on a cookie the request does not carry. A request
/// without the key gets no hash: it is balanced at random, never refused.
pub(crate) fn hash_key(
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
pub(crate) enum Authority {
    Uri(http::uri::Authority),
    Host(HeaderValue),
}

impl Authority {
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Authority::Uri(a) => a.as_str(),
            // Only visible ASCII is kept (see request_authority).
            Authority::Host(h) => h.to_str().unwrap_or_default(),
        }
    }
}

pub(crate) fn request_authority(req: &Request<Incoming>) -> Option<Authority> {
    if let Some(a) = req.uri().authority() {
        return Some(Authority::Uri(a.clone()));
    }
    req.headers()
        .get(header::HOST)
        .filter(|h| h.to_str().is_ok())
        .map(|h| Authority::Host(h.clone()))
}

pub(crate) static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Removes the headers that stop at this hop (RFC 9110 §7.6.1): those the
/// `Connection` header names and the fixed list. True when the message
/// carried any.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) -> bool {
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
        return false;
    }
    // Every `Connection` field counts, not only the first, and every name
    // in it, read as bytes: a field with one non-ASCII token still names
    // the others (both found by the request_path fuzz target: names in a
    // second field, and beside an obs-text token, reached the app).
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|list| list.as_bytes().split(|&b| b == b','))
        .filter_map(|name| HeaderName::from_bytes(name.trim_ascii()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
    headers.remove(header::TRANSFER_ENCODING);
    true
}

/// Removes every mesh header (`x-minimesh-*`) from `headers`, without
/// allocating (there are few, if any).
pub(crate) fn strip_mesh_headers(headers: &mut HeaderMap) {
    let is_mesh = |name: &&HeaderName| name.as_str().starts_with(headers::PREFIX);
    while let Some(name) = headers.keys().find(is_mesh).cloned() {
        headers.remove(name);
    }
}

/// A request read once for all its attempts: its head with the hop-by-hop
/// headers gone, its body (buffered when small, so that a retry can send
/// it again), and how many attempts it may have.
pub(crate) struct Prepared {
    pub(crate) parts: http::request::Parts,
    /// Sent upstream over HTTP/2.
    pub(crate) h2: bool,
    /// HTTP/2 carries `te: trailers` on (gRPC servers look for it).
    te_trailers: bool,
    pub(crate) body: RequestBody,
    /// A small body still to buffer ([`Prepared::read_body`]).
    unread: Option<crate::message::ClientBody>,
    /// Attempts allowed: 1 + the cluster's retries, or 1 when the body
    /// cannot be sent twice.
    pub(crate) attempts: u32,
    /// Safe to send again after a failure that may have reached the app.
    pub(crate) idempotent: bool,
    /// When the request started, for a first attempt that read no body
    /// since: no second clock read.
    first_start: Option<tokio::time::Instant>,
    /// The headers carry `host` (else the endpoint's authority is sent).
    has_host: bool,
    /// The HTTP/1.1 request, encoded once (by `new` when it can, else at
    /// the first attempt) and sent as is by every attempt.
    h1: Option<Outgoing>,
}

impl Prepared {
    /// Reads `req`'s head for `cluster`. A body small enough to buffer is
    /// read by [`Prepared::read_body`] when [`Prepared::body_unread`]; a
    /// request without one is ready without a future (most are).
    pub(crate) fn new(
        cluster: &ClusterHandle,
        retries: u32,
        req: Request<Incoming>,
        authority: Option<Authority>,
        (start, body_stall): (tokio::time::Instant, Option<Duration>),
    ) -> Prepared {
        let (mut parts, body) = req.into_parts();
        let h2 = cluster.upstream_h2(parts.version);
        // Every TE but `trailers` over HTTP/2 is hop-by-hop and dropped.
        let te_trailers = h2
            && parts.headers.get_all(header::TE).iter().any(|v| {
                v.as_bytes()
                    .split(|b| *b == b',')
                    .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
            });
        let stripped = strip_hop_by_hop(&mut parts.headers);
        // An authority read from the Host header needs no second lookup,
        // unless `Connection` named `host` and it was stripped.
        let mut has_host = matches!(authority, Some(Authority::Host(_))) && !stripped
            || parts.headers.contains_key(header::HOST);
        if !has_host {
            if let Some(v) = authority.and_then(|a| match a {
                Authority::Host(h) => Some(h),
                Authority::Uri(a) => HeaderValue::from_str(a.as_str()).ok(),
            }) {
                parts.headers.insert(header::HOST, v);
                has_host = true;
            }
        }
        let first_start = body.is_end_stream().then_some(start);
        let (buffered, streaming, unread) = if body.is_end_stream() {
            (Some(Bytes::new()), None, None)
        } else if body
            .size_hint()
            .upper()
            .is_some_and(|u| u <= MAX_BUFFERED_BODY)
        {
            let body = crate::message::ClientBody::new(body, body_stall);
            (None, None, Some(body))
        } else {
            let body = crate::message::ClientBody::new(body, body_stall);
            (None, Some(body), None)
        };
        // A buffered body can be sent again; a streamed one is recorded
        // over HTTP/2 while it is short, so those requests may be retried
        // too (see `crate::h2::Recording`).
        let attempts = if streaming.is_none() || h2 {
            1 + retries
        } else {
            1
        };
        let mut prepared = Prepared {
            idempotent: crate::h1::idempotent(&parts.method),
            parts,
            h2,
            te_trailers,
            body: RequestBody {
                buffered,
                streaming,
                tape: None,
            },
            unread,
            attempts,
            first_start,
            has_host,
            h1: None,
        };
        // Encoded now when nothing it needs is still to come (the body,
        // or an endpoint's authority for a request without a Host).
        if !h2 && has_host && prepared.unread.is_none() {
            prepared.encode_h1(None);
        }
        prepared
    }

    /// Encodes the HTTP/1.1 request, and lets go of the head it was
    /// encoded from. Its fields point into the client connection's read
    /// buffer, which hyper reads the next request into only once nothing
    /// else refers to it (else it allocates another); hyper reads from the
    /// connection again as soon as it has handed this request over, before
    /// the request's future first runs.
    fn encode_h1(&mut self, host: Option<&str>) {
        let parts = &mut self.parts;
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let up = encode(&parts.method, path, &parts.headers, host, self.body.h1());
        parts.headers = HeaderMap::new();
        parts.uri = http::Uri::default();
        self.h1 = Some(up);
    }

    /// A body to buffer before the first attempt ([`Prepared::read_body`]).
    pub(crate) fn body_unread(&self) -> bool {
        self.unread.is_some()
    }

    /// Buffers the body [`Prepared::new`] left unread; Err is the answer
    /// when it cannot be read.
    pub(crate) async fn read_body(&mut self) -> Result<(), Response<ResponseBody>> {
        let Some(body) = self.unread.take() else {
            return Ok(());
        };
        match Box::pin(body.collect()).await {
            Ok(c) => {
                self.body.buffered = Some(c.to_bytes());
                Ok(())
            }
            Err(e) => {
                let status = match e {
                    crate::message::ClientBodyError::Stalled(_) => StatusCode::REQUEST_TIMEOUT,
                    crate::message::ClientBodyError::Read(_) => StatusCode::BAD_REQUEST,
                };
                let reason = format!("reading request body: {e}");
                Err(local(status, &reason))
            }
        }
    }

    /// The request of an attempt at `ep`; None when its body was already
    /// sent and cannot go again.
    pub(crate) fn attempt(&mut self, ep: &EndpointState) -> Option<Attempt<'_>> {
        if self.h2 {
            return Some(Attempt::H2(H2Attempt {
                parts: &self.parts,
                te_trailers: self.te_trailers,
                body: &mut self.body,
            }));
        }
        if self.h1.is_none() {
            let host = (!self.has_host).then(|| ep.authority.as_str());
            self.encode_h1(host);
        }
        // Some: encoded by `new`, or just above.
        let up = self.h1.as_mut()?;
        up.resendable().then_some(Attempt::H1(up))
    }

    /// When an attempt starting now started: the request's start for a
    /// first attempt that read no body, else a clock read.
    pub(crate) fn attempt_started(&mut self) -> tokio::time::Instant {
        self.first_start
            .take()
            .unwrap_or_else(tokio::time::Instant::now)
    }
}
