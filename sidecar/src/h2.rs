//! Upstream HTTP/2 connections (cleartext, prior knowledge: what gRPC
//! servers and `http2` ports expect), shared by the requests in flight to
//! one endpoint.
//!
//! Each event loop keeps its own connections to an endpoint, as Envoy's
//! workers do: a connection's I/O runs on the loop that opened it, so a
//! request on it wakes no other thread. A request takes the first connection
//! of its loop with a free stream (`http.maxConcurrentStreams`, unlimited by
//! default), else dials one; requests that find a dial under way wait for it
//! rather than each opening a connection of its own, and fail with its error
//! if it fails (to be retried on another endpoint). A connection that has
//! carried `maxRequestsPerConnection` requests or lived past
//! `maxConnectionDuration` takes no new request and closes once its last
//! stream is done; one idle for `http.idleTimeout` is closed by
//! [`H2Pool::sweep`].

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::{Builder, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::Notify;
use tracing::debug;

use crate::upstream::{PoolSettings, UpstreamError};

/// Body of a request sent over HTTP/2: buffered (a retry sends it again) or
/// the caller's, streamed and recorded.
pub type RequestBody = Either<Full<Bytes>, Recording>;

/// Streamed request bodies up to this size are recorded as they pass, so
/// that a retry can send them again (gRPC calls carry no length, so none is
/// buffered before it goes out).
pub const MAX_RECORDED: usize = crate::upstream::MAX_BUFFERED_BODY as usize;

/// What a [`Recording`] has seen pass.
#[derive(Default)]
pub struct Tape {
    chunks: Vec<Bytes>,
    len: usize,
    /// The body ended, and every byte of it is in `chunks`.
    complete: bool,
    /// Longer than [`MAX_RECORDED`], or with trailers: it cannot be replayed.
    lost: bool,
}

impl Tape {
    /// The whole body, when it ended and was short enough to keep.
    pub fn replay(&self) -> Option<Bytes> {
        if !self.complete || self.lost {
            return None;
        }
        Some(match self.chunks.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => Bytes::from(many.concat()),
        })
    }
}

/// The caller's request body, streamed to the endpoint as it arrives, with
/// a copy of it kept on a [`Tape`] while it is short. Frames are forwarded
/// at once: a streaming call that waits for an answer before it sends more
/// must not wait on the sidecar.
pub struct Recording {
    inner: crate::message::ClientBody,
    tape: Arc<Mutex<Tape>>,
}

impl Recording {
    /// Records `inner` on `tape`.
    pub fn new(inner: crate::message::ClientBody, tape: Arc<Mutex<Tape>>) -> Recording {
        Recording { inner, tape }
    }
}

