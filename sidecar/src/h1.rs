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
use std::task::{Context, Poll};

use bytes::BytesMut;
use http::header::HeaderMap;
use http::Response;
use tokio::io::{AsyncRead, AsyncWriteExt};

#[cfg(test)]
mod random_responses;

pub mod fuzz;
mod request;
mod response;

pub use crate::message::{idempotent, UpstreamBody};
use request::send_body;
pub use request::{encode, Outgoing};
use response::read_head;
pub use response::{Chunk, Decoder, Lent, ResponseBody};

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
    /// The caller's request body failed (the caller went away, or stopped
    /// sending).
    #[error("reading the request body: {0}")]
    RequestBody(crate::message::ClientBodyError),
    /// The response broke HTTP/1.1.
    #[error("invalid response: {0}")]
    Invalid(String),
}

impl Error {
    /// True when the caller's request body failed, not the endpoint.
    pub fn is_client_body(&self) -> bool {
        matches!(self, Error::RequestBody(_))
    }

    /// True when the caller's request body stopped arriving for its bound.
    pub fn is_client_body_stalled(&self) -> bool {
        matches!(
            self,
            Error::RequestBody(crate::message::ClientBodyError::Stalled(_))
        )
    }

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
    io: crate::tls::Io,
    rbuf: BytesMut,
    /// The server may take another request on it once this response is read.
    keep_alive: bool,
    _open: Open,
}

/// How the request body goes out after the head.
pub struct Streaming {
    body: crate::message::ClientBody,
    chunked: bool,
}

impl Conn {
    /// Wraps a connected stream, counted in `open` until dropped.
    pub fn new(io: crate::tls::Io, open: &Arc<AtomicU32>) -> Conn {
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
    pub fn is_closed(&mut self) -> bool {
        !self.rbuf.is_empty() || self.io.is_closed()
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
        let (head, all_sent) = match &mut self.io {
            // Plaintext splits for free; TLS through a shared lock (a
            // streamed body is the rare case).
            crate::tls::Io::Plain(tcp) => {
                let (r, w) = tcp.split();
                send_and_read(
                    r,
                    w,
                    &mut body,
                    &mut self.rbuf,
                    &mut self.keep_alive,
                    is_head,
                )
                .await?
            }
            tls => {
                let (r, w) = tokio::io::split(tls);
                send_and_read(
                    r,
                    w,
                    &mut body,
                    &mut self.rbuf,
                    &mut self.keep_alive,
                    is_head,
                )
                .await?
            }
        };
        let head = Ok(head);
        if !all_sent {
            // Answered early (or the server stopped reading): the rest of the
            // body will not be sent, so the connection cannot be reused.
            self.keep_alive = false;
        }
        head
    }
}

/// Streams `body` on `w` while reading the response head from `r`: the
/// head, and whether the whole body went out first. Err when the caller's
/// body failed, or when no head came.
async fn send_and_read<R: AsyncRead + Unpin, W: tokio::io::AsyncWrite + Unpin>(
    mut r: R,
    mut w: W,
    body: &mut Streaming,
    rbuf: &mut BytesMut,
    keep_alive: &mut bool,
    is_head: bool,
) -> Result<((Response<()>, Decoder), bool), Error> {
    let send = send_body(&mut w, body);
    let recv = read_head(&mut r, rbuf, keep_alive, is_head);
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
        (Ok(head), Some(Ok(()))) => Ok((head, true)),
        (Ok(head), _) => Ok((head, false)),
        (Err(_), Some(Err(e))) => Err(e),
        (Err(e), _) => Err(e),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::header::{HeaderName, HeaderValue};
    use http::Method;
    use response::{chunk_size, parse_head, trailers};

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
        let out = encode(&Method::POST, "/p?q=1", &h, None, body);
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
            Some("ep:80"),
            UpstreamBody::Buffered(Bytes::new()),
        );
        assert!(out.idempotent);
        assert_eq!(
            std::str::from_utf8(&out.buf).unwrap(),
            "GET / HTTP/1.1\r\nhost: ep:80\r\n\r\n"
        );
    }
}
