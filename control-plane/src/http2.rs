//! The discovery port's HTTP/2 server (RFC 9113), made for what a control
//! plane holds: thousands of connections, each with two long-lived gRPC
//! streams that are idle nearly all the time.
//!
//! A general-purpose server (h2, under tonic's and hyper's) gives every
//! connection a 16 KiB write buffer, an 8 KiB read buffer and a 4 KiB HPACK
//! buffer for its whole life, and a task per stream: most of what a
//! connected sidecar cost. Here a connection holds buffers only while bytes
//! are in flight (a partial frame read, a write the socket did not take), and
//! its streams are polled by the connection's own task. Each stream becomes
//! an `http::Request` for the handler; the gRPC framing of the discovery
//! services is [`crate::grpc`]'s (tonic's message types and statuses, not its
//! generated servers, whose per-stream buffers stay at their largest).
//!
//! What the server does and refuses:
//! - Flow control both ways. The peer may have at most a window (64 KiB) of
//!   unread request data per stream and per connection; windows reopen as
//!   the service reads. Responses wait for the peer's windows.
//! - At most 16 concurrent streams (more are refused with REFUSED_STREAM), a
//!   16 KiB header list, 16 KiB frames, a 32 KiB header block across
//!   CONTINUATION frames, and no more writes queued once 256 KiB wait for a
//!   peer that does not read: then it stops reading the peer too.
//! - A ping every keepalive interval; a peer that does not answer within the
//!   timeout is disconnected (a sidecar that vanished without a FIN).
//! - Protocol errors end the connection with GOAWAY and the reason as debug
//!   data; an error confined to one stream (a malformed request, trailers
//!   after its end) resets that stream alone, and frames on a stream already
//!   closed are ignored. Shutdown sends GOAWAY(NO_ERROR) and closes.
//!
//! `http2/random_frames.rs` sends it random frame sequences, hostile and
//! well-behaved, and checks that it never panics, hangs or garbles its output.

pub mod hpack;
#[cfg(test)]
mod random_frames;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri, Version};
use http_body::{Body, Frame};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tracing::{debug, warn};

/// The response a handler produces for a stream (also what tonic's
/// generated servers return).
pub type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<Response<tonic::body::Body>, Infallible>> + Send>>;

/// Turns a request into its response: the routing to gRPC services.
pub type Handler = Arc<dyn Fn(Request<RecvBody>) -> ResponseFuture + Send + Sync>;

/// Connection settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// How often to ping each peer.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
}

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

// Frame types and flags (RFC 9113 §6).
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const PRIORITY: u8 = 0x2;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PUSH_PROMISE: u8 = 0x5;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY_FLAG: u8 = 0x20;

// Error codes (RFC 9113 §7).
const NO_ERROR: u32 = 0x0;
const PROTOCOL_ERROR: u32 = 0x1;
const INTERNAL_ERROR: u32 = 0x2;
const FLOW_CONTROL_ERROR: u32 = 0x3;
const STREAM_CLOSED: u32 = 0x5;
const FRAME_SIZE_ERROR: u32 = 0x6;
const REFUSED_STREAM: u32 = 0x7;
const COMPRESSION_ERROR: u32 = 0x9;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// Largest frame payload accepted and sent by default (the protocol's default).
const MAX_FRAME: usize = 16_384;
/// Concurrent streams a peer may open (a sidecar uses two).
const MAX_STREAMS: usize = 16;
/// Decoded header list a request may carry.
const MAX_HEADER_LIST: usize = 16_384;
/// Encoded header block across HEADERS and CONTINUATION frames.
const MAX_HEADER_BLOCK: usize = 32_768;
/// The protocol's default window, per stream and per connection, kept.
const WINDOW: u32 = 65_535;
/// Largest window the protocol allows.
const MAX_WINDOW: i64 = (1 << 31) - 1;
/// Response data is not framed while this much waits to be written.
const WRITE_HIGH: usize = 64 * 1024;
/// The peer is not read while this much waits to be written to it.
const READ_PAUSE: usize = 256 * 1024;
/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 16 * 1024;
/// Streams a peer may reset before it is told to calm down (a sidecar resets
/// a stream only when it reconnects one).
const MAX_PEER_RESETS: u32 = 1_000;

