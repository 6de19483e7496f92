//! The upstream HTTP/1.1 client on `hyper::client::conn::http1`: the arm of
//! the same-run A/B that decides whether `h1.rs` (the sidecar's own client)
//! earns its keep. Built only with `--features hyper-h1`, in place of
//! `h1.rs` and with the same interface, so that the pool, retries and
//! everything around them are the same code in both arms; see
//! BENCHMARKS.md ("the upstream HTTP/1.1 client") for the figures.
//!
//! Each connection is hyper's: its `Connection` runs as a task on the event
//! loop that dialed it, and requests and responses reach it through hyper's
//! `SendRequest`. The handshake is made on the first exchange (it does no
//! I/O for HTTP/1.1), so that a connection is made as `h1::Conn` is.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{handshake, SendRequest};
use hyper_util::rt::TokioIo;

pub use crate::message::{idempotent, UpstreamBody};

/// A request body as hyper sends it.
type ReqBody = Either<Full<Bytes>, crate::message::ClientBody>;

/// Why an exchange on an upstream connection failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection ended before any byte of a response.
    #[error("connection closed before a response")]
    ClosedBeforeResponse,
    /// Writing the request failed.
    #[error("writing the request: {0}")]
    Write(std::io::Error),
    /// The exchange failed in hyper.
    #[error("{0}")]
    Hyper(hyper::Error),
    /// The request could not be built.
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl Error {
    /// True when the caller's request body failed, not the endpoint.
    pub fn is_client_body(&self) -> bool {
        matches!(self, Error::Hyper(e) if e.is_user())
    }

    /// True when the caller's request body stopped arriving for its bound.
    pub fn is_client_body_stalled(&self) -> bool {
        matches!(self, Error::Hyper(e) if crate::message::stalled(e))
    }

    /// True when the endpoint sent nothing back: on a reused connection,
    /// a sign that the server closed it while it was idle.
    pub fn nothing_received(&self) -> bool {
        match self {
            Error::ClosedBeforeResponse | Error::Write(_) => true,
            Error::Hyper(e) => e.is_canceled() || e.is_closed() || e.is_incomplete_message(),
            Error::Invalid(_) => false,
        }
    }
}

/// Counts an open connection until dropped.
struct Open(Arc<AtomicU32>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One upstream connection.
pub struct Conn {
    io: Option<crate::tls::Io>,
    send: Option<SendRequest<ReqBody>>,
    _open: Open,
}

impl Conn {
    /// Wraps a connected stream, counted in `open` until dropped.
    pub fn new(io: crate::tls::Io, open: &Arc<AtomicU32>) -> Conn {
        open.fetch_add(1, Ordering::Relaxed);
        Conn {
            io: Some(io),
            send: None,
            _open: Open(open.clone()),
        }
    }

    /// True when an idle connection cannot take a request.
    pub fn is_closed(&mut self) -> bool {
        self.send.as_ref().is_some_and(|s| s.is_closed())
    }

    fn reusable(&self) -> bool {
        self.send.as_ref().is_some_and(|s| !s.is_closed())
    }

    /// Sends the request and reads the response head; the body follows.
    pub async fn exchange(&mut self, out: &mut Outgoing) -> Result<(Response<()>, Decoder), Error> {
        if self.send.is_none() {
            let io = self.io.take().ok_or(Error::ClosedBeforeResponse)?;
            let (send, conn) = handshake(TokioIo::new(io)).await.map_err(Error::Hyper)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            self.send = Some(send);
        }
        let Some(send) = self.send.as_mut() else {
            return Err(Error::ClosedBeforeResponse);
        };
        send.ready()
            .await
            .map_err(|_| Error::ClosedBeforeResponse)?;
        let req = out.request()?;
        let resp = send.send_request(req).await.map_err(Error::Hyper)?;
        let (parts, body) = resp.into_parts();
        Ok((Response::from_parts(parts, ()), body))
    }
}

/// The response body as hyper reads it.
pub type Decoder = Incoming;

/// A request kept for all its attempts: the head, and a buffered body or
/// a streamed one until an attempt takes it.
pub struct Outgoing {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    buffered: Option<Bytes>,
    streaming: Option<crate::message::ClientBody>,
    idempotent: bool,
}

impl Outgoing {
    /// True when a request whose attempt failed can go out again.
    pub fn resendable(&self) -> bool {
        self.buffered.is_some() || self.streaming.is_some()
    }

    /// GET, HEAD, OPTIONS, PUT, DELETE or TRACE (RFC 9110 §9.2.2).
    pub fn idempotent(&self) -> bool {
        self.idempotent
    }

    fn request(&mut self) -> Result<Request<ReqBody>, Error> {
        let body = match (&self.buffered, self.streaming.take()) {
            (Some(b), _) => Either::Left(Full::new(b.clone())),
            (None, Some(s)) => Either::Right(s),
            (None, None) => return Err(Error::Invalid("request body already sent".into())),
        };
        let mut req = Request::new(body);
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        Ok(req)
    }
}

/// Builds a request: its method, origin-form target, headers, `host` (the
/// Host header to add, for headers that carry none; None when they carry
/// one) and body; hyper states the framing.
pub fn encode(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    host: Option<&str>,
    body: UpstreamBody,
) -> Outgoing {
    let mut h = headers.clone();
    h.remove(header::CONTENT_LENGTH);
    if let Some(v) = host.and_then(|host| HeaderValue::from_str(host).ok()) {
        h.insert(header::HOST, v);
    }
    let target = if target.is_empty() { "/" } else { target };
    let (buffered, streaming) = match body {
        UpstreamBody::Buffered(b) => (Some(b), None),
        UpstreamBody::Streaming(s) => (None, Some(s)),
    };
    Outgoing {
        method: method.clone(),
        uri: target.parse().unwrap_or_else(|_| Uri::from_static("/")),
        headers: h,
        buffered,
        streaming,
        idempotent: idempotent(method),
    }
}

/// A connection lent for one exchange, and given back once its response
/// body has been read to the end: the pool's lease.
pub trait Lent {
    /// The connection.
    fn conn(&mut self) -> &mut Conn;
}

/// A response body, with the connection it came on until it ends.
pub struct ResponseBody<L> {
    body: Incoming,
    done: bool,
    lease: Option<L>,
}

impl<L: Lent> ResponseBody<L> {
    /// The body of a response on `lease`'s connection.
    pub fn new(body: Incoming, lease: L) -> ResponseBody<L> {
        ResponseBody {
            done: body.is_end_stream(),
            body,
            lease: Some(lease),
        }
    }

    /// The connection, when the body was read to the end and the server
    /// may take another request on it.
    pub fn take_reusable(&mut self) -> Option<L> {
        if !self.done {
            return None;
        }
        let mut lease = self.lease.take()?;
        lease.conn().reusable().then_some(lease)
    }
}

impl<L: Lent + Unpin> Body for ResponseBody<L> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.done = true,
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.done = true,
            Poll::Ready(Some(Err(_))) => this.lease = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