impl Body for Recording {
    type Data = Bytes;
    type Error = crate::message::ClientBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::message::ClientBodyError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(r) = &polled {
            let mut tape = this.tape.lock().unwrap_or_else(|p| p.into_inner());
            // The last frame may come with the end: the sender then polls
            // no more, and would never see the None below.
            if this.inner.is_end_stream() {
                tape.complete = true;
            }
            match r {
                Some(Ok(frame)) => match frame.data_ref() {
                    Some(data) if !tape.lost => {
                        tape.len += data.len();
                        if tape.len > MAX_RECORDED {
                            tape.lost = true;
                            tape.chunks = Vec::new();
                        } else {
                            tape.chunks.push(data.clone());
                        }
                    }
                    Some(_) => {}
                    None => tape.lost = true, // trailers
                },
                Some(Err(_)) => tape.lost = true,
                None => tape.complete = true,
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request for one HTTP/2 attempt. The `host` header becomes the
/// `:authority` (else `fallback`, the endpoint's address), and `te:
/// trailers` goes along when the caller sent it: gRPC servers look for it,
/// and it is the one value HTTP/2 allows.
pub fn request(
    method: &Method,
    path: Option<&PathAndQuery>,
    headers: &HeaderMap,
    fallback: &Authority,
    te_trailers: bool,
    body: RequestBody,
) -> Request<RequestBody> {
    let authority = headers
        .get(header::HOST)
        .and_then(|h| Authority::try_from(h.as_bytes()).ok())
        .unwrap_or_else(|| fallback.clone());
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTP);
    uri.authority = Some(authority);
    uri.path_and_query = Some(
        path.cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    let mut req = Request::new(body);
    *req.method_mut() = method.clone();
    *req.uri_mut() = Uri::from_parts(uri).unwrap_or_else(|_| Uri::from_static("/"));
    *req.version_mut() = Version::HTTP_2;
    let h = req.headers_mut();
    h.reserve(headers.len() + 1);
    for (name, value) in headers {
        if name != header::HOST {
            h.append(name, value.clone());
        }
    }
    if te_trailers {
        h.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    req
}

/// What the requests on one connection share.
struct Streams {
    /// Requests on the connection now (their response bodies not yet done).
    active: AtomicU32,
    /// When `active` last fell to zero ([`crate::clock::now_ms`]).
    idle_since_ms: AtomicU64,
}

struct Conn {
    send: SendRequest<RequestBody>,
    streams: Arc<Streams>,
    /// Requests it has taken.
    uses: u32,
    born_ms: u64,
}

impl Conn {
    /// True when it may take no new request.
    fn retired(&self, now_ms: u64, s: &PoolSettings) -> bool {
        self.send.is_closed()
            || (s.max_connection_ms > 0
                && now_ms.saturating_sub(self.born_ms) > s.max_connection_ms)
            || (s.max_requests_per_connection > 0 && self.uses >= s.max_requests_per_connection)
    }

    fn idle_for(&self, now_ms: u64) -> Option<u64> {
        (self.streams.active.load(Ordering::Relaxed) == 0)
            .then(|| now_ms.saturating_sub(self.streams.idle_since_ms.load(Ordering::Relaxed)))
    }
}

#[derive(Default)]
struct Slot {
    conns: Vec<Conn>,
    /// A request of this loop is dialing; others wait for its connection.
    dialing: bool,
    /// Dials ended so far…
    dials: u64,
    /// …and how the last one failed (None: it connected, or was dropped).
    failure: Option<DialFailure>,
}

/// Why a dial failed, kept for the requests that waited on it: they fail
/// at once with it (and go to another endpoint) rather than each dial a
/// black hole for the connect timeout in turn.
#[derive(Clone)]
enum DialFailure {
    Io(std::io::ErrorKind, String),
    Timeout(std::time::Duration),
}

impl DialFailure {
    fn of(e: &UpstreamError) -> Option<DialFailure> {
        match e {
            UpstreamError::Connect(io) => Some(DialFailure::Io(io.kind(), io.to_string())),
            UpstreamError::ConnectTimeout(d) => Some(DialFailure::Timeout(*d)),
            _ => None,
        }
    }

    fn error(&self) -> UpstreamError {
        match self {
            DialFailure::Io(kind, msg) => {
                UpstreamError::Connect(std::io::Error::new(*kind, msg.clone()))
            }
            DialFailure::Timeout(d) => UpstreamError::ConnectTimeout(*d),
        }
    }
}

#[derive(Default)]
struct Loop {
    slot: Mutex<Slot>,
    dialed: Notify,
}

impl Loop {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One endpoint's HTTP/2 connections, per event loop.
pub struct H2Pool {
    loops: Box<[Loop]>,
}

/// A stream taken on a connection: counted until the response body is done.
struct Stream(Arc<Streams>);

impl Drop for Stream {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0
                .idle_since_ms
                .store(crate::clock::now_ms(), Ordering::Relaxed);
        }
    }
}

/// Clears the dialing mark, says how the dial ended and wakes the waiters,
/// also when the dialing request is dropped midway (its caller went away).
struct Dialing<'a> {
    l: &'a Loop,
    failure: Option<DialFailure>,
}

impl Drop for Dialing<'_> {
    fn drop(&mut self) {
        let mut slot = self.l.lock();
        slot.dialing = false;
        slot.dials += 1;
        slot.failure = self.failure.take();
        drop(slot);
        self.l.dialed.notify_waiters();
    }
}

/// A stream taken on a connection, for one request.
pub struct H2Stream {
    send: SendRequest<RequestBody>,
    stream: Stream,
    /// On a connection dialed for it.
    fresh: bool,
}

/// A stream on an existing connection, the right to dial, or the failure
/// of the dial this request waited for.
enum Taken {
    Stream(SendRequest<RequestBody>, Stream),
    Dial,
    Failed(UpstreamError),
}

impl H2Pool {
    /// A pool with a slot per event loop.
    pub fn new(loops: usize) -> H2Pool {
        H2Pool {
            loops: (0..loops.max(1)).map(|_| Loop::default()).collect(),
        }
    }

