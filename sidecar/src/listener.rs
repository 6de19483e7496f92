//! The proxy listeners (outbound, inbound, gateway): each event loop
//! accepts on its own SO_REUSEPORT socket, evens connections out with the
//! other loops, serves HTTP/1.1 and HTTP/2 with hyper, and drains at
//! shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::proxy::Proxy;

pub mod captured;
mod client_io;
mod detect;
mod drain;
mod idle;
mod orig_dst;
mod sniff;
pub(crate) mod sockets;
use captured::Capture;
use client_io::ClientIo;
use drain::{Drain, Drained, Graceful};
use sniff::Speaks;

/// The event loops that share a listener address, and how many connections
/// each serves. The kernel spreads new connections over their SO_REUSEPORT
/// sockets by a hash of the addresses, blind to load: 64 keep-alive
/// connections over two loops typically land 36 to 28, and the busier loop
/// caps the whole proxy. So a loop that accepts a connection while another
/// serves fewer hands it over (least connections), as nginx's workers even
/// out by accepting while idle.
pub struct Loops {
    open: Vec<AtomicUsize>,
    handoff: Vec<std::sync::Mutex<Option<mpsc::UnboundedSender<Handoff>>>>,
    /// Most connections served at once (`--max-connections`).
    max: usize,
    /// Connections closed at once for being beyond `max`.
    refused: AtomicU64,
    /// When a failed accept (descriptors exhausted) was last logged, and
    /// how many failed since.
    accept_failed_logged_ms: AtomicU64,
    accept_failures: AtomicU64,
}

type Handoff = (std::net::TcpStream, SocketAddr);

impl Loops {
    /// `n` loops (at least one), with no bound on connections.
    pub fn new(n: usize) -> Arc<Loops> {
        Loops::with_max(n, usize::MAX)
    }

    /// `n` loops (at least one) serving at most `max` connections together.
    pub fn with_max(n: usize, max: usize) -> Arc<Loops> {
        Arc::new(Loops {
            open: (0..n.max(1)).map(|_| AtomicUsize::new(0)).collect(),
            handoff: (0..n.max(1)).map(|_| std::sync::Mutex::new(None)).collect(),
            max,
            refused: AtomicU64::new(0),
            accept_failed_logged_ms: AtomicU64::new(0),
            accept_failures: AtomicU64::new(0),
        })
    }

    /// Connections refused for being beyond the bound.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// True when the loops serve as many connections as they may.
    fn full(&self) -> bool {
        self.max != usize::MAX
            && self
                .open
                .iter()
                .map(|o| o.load(Ordering::Relaxed))
                .sum::<usize>()
                >= self.max
    }

