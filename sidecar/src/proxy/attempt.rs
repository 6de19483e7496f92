//! One attempt of a request at one endpoint: its body (buffered for a
//! retry when small), and sending it over the endpoint's HTTP/1.1 pool or
//! a shared HTTP/2 connection.

use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use http_body_util::{Either, Full};

use super::tries::Sent;
use crate::endpoint::EndpointState;
use crate::h1::Outgoing;
use crate::pool::UpstreamBody;

/// A response body from the endpoint, by the HTTP version it came in.
pub enum Upstream {
    /// Read from a pooled HTTP/1.1 connection.
    H1(crate::pool::H1Body),
    /// A stream of a shared HTTP/2 connection.
    H2(crate::h2::ResponseBody),
}

/// One attempt's request.
pub(crate) enum Attempt<'a> {
    H1(&'a mut Outgoing),
    H2(H2Attempt<'a>),
}

/// What an HTTP/2 attempt builds its request from, once it has a stream:
/// a refused connection leaves a streamed body for the next attempt.
pub(crate) struct H2Attempt<'a> {
    pub(crate) parts: &'a http::request::Parts,
    pub(crate) te_trailers: bool,
    pub(crate) body: &'a mut RequestBody,
}

/// A request's body over its attempts.
pub(crate) struct RequestBody {
    /// The whole body, read before the first attempt (known to be small).
    pub(crate) buffered: Option<Bytes>,
    /// The caller's body, until an attempt takes it.
    pub(crate) streaming: Option<crate::message::ClientBody>,
    /// What an HTTP/2 attempt recorded of the streamed body.
    pub(crate) tape: Option<Arc<std::sync::Mutex<crate::h2::Tape>>>,
}

impl RequestBody {
    /// True when another attempt has a body to send.
    pub(crate) fn resendable(&self) -> bool {
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
    pub(crate) fn h1(&mut self) -> UpstreamBody {
        match (&self.buffered, self.streaming.take()) {
            (Some(b), _) => UpstreamBody::Buffered(b.clone()),
            (None, Some(s)) => UpstreamBody::Streaming(s),
            (None, None) => UpstreamBody::Buffered(Bytes::new()),
        }
    }

    /// The body of an HTTP/2 attempt: the buffered one, the caller's
    /// (recorded), or a replay of what an earlier attempt recorded.
    pub(crate) fn h2(&mut self) -> Option<crate::h2::RequestBody> {
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

/// Sends one attempt to `ep`; `resend` admits the HTTP/1.1 pool's resend
/// after a reused connection closed under the request (see
/// [`crate::pool::Pool::send`]).
pub(crate) async fn send(
    ep: &EndpointState,
    settings: &crate::pool::PoolSettings,
    up: Attempt<'_>,
    resend: crate::pool::Resend<'_>,
) -> Sent {
    let sent = match up {
        Attempt::H1(out) => ep
            .pool()
            .send(ep.addr, settings, out, crate::clock::now_ms(), resend)
            .await
            .map(|r| r.map(Upstream::H1)),
        // Boxed: it would otherwise widen every request's future.
        Attempt::H2(a) => Box::pin(send_h2(ep, settings, a))
            .await
            .map(|r| r.map(Upstream::H2)),
    };
    match sent {
        Ok(resp) => Sent::Answered(resp),
        Err(e) => Sent::Failed(e),
    }
}

pub(crate) async fn send_h2(
    ep: &EndpointState,
    settings: &crate::pool::PoolSettings,
    a: H2Attempt<'_>,
) -> Result<Response<crate::h2::ResponseBody>, crate::pool::UpstreamError> {
    let pool = ep.pool();
    let stream = pool.h2_stream(ep.addr, settings).await?;
    let body = a.body.h2().ok_or(crate::pool::UpstreamError::BodySent)?;
    let req = crate::h2::request(
        &a.parts.method,
        a.parts.uri.path_and_query(),
        &a.parts.headers,
        &ep.authority,
        a.te_trailers,
        body,
    );
    pool.send_h2(ep.addr, settings, stream, req).await
}