    /// Takes a stream on a connection of loop `l`, or the right to dial one,
    /// waiting while another request of the loop dials.
    async fn take(&self, l: &Loop, settings: &PoolSettings) -> Taken {
        // The dials ended when this request began to wait.
        let mut waited_from = None;
        loop {
            let wait = {
                let mut slot = l.lock();
                let now = crate::clock::now_ms();
                slot.conns.retain(|c| !c.retired(now, settings));
                let free = slot.conns.iter_mut().find(|c| {
                    settings.max_streams == 0
                        || c.streams.active.load(Ordering::Relaxed) < settings.max_streams
                });
                if let Some(c) = free {
                    c.uses += 1;
                    c.streams.active.fetch_add(1, Ordering::Relaxed);
                    return Taken::Stream(c.send.clone(), Stream(c.streams.clone()));
                }
                if waited_from.is_some_and(|n| n != slot.dials) {
                    if let Some(f) = &slot.failure {
                        return Taken::Failed(f.error());
                    }
                }
                if !slot.dialing {
                    slot.dialing = true;
                    return Taken::Dial;
                }
                waited_from.get_or_insert(slot.dials);
                // Registered before the lock is let go: the dialer's
                // notify_waiters cannot slip in between.
                l.dialed.notified()
            };
            wait.await;
        }
    }

    /// A stream on a connection of this event loop to `addr`, dialing one
    /// when none has a free stream. Taken before the request is built, so
    /// that a refused connection leaves the request's body to send elsewhere.
    pub async fn stream(
        &self,
        addr: SocketAddr,
        settings: &PoolSettings,
        open: &Arc<AtomicU32>,
        peer: Option<&crate::tls::Peer>,
    ) -> Result<H2Stream, UpstreamError> {
        let l = &self.loops[crate::upstream::event_loop() as usize % self.loops.len()];
        match self.take(l, settings).await {
            Taken::Stream(send, stream) => Ok(H2Stream {
                send,
                stream,
                fresh: false,
            }),
            Taken::Failed(e) => Err(e),
            Taken::Dial => {
                let mut dialing = Dialing { l, failure: None };
                let send = match dial(addr, settings, open, peer).await {
                    Ok(send) => send,
                    Err(e) => {
                        dialing.failure = DialFailure::of(&e);
                        return Err(e);
                    }
                };
                let streams = Arc::new(Streams {
                    active: AtomicU32::new(1),
                    idle_since_ms: AtomicU64::new(crate::clock::now_ms()),
                });
                l.lock().conns.push(Conn {
                    send: send.clone(),
                    streams: streams.clone(),
                    uses: 1,
                    born_ms: crate::clock::now_ms(),
                });
                drop(dialing);
                Ok(H2Stream {
                    send,
                    stream: Stream(streams),
                    fresh: true,
                })
            }
        }
    }

    /// Sends `req` on `s`. A request that a pooled connection closed
    /// before taking it (the server went away while it was idle) goes out
    /// on another connection, at most three times. That resend is not a
    /// retry and counts against no budget: hyper's `try_send_request` gives
    /// a request back only when the connection closed before any frame of
    /// it was written (a stream it began and lost is an error without the
    /// request), so the copy that failed provably never reached the
    /// upstream (`a_request_given_back_by_a_closed_connection_is_sent_once`).
    pub async fn send(
        &self,
        addr: SocketAddr,
        settings: &PoolSettings,
        open: &Arc<AtomicU32>,
        peer: Option<&crate::tls::Peer>,
        mut s: H2Stream,
        mut req: Request<RequestBody>,
    ) -> Result<Response<ResponseBody>, UpstreamError> {
        let mut tries = 0;
        loop {
            match s.send.try_send_request(req).await {
                Ok(resp) => {
                    return Ok(resp.map(|inner| ResponseBody {
                        inner,
                        _stream: s.stream,
                    }))
                }
                Err(mut e) => match e.take_message() {
                    Some(back) if !s.fresh && tries < 3 => {
                        debug!(%addr, error = %e.error(), "pooled HTTP/2 connection closed before the request went out; sending it on another");
                        req = back;
                        tries += 1;
                        s = self.stream(addr, settings, open, peer).await?;
                    }
                    _ => return Err(UpstreamError::H2(e.into_error())),
                },
            }
        }
    }