    /// Logs a failed accept, at most once a second (with how many failed
    /// meanwhile): out of descriptors, every accept fails at once.
    fn accept_failed(&self, listener: &str, e: &std::io::Error) {
        let failed = self.accept_failures.fetch_add(1, Ordering::Relaxed) + 1;
        let now = crate::clock::precise_ms();
        let last = self.accept_failed_logged_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= 1000)
            && self
                .accept_failed_logged_ms
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.accept_failures.store(0, Ordering::Relaxed);
            warn!(listener, error = %e, failed, "accept failed (logged at most once a second; `failed` counts since the last line)");
        }
    }

    /// How many loops.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Never: there is at least one loop.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Connections loop `i` serves now.
    pub fn open(&self, i: usize) -> usize {
        self.open.get(i).map_or(0, |o| o.load(Ordering::Relaxed))
    }

    /// The loop with the fewest connections, `me` on a tie.
    fn least(&self, me: usize) -> usize {
        let mut best = me;
        for (i, o) in self.open.iter().enumerate() {
            if o.load(Ordering::Relaxed) < self.open[best].load(Ordering::Relaxed) {
                best = i;
            }
        }
        best
    }

    fn sender(&self, i: usize) -> Option<mpsc::UnboundedSender<Handoff>> {
        self.handoff[i]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Counts a connection against its loop until the connection ends.
struct Open(Arc<Loops>, usize);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open[self.1].fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a loop's connections share: the drain, the shutdown signal, the
/// loops and which one this is, and whether hyper's timer is the loop's
/// coarse one ([`crate::coarse_timer`]).
struct Serving {
    drain: Arc<Drain>,
    shutdown: watch::Receiver<bool>,
    loops: Arc<Loops>,
    me: usize,
    coarse: bool,
    /// The listener takes captured connections.
    capture: Option<Arc<Capture>>,
}

/// How long an inbound connection may take to send its first byte and
/// finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves one client connection on this loop, counted against it until it
/// ends, and drained with the others at shutdown. The inbound listener
/// first sorts it by the mutual TLS mode ([`crate::tls::Tls::accept_inbound`]).
/// A plaintext connection whose first bytes are not HTTP/2's preface
/// ([`sniff`]) is served by hyper's HTTP/1.1 server directly; HTTP/2, TLS,
/// and a client whose first bytes do not tell yet, by hyper-util's `auto`
/// server (which reads the version itself).
fn serve_connection(stream: TcpStream, peer: SocketAddr, proxy: &Arc<Proxy>, on: &Serving) {
    let Serving {
        drain,
        shutdown,
        loops,
        me,
        coarse,
        capture,
    } = on;
    let (me, coarse) = (*me, *coarse);
    loops.open[me].fetch_add(1, Ordering::Relaxed);
    let open = Open(loops.clone(), me);
    let _ = stream.set_nodelay(true);
    let inbound = proxy.inbound;
    let counted = drain.count();
    let mut shutdown = shutdown.clone();
    let proxy = proxy.clone();
    if let Some(capture) = capture {
        let serving = Conn {
            counted,
            peer,
            shutdown,
            coarse,
        };
        let capture = capture.clone();
        tokio::spawn(async move {
            let _open = open;
            captured::serve(stream, proxy, capture, serving).await;
        });
        return;
    }
    tokio::spawn(async move {
        let _open = open;
        if !inbound {
            // An outbound connection is plaintext: served on the TCP stream
            // itself, with no TLS wrapper to go through on every read.
            let Some(speaks) = first_bytes(&stream, &proxy, &mut shutdown).await else {
                return;
            };
            let conn = Conn {
                counted,
                peer,
                shutdown,
                coarse,
            };
            return serve_http(stream, speaks, proxy, None, conn).await;
        }
        let Some(io) = proxy
            .tls
            .accept_inbound(stream, peer, HANDSHAKE_TIMEOUT)
            .await
        else {
            return;
        };
        let speaks = match &io {
            crate::tls::Io::Plain(tcp) => match first_bytes(tcp, &proxy, &mut shutdown).await {
                Some(speaks) => speaks,
                None => return,
            },
            _ => Speaks::Unsure,
        };
        let conn = Conn {
            counted,
            peer,
            shutdown,
            coarse,
        };
        serve_http(io, speaks, proxy, None, conn).await;
    });
}

/// What a plaintext connection's first bytes say it speaks; None when it
/// closed or failed before a byte, stayed silent past the client idle
/// timeout, or the drain began meanwhile (until the first bytes, the idle
/// timeout and the drain are this wait's; hyper's own start with the
/// connection).
async fn first_bytes(
    tcp: &TcpStream,
    proxy: &Proxy,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Speaks> {
    let first = async {
        match proxy.client_idle_timeout {
            Some(idle) => tokio::time::timeout(idle, sniff::speaks(tcp)).await,
            None => Ok(sniff::speaks(tcp).await),
        }
    };
    let first = tokio::select! {
        first = first => first,
        _ = shutdown.wait_for(|s| *s) => return None,
    };
    match first {
        Ok(Ok(Some(speaks))) => Some(speaks),
        _ => None,
    }
}

/// What serving one connection takes besides the connection and its proxy.
struct Conn {
    counted: drain::Counted,
    peer: SocketAddr,
    shutdown: watch::Receiver<bool>,
    coarse: bool,
}

/// Serves HTTP on `io` with `proxy`, in the version `speaks` says; `dst`,
/// a captured connection's original destination, routes each request to
/// that Service address's cluster.
async fn serve_http<I: ClientIo>(
    io: I,
    speaks: Speaks,
    proxy: Arc<Proxy>,
    dst: Option<SocketAddr>,
    conn: Conn,
) {
    let Conn {
        counted,
        peer,
        shutdown,
        coarse,
    } = conn;
    // A plaintext inbound connection (PERMISSIVE) ends when the mode
    // becomes STRICT, as at shutdown.
    let closes_on_strict = (proxy.inbound && io.plaintext()).then(|| proxy.tls.clone());
    // Who the mutual TLS peer is, once per connection, for an inbound
    // listener's authorization.
    let caller: Option<Arc<str>> = match proxy.authz {
        Some(_) => io.peer_identity().map(Arc::from),
        None => None,
    };
    let io = TokioIo::new(io);
    let config = Config::of(&proxy, coarse);
    match speaks {
        Speaks::Http1 => {
            let svc = hyper::service::service_fn(move |req| {
                proxy.handle_to(req, peer, dst, caller.as_deref())
            });
            let conn = config.http1().serve_connection(io, svc);
            let watch = Watch {
                shutdown: closes_on_strict.is_some().then_some(shutdown),
                strict: closes_on_strict,
                idle: None,
            };
            run(conn, counted, peer, watch).await;
        }
        Speaks::Http2 | Speaks::Unsure => {
            // hyper's header timeout is HTTP/1.1's: this connection's idle
            // bound (and its first bytes') is [`idle`]'s.
            let activity = idle::Activity::new();
            let idle = config.idle.map(|d| (activity.clone(), d));
            let svc = hyper::service::service_fn(move |req| {
                let request = activity.start();
                let answer = proxy.handle_to(req, peer, dst, caller.as_deref());
                async move {
                    let r = answer.await?;
                    Ok::<_, std::convert::Infallible>(r.map(|b| idle::Held::new(b, request)))
                }
            });
            let conn = config.auto().serve_connection(io, svc).into_owned();
            let watch = Watch {
                shutdown: Some(shutdown),
                strict: closes_on_strict,
                idle,
            };
            run(conn, counted, peer, watch).await;
        }
    }
}

/// What else ends a connection besides its client: the drain (with
/// `shutdown`), STRICT mutual TLS coming into force (a plaintext inbound
/// one, `strict`), and its idle bound (`idle`: its activity and timeout).
struct Watch {
    shutdown: Option<watch::Receiver<bool>>,
    /// A plaintext inbound connection closes when this sidecar's mode
    /// becomes STRICT.
    strict: Option<Arc<crate::tls::Tls>>,
    idle: Option<(Arc<idle::Activity>, Duration)>,
}

/// How a loop's hyper servers are set up. hyper's header read timeout runs
/// from when a connection starts waiting for a request head: it closes idle
/// keep-alive connections and clients that send headers too slowly alike.
/// On an event loop (a single-threaded runtime) its timer is the loop's
/// coarse one. hyper answers a head that fills its read buffer (at least
/// 8 KiB), or has more fields, with 431 and closes.
struct Config {
    idle: Option<Duration>,
    limits: crate::proxy::HeadLimits,
    coarse: bool,
}

impl Config {
    fn of(proxy: &Proxy, coarse: bool) -> Config {
        Config {
            idle: proxy.client_idle_timeout,
            limits: proxy.head_limits,
            coarse,
        }
    }

    /// HTTP/1.1 with flattened writes: a response's head and body chunks
    /// are copied into one buffer and written with one `write`, rather than
    /// queued for `writev` (460 fewer instructions a request for the small
    /// responses of an API; BENCHMARKS.md). TLS writes are flattened anyway.
    fn http1(&self) -> hyper::server::conn::http1::Builder {
        let mut b = hyper::server::conn::http1::Builder::new();
        if self.coarse {
            b.timer(crate::coarse_timer::CoarseTimer);
        } else {
            b.timer(hyper_util::rt::TokioTimer::new());
        }
        b.header_read_timeout(self.idle)
            .max_buf_size(self.max_buf())
            .max_headers(self.limits.count)
            .writev(false);
        b
    }

    /// HTTP/1.1 or HTTP/2, as the client's first bytes say.
    fn auto(&self) -> hyper_util::server::conn::auto::Builder<TokioExecutor> {
        let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        if self.coarse {
            b.http1().timer(crate::coarse_timer::CoarseTimer);
        } else {
            b.http1().timer(hyper_util::rt::TokioTimer::new());
        }
        b.http1()
            .header_read_timeout(self.idle)
            .max_buf_size(self.max_buf())
            .max_headers(self.limits.count);
        b.http2().max_header_list_size(self.max_header_list());
        b
    }

    fn max_buf(&self) -> usize {
        self.limits.bytes.max(8192)
    }

    fn max_header_list(&self) -> u32 {
        u32::try_from(self.limits.bytes).unwrap_or(u32::MAX)
    }
}

/// Resolves once `tls` is STRICT (never without one).
async fn became_strict(tls: &Option<Arc<crate::tls::Tls>>) {
    match tls {
        Some(tls) => tls.became_strict().await,
        None => std::future::pending().await,
    }
}

/// Serves `conn` until it ends, counted by `counted` and gracefully closed
/// when the drain starts; as `watch` says, also when STRICT mutual TLS
/// comes into force (requests in flight answered, then the close or
/// GOAWAY), and once idle too long (then dropped if it has not closed
/// within [`idle::GRACE`]).
async fn run<C, E>(conn: C, counted: drain::Counted, peer: SocketAddr, watch: Watch)
where
    C: Graceful<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let Some(mut shutdown) = watch.shutdown else {
        if let Err(e) = Drained::new(conn, counted).await {
            debug!(%peer, error = %e, "connection ended");
        }
        return;
    };
    let _counted = counted;
    tokio::pin!(conn);
    let mut closing = false;
    let (activity, idle) = match watch.idle {
        Some((a, d)) => (Some(a), d),
        None => (None, Duration::MAX),
    };
    let mut check = tokio::time::interval(
        (idle / 8).clamp(Duration::from_millis(50), Duration::from_secs(3600)),
    );
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let idled = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(idled);
    let mut idle_closing = false;
    loop {
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    debug!(%peer, error = %e, "connection ended");
                }
                return;
            }
            _ = became_strict(&watch.strict), if watch.strict.is_some() && !closing => {
                debug!(%peer, "closing a plaintext connection: STRICT mutual TLS is now in force");
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = shutdown.wait_for(|s| *s), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = check.tick(), if activity.is_some() && !idle_closing => {
                if activity.as_ref().is_some_and(|a| a.idle_for(idle)) {
                    debug!(%peer, ?idle, "closing an idle connection");
                    if !closing {
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    idle_closing = true;
                    idled.as_mut().reset(tokio::time::Instant::now() + idle::GRACE);
                }
            }
            _ = &mut idled, if idle_closing => {
                debug!(%peer, "dropping an idle connection that did not close in time");
                return;
            }
        }
    }
}

