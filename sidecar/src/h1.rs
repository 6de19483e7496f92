//! The upstream side of the proxy: HTTP/1.1 requests written to, and
//! responses read from, a pooled TCP connection by the request's own task.
//!
//! hyper's client (`hyper::client::conn::http1`) runs each connection as a
//! task of its own and passes every request and response through a channel
//! and a one-shot to it: two task hand-offs per request. A proxy needs far
//! less of a client: the request head it writes comes from a message hyper's
//! server already parsed and validated, and the response is passed on, not
//! interpreted. So the request's task writes the head from one reused buffer
//! and parses the response head with `httparse` (the parser hyper itself
//! uses), and the response body decodes itself from the connection as the
//! downstream side asks for it. Response header values share the head's
//! buffer instead of being copied.
//!
//! What it saves, measured: the sidecar built with hyper's client in its
//! place (`--features hyper-h1`, `src/h1_hyper.rs`, the same pool and
//! request path around it) beside this one, on the same event loops and in
//! the same rounds of `minimesh bench overhead --baseline-sidecar` (5
//! rounds, 2026-12-05, BENCHMARKS.md): 18% less CPU per request at
//! saturation (11.6 against 14.1 µs), 10% less per 1,000 requests at 1,000
//! req/s (0.055 against 0.061 CPU s), and 1.11× hyper's top rate (ahead in
//! 5 of 5 rounds). The bar for keeping it was 5%.
//!
//! Response framing follows RFC 9112 §6.3: no body for HEAD, 1xx, 204 and
//! 304; chunked when it is the final transfer coding; else Content-Length
//! (conflicting values are refused); else until the connection closes. A
//! response that carries both Transfer-Encoding and Content-Length, closes
//! the connection, arrives before the request body was sent, or leaves
//! bytes behind it ends its connection instead of returning it to the pool.
//! Chunk extensions must be well formed (RFC 9112 §7.1.1); trailer fields
//! that would frame, route or speak for the mesh are dropped. The limits
//! (head, chunk-size line, trailer section) hold however the bytes were
//! split into reads. The reader is fuzzed (`fuzz/`, through [`fuzz`]) for
//! exactly that: the same result in one read, byte by byte, or in any split.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

#[cfg(test)]
mod random_responses;

pub mod fuzz;

/// Largest response head accepted (status line and headers).
pub const MAX_HEAD: usize = 64 * 1024;
/// Most response header fields accepted.
pub const MAX_HEADERS: usize = 128;
/// Longest chunk-size line accepted (with extensions).
const MAX_CHUNK_LINE: usize = 4 * 1024;
/// Largest trailer section accepted.
const MAX_TRAILERS: usize = 16 * 1024;
/// Read buffer growth step.
const READ_CHUNK: usize = 8 * 1024;

/// Body sent upstream: buffered (so that a retry can resend it) or streamed.
pub enum UpstreamBody {
    /// The whole body, read before the request goes out.
    Buffered(Bytes),
    /// The caller's body, passed on as it arrives.
    Streaming(Incoming),
}

/// Why an exchange on an upstream connection failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection ended before any byte of a response.
    #[error("connection closed before a response")]
    ClosedBeforeResponse,
    /// The connection ended in the middle of a response.
    #[error("connection closed in the middle of the response")]
    Incomplete,
    /// Writing the request failed.
    #[error("writing the request: {0}")]
    Write(io::Error),
    /// Reading the response failed.
    #[error("reading the response: {0}")]
    Read(io::Error),
    /// The caller's request body failed (the caller went away).
    #[error("reading the request body: {0}")]
    RequestBody(hyper::Error),
    /// The response broke HTTP/1.1.
    #[error("invalid response: {0}")]
    Invalid(String),
}

