//! What goes back to the caller: responses minimesh answers itself (with
//! the reason), and upstream bodies that hold their endpoint's counts until
//! they end.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{header, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};

use super::admission::InflightGuard;
use super::attempt::Upstream;
use super::request::strip_hop_by_hop;
use super::tries::outlier_outcome;
use super::{ResponseBody, ENDPOINT_HEADER, ERROR_HEADER, UNPROCESSED_HEADER};
use crate::endpoint::{ActiveGuard, EndpointState};
use crate::outlier::Outcome;
use crate::routing::ClusterHandle;

/// Marks a response minimesh generates as one no endpoint has seen.
pub(crate) fn unprocessed(mut r: Response<ResponseBody>) -> Response<ResponseBody> {
    r.headers_mut().insert(
        HeaderName::from_static(UNPROCESSED_HEADER),
        HeaderValue::from_static("true"),
    );
    r
}

pub(crate) fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// An inbound request authorization denies: 403 with Istio's body
/// (`RBAC: access denied`), so that clients and tests written for Istio
/// read it the same.
pub(crate) fn rbac_denied() -> Response<ResponseBody> {
    let mut r = Response::new(Either::Right(Full::new(Bytes::from_static(
        b"RBAC: access denied",
    ))));
    *r.status_mut() = StatusCode::FORBIDDEN;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r.headers_mut().insert(
        HeaderName::from_static(ERROR_HEADER),
        HeaderValue::from_static("RBAC: access denied"),
    );
    r
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
    pub(crate) inner: Upstream,
    pub(crate) guard: ActiveGuard,
    pub(crate) _inflight: Option<InflightGuard>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Upstream::H1(body) = &mut self.inner {
            if let Some(lease) = body.take_reusable() {
                self.guard
                    .endpoint()
                    .pool()
                    .put(lease, crate::clock::now_ms());
            }
        }
    }
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

/// How the answering attempt went, for [`pass_on`].
pub(crate) struct Delivery {
    /// When the attempt started.
    pub(crate) started: tokio::time::Instant,
    /// An earlier attempt may have been processed.
    pub(crate) delivered: bool,
    /// Name the endpoint in the response ([`ENDPOINT_HEADER`]).
    pub(crate) named: bool,
}

/// Passes an endpoint's response on to the caller: counts it towards the
/// endpoint (reachable, latency, outcome, outlier detection), drops the
/// hop-by-hop headers, names the endpoint (unless told not to), and holds
/// the endpoint's and the cluster's in-flight counts until the body ends.
pub(crate) fn pass_on(
    cluster: &ClusterHandle,
    ep: &EndpointState,
    mut resp: Response<Upstream>,
    held: (ActiveGuard, Option<InflightGuard>),
    at: Delivery,
) -> Response<ResponseBody> {
    let Delivery {
        started,
        delivered,
        named,
    } = at;
    if matches!(resp.status().as_u16(), 502 | 503) && resp.headers().contains_key(ERROR_HEADER) {
        // The endpoint's own sidecar answered that its app is gone, on the
        // last attempt: skip it as a retry would have, rather than mark it
        // reachable for every request.
        ep.back_off();
    } else {
        ep.mark_reachable();
    }
    // Passed on only from the endpoint's own sidecar (never from an app)
    // and only when no earlier attempt may have been processed.
    if resp.status() == StatusCode::SERVICE_UNAVAILABLE && (delivered || cluster.local_app) {
        resp.headers_mut().remove(UNPROCESSED_HEADER);
    }
    let now = tokio::time::Instant::now();
    let now_ms = crate::clock::advance(now);
    let elapsed = now.saturating_duration_since(started).as_micros() as u64;
    if cluster.balancer.policy() == crate::balance::Policy::PeakEwma {
        ep.observe_rtt(elapsed as f64, held.0.ahead(), now_ms * 1000);
    }
    ep.counters()
        .count_response(resp.status().is_server_error(), elapsed);
    outlier_outcome(cluster, ep, Outcome::Status(resp.status()));
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if named {
        parts
            .headers
            .insert(HeaderName::from_static(ENDPOINT_HEADER), ep.header.clone());
    }
    let (guard, inflight) = held;
    Response::from_parts(
        parts,
        Either::Left(Tracked {
            inner: body,
            guard,
            _inflight: inflight,
        }),
    )
}