/// Hands a connection loop `me` accepted to the loop serving the fewest,
/// counted against that loop until it takes it; or gives it back to serve
/// here (this loop is the least loaded, or the other one has stopped). None
/// if the connection was handed over, or lost in the move.
fn hand_over(
    loops: &Loops,
    me: usize,
    stream: TcpStream,
    peer: SocketAddr,
) -> Option<(TcpStream, SocketAddr)> {
    let to = loops.least(me);
    let Some(tx) = (to != me).then(|| loops.sender(to)).flatten() else {
        return Some((stream, peer));
    };
    let std = stream.into_std().ok()?;
    loops.open[to].fetch_add(1, Ordering::Relaxed);
    match tx.send((std, peer)) {
        Ok(()) => None,
        Err(mpsc::error::SendError((std, _))) => {
            loops.open[to].fetch_sub(1, Ordering::Relaxed);
            TcpStream::from_std(std).ok().map(|s| (s, peer))
        }
    }
}

/// Accepts connections on `listener` (HTTP/1.1 and HTTP/2 cleartext), as
/// loop `me` of `loops`, until `shutdown` turns true, then lets requests in
/// flight finish (up to `drain`).
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    proxy: Arc<Proxy>,
    capture: Option<Arc<Capture>>,
    mut shutdown: watch::Receiver<bool>,
    drain: Duration,
    loops: Arc<Loops>,
    me: usize,
) {
    let connections = Arc::new(Drain::default());
    let local_addr: Option<SocketAddr> = listener.local_addr().ok();
    let coarse = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::CurrentThread;
    if coarse {
        crate::coarse_timer::ensure_waking();
    }
    let on = Serving {
        drain: connections.clone(),
        shutdown: shutdown.clone(),
        loops: loops.clone(),
        me,
        coarse,
        capture,
    };
    let (tx, mut handed) = mpsc::unbounded_channel::<Handoff>();
    *loops.handoff[me].lock().unwrap_or_else(|p| p.into_inner()) = Some(tx);
    info!(listener = name, addr = ?local_addr, "listening");
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                // Beyond the bound: closed at once, counted.
                Ok(_) if loops.full() => {
                    loops.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Ok((stream, peer)) => match hand_over(&loops, me, stream, peer) {
                    Some(mine) => mine,
                    None => continue,
                },
                Err(e) => {
                    loops.accept_failed(name, &e);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            Some((std, peer)) = handed.recv() => {
                // Counted by the loop that handed it over until now.
                loops.open[me].fetch_sub(1, Ordering::Relaxed);
                match TcpStream::from_std(std) {
                    Ok(s) => (s, peer),
                    Err(e) => {
                        warn!(listener = name, error = %e, "cannot take a handed-over connection");
                        continue;
                    }
                }
            },
            _ = shutdown.changed() => break,
        };
        serve_connection(stream, peer, &proxy, &on);
    }
    loops.handoff[me]
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    drop(listener);
    // Connections handed over but not yet taken are served, and drained
    // with the rest.
    handed.close();
    while let Ok((std, peer)) = handed.try_recv() {
        loops.open[me].fetch_sub(1, Ordering::Relaxed);
        if let Ok(stream) = TcpStream::from_std(std) {
            serve_connection(stream, peer, &proxy, &on);
        }
    }
    if !connections.run(drain).await {
        warn!(
            listener = name,
            "requests still in flight after the drain time; closing"
        );
    }
}