impl Error {
    /// True when the endpoint sent nothing back: on a reused connection,
    /// a sign that the server closed it while it was idle.
    pub fn nothing_received(&self) -> bool {
        match self {
            Error::ClosedBeforeResponse | Error::Write(_) => true,
            Error::Read(e) => matches!(
                e.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            _ => false,
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

/// One upstream connection with its buffers.
pub struct Conn {
    io: TcpStream,
    rbuf: BytesMut,
    /// The server may take another request on it once this response is read.
    keep_alive: bool,
    _open: Open,
}

/// How the request body goes out after the head.
pub struct Streaming {
    body: Incoming,
    chunked: bool,
}

impl Conn {
    /// Wraps a connected stream, counted in `open` until dropped.
    pub fn new(io: TcpStream, open: &Arc<AtomicU32>) -> Conn {
        open.fetch_add(1, Ordering::Relaxed);
        Conn {
            io,
            rbuf: BytesMut::new(),
            keep_alive: true,
            _open: Open(open.clone()),
        }
    }

    /// True when an idle connection cannot take a request: the server
    /// closed it, reset it or sent bytes nobody asked for. Costs no system
    /// call unless the event loop saw the socket become readable.
    pub fn is_closed(&self) -> bool {
        if !self.rbuf.is_empty() {
            return true;
        }
        let mut probe = [0u8; 1];
        !matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// May go back to the pool: the server keeps it open and no stray bytes
    /// follow the response.
    fn reusable(&self) -> bool {
        self.keep_alive && self.rbuf.is_empty()
    }

    /// Writes the encoded request, streams its body if any, and reads the
    /// response head. A response that arrives before the body was all sent
    /// is returned, and the connection is closed after it. A streamed body
    /// is taken from `out` only once the head was written, so that a
    /// request whose head could not be written can go out elsewhere.
    pub async fn exchange(&mut self, out: &mut Outgoing) -> Result<(Response<()>, Decoder), Error> {
        let is_head = out.is_head;
        if let Err(e) = self.io.write_all(&out.buf).await {
            // A server may answer before it has read the whole request (413
            // to a large body) and close: that answer is the response.
            self.keep_alive = false;
            let mut ignored = false;
            return match read_head(&mut self.io, &mut self.rbuf, &mut ignored, is_head).await {
                Ok(head) => Ok(head),
                Err(_) => Err(Error::Write(e)),
            };
        }
        self.keep_alive = true;
        let Some(mut body) = out.streaming.take() else {
            return read_head(&mut self.io, &mut self.rbuf, &mut self.keep_alive, is_head).await;
        };
        let mut all_sent = false;
        let head = {
            let (mut r, mut w) = self.io.split();
            let send = send_body(&mut w, &mut body);
            let recv = read_head(&mut r, &mut self.rbuf, &mut self.keep_alive, is_head);
            tokio::pin!(send, recv);
            let mut sent: Option<Result<(), Error>> = None;
            let head = loop {
                tokio::select! {
                    biased;
                    head = &mut recv => break head,
                    r = &mut send, if sent.is_none() => match r {
                        // The caller went away mid-body: no response will come.
                        Err(e @ Error::RequestBody(_)) => return Err(e),
                        r => sent = Some(r),
                    },
                }
            };
            match (head, sent) {
                (Ok(head), Some(Ok(()))) => {
                    all_sent = true;
                    Ok(head)
                }
                (Ok(head), _) => Ok(head),
                (Err(_), Some(Err(e))) => Err(e),
                (Err(e), _) => Err(e),
            }
        };
        if !all_sent {
            // Answered early (or the server stopped reading): the rest of the
            // body will not be sent, so the connection cannot be reused.
            self.keep_alive = false;
        }
        head
    }
}

/// A request encoded once for all its attempts: the head and a buffered
/// body, in a buffer reused from request to request on this thread.
pub struct Outgoing {
    buf: Vec<u8>,
    is_head: bool,
    idempotent: bool,
    /// The body still to stream after the head, until an attempt takes it.
    streaming: Option<Streaming>,
    streams: bool,
}

/// Encode buffers kept per thread for reuse (one per request awaiting its
/// response head), and the largest kept: a head with a small body fits, and
/// what a burst of large bodies leaves behind is bounded by 1 MiB a thread.
const SPARE_BUFS: usize = 64;
const SPARE_BUF_MAX: usize = 16 * 1024;

thread_local! {
    static SPARE: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.buf);
        if buf.capacity() <= SPARE_BUF_MAX {
            buf.clear();
            SPARE.with(|s| {
                if let Ok(mut s) = s.try_borrow_mut() {
                    if s.len() < SPARE_BUFS {
                        s.push(buf);
                    }
                }
            });
        }
    }
}

impl Outgoing {
    /// True when a request whose attempt failed can go out again: its body
    /// was buffered, or is still here to stream.
    pub fn resendable(&self) -> bool {
        !self.streams || self.streaming.is_some()
    }

    /// GET, HEAD, OPTIONS, PUT, DELETE or TRACE (RFC 9110 §9.2.2).
    pub fn idempotent(&self) -> bool {
        self.idempotent
    }
}

/// Encodes a request: its method, origin-form target, headers (with
/// `host` when they carry none) and body. A buffered body goes in with the
/// head; a streamed one is sent with a length when its size is known, else
/// chunked.
pub fn encode(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    host: &str,
    body: UpstreamBody,
) -> Outgoing {
    let mut w = SPARE
        .with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop()))
        .unwrap_or_default();
    w.extend_from_slice(method.as_str().as_bytes());
    w.push(b' ');
    w.extend_from_slice(if target.is_empty() {
        b"/"
    } else {
        target.as_bytes()
    });
    w.extend_from_slice(b" HTTP/1.1\r\n");
    if !headers.contains_key(header::HOST) {
        // HTTP/1.1 requires one.
        put_field(&mut w, b"host", host.as_bytes());
    }
    for (name, value) in headers {
        // The framing is ours to state (below), from the body we send.
        if name != header::CONTENT_LENGTH {
            put_field(&mut w, name.as_str().as_bytes(), value.as_bytes());
        }
    }
    let streaming = match body {
        UpstreamBody::Buffered(data) => {
            if !data.is_empty() || !bodyless_method(method) {
                content_length(&mut w, data.len() as u64);
            }
            w.extend_from_slice(b"\r\n");
            w.extend_from_slice(&data);
            None
        }
        UpstreamBody::Streaming(body) => {
            let chunked = match body.size_hint().exact() {
                Some(n) => {
                    content_length(&mut w, n);
                    false
                }
                None => {
                    w.extend_from_slice(b"transfer-encoding: chunked\r\n");
                    true
                }
            };
            w.extend_from_slice(b"\r\n");
            Some(Streaming { body, chunked })
        }
    };
    Outgoing {
        buf: w,
        is_head: *method == Method::HEAD,
        idempotent: idempotent(method),
        streams: streaming.is_some(),
        streaming,
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

fn bodyless_method(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET
            | Method::HEAD
            | Method::DELETE
            | Method::OPTIONS
            | Method::TRACE
            | Method::CONNECT
    )
}

/// Appends one header field line.
fn put_field(w: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    w.extend_from_slice(name);
    w.extend_from_slice(b": ");
    w.extend_from_slice(value);
    w.extend_from_slice(b"\r\n");
}

fn content_length(w: &mut Vec<u8>, n: u64) {
    use std::io::Write;
    // Writing into a Vec cannot fail.
    let _ = write!(w, "content-length: {n}\r\n");
}

async fn send_body<W: AsyncWrite + Unpin>(io: &mut W, s: &mut Streaming) -> Result<(), Error> {
    while let Some(frame) = s.body.frame().await {
        let frame = frame.map_err(Error::RequestBody)?;
        match frame.into_data() {
            Ok(data) if data.is_empty() => {}
            Ok(data) => {
                if s.chunked {
                    // The chunk-size line, without an allocation per chunk.
                    let mut line = [0u8; 20];
                    let mut c = std::io::Cursor::new(&mut line[..]);
                    let _ = std::io::Write::write_fmt(&mut c, format_args!("{:x}\r\n", data.len()));
                    let n = c.position() as usize;
                    io.write_all(&line[..n]).await.map_err(Error::Write)?;
                }
                io.write_all(&data).await.map_err(Error::Write)?;
                if s.chunked {
                    io.write_all(b"\r\n").await.map_err(Error::Write)?;
                }
            }
            Err(frame) => {
                if let (true, Ok(trailers)) = (s.chunked, frame.into_trailers()) {
                    let mut t = b"0\r\n".to_vec();
                    for (name, value) in &trailers {
                        put_field(&mut t, name.as_str().as_bytes(), value.as_bytes());
                    }
                    t.extend_from_slice(b"\r\n");
                    io.write_all(&t).await.map_err(Error::Write)?;
                    return Ok(());
                }
            }
        }
    }
    if s.chunked {
        io.write_all(b"0\r\n\r\n").await.map_err(Error::Write)?;
    }
    Ok(())
}

/// Reads what the socket has into `buf`'s spare capacity. Through
/// `AsyncRead`, so that a short read clears the socket's readiness and the
/// next read waits for the event loop instead of costing a system call.
fn poll_fill<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
    tokio_util::io::poll_read_buf(std::pin::Pin::new(io), cx, buf)
}

fn invalid(what: impl Into<String>) -> Error {
    Error::Invalid(what.into())
}

/// Reads and parses the response head (skipping interim 1xx responses).
async fn read_head<R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut BytesMut,
    keep_alive: &mut bool,
    is_head: bool,
) -> Result<(Response<()>, Decoder), Error> {
    let mut received = false;
    loop {
        if !buf.is_empty() {
            received = true;
            if let Some(head) = parse_head(buf, keep_alive, is_head)? {
                return Ok(head);
            }
            if buf.len() >= MAX_HEAD {
                return Err(invalid(format!(
                    "response head larger than {MAX_HEAD} bytes"
                )));
            }
        }
        let n = std::future::poll_fn(|cx| poll_fill(&mut *io, buf, cx))
            .await
            .map_err(Error::Read)?;
        if n == 0 {
            return Err(if received || !buf.is_empty() {
                Error::Incomplete
            } else {
                Error::ClosedBeforeResponse
            });
        }
    }
}

