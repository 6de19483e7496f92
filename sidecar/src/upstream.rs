//! What the upstream connection types (HTTP/1.1 in `h1.rs`, HTTP/2 in
//! `h2.rs`) and their pool (`pool.rs`) share: a cluster's connection
//! settings, the errors of sending a request, and which event loop a thread
//! runs. It depends on neither, so that the three form no import cycle.

use std::time::Duration;

use crate::h1;

/// Request bodies up to this size are buffered so that a retry can resend
/// them; larger or unknown-length bodies stream through without retries.
pub const MAX_BUFFERED_BODY: u64 = 64 * 1024;

/// Istio's default `connectionPool.http.idleTimeout`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// Per-cluster connection settings (Istio's `connectionPool`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSettings {
    /// TCP connect timeout (`tcp.connectTimeout`; the sidecar's
    /// `--connect-timeout` when the rule sets none).
    pub connect_timeout: Duration,
    /// Idle connections older than this are closed (`http.idleTimeout`).
    pub idle_timeout: Duration,
    /// Requests a connection carries before it is closed; 0 is unlimited
    /// (`http.maxRequestsPerConnection`; 1 disables keep-alive).
    pub max_requests_per_connection: u32,
    /// Milliseconds a connection lives at most; 0 is unlimited
    /// (`tcp.maxConnectionDuration`). An older one is closed when its
    /// request is done, as Envoy drains an HTTP/1.1 connection.
    pub max_connection_ms: u64,
    /// Requests one HTTP/2 connection carries at once at most; 0 is
    /// unlimited (`http.maxConcurrentStreams`).
    pub max_streams: u32,
}

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The TCP connection was refused or failed.
    #[error(transparent)]
    Connect(std::io::Error),
    /// The TCP connection did not complete in time.
    #[error("connect timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// The request failed on an established connection (reset, closed, bad response).
    #[error(transparent)]
    Request(h1::Error),
    /// The request failed on an established HTTP/2 connection.
    #[error(transparent)]
    H2(hyper::Error),
    /// A streamed request body was sent on an earlier attempt and was too
    /// long to keep: there is nothing to send again.
    #[error("request body already sent")]
    BodySent,
}

impl UpstreamError {
    /// The error of a dial that took up to `timeout`.
    pub fn of_dial(e: std::io::Error, timeout: Duration) -> UpstreamError {
        match e.kind() {
            std::io::ErrorKind::TimedOut => UpstreamError::ConnectTimeout(timeout),
            _ => UpstreamError::Connect(e),
        }
    }

    /// True when no connection could be made: the request never reached the endpoint.
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect(_) | UpstreamError::ConnectTimeout(_)
        )
    }

    /// True when the endpoint refused the request's HTTP/2 stream: it did
    /// not process it, so even a non-idempotent request may go elsewhere.
    pub fn is_refused_stream(&self) -> bool {
        matches!(self, UpstreamError::H2(e) if refused_stream(e))
    }

    /// True when the caller's own request body failed (malformed chunked
    /// encoding, or the caller went away): the endpoint is not to blame.
    pub fn is_client_body(&self) -> bool {
        match self {
            UpstreamError::Request(e) => e.is_client_body(),
            // hyper's HTTP/2 client reports the body it was given failing
            // as a user error.
            UpstreamError::H2(e) => e.is_user(),
            _ => false,
        }
    }

    /// True when the caller's request body stopped arriving for its bound
    /// (`--client-body-timeout`).
    pub fn is_client_body_stalled(&self) -> bool {
        match self {
            UpstreamError::Request(e) => e.is_client_body_stalled(),
            UpstreamError::H2(e) => crate::message::stalled(e),
            _ => false,
        }
    }
}

thread_local! {
    /// Which event loop this thread runs (see [`set_event_loop`]).
    static EVENT_LOOP: std::cell::Cell<u16> = const { std::cell::Cell::new(0) };
}

/// Names the event loop of this thread. A connection's I/O runs on the loop
/// that opened it, so a request prefers an idle connection of its own loop:
/// no cross-thread wake-up per request.
pub fn set_event_loop(n: u16) {
    EVENT_LOOP.with(|l| l.set(n));
}

pub(crate) fn event_loop() -> u16 {
    EVENT_LOOP.with(|l| l.get())
}

/// True when the server did not process the request: it refused the
/// stream (`REFUSED_STREAM`), or is going away (`GOAWAY`, which fails only
/// the streams it will not process: a server draining for a restart). Any
/// request may then go to another endpoint.
pub fn refused_stream(e: &hyper::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(h2) = err.downcast_ref::<::h2::Error>() {
            return h2.reason() == Some(::h2::Reason::REFUSED_STREAM)
                || (h2.is_go_away() && h2.is_remote());
        }
        cur = err.source();
    }
    false
}