    /// Closes connections idle for longer than the idle timeout, and lets
    /// go of retired ones (they close once their streams are done).
    pub fn sweep(&self, settings: &PoolSettings, now: u64) {
        let idle_ms = settings.idle_timeout.as_millis() as u64;
        for l in self.loops.iter() {
            l.lock().conns.retain(|c| {
                !c.retired(now, settings) && c.idle_for(now).is_none_or(|ms| ms <= idle_ms)
            });
        }
    }

    /// HTTP/2 connections this pool holds (open, taking requests).
    pub fn conns(&self) -> usize {
        self.loops.iter().map(|l| l.lock().conns.len()).sum()
    }
}

/// Counts an open connection until its task ends.
struct Open(Arc<AtomicU32>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn dial(
    addr: SocketAddr,
    settings: &PoolSettings,
    open: &Arc<AtomicU32>,
    peer: Option<&crate::tls::Peer>,
) -> Result<SendRequest<RequestBody>, UpstreamError> {
    let timeout = settings.connect_timeout;
    let stream = crate::tls::connect(addr, timeout, peer, true)
        .await
        .map_err(|e| UpstreamError::of_dial(e, timeout))?;
    let mut builder = Builder::new(TokioExecutor::new());
    builder.timer(TokioTimer::new());
    let handshake = builder.handshake::<_, RequestBody>(TokioIo::new(stream));
    let (send, conn) = match tokio::time::timeout(timeout, handshake).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => return Err(UpstreamError::Connect(std::io::Error::other(e))),
        Err(_) => return Err(UpstreamError::ConnectTimeout(timeout)),
    };
    open.fetch_add(1, Ordering::Relaxed);
    let open = Open(open.clone());
    tokio::spawn(async move {
        let _open = open;
        if let Err(e) = conn.await {
            debug!(%addr, error = %e, "upstream HTTP/2 connection ended");
        }
    });
    Ok(send)
}

/// The body of a response that came over HTTP/2; its stream counts against
/// the connection until the body is done.
pub struct ResponseBody {
    inner: Incoming,
    _stream: Stream,
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use http_body_util::BodyExt;
    use tokio::net::TcpListener;

    use super::*;

    const SETTINGS: PoolSettings = PoolSettings {
        connect_timeout: Duration::from_secs(1),
        idle_timeout: crate::upstream::DEFAULT_IDLE_TIMEOUT,
        max_requests_per_connection: 0,
        max_connection_ms: 0,
        max_streams: 0,
    };