/// Serves HTTP/2 on `listener` with `handler` until `shutdown` resolves;
/// then every connection gets GOAWAY and is closed.
pub async fn serve(
    listener: TcpListener,
    handler: Handler,
    settings: Settings,
    shutdown: impl Future<Output = ()>,
) {
    let (stop_tx, stop_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((io, _)) => {
                    // Small frames (ACKs, pings) go out at once.
                    let _ = io.set_nodelay(true);
                    let conn = Connection::new(io, handler.clone(), settings);
                    tokio::spawn(conn.run(stop_rx.clone()));
                }
                Err(e) => {
                    // Out of file descriptors, most likely: let connections close.
                    warn!(error = %e, "accepting a discovery connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    drop(stop_rx);
    let _ = stop_tx.send(());
    // Give connections a moment to send their GOAWAY.
    let _ = tokio::time::timeout(Duration::from_secs(1), stop_tx.closed()).await;
}

/// Why a connection ends with GOAWAY.
#[derive(Debug)]
struct ConnError {
    code: u32,
    reason: &'static str,
}

fn conn_error(code: u32, reason: &'static str) -> ConnError {
    ConnError { code, reason }
}

/// The request body of a stream, filled by its connection.
#[derive(Debug)]
pub struct RecvBody {
    shared: Arc<Mutex<Recv>>,
}

/// A stream was reset before its request body ended.
#[derive(Debug, thiserror::Error)]
#[error("the stream was reset")]
pub struct StreamReset;

#[derive(Debug, Default)]
struct Recv {
    queue: VecDeque<Bytes>,
    end: bool,
    reset: bool,
    waker: Option<Waker>,
    /// Bytes the service has read and the peer's windows have not yet been
    /// reopened for.
    consumed: usize,
}

fn lock(shared: &Mutex<Recv>) -> std::sync::MutexGuard<'_, Recv> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Body for RecvBody {
    type Data = Bytes;
    type Error = StreamReset;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamReset>>> {
        let mut recv = lock(&self.shared);
        if let Some(data) = recv.queue.pop_front() {
            recv.consumed += data.len();
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if recv.reset {
            return Poll::Ready(Some(Err(StreamReset)));
        }
        if recv.end {
            return Poll::Ready(None);
        }
        if !recv.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            recv.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        let recv = lock(&self.shared);
        recv.end && recv.queue.is_empty()
    }
}

enum Reply {
    Waiting(ResponseFuture),
    Sending(tonic::body::Body),
    Finished,
}

struct Stream {
    id: u32,
    recv: Arc<Mutex<Recv>>,
    /// Bytes the peer may still send on this stream.
    allowance: u32,
    /// Bytes read by the service since the window was last reopened.
    unacked: u32,
    /// Bytes this side may still send (the peer's window; may go negative
    /// when the peer shrinks its initial window).
    send_window: i64,
    remote_done: bool,
    reply: Reply,
    /// Response data not yet framed (waiting for a window).
    pending: Bytes,
    trailers: Option<HeaderMap>,
}

/// A header block still waiting for its CONTINUATION frames.
struct PartialBlock {
    stream: u32,
    end_stream: bool,
    block: Vec<u8>,
}

struct Connection {
    io: TcpStream,
    handler: Handler,
    settings: Settings,
    /// Bytes read but not yet a whole frame; empty (unallocated) when idle.
    rbuf: Vec<u8>,
    /// Frames to write, from `wpos` on; unallocated when idle.
    wbuf: Vec<u8>,
    wpos: usize,
    preface: bool,
    got_settings: bool,
    decoder: hpack::Decoder,
    partial: Option<Box<PartialBlock>>,
    streams: Vec<Stream>,
    last_stream: u32,
    peer_resets: u32,
    /// The peer's SETTINGS_INITIAL_WINDOW_SIZE and SETTINGS_MAX_FRAME_SIZE.
    peer_window: u32,
    peer_max_frame: usize,
    /// Bytes this side may still send on the connection.
    send_window: i64,
    /// Bytes the peer may still send on the connection, and bytes read since
    /// that window was last reopened.
    allowance: u32,
    unacked: u32,
    keepalive: Pin<Box<Sleep>>,
    awaiting_pong: bool,
    /// The peer sent GOAWAY: no new streams; close when the last one ends.
    peer_going_away: bool,
    /// Nothing more is read or framed; close once the writes are out.
    done: bool,
    /// The peer closed its side.
    eof: bool,
    /// This side's FIN is sent (a lingering close).
    write_shut: bool,
}

impl Connection {
    fn new(io: TcpStream, handler: Handler, settings: Settings) -> Self {
        let mut conn = Connection {
            io,
            handler,
            settings,
            rbuf: Vec::new(),
            wbuf: Vec::new(),
            wpos: 0,
            preface: false,
            got_settings: false,
            decoder: hpack::Decoder::new(),
            partial: None,
            streams: Vec::new(),
            last_stream: 0,
            peer_resets: 0,
            peer_window: WINDOW,
            peer_max_frame: MAX_FRAME,
            send_window: i64::from(WINDOW),
            allowance: WINDOW,
            unacked: 0,
            keepalive: Box::pin(tokio::time::sleep(settings.keepalive_interval)),
            awaiting_pong: false,
            peer_going_away: false,
            done: false,
            eof: false,
            write_shut: false,
        };
        // The server's connection preface: its SETTINGS.
        let mut payload = Vec::with_capacity(12);
        for (id, value) in [(0x3u16, MAX_STREAMS as u32), (0x6, MAX_HEADER_LIST as u32)] {
            payload.extend_from_slice(&id.to_be_bytes());
            payload.extend_from_slice(&value.to_be_bytes());
        }
        conn.put_frame(SETTINGS, 0, 0, &payload);
        conn
    }

    async fn run(mut self, mut stop: watch::Receiver<()>) {
        tokio::select! {
            () = &mut self => return,
            _ = stop.changed() => {}
        }
        self.go_away(NO_ERROR, "server shutting down");
        (&mut self).await;
    }

    fn put_frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        self.put_frame_head(payload.len(), kind, flags, stream);
        self.wbuf.extend_from_slice(payload);
    }

    fn put_frame_head(&mut self, len: usize, kind: u8, flags: u8, stream: u32) {
        let len = len as u32;
        self.wbuf.extend_from_slice(&len.to_be_bytes()[1..]);
        self.wbuf.push(kind);
        self.wbuf.push(flags);
        self.wbuf.extend_from_slice(&stream.to_be_bytes());
    }

    fn reset_stream(&mut self, stream: u32, code: u32) {
        self.put_frame(RST_STREAM, 0, stream, &code.to_be_bytes());
    }

    fn go_away(&mut self, code: u32, reason: &str) {
        if self.done {
            return;
        }
        let mut payload = Vec::with_capacity(8 + reason.len());
        payload.extend_from_slice(&self.last_stream.to_be_bytes());
        payload.extend_from_slice(&code.to_be_bytes());
        payload.extend_from_slice(reason.as_bytes());
        self.put_frame(GOAWAY, 0, 0, &payload);
        self.finish();
    }

    /// Stops reading and framing: the connection closes once what is queued
    /// is written, within a second.
    fn finish(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let deadline = Instant::now() + Duration::from_secs(1);
        if self.keepalive.deadline() > deadline {
            self.keepalive.as_mut().reset(deadline);
        }
        for stream in self.streams.drain(..) {
            let mut recv = lock(&stream.recv);
            recv.reset = true;
            if let Some(w) = recv.waker.take() {
                w.wake();
            }
        }
    }

    fn queued(&self) -> usize {
        self.wbuf.len() - self.wpos
    }

    /// Reads what the socket has and handles every whole frame.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Result<bool, std::io::Error> {
        let mut progress = false;
        for _ in 0..8 {
            if self.done || self.queued() > READ_PAUSE {
                break;
            }
            match self.io.poll_read_ready(cx) {
                Poll::Pending => break,
                Poll::Ready(r) => r?,
            }
            let mut buf = std::mem::take(&mut self.rbuf);
            buf.reserve(READ_CHUNK);
            match self.io.try_read_buf(&mut buf) {
                Ok(0) => {
                    // The peer closed: what is queued still goes out.
                    self.eof = true;
                    self.finish();
                    break;
                }
                Ok(_) => {
                    progress = true;
                    let used = match self.frames(&buf) {
                        Ok(used) => used,
                        Err(e) => {
                            debug!(
                                code = e.code,
                                reason = e.reason,
                                "closing a discovery connection"
                            );
                            self.go_away(e.code, e.reason);
                            buf.len()
                        }
                    };
                    buf.drain(..used);
                    // Keep only a partial frame, and no spare capacity.
                    if !buf.is_empty() {
                        buf.shrink_to_fit();
                        self.rbuf = buf;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.rbuf = buf,
                Err(e) => return Err(e),
            }
        }
        if self.rbuf.is_empty() {
            self.rbuf = Vec::new();
        }
        Ok(progress)
    }

    /// Handles the whole frames at the start of `buf`; returns the bytes used.
    fn frames(&mut self, buf: &[u8]) -> Result<usize, ConnError> {
        let mut pos = 0;
        if !self.preface {
            let n = buf.len().min(PREFACE.len());
            if buf[..n] != PREFACE[..n] {
                return Err(conn_error(
                    PROTOCOL_ERROR,
                    "not an HTTP/2 connection preface",
                ));
            }
            if n < PREFACE.len() {
                return Ok(0);
            }
            self.preface = true;
            pos = PREFACE.len();
        }
        while buf.len() - pos >= 9 && !self.done {
            let head = &buf[pos..pos + 9];
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            if len > MAX_FRAME {
                return Err(conn_error(
                    FRAME_SIZE_ERROR,
                    "frame larger than SETTINGS_MAX_FRAME_SIZE",
                ));
            }
            if buf.len() - pos - 9 < len {
                break;
            }
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            self.frame(head[3], head[4], id, &buf[pos + 9..pos + 9 + len])?;
            pos += 9 + len;
        }
        Ok(pos)
    }

    fn frame(&mut self, kind: u8, flags: u8, id: u32, payload: &[u8]) -> Result<(), ConnError> {
        if !self.got_settings && kind != SETTINGS {
            return Err(conn_error(
                PROTOCOL_ERROR,
                "the first frame was not SETTINGS",
            ));
        }
        if self
            .partial
            .as_ref()
            .is_some_and(|p| kind != CONTINUATION || id != p.stream)
        {
            return Err(conn_error(PROTOCOL_ERROR, "expected a CONTINUATION frame"));
        }
        match kind {
            DATA => self.data(flags, id, payload),
            HEADERS => self.headers(flags, id, payload),
            PRIORITY => {
                if id == 0 {
                    return Err(conn_error(PROTOCOL_ERROR, "PRIORITY on stream 0"));
                }
                if payload.len() != 5 {
                    return Err(conn_error(FRAME_SIZE_ERROR, "PRIORITY frame not 5 bytes"));
                }
                Ok(())
            }
            RST_STREAM => {
                if id == 0 || id > self.last_stream {
                    return Err(conn_error(PROTOCOL_ERROR, "RST_STREAM on an idle stream"));
                }
                if payload.len() != 4 {
                    return Err(conn_error(FRAME_SIZE_ERROR, "RST_STREAM frame not 4 bytes"));
                }
                self.peer_resets += 1;
                if self.peer_resets > MAX_PEER_RESETS {
                    return Err(conn_error(ENHANCE_YOUR_CALM, "too many streams reset"));
                }
                if let Some(i) = self.streams.iter().position(|s| s.id == id) {
                    let stream = self.streams.swap_remove(i);
                    self.drop_stream(stream);
                }
                Ok(())
            }
            SETTINGS => self.settings_frame(flags, id, payload),
            PUSH_PROMISE => Err(conn_error(PROTOCOL_ERROR, "PUSH_PROMISE from a client")),
            PING => {
                if id != 0 {
                    return Err(conn_error(PROTOCOL_ERROR, "PING on a stream"));
                }
                if payload.len() != 8 {
                    return Err(conn_error(FRAME_SIZE_ERROR, "PING frame not 8 bytes"));
                }
                if flags & ACK != 0 {
                    self.awaiting_pong = false;
                    let next = Instant::now() + self.settings.keepalive_interval;
                    self.keepalive.as_mut().reset(next);
                } else {
                    self.put_frame(PING, ACK, 0, payload);
                }
                Ok(())
            }
            GOAWAY => {
                if id != 0 {
                    return Err(conn_error(PROTOCOL_ERROR, "GOAWAY on a stream"));
                }
                self.peer_going_away = true;
                Ok(())
            }
            WINDOW_UPDATE => self.window_update(id, payload),
            CONTINUATION => {
                let Some(mut partial) = self.partial.take() else {
                    return Err(conn_error(PROTOCOL_ERROR, "CONTINUATION without HEADERS"));
                };
                if partial.block.len() + payload.len() > MAX_HEADER_BLOCK {
                    return Err(conn_error(ENHANCE_YOUR_CALM, "header block too large"));
                }
                partial.block.extend_from_slice(payload);
                if flags & END_HEADERS != 0 {
                    self.header_block(partial.stream, partial.end_stream, &partial.block)
                } else {
                    self.partial = Some(partial);
                    Ok(())
                }
            }
            // Unknown frame types are ignored (RFC 9113 §4.1).
            _ => Ok(()),
        }
    }

    fn settings_frame(&mut self, flags: u8, id: u32, payload: &[u8]) -> Result<(), ConnError> {
        if id != 0 {
            return Err(conn_error(PROTOCOL_ERROR, "SETTINGS on a stream"));
        }
        if flags & ACK != 0 {
            if !payload.is_empty() {
                return Err(conn_error(
                    FRAME_SIZE_ERROR,
                    "SETTINGS acknowledgement with a payload",
                ));
            }
            return Ok(());
        }
        if !payload.len().is_multiple_of(6) {
            return Err(conn_error(
                FRAME_SIZE_ERROR,
                "SETTINGS frame not a multiple of 6 bytes",
            ));
        }
        for setting in payload.chunks_exact(6) {
            let key = u16::from_be_bytes([setting[0], setting[1]]);
            let value = u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
            match key {
                0x2 if value > 1 => {
                    return Err(conn_error(
                        PROTOCOL_ERROR,
                        "SETTINGS_ENABLE_PUSH not 0 or 1",
                    ))
                }
                0x4 => {
                    if i64::from(value) > MAX_WINDOW {
                        return Err(conn_error(
                            FLOW_CONTROL_ERROR,
                            "SETTINGS_INITIAL_WINDOW_SIZE too large",
                        ));
                    }
                    let delta = i64::from(value) - i64::from(self.peer_window);
                    for s in &mut self.streams {
                        s.send_window += delta;
                        if s.send_window > MAX_WINDOW {
                            return Err(conn_error(FLOW_CONTROL_ERROR, "stream window too large"));
                        }
                    }
                    self.peer_window = value;
                }
                0x5 => {
                    if !(16_384..=16_777_215).contains(&value) {
                        return Err(conn_error(
                            PROTOCOL_ERROR,
                            "SETTINGS_MAX_FRAME_SIZE out of range",
                        ));
                    }
                    self.peer_max_frame = value as usize;
                }
                // Header table size (the encoder uses no table), concurrent
                // streams (a server opens none), header list size, unknown.
                _ => {}
            }
        }
        self.got_settings = true;
        self.put_frame(SETTINGS, ACK, 0, &[]);
        Ok(())
    }

    fn window_update(&mut self, id: u32, payload: &[u8]) -> Result<(), ConnError> {
        if payload.len() != 4 {
            return Err(conn_error(
                FRAME_SIZE_ERROR,
                "WINDOW_UPDATE frame not 4 bytes",
            ));
        }
        let increment = i64::from(
            u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) & 0x7fff_ffff,
        );
        if increment == 0 {
            return Err(conn_error(PROTOCOL_ERROR, "WINDOW_UPDATE of 0"));
        }
        if id == 0 {
            self.send_window += increment;
            if self.send_window > MAX_WINDOW {
                return Err(conn_error(
                    FLOW_CONTROL_ERROR,
                    "connection window too large",
                ));
            }
        } else if let Some(i) = self.streams.iter().position(|s| s.id == id) {
            self.streams[i].send_window += increment;
            if self.streams[i].send_window > MAX_WINDOW {
                let stream = self.streams.swap_remove(i);
                self.reset_stream(id, FLOW_CONTROL_ERROR);
                self.drop_stream(stream);
            }
        }
        Ok(())
    }

    /// Strips padding (and priority fields) from a DATA or HEADERS payload.
    fn unpad(flags: u8, payload: &[u8], priority: bool) -> Result<&[u8], ConnError> {
        let mut p = payload;
        if flags & PADDED != 0 {
            let (&pad, rest) = p.split_first().ok_or(conn_error(
                FRAME_SIZE_ERROR,
                "padded frame without a pad length",
            ))?;
            if usize::from(pad) > rest.len() {
                return Err(conn_error(PROTOCOL_ERROR, "padding longer than the frame"));
            }
            p = &rest[..rest.len() - usize::from(pad)];
        }
        if priority && flags & PRIORITY_FLAG != 0 {
            if p.len() < 5 {
                return Err(conn_error(
                    FRAME_SIZE_ERROR,
                    "HEADERS too short for its priority",
                ));
            }
            p = &p[5..];
        }
        Ok(p)
    }

    fn data(&mut self, flags: u8, id: u32, payload: &[u8]) -> Result<(), ConnError> {
        if id == 0 {
            return Err(conn_error(PROTOCOL_ERROR, "DATA on stream 0"));
        }
        let len = payload.len() as u32;
        if len > self.allowance {
            return Err(conn_error(
                FLOW_CONTROL_ERROR,
                "DATA beyond the connection window",
            ));
        }
        self.allowance -= len;
        let data = Self::unpad(flags, payload, false)?;
        // Padding is flow-controlled but never read: it counts as read now.
        let padding = len - data.len() as u32;
        let Some(i) = self.streams.iter().position(|s| s.id == id) else {
            if id > self.last_stream {
                return Err(conn_error(PROTOCOL_ERROR, "DATA on an idle stream"));
            }
            // A stream already closed or reset: the data is dropped.
            self.unacked += len;
            return Ok(());
        };
        self.unacked += padding;
        let stream = &mut self.streams[i];
        if stream.remote_done || len > stream.allowance {
            let code = if stream.remote_done {
                STREAM_CLOSED
            } else {
                FLOW_CONTROL_ERROR
            };
            let stream = self.streams.swap_remove(i);
            self.unacked += len - padding;
            self.reset_stream(id, code);
            self.drop_stream(stream);
            return Ok(());
        }
        stream.allowance -= len;
        stream.unacked += padding;
        stream.remote_done = flags & END_STREAM != 0;
        let mut recv = lock(&stream.recv);
        if !data.is_empty() {
            recv.queue.push_back(Bytes::copy_from_slice(data));
        }
        recv.end = stream.remote_done;
        if let Some(w) = recv.waker.take() {
            w.wake();
        }
        Ok(())
    }

    fn headers(&mut self, flags: u8, id: u32, payload: &[u8]) -> Result<(), ConnError> {
        if id == 0 || id.is_multiple_of(2) {
            return Err(conn_error(
                PROTOCOL_ERROR,
                "HEADERS on a stream a client may not open",
            ));
        }
        let block = Self::unpad(flags, payload, true)?;
        let end_stream = flags & END_STREAM != 0;
        if flags & END_HEADERS != 0 {
            self.header_block(id, end_stream, block)
        } else {
            if block.len() > MAX_HEADER_BLOCK {
                return Err(conn_error(ENHANCE_YOUR_CALM, "header block too large"));
            }
            self.partial = Some(Box::new(PartialBlock {
                stream: id,
                end_stream,
                block: block.to_vec(),
            }));
            Ok(())
        }
    }

    fn header_block(&mut self, id: u32, end_stream: bool, block: &[u8]) -> Result<(), ConnError> {
        let mut method = None;
        let mut path = None;
        let mut headers = HeaderMap::new();
        let mut malformed = false;
        let mut regular_seen = false;
        self.decoder
            .decode(block, MAX_HEADER_LIST, |name, value| {
                if let Some(pseudo) = name.strip_prefix(b":") {
                    malformed |= regular_seen;
                    match pseudo {
                        b"method" => method = Method::from_bytes(&value).ok(),
                        b"path" => path = Some(value),
                        b"scheme" | b"authority" => {}
                        _ => malformed = true,
                    }
                    return;
                }
                regular_seen = true;
                match (
                    HeaderName::from_bytes(&name),
                    HeaderValue::from_bytes(&value),
                ) {
                    (Ok(n), Ok(v)) => {
                        headers.append(n, v);
                    }
                    _ => malformed = true,
                }
            })
            .map_err(|e| conn_error(COMPRESSION_ERROR, e.0))?;

        if let Some(i) = self.streams.iter().position(|s| s.id == id) {
            // Trailers from the client: they must end the stream, and come
            // before it has ended (RFC 9113 §8.1, §5.1). An error ends this
            // stream, not the connection's others.
            let stream = &mut self.streams[i];
            if !end_stream || stream.remote_done {
                let code = if stream.remote_done {
                    STREAM_CLOSED
                } else {
                    PROTOCOL_ERROR
                };
                let stream = self.streams.swap_remove(i);
                self.reset_stream(id, code);
                self.drop_stream(stream);
                return Ok(());
            }
            stream.remote_done = true;
            let mut recv = lock(&stream.recv);
            recv.end = true;
            if let Some(w) = recv.waker.take() {
                w.wake();
            }
            return Ok(());
        }
        if id <= self.last_stream {
            // A closed stream. It may be one this side reset while the peer
            // was still sending, whose frames must be ignored (RFC 9113
            // §5.1); the block was decoded above, so the table stays in step.
            return Ok(());
        }
        self.last_stream = id;
        if self.peer_going_away || self.streams.len() >= MAX_STREAMS {
            self.reset_stream(id, REFUSED_STREAM);
            return Ok(());
        }
        let uri = path.and_then(|p| Uri::try_from(p).ok());
        let (Some(method), Some(uri), false) = (method, uri, malformed) else {
            self.reset_stream(id, PROTOCOL_ERROR);
            return Ok(());
        };
        let recv = Arc::new(Mutex::new(Recv {
            end: end_stream,
            ..Recv::default()
        }));
        let mut request = Request::new(RecvBody {
            shared: recv.clone(),
        });
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.version_mut() = Version::HTTP_2;
        *request.headers_mut() = headers;
        let reply = Reply::Waiting((self.handler)(request));
        self.streams.push(Stream {
            id,
            recv,
            allowance: WINDOW,
            unacked: 0,
            send_window: i64::from(self.peer_window),
            remote_done: end_stream,
            reply,
            pending: Bytes::new(),
            trailers: None,
        });
        Ok(())
    }

    /// Ends a stream's request body and gives its unread bytes back to the
    /// connection's window.
    fn drop_stream(&mut self, stream: Stream) {
        let mut recv = lock(&stream.recv);
        let unread: usize = recv.queue.iter().map(Bytes::len).sum();
        self.unacked += (unread + recv.consumed) as u32;
        recv.queue.clear();
        recv.reset = !recv.end;
        if let Some(w) = recv.waker.take() {
            w.wake();
        }
    }

    /// Writes a header block as HEADERS (and CONTINUATION) frames.
    fn put_headers(&mut self, id: u32, status: Option<u16>, headers: &HeaderMap, end_stream: bool) {
        let mut block = Vec::new();
        if let Some(status) = status {
            hpack::put_status(&mut block, status);
        }
        for (name, value) in headers {
            // Connection-specific fields have no place in HTTP/2.
            if matches!(
                name.as_str(),
                "connection" | "keep-alive" | "proxy-connection" | "transfer-encoding" | "upgrade"
            ) {
                continue;
            }
            hpack::put_field(
                &mut block,
                name.as_str().as_bytes(),
                value.as_bytes(),
                value.is_sensitive(),
            );
        }
        let end = if end_stream { END_STREAM } else { 0 };
        let mut chunks = block.chunks(self.peer_max_frame).peekable();
        let mut kind = HEADERS;
        let mut flags = end;
        if chunks.peek().is_none() {
            self.put_frame(HEADERS, flags | END_HEADERS, id, &[]);
            return;
        }
        while let Some(chunk) = chunks.next() {
            if chunks.peek().is_none() {
                flags |= END_HEADERS;
            }
            self.put_frame(kind, flags, id, chunk);
            kind = CONTINUATION;
            flags = 0;
        }
    }

    /// Polls every stream's response, framing what is ready.
    fn poll_streams(&mut self, cx: &mut Context<'_>) -> bool {
        let mut progress = false;
        let mut i = 0;
        while i < self.streams.len() && !self.done {
            // Reopen the peer's windows for what the service has read.
            let consumed = std::mem::take(&mut lock(&self.streams[i].recv).consumed) as u32;
            let stream = &mut self.streams[i];
            stream.unacked += consumed;
            self.unacked += consumed;
            if stream.unacked >= WINDOW / 2 && !stream.remote_done {
                let (id, n) = (stream.id, stream.unacked);
                stream.allowance += n;
                stream.unacked = 0;
                self.put_frame(WINDOW_UPDATE, 0, id, &n.to_be_bytes());
            }
            if self.poll_reply(i, cx) {
                progress = true;
            }
            if matches!(self.streams[i].reply, Reply::Finished) {
                let stream = self.streams.swap_remove(i);
                if !stream.remote_done {
                    // The response is complete; the rest of the request is not wanted.
                    self.reset_stream(stream.id, NO_ERROR);
                }
                self.drop_stream(stream);
                continue;
            }
            i += 1;
        }
        if self.unacked >= WINDOW / 2 && !self.done {
            let n = self.unacked;
            self.allowance += n;
            self.unacked = 0;
            self.put_frame(WINDOW_UPDATE, 0, 0, &n.to_be_bytes());
        }
        if self.peer_going_away && self.streams.is_empty() {
            self.finish();
        }
        progress
    }

    fn poll_reply(&mut self, i: usize, cx: &mut Context<'_>) -> bool {
        let mut progress = false;
        loop {
            let id = self.streams[i].id;
            match &mut self.streams[i].reply {
                Reply::Finished => return progress,
                Reply::Waiting(future) => match future.as_mut().poll(cx) {
                    Poll::Pending => return progress,
                    Poll::Ready(Ok(response)) => {
                        let (parts, body) = response.into_parts();
                        let end = body.is_end_stream();
                        self.put_headers(id, Some(parts.status.as_u16()), &parts.headers, end);
                        self.streams[i].reply = if end {
                            Reply::Finished
                        } else {
                            Reply::Sending(body)
                        };
                        progress = true;
                    }
                    Poll::Ready(Err(never)) => match never {},
                },
                Reply::Sending(_) => {
                    if !self.send_pending(i) {
                        return progress;
                    }
                    if let Some(trailers) = self.streams[i].trailers.take() {
                        self.put_headers(id, None, &trailers, true);
                        self.streams[i].reply = Reply::Finished;
                        return true;
                    }
                    if self.queued() > WRITE_HIGH {
                        return progress;
                    }
                    let Reply::Sending(body) = &mut self.streams[i].reply else {
                        unreachable!("matched above");
                    };
                    match Pin::new(body).poll_frame(cx) {
                        Poll::Pending => return progress,
                        Poll::Ready(None) => {
                            self.put_frame(DATA, END_STREAM, id, &[]);
                            self.streams[i].reply = Reply::Finished;
                            return true;
                        }
                        Poll::Ready(Some(Ok(frame))) => {
                            progress = true;
                            match frame.into_data() {
                                Ok(data) => self.streams[i].pending = data,
                                Err(frame) => self.streams[i].trailers = frame.into_trailers().ok(),
                            }
                        }
                        Poll::Ready(Some(Err(e))) => {
                            debug!(stream = id, error = %e, "response body failed");
                            self.reset_stream(id, INTERNAL_ERROR);
                            // The reset ends the stream both ways.
                            self.streams[i].remote_done = true;
                            self.streams[i].reply = Reply::Finished;
                            return true;
                        }
                    }
                }
            }
        }
    }

    /// Frames as much of stream `i`'s pending data as the windows allow;
    /// true when none is left.
    fn send_pending(&mut self, i: usize) -> bool {
        loop {
            let stream = &self.streams[i];
            if stream.pending.is_empty() {
                return true;
            }
            let window = stream.send_window.min(self.send_window);
            if window <= 0 || self.queued() > WRITE_HIGH {
                return false;
            }
            let n = stream
                .pending
                .len()
                .min(window as usize)
                .min(self.peer_max_frame);
            let id = stream.id;
            let chunk = self.streams[i].pending.split_to(n);
            self.put_frame(DATA, 0, id, &chunk);
            self.streams[i].send_window -= n as i64;
            self.send_window -= n as i64;
        }
    }

    /// Pings the peer every interval; a peer that does not answer is gone.
    fn poll_keepalive(&mut self, cx: &mut Context<'_>) -> Result<(), &'static str> {
        while self.keepalive.as_mut().poll(cx).is_ready() {
            if self.done {
                return Err("the peer did not take the last frames in time");
            }
            if self.awaiting_pong {
                return Err("the peer did not answer a ping in time");
            }
            self.put_frame(PING, 0, 0, &[0u8; 8]);
            self.awaiting_pong = true;
            let deadline = Instant::now() + self.settings.keepalive_timeout;
            self.keepalive.as_mut().reset(deadline);
        }
        Ok(())
    }

    /// Writes what is queued; true when some was written.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Result<bool, std::io::Error> {
        let mut progress = false;
        while self.wpos < self.wbuf.len() {
            match self.io.poll_write_ready(cx) {
                Poll::Pending => return Ok(progress),
                Poll::Ready(r) => r?,
            }
            match self.io.try_write(&self.wbuf[self.wpos..]) {
                Ok(n) => {
                    self.wpos += n;
                    progress = true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        // Idle connections hold no write buffer.
        self.wbuf = Vec::new();
        self.wpos = 0;
        Ok(progress)
    }
}

impl Connection {
    /// A lingering close: send FIN, then discard what the peer still sends
    /// until it closes too, so that the kernel does not answer its last
    /// bytes with a reset that could destroy our GOAWAY before it is read.
    fn poll_close(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.eof {
            return Poll::Ready(());
        }
        if !self.write_shut {
            self.write_shut = true;
            if let Poll::Ready(Err(_)) =
                tokio::io::AsyncWrite::poll_shutdown(Pin::new(&mut self.io), cx)
            {
                return Poll::Ready(());
            }
        }
        let mut sink = [0u8; 1024];
        loop {
            match self.io.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(())) => {}
            }
            match self.io.try_read(&mut sink) {
                Ok(0) => return Poll::Ready(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Poll::Ready(()),
            }
        }
    }
}

impl Future for Connection {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        for _ in 0..32 {
            let mut progress = match this.poll_read(cx) {
                Ok(p) => p,
                Err(e) => {
                    debug!(error = %e, "discovery connection closed");
                    return Poll::Ready(());
                }
            };
            progress |= this.poll_streams(cx);
            if let Err(reason) = this.poll_keepalive(cx) {
                debug!(reason, "closing a discovery connection");
                return Poll::Ready(());
            }
            match this.poll_flush(cx) {
                Ok(p) => progress |= p,
                Err(e) => {
                    debug!(error = %e, "discovery connection closed");
                    return Poll::Ready(());
                }
            }
            if this.done && this.queued() == 0 {
                return this.poll_close(cx);
            }
            if !progress {
                return Poll::Pending;
            }
        }
        // Much to do: let other connections run first.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server on a loopback port whose handler echoes the request body.
    async fn echo_server(settings: Settings) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handler: Handler = Arc::new(|request: Request<RecvBody>| {
            Box::pin(async move {
                let path = request.uri().path().to_string();
                let body = request.into_body().collect().await.map(|b| b.to_bytes());
                let response = match body {
                    Ok(bytes) => Response::builder()
                        .header("x-path", path)
                        .body(tonic::body::Body::new(Full::new(bytes)))
                        .unwrap(),
                    Err(_) => Response::new(tonic::body::Body::empty()),
                };
                Ok(response)
            })
        });
        tokio::spawn(serve(listener, handler, settings, std::future::pending()));
        addr
    }

    fn settings() -> Settings {
        Settings {
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(5),
        }
    }

    fn frame(kind: u8, flags: u8, id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        out.extend([kind, flags]);
        out.extend(id.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// Every frame the server sends until it closes (or 5 s pass).
    async fn frames_until_close(io: &mut TcpStream) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut bytes = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), io.read_to_end(&mut bytes));
        read.await
            .expect("the server closes the connection")
            .unwrap();
        let mut frames = Vec::new();
        let mut rest = &bytes[..];
        while rest.len() >= 9 {
            let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            frames.push((rest[3], rest[4], id, rest[9..9 + len].to_vec()));
            rest = &rest[9 + len..];
        }
        frames
    }

    /// An HTTP/2 client (hyper's) connected to `addr`.
    pub(super) async fn hyper_client(
        addr: std::net::SocketAddr,
    ) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
        let io = hyper_util::rt::TokioIo::new(TcpStream::connect(addr).await.unwrap());
        let (sender, conn) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .unwrap();
        tokio::spawn(conn);
        sender
    }

    /// The (stream, error code) of every RST_STREAM among `frames`.
    fn resets(frames: &[(u8, u8, u32, Vec<u8>)]) -> Vec<(u32, Vec<u8>)> {
        frames
            .iter()
            .filter(|f| f.0 == RST_STREAM)
            .map(|f| (f.2, f.3.clone()))
            .collect()
    }

    fn goaway(frames: &[(u8, u8, u32, Vec<u8>)]) -> (u32, String) {
        let (_, _, _, p) = frames.iter().find(|f| f.0 == GOAWAY).expect("a GOAWAY");
        let code = u32::from_be_bytes([p[4], p[5], p[6], p[7]]);
        (code, String::from_utf8_lossy(&p[8..]).into_owned())
    }

    #[tokio::test]
    async fn a_megabyte_each_way_through_the_flow_control_windows() {
        let addr = echo_server(settings()).await;
        let mut sender = hyper_client(addr).await;
        let payload: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        // Two streams at once on one connection, sharing its window.
        let mut replies = Vec::new();
        for path in ["/one", "/two"] {
            let request = Request::post(format!("http://cp{path}"))
                .body(Full::new(Bytes::from(payload.clone())))
                .unwrap();
            replies.push(sender.send_request(request));
        }
        for (reply, path) in replies.into_iter().zip(["/one", "/two"]) {
            let response = reply.await.unwrap();
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()["x-path"], path);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(body.len(), payload.len());
            assert!(body == payload, "the echoed body differs");
        }
    }

    #[tokio::test]
    async fn a_client_that_is_not_http2_gets_goaway_with_the_reason() {
        let addr = echo_server(settings()).await;
        let mut io = TcpStream::connect(addr).await.unwrap();
        io.write_all(b"GET / HTTP/1.1\r\nHost: cp\r\n\r\n")
            .await
            .unwrap();
        let frames = frames_until_close(&mut io).await;
        assert_eq!(frames[0].0, SETTINGS);
        assert_eq!(
            goaway(&frames),
            (
                PROTOCOL_ERROR,
                "not an HTTP/2 connection preface".to_string()
            )
        );
    }

    #[tokio::test]
    async fn oversized_frames_and_streams_out_of_order_end_the_connection() {
        let addr = echo_server(settings()).await;
        for (frame, code, reason) in [
            (
                frame(DATA, 0, 1, &vec![0; MAX_FRAME + 1]),
                FRAME_SIZE_ERROR,
                "frame larger than SETTINGS_MAX_FRAME_SIZE",
            ),
            (
                frame(HEADERS, END_HEADERS, 2, &[0x83]),
                PROTOCOL_ERROR,
                "HEADERS on a stream a client may not open",
            ),
            (
                frame(HEADERS, END_HEADERS, 1, &[0x80]),
                COMPRESSION_ERROR,
                "index 0",
            ),
            (
                frame(CONTINUATION, END_HEADERS, 1, &[0x83]),
                PROTOCOL_ERROR,
                "CONTINUATION without HEADERS",
            ),
            (
                frame(WINDOW_UPDATE, 0, 0, &[0x7f, 0xff, 0xff, 0xff]),
                FLOW_CONTROL_ERROR,
                "connection window too large",
            ),
        ] {
            let mut io = TcpStream::connect(addr).await.unwrap();
            let mut bytes = PREFACE.to_vec();
            bytes.extend(frame_settings());
            bytes.extend(frame);
            io.write_all(&bytes).await.unwrap();
            let frames = frames_until_close(&mut io).await;
            assert_eq!(goaway(&frames), (code, reason.to_string()));
        }
    }

    fn frame_settings() -> Vec<u8> {
        frame(SETTINGS, 0, 0, &[])
    }

    /// The preface, SETTINGS, and one stream more than the limit, each
    /// opened with POST / (static entries 3 and 4) and left open (no
    /// END_STREAM).
    fn one_stream_too_many() -> Vec<u8> {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame_settings());
        for i in 0..=MAX_STREAMS as u32 {
            bytes.extend(frame(HEADERS, END_HEADERS, 2 * i + 1, &[0x83, 0x84]));
        }
        bytes
    }

    #[tokio::test]
    async fn pings_are_answered_and_a_peer_that_does_not_answer_is_dropped() {
        let addr = echo_server(Settings {
            keepalive_interval: Duration::from_millis(200),
            keepalive_timeout: Duration::from_millis(200),
        })
        .await;
        let mut io = TcpStream::connect(addr).await.unwrap();
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame_settings());
        bytes.extend(frame(PING, 0, 0, b"12345678"));
        io.write_all(&bytes).await.unwrap();
        // Never answering the server's ping: it closes the connection.
        let frames = frames_until_close(&mut io).await;
        let kinds: Vec<(u8, u8)> = frames.iter().map(|f| (f.0, f.1)).collect();
        assert_eq!(
            kinds,
            [(SETTINGS, 0), (SETTINGS, ACK), (PING, ACK), (PING, 0)],
            "server SETTINGS, its ACK of ours, the answer to our ping, its own ping"
        );
        assert_eq!(frames[2].3, b"12345678");
    }

    #[tokio::test]
    async fn frames_on_a_refused_stream_are_ignored_and_a_bad_stream_ends_alone() {
        let addr = echo_server(settings()).await;
        let mut io = TcpStream::connect(addr).await.unwrap();
        // Streams 1 to 31 are taken; 33 is refused.
        let mut bytes = one_stream_too_many();
        let refused = 2 * MAX_STREAMS as u32 + 1;
        // The client had queued more for 33 before it saw the refusal: its
        // body and trailers (an empty block) are ignored.
        bytes.extend(frame(DATA, 0, refused, b"late"));
        bytes.extend(frame(HEADERS, END_STREAM | END_HEADERS, refused, &[]));
        // Stream 3 sends headers again without ending: malformed, so that
        // stream is reset; the connection and its other streams go on.
        bytes.extend(frame(HEADERS, END_HEADERS, 3, &[]));
        for i in 0..MAX_STREAMS as u32 {
            let id = 2 * i + 1;
            if id != 3 {
                bytes.extend(frame(DATA, END_STREAM, id, id.to_string().as_bytes()));
            }
        }
        // No new streams: the server closes once those it has are answered.
        bytes.extend(frame(GOAWAY, 0, 0, &[0, 0, 0, 0, 0, 0, 0, 0]));
        io.write_all(&bytes).await.unwrap();
        let frames = frames_until_close(&mut io).await;
        assert!(frames.iter().all(|f| f.0 != GOAWAY), "no connection error");
        let resets = resets(&frames);
        assert_eq!(
            resets,
            [
                (refused, REFUSED_STREAM.to_be_bytes().to_vec()),
                (3, PROTOCOL_ERROR.to_be_bytes().to_vec())
            ]
        );
        let mut echoed: Vec<(u32, Vec<u8>)> = frames
            .iter()
            .filter(|f| f.0 == DATA && !f.3.is_empty())
            .map(|f| (f.2, f.3.clone()))
            .collect();
        echoed.sort();
        let expected: Vec<(u32, Vec<u8>)> = (0..MAX_STREAMS as u32)
            .map(|i| 2 * i + 1)
            .filter(|&id| id != 3)
            .map(|id| (id, id.to_string().into_bytes()))
            .collect();
        assert_eq!(echoed, expected, "every other stream is answered");
    }

    #[tokio::test]
    async fn streams_beyond_the_limit_are_refused() {
        let addr = echo_server(settings()).await;
        let mut io = TcpStream::connect(addr).await.unwrap();
        let mut bytes = one_stream_too_many();
        bytes.extend(frame(GOAWAY, 0, 0, &[0, 0, 0, 0, 0, 0, 0, 0]));
        io.write_all(&bytes).await.unwrap();
        io.shutdown().await.unwrap();
        let frames = frames_until_close(&mut io).await;
        let resets = resets(&frames);
        assert_eq!(
            resets,
            [(
                2 * MAX_STREAMS as u32 + 1,
                REFUSED_STREAM.to_be_bytes().to_vec()
            )]
        );
    }
}
