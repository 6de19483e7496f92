//! Upstream HTTP/1.1 connections ([`crate::h1::Conn`]), pooled per endpoint.
//!
//! Each endpoint keeps a short stack of idle connections per event loop. A
//! request takes one of its loop's, else dials a new one, and its response
//! body gives it back to the loop that opened it once read to the end,
//! unless the connection has carried `max_requests_per_connection` requests
//! or lived past the maximum duration. Idle connections older than the idle timeout or the maximum
//! duration are closed by [`ConnPool::sweep`] and skipped at checkout.
//! Each stack's lock guards only a push or a pop, never an await, and with a
//! stack per loop (on its own cache line) the loops do not contend for it.
//!
//! A loop never borrows another loop's idle connection, as nginx's workers
//! keep a keep-alive cache each: a socket's readiness is delivered by the
//! reactor of the loop that opened it, so a request on a borrowed one wakes
//! that loop's thread, which then wakes the request's, for every read and
//! write (two context switches and an eventfd write each, measured at 2% of
//! requests at 1,000 req/s over two loops). A loop dials its own instead;
//! the cost is at most one connection per loop and concurrent request more.
//!
//! Our own pool rather than hyper-util's: Istio's `connectionPool` fields
//! (`tcp.connectTimeout`, `tcp.maxConnectionDuration`, `http.idleTimeout`,
//! `http.maxRequestsPerConnection`)
//! are per cluster, and the open-connection count per endpoint is a metric
//! users compare balancers by.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Response;
use tracing::debug;

pub use crate::h1::UpstreamBody;
use crate::h1::{self, Conn};
use crate::upstream::event_loop;
pub use crate::upstream::{
    set_event_loop, PoolSettings, UpstreamError, DEFAULT_IDLE_TIMEOUT, MAX_BUFFERED_BODY,
};

/// Idle connections kept per endpoint at most (over all its loops' stacks);
/// more are closed when freed.
pub const MAX_IDLE_PER_ENDPOINT: usize = 256;

struct Idle {
    conn: Conn,
    uses: u32,
    /// When it was opened ([`crate::clock::now_ms`]).
    born_ms: u64,
    /// When it went idle ([`crate::clock::now_ms`]: the request path keeps
    /// that clock fresh, and idle timeouts are seconds, so no clock call).
    since_ms: u64,
    owner: u16,
}

impl Idle {
    /// True when the connection has been idle too long or lived too long.
    fn expired(&self, now_ms: u64, settings: &PoolSettings) -> bool {
        now_ms.saturating_sub(self.since_ms) > settings.idle_timeout.as_millis() as u64
            || (settings.max_connection_ms > 0
                && now_ms.saturating_sub(self.born_ms) > settings.max_connection_ms)
    }
}

/// One event loop's idle connections to an endpoint, on a cache line of its
/// own so that two loops' stacks never share one.
#[derive(Default)]
#[repr(align(64))]
struct Stack(Mutex<Vec<Idle>>);

impl Stack {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Asked before a request goes out again on a fresh connection after a
/// reused one closed under it: true admits the resend (the proxy takes a
/// retry's `maxRetries` slot and budget token for it).
pub type Resend<'a> = &'a mut (dyn FnMut() -> bool + Send);

/// One endpoint's connections.
pub struct ConnPool {
    /// Indexed by event loop.
    idle: Box<[Stack]>,
    /// Connections open now (busy and idle, HTTP/1.1 and HTTP/2).
    open: Arc<AtomicU32>,
    /// HTTP/2 connections, made on first use: most endpoints never have any.
    h2: std::sync::OnceLock<crate::h2::H2Pool>,
    /// The endpoint runs a sidecar: new connections to it are mutual TLS
    /// (when this sidecar has the mesh's TLS; see [`crate::tls`]), to a
    /// server whose certificate names an identity of its pod.
    peer: arc_swap::ArcSwapOption<crate::tls::Peer>,
}

impl Default for ConnPool {
    fn default() -> Self {
        ConnPool::with_loops(1)
    }
}

impl std::fmt::Debug for ConnPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("open", &self.open.load(Ordering::Relaxed))
            .finish()
    }
}