/// Parses a complete head at the start of `buf` (consuming it), or None
/// when more bytes are needed.
fn parse_head(
    buf: &mut BytesMut,
    keep_alive: &mut bool,
    is_head: bool,
) -> Result<Option<(Response<()>, Decoder)>, Error> {
    loop {
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut fields);
        let len = match parsed.parse(buf) {
            // However the head arrived (one read or many), the limit holds.
            Ok(httparse::Status::Complete(len)) if len > MAX_HEAD => {
                return Err(invalid(format!(
                    "response head larger than {MAX_HEAD} bytes"
                )))
            }
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(invalid(format!("more than {MAX_HEADERS} header fields")))
            }
            Err(e) => return Err(invalid(e.to_string())),
        };
        let code = parsed.code.unwrap_or(0);
        if (100..200).contains(&code) {
            if code == 101 {
                return Err(invalid(
                    "101 Switching Protocols to a request that asked for no upgrade",
                ));
            }
            // Interim (100 Continue, 103 Early Hints): the final one follows.
            buf.advance(len);
            continue;
        }
        let status = StatusCode::from_u16(code).map_err(|_| invalid(format!("status {code}")))?;
        let version = if parsed.version == Some(0) {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        // Where each field's name and value lie in the head, so that the
        // values can share its buffer once it is frozen.
        let base = buf.as_ptr() as usize;
        let mut spans = [(0u32, 0u32, 0u32, 0u32); MAX_HEADERS];
        let n = parsed.headers.len();
        for (span, h) in spans.iter_mut().zip(parsed.headers.iter()) {
            let name = h.name.as_ptr() as usize - base;
            let value = h.value.as_ptr() as usize - base;
            *span = (
                name as u32,
                (name + h.name.len()) as u32,
                value as u32,
                (value + h.value.len()) as u32,
            );
        }
        let head = buf.split_to(len).freeze();
        // One more: the proxy adds the header naming the endpoint.
        let mut headers = HeaderMap::with_capacity(n + 1);
        let mut length: Option<u64> = None;
        let mut transfer_encoding = false;
        let mut chunked = false;
        let mut close = version == Version::HTTP_10;
        for &(ns, ne, vs, ve) in &spans[..n] {
            let name = HeaderName::from_bytes(&head[ns as usize..ne as usize])
                .map_err(|_| invalid("bad header name"))?;
            let value = HeaderValue::from_maybe_shared(head.slice(vs as usize..ve as usize))
                .map_err(|_| invalid(format!("bad value of header {name}")))?;
            if name == header::CONTENT_LENGTH {
                let v =
                    parse_length(value.as_bytes()).ok_or_else(|| invalid("bad content-length"))?;
                if length.is_some_and(|l| l != v) {
                    return Err(invalid("conflicting content-length values"));
                }
                length = Some(v);
            } else if name == header::TRANSFER_ENCODING {
                transfer_encoding = true;
                // Only the final coding decides.
                chunked = value
                    .as_bytes()
                    .rsplit(|&b| b == b',')
                    .next()
                    .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            } else if name == header::CONNECTION {
                for token in value.as_bytes().split(|&b| b == b',') {
                    let token = token.trim_ascii();
                    if token.eq_ignore_ascii_case(b"close") {
                        close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive")
                        && version == Version::HTTP_10
                    {
                        close = false;
                    }
                }
            }
            headers.append(name, value);
        }
        let decoder = if is_head || code == 204 || code == 304 {
            Decoder::Done
        } else if transfer_encoding {
            // With Content-Length too, the message is suspect: read it as
            // chunked (the coding wins) and do not reuse the connection.
            close |= length.is_some() || !chunked;
            if chunked {
                Decoder::Chunked(Chunk::Size)
            } else {
                Decoder::Eof
            }
        } else {
            match length {
                Some(0) => Decoder::Done,
                Some(n) => Decoder::Length(n),
                None => {
                    close = true;
                    Decoder::Eof
                }
            }
        };
        *keep_alive = !close;
        let mut resp = Response::new(());
        *resp.status_mut() = status;
        *resp.version_mut() = version;
        *resp.headers_mut() = headers;
        return Ok(Some((resp, decoder)));
    }
}

