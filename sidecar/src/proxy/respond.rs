//! What goes back to the caller: responses minimesh answers itself (with
//! the reason), and upstream bodies that hold their endpoint's counts until
//! they end.

use super::*;

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
                self.guard.endpoint().pool.put(lease);
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