/// A response body on a pooled HTTP/1.1 connection, which goes back to the
/// pool once the body is read to the end.
pub type H1Body = h1::ResponseBody<Lease>;

impl h1::Lent for Lease {
    fn conn(&mut self) -> &mut Conn {
        &mut self.conn
    }
}

/// A connection checked out for one request; give it back with
/// [`ConnPool::put`] once the response body was read to the end.
pub struct Lease {
    pub(crate) conn: Conn,
    uses: u32,
    max_uses: u32,
    born_ms: u64,
    max_age_ms: u64,
    owner: u16,
}

impl ConnPool {
    /// A pool keeping idle connections per event loop (`loops`).
    pub fn with_loops(loops: usize) -> Self {
        ConnPool {
            idle: (0..loops.max(1)).map(|_| Stack::default()).collect(),
            open: Arc::default(),
            h2: std::sync::OnceLock::new(),
            peer: Default::default(),
        }
    }

    /// Whether new connections are mutual TLS (the endpoint runs a sidecar,
    /// and this one has the mesh's TLS, `mesh`), and to which identities
    /// (`namespace/service account`; none: any of the trust domain).
    /// Unchanged, the count of refusals is kept.
    pub fn set_mtls(&self, on: bool, accounts: &[String], mesh: Option<&Arc<crate::tls::Mesh>>) {
        let mesh = mesh.filter(|_| on);
        let current = self.peer.load();
        let same = match (&*current, mesh) {
            (None, None) => true,
            (Some(p), Some(_)) => p.accounts() == accounts,
            _ => false,
        };
        if !same {
            self.peer.store(
                mesh.map(|m| Arc::new(crate::tls::Peer::dialed_with(accounts.to_vec(), m.clone()))),
            );
        }
    }

    /// New connections expect what `peer` says (another pool's, shared).
    pub fn set_peer(&self, peer: Option<Arc<crate::tls::Peer>>) {
        self.peer.store(peer);
    }

    /// What new connections expect of the endpoint: None, plaintext.
    pub fn peer(&self) -> Option<Arc<crate::tls::Peer>> {
        self.peer.load_full()
    }

    /// True when new connections are mutual TLS.
    pub fn mtls(&self) -> bool {
        self.peer.load().is_some()
    }

    /// Connections open now (busy and idle, HTTP/1.1 and HTTP/2).
    pub fn open_connections(&self) -> u32 {
        self.open.load(Ordering::Relaxed)
    }

    /// This endpoint's HTTP/2 connections (see [`crate::h2`]).
    fn h2(&self) -> &crate::h2::H2Pool {
        self.h2
            .get_or_init(|| crate::h2::H2Pool::new(self.idle.len()))
    }

    /// A stream on one of the endpoint's HTTP/2 connections (made if none
    /// has room).
    pub async fn h2_stream(
        &self,
        addr: SocketAddr,
        settings: &PoolSettings,
    ) -> Result<crate::h2::H2Stream, UpstreamError> {
        self.h2()
            .stream(addr, settings, &self.open, self.peer().as_deref())
            .await
    }

    /// Sends `req` on `stream` (from [`ConnPool::h2_stream`]).
    pub async fn send_h2(
        &self,
        addr: SocketAddr,
        settings: &PoolSettings,
        stream: crate::h2::H2Stream,
        req: http::Request<crate::h2::RequestBody>,
    ) -> Result<http::Response<crate::h2::ResponseBody>, UpstreamError> {
        self.h2()
            .send(
                addr,
                settings,
                &self.open,
                self.peer().as_deref(),
                stream,
                req,
            )
            .await
    }

    /// The most recent idle connection of this event loop (never another
    /// loop's: see the module's text).
    fn take(&self, settings: &PoolSettings, now: u64) -> Option<Idle> {
        let stack = &self.idle[event_loop() as usize % self.idle.len()];
        loop {
            let mut idle = stack.lock().pop()?;
            if idle.conn.is_closed() || idle.expired(now, settings) {
                continue; // dropping it closes the connection
            }
            return Some(idle);
        }
    }