fn parse_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// Where a response body is in its framing.
#[derive(Debug)]
pub enum Decoder {
    /// This many bytes remain.
    Length(u64),
    /// Chunked transfer coding.
    Chunked(Chunk),
    /// Until the connection closes.
    Eof,
    /// Read to the end.
    Done,
}

/// Where a chunked body is.
#[derive(Debug)]
pub enum Chunk {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk, this many bytes remain.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
}

/// What a response body is read from: the bytes read so far, and a way
/// to read more (a connection, or memory for the fuzz target).
trait Source {
    /// Bytes read and not yet consumed.
    fn rbuf(&mut self) -> &mut BytesMut;
    /// Reads more into [`Source::rbuf`]; 0 at the end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>>;
}

impl Source for Conn {
    fn rbuf(&mut self) -> &mut BytesMut {
        &mut self.rbuf
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        poll_fill(&mut self.io, &mut self.rbuf, cx)
    }
}

impl Decoder {
    /// The next frame of the body from `conn`.
    fn poll_frame<S: Source>(
        &mut self,
        conn: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        loop {
            match self {
                Decoder::Done => return Poll::Ready(None),
                Decoder::Length(rem) => {
                    let data = ready!(take_up_to(conn, cx, rem))?;
                    if *rem == 0 {
                        *self = Decoder::Done;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Decoder::Eof => {
                    if conn.rbuf().is_empty() && ready!(fill(conn, cx))? == 0 {
                        *self = Decoder::Done;
                        return Poll::Ready(None);
                    }
                    let data = conn.rbuf().split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Decoder::Chunked(Chunk::Data(rem)) => {
                    let data = ready!(take_up_to(conn, cx, rem))?;
                    if *rem == 0 {
                        *self = Decoder::Chunked(Chunk::DataEnd);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Decoder::Chunked(Chunk::DataEnd) => {
                    if conn.rbuf().len() < 2 {
                        if ready!(fill(conn, cx))? == 0 {
                            return Poll::Ready(Some(Err(Error::Incomplete)));
                        }
                        continue;
                    }
                    if &conn.rbuf()[..2] != b"\r\n" {
                        return Poll::Ready(Some(Err(invalid("chunk data not followed by CRLF"))));
                    }
                    conn.rbuf().advance(2);
                    *self = Decoder::Chunked(Chunk::Size);
                }
                Decoder::Chunked(Chunk::Size) => {
                    // The limits hold however the bytes were split into
                    // reads: a line found in one large read is measured too.
                    let eol = conn.rbuf().iter().position(|&b| b == b'\n');
                    if eol.unwrap_or(conn.rbuf().len()) > MAX_CHUNK_LINE {
                        return Poll::Ready(Some(Err(invalid("chunk-size line too long"))));
                    }
                    let Some(eol) = eol else {
                        if ready!(fill(conn, cx))? == 0 {
                            return Poll::Ready(Some(Err(Error::Incomplete)));
                        }
                        continue;
                    };
                    let size = match chunk_size(&conn.rbuf()[..=eol]) {
                        Some(s) => s,
                        None => return Poll::Ready(Some(Err(invalid("bad chunk-size line")))),
                    };
                    conn.rbuf().advance(eol + 1);
                    *self = Decoder::Chunked(if size == 0 {
                        Chunk::Trailers
                    } else {
                        Chunk::Data(size)
                    });
                }
                Decoder::Chunked(Chunk::Trailers) => {
                    if conn.rbuf().starts_with(b"\r\n") {
                        conn.rbuf().advance(2);
                        *self = Decoder::Done;
                        return Poll::Ready(None);
                    }
                    let end = conn.rbuf().windows(4).position(|w| w == b"\r\n\r\n");
                    if end.map_or(conn.rbuf().len(), |e| e + 4) > MAX_TRAILERS {
                        return Poll::Ready(Some(Err(invalid("trailer section too large"))));
                    }
                    let Some(end) = end else {
                        if ready!(fill(conn, cx))? == 0 {
                            return Poll::Ready(Some(Err(Error::Incomplete)));
                        }
                        continue;
                    };
                    let section = conn.rbuf().split_to(end + 4);
                    *self = Decoder::Done;
                    return Poll::Ready(Some(trailers(&section).map(Frame::trailers)));
                }
            }
        }
    }
}

/// Up to `rem` bytes of a body whose length is known (a Content-Length
/// body, or one chunk), reading when none is buffered; `rem` goes down by
/// as many. The connection ending first is an error.
fn take_up_to<S: Source>(
    conn: &mut S,
    cx: &mut Context<'_>,
    rem: &mut u64,
) -> Poll<Result<Bytes, Error>> {
    if conn.rbuf().is_empty() && ready!(fill(conn, cx))? == 0 {
        return Poll::Ready(Err(Error::Incomplete));
    }
    let take = (*rem).min(conn.rbuf().len() as u64);
    *rem -= take;
    Poll::Ready(Ok(conn.rbuf().split_to(take as usize).freeze()))
}

fn fill<S: Source>(conn: &mut S, cx: &mut Context<'_>) -> Poll<Result<usize, Error>> {
    conn.poll_fill(cx).map_err(Error::Read)
}

/// The size on a chunk-size line (`1a;name=value\r\n`), or None if
/// malformed. After the hex digits only chunk extensions may follow, as RFC
/// 9112 §7.1.1 writes them: `;` and a token, optionally `=` and a token or a
/// quoted string, with optional whitespace around `;` and `=`. Anything else
/// (a bare CR, a control character, a stray byte) is refused rather than
/// passed over: a line two parsers read differently is how requests and
/// responses are smuggled.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\r\n")?;
    let end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let (digits, mut rest) = line.split_at(end);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    loop {
        rest = skip_ws(rest);
        if rest.is_empty() {
            break;
        }
        rest = skip_ws(rest.strip_prefix(b";")?);
        let name = token_len(rest);
        if name == 0 {
            return None;
        }
        rest = skip_ws(&rest[name..]);
        if let Some(value) = rest.strip_prefix(b"=") {
            let value = skip_ws(value);
            let n = if value.first() == Some(&b'"') {
                quoted_len(value)?
            } else {
                token_len(value)
            };
            if n == 0 {
                return None;
            }
            rest = &value[n..];
        }
    }
    digits.iter().try_fold(0u64, |n, &d| {
        let v = (d as char).to_digit(16)?;
        Some((n << 4) | u64::from(v))
    })
}

fn skip_ws(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| matches!(c, b' ' | b'\t')).count();
    &b[n..]
}

/// Length of the token (RFC 9110 §5.6.2) at the start of `b`.
fn token_len(b: &[u8]) -> usize {
    b.iter()
        .take_while(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(c))
        .count()
}

/// Length of the quoted string (RFC 9110 §5.6.4) at the start of `b`,
/// quotes included; None if it is not one.
fn quoted_len(b: &[u8]) -> Option<usize> {
    let mut i = 1;
    while i < b.len() {
        match b[i] {
            b'"' => return Some(i + 1),
            b'\\'
                if b.get(i + 1)
                    .is_some_and(|c| *c == b'\t' || (b' '..0x7f).contains(c) || *c >= 0x80) =>
            {
                i += 2
            }
            b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..=0xff => i += 1,
            _ => return None,
        }
    }
    None
}

/// Trailer fields that are never passed on: they would frame, route or
/// speak for the mesh, and a trailer may do none of that (RFC 9110 §6.5.1).
/// The same names the proxy drops from response headers, and the mesh's own.
fn dropped_trailer(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "transfer-encoding"
            | "upgrade"
            | "trailer"
            | "content-length"
            | "host"
    ) || name.as_str().starts_with(minimesh_proto::headers::PREFIX)
}

fn trailers(section: &[u8]) -> Result<HeaderMap, Error> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match httparse::parse_headers(section, &mut fields) {
        Ok(httparse::Status::Complete((_, fields))) => {
            let mut map = HeaderMap::with_capacity(fields.len());
            for f in fields {
                let name = HeaderName::from_bytes(f.name.as_bytes())
                    .map_err(|_| invalid("bad trailer name"))?;
                let value =
                    HeaderValue::from_bytes(f.value).map_err(|_| invalid("bad trailer value"))?;
                if !dropped_trailer(&name) {
                    map.append(name, value);
                }
            }
            Ok(map)
        }
        _ => Err(invalid("bad trailer section")),
    }
}

/// A connection lent for one exchange, and given back once its response
/// body has been read to the end: the pool's lease.
pub trait Lent {
    /// The connection.
    fn conn(&mut self) -> &mut Conn;
}

/// A response body read from its connection as it is polled.
pub struct ResponseBody<L> {
    decoder: Decoder,
    lease: Option<L>,
}

impl<L: Lent> ResponseBody<L> {
    /// The body of a response on `lease`'s connection.
    pub fn new(decoder: Decoder, lease: L) -> ResponseBody<L> {
        ResponseBody {
            decoder,
            lease: Some(lease),
        }
    }

