//! The client idle bound of connections hyper's HTTP/1.1 header timeout
//! does not cover: HTTP/2 (and a client whose first bytes have not told its
//! version yet, such as one that sent `P` and stopped). A connection with
//! no request in flight for the idle timeout (from its start, or from the
//! end of its last response) is closed, as nginx's `keepalive_timeout`
//! (and `http2_idle_timeout`) close one: gracefully (a GOAWAY), and at
//! once a moment later if it has not ended by then.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// How long a connection told to close gracefully for being idle may take
/// before it is dropped.
pub(super) const GRACE: Duration = Duration::from_millis(250);

/// Requests in flight on one connection, and when the last one ended.
#[derive(Debug)]
pub(super) struct Activity {
    active: AtomicUsize,
    last_ms: AtomicU64,
}

impl Activity {
    /// A connection starting now.
    pub(super) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            active: AtomicUsize::new(0),
            last_ms: AtomicU64::new(crate::clock::precise_ms()),
        })
    }

    /// A request starts: in flight until the returned guard (held by its
    /// response body) drops.
    pub(super) fn start(self: &Arc<Self>) -> InFlight {
        self.active.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Idle for `idle` or longer: nothing in flight, and the last request
    /// ended that long ago.
    pub(super) fn idle_for(&self, idle: Duration) -> bool {
        self.active.load(Ordering::Relaxed) == 0
            && crate::clock::precise_ms().saturating_sub(self.last_ms.load(Ordering::Relaxed))
                >= idle.as_millis() as u64
    }
}

/// One request in flight.
#[derive(Debug)]
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .last_ms
            .store(crate::clock::precise_ms(), Ordering::Relaxed);
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that keeps its request in flight until it ends.
pub(super) struct Held<B> {
    inner: B,
    _request: InFlight,
}

impl<B> Held<B> {
    pub(super) fn new(inner: B, request: InFlight) -> Held<B> {
        Held {
            inner,
            _request: request,
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Held<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