    /// Gives a connection back after its response was read to the end, at
    /// `now` (the sidecar clock's milliseconds).
    pub fn put(&self, lease: Lease, now: u64) {
        if lease.max_uses > 0 && lease.uses >= lease.max_uses {
            return;
        }
        if lease.max_age_ms > 0 && now.saturating_sub(lease.born_ms) > lease.max_age_ms {
            return;
        }
        let n = self.idle.len();
        let mut idle = self.idle[lease.owner as usize % n].lock();
        if idle.len() < (MAX_IDLE_PER_ENDPOINT / n).max(1) {
            idle.push(Idle {
                conn: lease.conn,
                uses: lease.uses,
                born_ms: lease.born_ms,
                since_ms: now,
                owner: lease.owner,
            });
        }
    }

    /// Closes idle connections idle for longer than the idle timeout, older
    /// than the maximum duration, or already closed, at `now`.
    pub fn sweep(&self, settings: &PoolSettings, now: u64) {
        for stack in self.idle.iter() {
            stack
                .lock()
                .retain_mut(|c| !c.conn.is_closed() && !c.expired(now, settings));
        }
        if let Some(h2) = self.h2.get() {
            h2.sweep(settings, now);
        }
    }

    /// Idle connections now.
    pub fn idle_count(&self) -> usize {
        self.idle.iter().map(|s| s.lock().len()).sum()
    }

    /// Sends `req` to `addr` on an idle connection or a new one, and
    /// returns the response with a body that reads from the connection.
    ///
    /// A reused connection the server closed while idle is found at
    /// checkout ([`h1::Conn::is_closed`]: its FIN or reset already arrived)
    /// and never written to. One that the server closes as the request goes
    /// out (nothing came back) races the server's idle timeout, and the
    /// request may or may not have reached it: then the request goes out
    /// once more, on a fresh connection, as Go's client does, but only when
    /// `resend` admits it: the proxy counts that send as a retry (a
    /// `maxRetries` slot and a token of the retry budget, as
    /// [`crate::retry`] would), so a server that closes every reused
    /// connection cannot double the load. Only an idempotent request, or one
    /// whose head could not even be written, is resent. `now` is the sidecar
    /// clock's milliseconds (connections' ages are measured in it).
    pub async fn send(
        &self,
        addr: SocketAddr,
        settings: &PoolSettings,
        out: &mut h1::Outgoing,
        now: u64,
        resend: Resend<'_>,
    ) -> Result<Response<H1Body>, UpstreamError> {
        let (mut conn, mut uses, mut born_ms, mut owner, mut reused) =
            match self.take(settings, now) {
                Some(idle) => (idle.conn, idle.uses, idle.born_ms, idle.owner, true),
                // Boxed: dialing is rare with keep-alive, and the dial's
                // state would otherwise widen every request's future.
                None => (
                    Box::pin(self.connect(addr, settings.connect_timeout)).await?,
                    0,
                    now,
                    event_loop(),
                    false,
                ),
            };
        loop {
            match conn.exchange(out).await {
                Ok((head, decoder)) => {
                    let lease = Lease {
                        conn,
                        uses: uses + 1,
                        max_uses: settings.max_requests_per_connection,
                        born_ms,
                        max_age_ms: settings.max_connection_ms,
                        owner,
                    };
                    return Ok(head.map(|()| h1::ResponseBody::new(decoder, lease)));
                }
                Err(e)
                    if reused
                        && e.nothing_received()
                        && out.resendable()
                        && (out.idempotent() || matches!(e, h1::Error::Write(_)))
                        && resend() =>
                {
                    debug!(%addr, error = %e, "pooled connection closed as the request went out; resending on a new one (counted as a retry)");
                    conn = Box::pin(self.connect(addr, settings.connect_timeout)).await?;
                    (uses, born_ms, owner, reused) = (0, now, event_loop(), false);
                }
                Err(e) => return Err(UpstreamError::Request(e)),
            }
        }
    }

