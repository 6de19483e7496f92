//! The response side: the head parsed with `httparse` (interim 1xx
//! skipped, framing decided as RFC 9112 §6.3 says), the body decoded from
//! the connection as it is polled (Content-Length, chunked with validated
//! extensions and filtered trailers, until close), and the body type that
//! gives the connection back to its pool at the end.

use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{header, Response, StatusCode, Version};
use http_body::{Body, Frame};
use tokio::io::AsyncRead;

use super::{
    invalid, poll_fill, Conn, Error, Source, MAX_CHUNK_LINE, MAX_HEAD, MAX_HEADERS, MAX_TRAILERS,
};

/// Header fields whose places in a head are noted on the stack; a head
/// with more notes them in a vector.
const FEW_HEADERS: usize = 24;

/// Reads and parses the response head (skipping interim 1xx responses).
pub(super) async fn read_head<R: AsyncRead + Unpin>(
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
pub(super) fn parse_head(
    buf: &mut BytesMut,
    keep_alive: &mut bool,
    is_head: bool,
) -> Result<Option<(Response<()>, Decoder)>, Error> {
    loop {
        // Uninitialised: httparse writes the fields it finds, and a head has
        // a handful, not MAX_HEADERS (4 KiB of stack to clear per response).
        let mut fields = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut []);
        let config = httparse::ParserConfig::default();
        let len = match config.parse_response_with_uninit_headers(&mut parsed, buf, &mut fields) {
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
        let n = parsed.headers.len();
        let (mut few, mut many) = ([(0u32, 0u32, 0u32, 0u32); FEW_HEADERS], Vec::new());
        let spans = if n <= FEW_HEADERS {
            &mut few[..n]
        } else {
            many.resize(n, (0, 0, 0, 0));
            &mut many[..]
        };
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
        for &(ns, ne, vs, ve) in spans.iter() {
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

pub(super) fn parse_length(v: &[u8]) -> Option<u64> {
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

impl Decoder {
    /// The next frame of the body from `conn`.
    pub(super) fn poll_frame<S: Source>(
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
pub(super) fn take_up_to<S: Source>(
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

pub(super) fn fill<S: Source>(conn: &mut S, cx: &mut Context<'_>) -> Poll<Result<usize, Error>> {
    conn.poll_fill(cx).map_err(Error::Read)
}

/// The size on a chunk-size line (`1a;name=value\r\n`), or None if
/// malformed. After the hex digits only chunk extensions may follow, as RFC
/// 9112 §7.1.1 writes them: `;` and a token, optionally `=` and a token or a
/// quoted string, with optional whitespace around `;` and `=`. Anything else
/// (a bare CR, a control character, a stray byte) is refused rather than
/// passed over: a line two parsers read differently is how requests and
/// responses are smuggled.
pub(super) fn chunk_size(line: &[u8]) -> Option<u64> {
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

pub(super) fn skip_ws(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|c| matches!(c, b' ' | b'\t')).count();
    &b[n..]
}

/// Length of the token (RFC 9110 §5.6.2) at the start of `b`.
pub(super) fn token_len(b: &[u8]) -> usize {
    b.iter()
        .take_while(|c| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(c))
        .count()
}

/// Length of the quoted string (RFC 9110 §5.6.4) at the start of `b`,
/// quotes included; None if it is not one.
pub(super) fn quoted_len(b: &[u8]) -> Option<usize> {
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
pub(super) fn dropped_trailer(name: &HeaderName) -> bool {
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

pub(super) fn trailers(section: &[u8]) -> Result<HeaderMap, Error> {
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
    pub(super) decoder: Decoder,
    pub(super) lease: Option<L>,
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
