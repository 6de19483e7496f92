//! The gateway's edge: what outside clients may send in and see come back.
//! Mesh headers (`x-minimesh-*`) are for sidecars: a client's are dropped
//! before routing, and none goes back to it (they name pods); an error
//! minimesh answers tells the client what failed, not where.

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use tracing::debug;

use super::request::strip_mesh_headers;
use super::{ResponseBody, ERROR_HEADER};

/// How a listener treats clients outside the mesh (gateway mode).
#[derive(Debug, Clone, Copy, Default)]
pub struct Edge {
    /// Pass mesh headers and minimesh's detailed error reasons to outside
    /// clients (`--debug-headers`): for benchmarks and demos, never for a
    /// gateway the public reaches.
    pub debug_headers: bool,
}

impl Edge {
    /// A client's request as it enters the mesh: its mesh headers dropped,
    /// so that no outside client speaks for a sidecar.
    pub(crate) fn inward(&self, req: &mut Request<Incoming>) {
        strip_mesh_headers(req.headers_mut());
    }

    /// A response as it leaves the mesh: without mesh headers, and an error
    /// minimesh answered (here, or an endpoint's sidecar did) reduced to
    /// what the client may know. The full reason is logged at debug level.
    pub(crate) fn outward(&self, mut resp: Response<ResponseBody>) -> Response<ResponseBody> {
        if self.debug_headers {
            return resp;
        }
        // Only 5xx reasons are reduced (a 4xx's stays, see public_reason).
        let reason = match resp.status().is_server_error() {
            true => resp.headers().get(ERROR_HEADER).cloned(),
            false => None,
        };
        strip_mesh_headers(resp.headers_mut());
        let Some(reason) = reason else {
            return resp;
        };
        let status = resp.status();
        let Some(public) = public_reason(status) else {
            // The client's own error: the reason is about its request only
            // (no route for its host, its body unreadable), and stays.
            return resp;
        };
        debug!(%status, reason = ?reason, "error answered to an outside client as {public:?}");
        let (mut parts, _) = resp.into_parts();
        parts.headers.remove(header::CONTENT_LENGTH);
        let body = Bytes::from(format!("minimesh: {public}\n"));
        Response::from_parts(parts, Either::Right(Full::new(body)))
    }
}

/// What an outside client is told of an error minimesh answered with
/// `status`: None for the client's own (4xx), whose reason it may read.
fn public_reason(status: StatusCode) -> Option<&'static str> {
    Some(match status.as_u16() {
        400..=499 => return None,
        502 => "upstream failed",
        503 => "upstream unavailable",
        504 => "upstream timed out",
        _ => "internal error",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::{local, ENDPOINT_HEADER};
    use http::header::{HeaderName, HeaderValue};
    use http_body_util::BodyExt;

    fn error(status: StatusCode, reason: &str) -> Response<ResponseBody> {
        let mut r = local(status, reason);
        r.headers_mut().insert(
            HeaderName::from_static(ENDPOINT_HEADER),
            HeaderValue::from_static("10.1.2.3:8080"),
        );
        r
    }

    async fn body(r: Response<ResponseBody>) -> String {
        let b = r.into_body().collect().await.ok().map(|c| c.to_bytes());
        String::from_utf8(b.unwrap_or_default().to_vec()).unwrap_or_default()
    }

    #[tokio::test]
    async fn an_upstream_error_leaves_without_addresses_or_mesh_headers() {
        let edge = Edge::default();
        let r = edge.outward(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "all 3 attempts failed; last: connect to 10.1.2.3:8080 failed: refused",
        ));
        assert_eq!(r.status(), 503);
        assert!(
            r.headers()
                .keys()
                .all(|k| !k.as_str().starts_with("x-minimesh-")),
            "{:?}",
            r.headers()
        );
        assert_eq!(body(r).await, "minimesh: upstream unavailable\n");
        for (status, public) in [(502, "upstream failed"), (504, "upstream timed out")] {
            let status = StatusCode::from_u16(status).unwrap_or_default();
            let r = edge.outward(error(status, "10.1.2.3:8080 did not answer"));
            assert_eq!(body(r).await, format!("minimesh: {public}\n"));
        }
    }

    #[tokio::test]
    async fn a_client_error_keeps_its_reason_and_debug_headers_keep_everything() {
        let r = Edge::default().outward(error(StatusCode::NOT_FOUND, "no route for host x"));
        assert!(!r.headers().contains_key(ERROR_HEADER));
        assert_eq!(body(r).await, "minimesh: no route for host x\n");
        let debug = Edge {
            debug_headers: true,
        };
        let r = debug.outward(error(
            StatusCode::BAD_GATEWAY,
            "upstream 10.1.2.3:8080 failed",
        ));
        assert_eq!(r.headers()[ENDPOINT_HEADER], "10.1.2.3:8080");
        assert_eq!(body(r).await, "minimesh: upstream 10.1.2.3:8080 failed\n");
    }
}