    async fn connect(&self, addr: SocketAddr, timeout: Duration) -> Result<Conn, UpstreamError> {
        let io = crate::tls::connect(addr, timeout, self.peer().as_deref(), false)
            .await
            .map_err(|e| UpstreamError::of_dial(e, timeout))?;
        Ok(Conn::new(io, &self.open))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A server answering every request with 200 and counting connections.
    async fn server(close_after_first: bool) -> (SocketAddr, Arc<AtomicU32>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let conns = Arc::new(AtomicU32::new(0));
        let c = conns.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                c.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                            .await;
                        if close_after_first {
                            return;
                        }
                    }
                });
            }
        });
        (addr, conns)
    }

    fn get(addr: SocketAddr) -> h1::Outgoing {
        let body = UpstreamBody::Buffered(Bytes::new());
        h1::encode(
            &http::Method::GET,
            "/",
            &http::HeaderMap::new(),
            Some(&addr.to_string()),
            body,
        )
    }

    /// A request and its whole response at `now` (the sidecar clock's
    /// milliseconds; the tests pass the time, nothing sleeps for it).
    async fn roundtrip_at(pool: &ConnPool, addr: SocketAddr, s: &PoolSettings, now: u64) {
        use http_body_util::BodyExt;
        let resp = pool
            .send(addr, s, &mut get(addr), now, &mut || true)
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        while body.frame().await.transpose().expect("body").is_some() {}
        // Not reusable when the client saw the server close it (hyper's
        // client arm may, by the end of the body): then it is not pooled,
        // and the tests that count connections see that.
        if let Some(lease) = body.take_reusable() {
            pool.put(lease, now);
        }
    }

    async fn roundtrip(pool: &ConnPool, addr: SocketAddr, s: &PoolSettings) {
        roundtrip_at(pool, addr, s, 1).await;
    }

    const SETTINGS: PoolSettings = PoolSettings {
        connect_timeout: Duration::from_secs(1),
        idle_timeout: DEFAULT_IDLE_TIMEOUT,
        max_requests_per_connection: 0,
        max_connection_ms: 0,
        max_streams: 0,
    };

    #[tokio::test]
    async fn a_loop_dials_its_own_connection_rather_than_borrow_another_loops() {
        let (addr, conns) = server(false).await;
        let pool = ConnPool::with_loops(2);
        set_event_loop(1);
        roundtrip(&pool, addr, &SETTINGS).await;
        set_event_loop(0);
        roundtrip(&pool, addr, &SETTINGS).await;
        roundtrip(&pool, addr, &SETTINGS).await;
        set_event_loop(1);
        roundtrip(&pool, addr, &SETTINGS).await;
        assert_eq!(conns.load(Ordering::Relaxed), 2, "one connection per loop");
        assert_eq!(
            (pool.idle[0].lock().len(), pool.idle[1].lock().len()),
            (1, 1),
            "each given back to the loop that opened it"
        );
        set_event_loop(0);
    }

    #[tokio::test]
    async fn reuses_connections_and_honours_max_requests_per_connection() {
        let (addr, conns) = server(false).await;
        let pool = ConnPool::default();
        for _ in 0..10 {
            roundtrip(&pool, addr, &SETTINGS).await;
        }
        assert_eq!(conns.load(Ordering::Relaxed), 1, "keep-alive reuses one");

        let (addr, conns) = server(false).await;
        let pool = ConnPool::default();
        let s = PoolSettings {
            max_requests_per_connection: 3,
            ..SETTINGS
        };
        for _ in 0..10 {
            roundtrip(&pool, addr, &s).await;
        }
        assert_eq!(
            conns.load(Ordering::Relaxed),
            4,
            "10 requests, 3 per connection"
        );
    }

    #[tokio::test]
    async fn a_connection_the_server_closed_is_not_a_failure() {
        let (addr, conns) = server(true).await;
        let pool = ConnPool::default();
        for _ in 0..5 {
            roundtrip(&pool, addr, &SETTINGS).await;
            // Let the server's close reach the pooled connection or not:
            // both orders must succeed.
            tokio::task::yield_now().await;
        }
        assert_eq!(conns.load(Ordering::Relaxed), 5);
    }

    /// Waits (up to 5 s) for the pool's open count to read `want`: a
    /// dropped connection's socket closes at once, its count with it.
    async fn open_becomes(pool: &ConnPool, want: u32) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while pool.open.load(Ordering::Relaxed) != want {
            assert!(
                tokio::time::Instant::now() < deadline,
                "open never became {want}"
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn idle_connections_expire() {
        let (addr, conns) = server(false).await;
        let pool = ConnPool::default();
        let s = PoolSettings {
            idle_timeout: Duration::from_millis(50),
            ..SETTINGS
        };
        roundtrip_at(&pool, addr, &s, 1_000).await;
        pool.sweep(&s, 1_050);
        assert_eq!(pool.idle_count(), 1, "idle for the timeout, not longer");
        pool.sweep(&s, 1_051);
        assert_eq!(pool.idle_count(), 0, "idle for longer");
        roundtrip_at(&pool, addr, &s, 1_100).await;
        assert_eq!(conns.load(Ordering::Relaxed), 2);
        // Checkout skips one idle too long, as the sweep would have.
        roundtrip_at(&pool, addr, &s, 1_200).await;
        assert_eq!(conns.load(Ordering::Relaxed), 3);
        open_becomes(&pool, 1).await;
    }

    #[tokio::test]
    async fn connections_older_than_the_maximum_duration_are_not_reused() {
        use http_body_util::BodyExt;
        let (addr, conns) = server(false).await;
        let pool = ConnPool::default();
        let s = PoolSettings {
            max_connection_ms: 300,
            ..SETTINGS
        };
        roundtrip_at(&pool, addr, &s, 1_000).await;
        roundtrip_at(&pool, addr, &s, 1_300).await;
        assert_eq!(conns.load(Ordering::Relaxed), 1, "young: reused");
        // Past the limit: skipped at checkout, and swept.
        roundtrip_at(&pool, addr, &s, 1_301).await;
        assert_eq!(conns.load(Ordering::Relaxed), 2, "old: a new one");
        assert_eq!(pool.idle_count(), 1);
        pool.sweep(&s, 1_601);
        assert_eq!(pool.idle_count(), 1, "as old as the limit: kept");
        pool.sweep(&s, 1_602);
        assert_eq!(pool.idle_count(), 0, "swept");
        // Past the limit while busy: closed once its request is done.
        let resp = pool
            .send(addr, &s, &mut get(addr), 2_000, &mut || true)
            .await
            .expect("send");
        let mut body = resp.into_body();
        while body.frame().await.transpose().expect("body").is_some() {}
        pool.put(body.take_reusable().expect("reusable"), 2_301);
        assert_eq!(pool.idle_count(), 0, "not given back");
        assert_eq!(conns.load(Ordering::Relaxed), 3);
        open_becomes(&pool, 0).await;
    }

    /// A server that answers each request with `response`, one byte per
    /// write, so that every boundary of the framing falls between reads.
    async fn trickling_server(response: &'static [u8]) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let _ = s.set_nodelay(true);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let mut head = Vec::new();
                    loop {
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        head.clear();
                        for b in response {
                            if s.write_all(std::slice::from_ref(b)).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_micros(200)).await;
                        }
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn framing_split_across_reads_decodes_whole() {
        use http_body_util::BodyExt;
        let cases: [(&[u8], &[u8], bool); 3] = [
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n7;x=y\r\n, world\r\n0\r\nx-sum: 1\r\n\r\n",
                b"hello, world",
                true,
            ),
            (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\nhello, world",
                b"hello, world",
                false,
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nc\r\nhello, world\r\n0\r\n\r\n",
                b"hello, world",
                false,
            ),
        ];
        for (response, want, trailers) in cases {
            let addr = trickling_server(response).await;
            let pool = ConnPool::default();
            // Twice: the connection must come back reusable, framing intact.
            for _ in 0..2 {
                let resp = pool
                    .send(addr, &SETTINGS, &mut get(addr), 1, &mut || true)
                    .await
                    .expect("send");
                assert_eq!(resp.status(), 200);
                let mut body = resp.into_body();
                let mut data = Vec::new();
                let mut got_trailers = None;
                while let Some(frame) = body.frame().await.transpose().expect("body") {
                    match frame.into_data() {
                        Ok(d) => data.extend_from_slice(&d),
                        Err(f) => got_trailers = f.into_trailers().ok(),
                    }
                }
                assert_eq!(data, want);
                assert_eq!(got_trailers.map(|t| t["x-sum"].clone()).is_some(), trailers);
                pool.put(body.take_reusable().expect("reusable"), 1);
            }
            assert_eq!(
                pool.open.load(Ordering::Relaxed),
                1,
                "one connection for both"
            );
        }
    }

    /// A server that answers the first request of each connection and
    /// closes the connection on reading the second, unanswered: the race with
    /// its idle timeout, after the request reached it. Counts the requests
    /// it read.
    async fn closing_on_second_request() -> (SocketAddr, Arc<AtomicU32>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let seen = Arc::new(AtomicU32::new(0));
        let c = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let c = c.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    for answer in [true, false] {
                        let mut head = Vec::new();
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        c.fetch_add(1, Ordering::Relaxed);
                        if answer {
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                            if s.write_all(ok).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, seen)
    }

    #[tokio::test]
    async fn a_resend_after_a_reused_connection_closed_is_admitted_first() {
        let (addr, seen) = closing_on_second_request().await;
        let pool = ConnPool::default();
        roundtrip_at(&pool, addr, &SETTINGS, 1).await;
        // Admitted (a retry's slot and budget token): the request went out
        // twice, and the server read it twice.
        let mut asked = 0;
        let resp = pool
            .send(addr, &SETTINGS, &mut get(addr), 1, &mut || {
                asked += 1;
                true
            })
            .await
            .expect("resent on a fresh connection");
        assert_eq!(resp.status(), 200);
        assert_eq!(asked, 1);
        assert_eq!(
            seen.load(Ordering::Relaxed),
            3,
            "the first copy reached the server"
        );
        drop(resp);
        // Refused (no retry left): the failure is the caller's to answer.
        roundtrip_at(&pool, addr, &SETTINGS, 1).await;
        let mut asked = 0;
        let err = pool
            .send(addr, &SETTINGS, &mut get(addr), 1, &mut || {
                asked += 1;
                false
            })
            .await
            .err()
            .expect("not resent");
        assert_eq!(asked, 1);
        assert!(
            matches!(&err, UpstreamError::Request(e) if e.nothing_received()),
            "{err}"
        );
        // A POST whose head went out is never resent: the resend is not asked.
        roundtrip_at(&pool, addr, &SETTINGS, 1).await;
        let mut post = h1::encode(
            &http::Method::POST,
            "/",
            &http::HeaderMap::new(),
            Some(&addr.to_string()),
            UpstreamBody::Buffered(Bytes::from_static(b"x")),
        );
        let mut asked = 0;
        let sent = pool
            .send(addr, &SETTINGS, &mut post, 1, &mut || {
                asked += 1;
                true
            })
            .await;
        assert!(sent.is_err());
        assert_eq!(asked, 0);
    }

    #[tokio::test]
    async fn connect_errors_are_typed() {
        // A port nothing listens on.
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        drop(l);
        let pool = ConnPool::default();
        let err = pool
            .send(addr, &SETTINGS, &mut get(addr), 1, &mut || true)
            .await
            .err()
            .expect("refused");
        assert!(err.is_connect(), "{err}");
        assert!(
            matches!(&err, UpstreamError::Connect(e) if e.kind() == std::io::ErrorKind::ConnectionRefused),
            "{err}"
        );
    }
}
