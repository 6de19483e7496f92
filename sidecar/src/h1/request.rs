//! The request side: a request encoded once for all its attempts (head
//! and buffered body in one reused buffer), and a streamed body written
//! after the head (with its length when known, else chunked).

use http::header::HeaderMap;
use http::{header, Method};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::{Error, Streaming};
use crate::message::{idempotent, UpstreamBody};

/// A request encoded once for all its attempts: the head and a buffered
/// body, in a buffer reused from request to request on this thread.
pub struct Outgoing {
    pub(super) buf: Vec<u8>,
    pub(super) is_head: bool,
    pub(super) idempotent: bool,
    /// The body still to stream after the head, until an attempt takes it.
    pub(super) streaming: Option<Streaming>,
    pub(super) streams: bool,
}

/// Encode buffers kept per thread for reuse (one per request awaiting its
/// response head), and the largest kept: a head with a small body fits, and
/// what a burst of large bodies leaves behind is bounded by 1 MiB a thread.
pub(super) const SPARE_BUFS: usize = 64;
pub(super) const SPARE_BUF_MAX: usize = 16 * 1024;

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

/// Encodes a request: its method, origin-form target, headers, `host` and
/// body. `host` is the Host header to add, for headers that carry none
/// (the caller knows: no lookup here); None when they carry one. A
/// buffered body goes in with the head; a streamed one is sent with a
/// length when its size is known, else chunked.
pub fn encode(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    host: Option<&str>,
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
    if let Some(host) = host {
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

pub(super) fn bodyless_method(m: &Method) -> bool {
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
pub(super) fn put_field(w: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    w.extend_from_slice(name);
    w.extend_from_slice(b": ");
    w.extend_from_slice(value);
    w.extend_from_slice(b"\r\n");
}

pub(super) fn content_length(w: &mut Vec<u8>, n: u64) {
    use std::io::Write;
    // Writing into a Vec cannot fail.
    let _ = write!(w, "content-length: {n}\r\n");
}

pub(super) async fn send_body<W: AsyncWrite + Unpin>(
    io: &mut W,
    s: &mut Streaming,
) -> Result<(), Error> {
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
