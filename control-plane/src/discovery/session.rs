//! A gRPC bidirectional stream run as a state machine polled by the response
//! stream itself, with no task or channel of its own: the control plane
//! holds one per connected sidecar per service, so what each one costs is
//! multiplied by thousands. Responses are produced only as the transport asks
//! for them, so a client that stops reading stops being read (backpressure).
//!
//! The driver knows nothing of the transport: it reads any stream of
//! decoded requests (tonic's `Streaming` on the discovery port, a channel in
//! unit tests) and yields decoded responses.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::Stream;
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tonic::Status;
use tracing::debug;

/// A gRPC response stream.
pub(crate) type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// What one stream does with the client's requests and with changes of the
/// value it watches (the config snapshot, the load-report interval).
pub(crate) trait Session: Send + Unpin + 'static {
    type Request: Send + 'static;
    type Response: Send + Unpin + 'static;
    type Watched: Clone + Send + Sync + 'static;

    /// A request from the client, with the watched value as of now; the
    /// responses it causes go to `out`. An error ends the stream with it.
    fn on_request(
        &mut self,
        req: Self::Request,
        now: &Self::Watched,
        out: &mut VecDeque<Self::Response>,
    ) -> Result<(), Status>;

    /// The watched value changed (also called once with its value at start).
    fn on_change(&mut self, now: &Self::Watched, out: &mut VecDeque<Self::Response>);

    /// The stream ended (the client closed it or went away, or it failed).
    fn on_end(&mut self) {}
}

/// Runs `session` on `inbound` (the client's requests, decoded), watching
/// `watched`.
pub(crate) fn drive<S, I>(
    session: S,
    inbound: I,
    watched: watch::Receiver<S::Watched>,
) -> BoxStream<S::Response>
where
    S: Session,
    I: Stream<Item = Result<S::Request, Status>> + Send + Unpin + 'static,
{
    Box::pin(Driver {
        session,
        inbound,
        current: watched.clone(),
        changes: WatchStream::new(watched),
        out: VecDeque::new(),
        error: None,
        done: false,
    })
}

struct Driver<S: Session, I> {
    session: S,
    inbound: I,
    /// For the value as of a request.
    current: watch::Receiver<S::Watched>,
    changes: WatchStream<S::Watched>,
    /// Responses not yet taken by the transport: at most one per resource
    /// type per event, and freed when drained (pushes are rare, idle streams
    /// many).
    out: VecDeque<S::Response>,
    error: Option<Status>,
    done: bool,
}

impl<S, I> Stream for Driver<S, I>
where
    S: Session,
    I: Stream<Item = Result<S::Request, Status>> + Unpin,
{
    type Item = Result<S::Response, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(r) = this.out.pop_front() {
                if this.out.is_empty() {
                    this.out = VecDeque::new();
                }
                return Poll::Ready(Some(Ok(r)));
            }
            if let Some(e) = this.error.take() {
                return Poll::Ready(Some(Err(e)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inbound).poll_next(cx) {
                Poll::Ready(Some(Ok(req))) => {
                    let now = this.current.borrow().clone();
                    if let Err(status) = this.session.on_request(req, &now, &mut this.out) {
                        this.error = Some(status);
                        this.end();
                    }
                    continue;
                }
                Poll::Ready(Some(Err(e))) => {
                    // A request that could not be read (too large,
                    // compressed, undecodable): the client is told why. A
                    // reset stream hears nothing more anyway.
                    debug!(error = %e, "stream ended");
                    this.error = Some(unreadable(e));
                    this.end();
                    continue;
                }
                Poll::Ready(None) => {
                    this.end();
                    continue;
                }
                Poll::Pending => {}
            }
            match Pin::new(&mut this.changes).poll_next(cx) {
                Poll::Ready(Some(now)) => this.session.on_change(&now, &mut this.out),
                Poll::Ready(None) => this.end(),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The status a stream ends with when a request could not be read: a
/// message over the size limit is RESOURCE_EXHAUSTED, as gRPC's status-code
/// guide has it (tonic's decoder says OUT_OF_RANGE); the rest as they are.
fn unreadable(e: Status) -> Status {
    if e.code() == tonic::Code::OutOfRange {
        Status::resource_exhausted(e.message().to_string())
    } else {
        e
    }
}

impl<S: Session, I> Driver<S, I> {
    fn end(&mut self) {
        if !self.done {
            self.done = true;
            self.session.on_end();
        }
    }
}

impl<S: Session, I> Drop for Driver<S, I> {
    fn drop(&mut self) {
        self.end();
    }
}