    /// The connection, when the body was read to the end and the server
    /// may take another request on it.
    pub fn take_reusable(&mut self) -> Option<L> {
        if !matches!(self.decoder, Decoder::Done) {
            return None;
        }
        let mut lease = self.lease.take()?;
        lease.conn().reusable().then_some(lease)
    }
}

impl<L: Lent + Unpin> Body for ResponseBody<L> {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        let Some(lease) = this.lease.as_mut() else {
            return Poll::Ready(None);
        };
        let conn = lease.conn();
        let polled = this.decoder.poll_frame(conn, cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            // The connection's state is unknown: never reuse it.
            this.decoder = Decoder::Done;
            conn.keep_alive = false;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.decoder, Decoder::Done)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self.decoder {
            Decoder::Done => http_body::SizeHint::with_exact(0),
            Decoder::Length(n) => http_body::SizeHint::with_exact(n),
            _ => http_body::SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8], is_head: bool) -> Result<Option<(Response<()>, Decoder, bool)>, Error> {
        let mut buf = BytesMut::from(raw);
        let mut keep_alive = true;
        Ok(parse_head(&mut buf, &mut keep_alive, is_head)?.map(|(r, d)| (r, d, keep_alive)))
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let (r, d, ka) = parse(
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-a"], "b");
        assert!(matches!(d, Decoder::Length(5)) && ka);

        let (_, d, ka) = parse(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert!(matches!(d, Decoder::Chunked(Chunk::Size)) && ka);

        // Both: chunked wins and the connection is not reused.
        let (_, d, ka) = parse(
            b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert!(matches!(d, Decoder::Chunked(_)) && !ka);

        // Neither: until close.
        let (_, d, ka) = parse(b"HTTP/1.1 200 OK\r\n\r\n", false).unwrap().unwrap();
        assert!(matches!(d, Decoder::Eof) && !ka);

        // HEAD, 204 and 304 have no body whatever the headers say.
        let (_, d, _) = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", true)
            .unwrap()
            .unwrap();
        assert!(matches!(d, Decoder::Done));
        let (_, d, _) = parse(
            b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert!(matches!(d, Decoder::Done));

        // HTTP/1.0 closes unless it says keep-alive.
        let (_, _, ka) = parse(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", false)
            .unwrap()
            .unwrap();
        assert!(!ka);
        let (_, _, ka) = parse(
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 0\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert!(ka);
        let (_, _, ka) = parse(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert!(!ka);
    }

    #[test]
    fn interim_responses_are_skipped_and_partial_heads_wait() {
        let (r, _, _) = parse(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n",
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.status(), 201);
        assert!(parse(b"HTTP/1.1 200 OK\r\ncontent-le", false)
            .unwrap()
            .is_none());
    }

    #[test]
    fn bad_responses_are_refused_with_the_reason() {
        let cases: [(&[u8], &str); 4] = [
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
                "invalid response: conflicting content-length values",
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
                "invalid response: bad content-length",
            ),
            (
                b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
                "invalid response: 101 Switching Protocols to a request that asked for no upgrade",
            ),
            (
                b"HTTP/1.1 2000 OK\r\n\r\n",
                "invalid response: invalid response status",
            ),
        ];
        for (raw, want) in cases {
            let err = parse(raw, false).expect_err("refused");
            assert_eq!(err.to_string(), want);
        }
    }

    #[test]
    fn chunk_sizes_parse_strictly() {
        assert_eq!(chunk_size(b"1a\r\n"), Some(26));
        assert_eq!(chunk_size(b"1A;name=value\r\n"), Some(26));
        assert_eq!(chunk_size(b"0\r\n"), Some(0));
        assert_eq!(chunk_size(b"\r\n"), None);
        assert_eq!(chunk_size(b"zz\r\n"), None);
        assert_eq!(chunk_size(b"1a\n"), None);
        assert_eq!(chunk_size(b"11111111111111111\r\n"), None, "over 64 bits");
        // Extensions as RFC 9112 writes them, whitespace around `;` and `=`.
        for ok in [
            &b"1a ;name\r\n"[..],
            b"1a;a=1;b=\"x;y \\\"z\\\"\"\r\n",
            b"1a\t; n = v \r\n",
            b"1a;n=v;m\r\n",
        ] {
            assert_eq!(chunk_size(ok), Some(26), "{}", String::from_utf8_lossy(ok));
        }
        // Anything else after the size is refused.
        for bad in [
            &b"1a x\r\n"[..],
            b"1a;\r\n",
            b"1a;=v\r\n",
            b"1a;n=\r\n",
            b"1a;n=\"open\r\n",
            b"1a;n\x00\r\n",
            b"1a;n=v\rx\r\n",
            b"1a;n=a b\r\n",
            b"1a,\r\n",
            b"-1\r\n",
        ] {
            assert_eq!(chunk_size(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn trailers_that_would_frame_route_or_speak_for_the_mesh_are_dropped() {
        let section = b"x-sum: 1\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\nconnection: close\r\nhost: evil\r\nx-minimesh-error: fake\r\ngrpc-status: 0\r\n\r\n";
        let t = trailers(section).expect("trailers");
        let names: Vec<&str> = t.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-sum", "grpc-status"]);
    }

    #[test]
    fn request_heads_state_their_own_framing() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("svc"));
        h.insert("content-length", HeaderValue::from_static("99"));
        let body = UpstreamBody::Buffered(Bytes::from_static(b"hi"));
        let out = encode(&Method::POST, "/p?q=1", &h, "ep:80", body);
        assert!(!out.is_head && !out.idempotent && out.resendable());
        assert_eq!(
            std::str::from_utf8(&out.buf).unwrap(),
            "POST /p?q=1 HTTP/1.1\r\nhost: svc\r\ncontent-length: 2\r\n\r\nhi"
        );
        drop(out);
        // No Host: the fallback; a GET with no body states no length.
        let out = encode(
            &Method::GET,
            "",
            &HeaderMap::new(),
            "ep:80",
            UpstreamBody::Buffered(Bytes::new()),
        );
        assert!(out.idempotent);
        assert_eq!(
            std::str::from_utf8(&out.buf).unwrap(),
            "GET / HTTP/1.1\r\nhost: ep:80\r\n\r\n"
        );
    }
}
