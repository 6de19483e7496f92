//! What both upstream HTTP/1.1 clients (`h1.rs`, and the A/B arm on
//! hyper's client, `h1_hyper.rs`) take from the request path: the body to
//! send, and whether a method may be sent again; and the caller's body as
//! every upstream client reads it, bounded like nginx's
//! `client_body_timeout` ([`ClientBody`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

/// Body sent upstream: buffered (so that a retry can resend it) or streamed.
pub enum UpstreamBody {
    /// The whole body, read before the request goes out.
    Buffered(Bytes),
    /// The caller's body, passed on as it arrives.
    Streaming(ClientBody),
}

/// Why the caller's body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClientBodyError {
    /// hyper's: malformed framing, or the caller went away.
    #[error("{0}")]
    Read(#[from] hyper::Error),
    /// Nothing arrived for the bound (`--client-body-timeout`).
    #[error("the client sent nothing of its request body for {0:?}")]
    Stalled(Duration),
}

/// True when `e`, or an error it came from (hyper keeps a failed body's
/// error as its source), is the caller's body stalling.
pub fn stalled(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if matches!(
            c.downcast_ref::<ClientBodyError>(),
            Some(ClientBodyError::Stalled(_))
        ) {
            return true;
        }
        cur = c.source();
    }
    false
}

/// The caller's request body: hyper's, failing with
/// [`ClientBodyError::Stalled`] when no part of it arrives for `stall`
/// (between two parts, as nginx's `client_body_timeout`), so that a client
/// that stops sending holds no upstream connection for longer.
pub struct ClientBody {
    inner: Incoming,
    stall: Option<Duration>,
    /// Made at the first wait, reset at each later one.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    waiting: bool,
}

impl ClientBody {
    /// `inner`, bounded by `stall` (None: never).
    pub fn new(inner: Incoming, stall: Option<Duration>) -> ClientBody {
        ClientBody {
            inner,
            stall,
            timer: None,
            waiting: false,
        }
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.waiting = false;
                Poll::Ready(frame.map(|f| f.map_err(ClientBodyError::Read)))
            }
            Poll::Pending => {
                let Some(stall) = this.stall else {
                    return Poll::Pending;
                };
                let deadline = tokio::time::Instant::now() + stall;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !this.waiting {
                    timer.as_mut().reset(deadline);
                    this.waiting = true;
                }
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(ClientBodyError::Stalled(stall)))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// GET, HEAD, OPTIONS, PUT, DELETE or TRACE (RFC 9110 §9.2.2): safe to
/// send again when an attempt failed before a response.
pub fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}
