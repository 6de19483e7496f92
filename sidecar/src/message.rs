//! What both upstream HTTP/1.1 clients (`h1.rs`, and the A/B arm on
//! hyper's client, `h1_hyper.rs`) take from the request path: the body to
//! send, and whether a method may be sent again.

use bytes::Bytes;
use http::Method;
use hyper::body::Incoming;

/// Body sent upstream: buffered (so that a retry can resend it) or streamed.
pub enum UpstreamBody {
    /// The whole body, read before the request goes out.
    Buffered(Bytes),
    /// The caller's body, passed on as it arrives.
    Streaming(Incoming),
}

/// GET, HEAD, OPTIONS, PUT, DELETE or TRACE (RFC 9110 §9.2.2): safe to
/// send again when an attempt failed before a response.
pub fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}