    /// An h2c server answering every request after 200 ms (so that
    /// concurrent requests overlap), counting connections.
    async fn server() -> (SocketAddr, Arc<AtomicU32>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let conns = Arc::new(AtomicU32::new(0));
        let c = conns.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                c.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(
                            TokioIo::new(s),
                            hyper::service::service_fn(|_req| async {
                                tokio::time::sleep(Duration::from_millis(200)).await;
                                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
                            }),
                        ),
                );
            }
        });
        (addr, conns)
    }

    /// A GET of `svc` with no body.
    fn get() -> Request<RequestBody> {
        request(
            &Method::GET,
            None,
            &HeaderMap::new(),
            &Authority::from_static("svc"),
            false,
            Either::Left(Full::new(Bytes::new())),
        )
    }

    async fn call(pool: &H2Pool, addr: SocketAddr, s: &PoolSettings, open: &Arc<AtomicU32>) {
        let stream = pool.stream(addr, s, open, None).await.expect("stream");
        let req = get();
        let resp = pool
            .send(addr, s, open, None, stream, req)
            .await
            .expect("send");
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(body, "ok");
    }

    #[tokio::test]
    async fn requests_share_connections_up_to_max_concurrent_streams() {
        // Four requests at once: one connection when streams are unlimited
        // (the others wait for its dial rather than dial their own), two at
        // two streams each, four at one.
        for (max_streams, want) in [(0, 1), (2, 2), (1, 4)] {
            let (addr, conns) = server().await;
            let pool = H2Pool::new(1);
            let open = Arc::new(AtomicU32::new(0));
            let s = PoolSettings {
                max_streams,
                ..SETTINGS
            };
            tokio::join!(
                call(&pool, addr, &s, &open),
                call(&pool, addr, &s, &open),
                call(&pool, addr, &s, &open),
                call(&pool, addr, &s, &open),
            );
            assert_eq!(
                conns.load(Ordering::Relaxed),
                want,
                "maxConcurrentStreams {max_streams}"
            );
            assert_eq!(pool.conns(), want as usize);
            // Later requests reuse them.
            call(&pool, addr, &s, &open).await;
            assert_eq!(conns.load(Ordering::Relaxed), want);
        }
    }

    #[tokio::test]
    async fn requests_waiting_on_a_failed_dial_fail_with_it() {
        // A port nobody listens on: four requests at once make one dial,
        // and all four get its error, rather than dial in turn.
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        let pool = H2Pool::new(1);
        let open = Arc::new(AtomicU32::new(0));
        let try_one = || async {
            match pool.stream(addr, &SETTINGS, &open, None).await {
                Err(e) => assert!(e.is_connect(), "{e}"),
                Ok(_) => panic!("connected to a closed port"),
            }
        };
        tokio::join!(try_one(), try_one(), try_one(), try_one());
        assert_eq!(pool.loops[0].lock().dials, 1);
        // The next request dials again.
        try_one().await;
        assert_eq!(pool.loops[0].lock().dials, 2);
    }

    /// An h2c server counting the requests it reads; notifying `close`
    /// drops every connection open then (the server went away).
    async fn closable_server() -> (SocketAddr, Arc<AtomicU32>, Arc<tokio::sync::Notify>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let seen = Arc::new(AtomicU32::new(0));
        let close = Arc::new(tokio::sync::Notify::new());
        let (c, n) = (seen.clone(), close.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (c, n) = (c.clone(), n.clone());
                tokio::spawn(async move {
                    let serve = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(
                            TokioIo::new(s),
                            hyper::service::service_fn(move |_req| {
                                c.fetch_add(1, Ordering::Relaxed);
                                async {
                                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
                                }
                            }),
                        );
                    tokio::select! {
                        _ = serve => {}
                        _ = n.notified() => {}
                    }
                });
            }
        });
        (addr, seen, close)
    }

    #[tokio::test]
    async fn a_request_given_back_by_a_closed_connection_is_sent_once() {
        let (addr, seen, close) = closable_server().await;
        let pool = H2Pool::new(1);
        let open = Arc::new(AtomicU32::new(0));
        call(&pool, addr, &SETTINGS, &open).await;
        // A stream on the pooled connection; then the server goes away and
        // the client's connection ends before the request is written.
        let stream = pool
            .stream(addr, &SETTINGS, &open, None)
            .await
            .expect("stream");
        assert!(!stream.fresh);
        close.notify_waiters();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !stream.send.is_closed() {
            assert!(tokio::time::Instant::now() < deadline, "still open");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let req = get();
        let resp = pool
            .send(addr, &SETTINGS, &open, None, stream, req)
            .await
            .expect("sent on a new connection");
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(body, "ok");
        // Two calls, two requests read: the copy given back never went out.
        assert_eq!(seen.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_idle_timeout() {
        let (addr, conns) = server().await;
        let pool = H2Pool::new(1);
        let open = Arc::new(AtomicU32::new(0));
        let s = PoolSettings {
            idle_timeout: Duration::from_millis(300),
            ..SETTINGS
        };
        call(&pool, addr, &s, &open).await;
        let now = crate::clock::tick();
        pool.sweep(&s, now);
        assert_eq!(pool.conns(), 1, "idle for less than the timeout");
        // The time is the sweep's to be given: a second later, no sleep.
        pool.sweep(&s, now + 1_000);
        assert_eq!(pool.conns(), 0, "idle for longer");
        // Its task ends once the pool let go of it.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while open.load(Ordering::Relaxed) != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "connection still open"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        call(&pool, addr, &s, &open).await;
        assert_eq!(conns.load(Ordering::Relaxed), 2, "a new one after");
    }
}
