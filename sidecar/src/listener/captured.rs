//! Connections the pod's capture rules redirected to the sidecar
//! (`sidecar init-capture`): the app's own connections, unchanged, on the
//! outbound capture listener, and callers' connections to the pod on the
//! inbound one. Each is sorted by where it was going ([`original_dst`]):
//!
//! - outbound to a Service address (`<cluster IP>:<port>`): its port's
//!   protocol decides; HTTP is served here and balanced request by request,
//!   anything else is balanced once per connection and copied as bytes;
//!   a port of unknown protocol is detected from the first bytes;
//! - outbound anywhere else: passed through to where it was going;
//! - inbound: sorted by the mutual TLS mode, then served to the app on the
//!   port the caller dialed: HTTP request by request, anything else as bytes.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use minimesh_proto::v1::{PortProtocol, UpstreamProtocol};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tracing::debug;

use super::detect::{detect, Detected};
use super::orig_dst::original_dst;
use super::sniff::{self, Speaks};
use super::{serve_http, Conn, HANDSHAKE_TIMEOUT};
use crate::pool::PoolSettings;
use crate::proxy::Proxy;
use crate::routing::{self, Routing};
use crate::tls::Io;

/// Which side of the pod a capture listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The app's connections out of the pod.
    Outbound,
    /// Callers' connections into the pod.
    Inbound,
}

/// Most app ports the inbound side keeps an HTTP proxy for; a connection to
/// a port beyond them is proxied as bytes (no per-request metrics), so that
/// callers dialing every port cannot grow the sidecar's memory.
pub const MAX_APP_PORTS: usize = 64;

/// A capture listener's settings, counters and (inbound) the app's proxies.
pub struct Capture {
    /// Which side this listener serves.
    pub side: Side,
    /// How long to wait for a client's first bytes on a port of unknown
    /// protocol before proxying it as bytes.
    pub detect_timeout: Duration,
    /// Connect timeout to a destination outside the mesh, and (inbound) to the app.
    pub connect_timeout: Duration,
    /// Connections by how they were proxied.
    pub metrics: CaptureMetrics,
    /// Inbound: what the app's proxies are made from.
    pub app: Option<AppTemplate>,
    apps: Mutex<HashMap<u16, Arc<Proxy>>>,
    /// The sidecar's mutual TLS (inbound: the mode and identity).
    tls: Arc<crate::tls::Tls>,
}

/// What an inbound HTTP proxy to one of the app's ports is made of.
pub struct AppTemplate {
    /// The sidecar's event loops.
    pub loops: usize,
    /// The pod (workload) name, the app endpoint's name.
    pub workload: String,
    /// The HTTP version spoken to the app.
    pub protocol: UpstreamProtocol,
    /// Connection settings to the app.
    pub pool: PoolSettings,
    /// Client connection bounds, as the proxy listeners'.
    pub client_idle_timeout: Option<Duration>,
    /// Client body bound, as the proxy listeners'.
    pub client_body_timeout: Option<Duration>,
    /// Client head bounds.
    pub head_limits: crate::proxy::HeadLimits,
    /// The authorization policies each app port's proxy enforces.
    pub authz: Arc<crate::authz::Shared>,
}

impl Capture {
    /// A capture listener for `side`, its counters registered on `registry`.
    pub fn new(
        side: Side,
        detect_timeout: Duration,
        connect_timeout: Duration,
        app: Option<AppTemplate>,
        metrics: CaptureMetrics,
        tls: Arc<crate::tls::Tls>,
    ) -> Capture {
        Capture {
            tls,
            side,
            detect_timeout,
            connect_timeout,
            metrics,
            app,
            apps: Mutex::new(HashMap::new()),
        }
    }

    /// The HTTP proxy to the app's `port`, made on first use; None past
    /// [`MAX_APP_PORTS`] ports.
    fn app_proxy(&self, port: u16) -> Option<Arc<Proxy>> {
        let t = self.app.as_ref()?;
        let mut apps = self.apps.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = apps.get(&port) {
            return Some(p.clone());
        }
        if apps.len() >= MAX_APP_PORTS {
            return None;
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let cluster = routing::app_cluster(addr, &t.workload, t.protocol, t.pool, t.loops);
        let proxy = Arc::new(Proxy {
            routing: Arc::new(ArcSwap::from_pointee(Routing::only(cluster))),
            ready: Arc::new(AtomicBool::new(true)),
            trust_forwarded_for: false,
            client_idle_timeout: t.client_idle_timeout,
            client_body_timeout: t.client_body_timeout,
            head_limits: t.head_limits,
            inbound: true,
            edge: None,
            authz: Some((t.authz.clone(), port)),
            tls: self.tls.clone(),
        });
        apps.insert(port, proxy.clone());
        Some(proxy)
    }
}

/// Labels of the captured-connection counter.
type Labels = Vec<(&'static str, String)>;

/// Counters of captured connections.
#[derive(Clone, Default)]
pub struct CaptureMetrics {
    connections: Family<Labels, Counter>,
}

impl CaptureMetrics {
    /// Registers the counters on `registry`.
    pub fn register(registry: &mut Registry) -> CaptureMetrics {
        let m = CaptureMetrics::default();
        registry.register(
            "minimesh_captured_connections",
            "Connections the capture rules redirected to the sidecar, by side (outbound, inbound), how they were proxied (http, tcp, passthrough, refused), the mutual TLS state of inbound ones (mutual, plaintext) and the caller's SPIFFE ID",
            m.connections.clone(),
        );
        m
    }

    fn count(&self, side: Side, how: &str, tls: Option<&Io>) {
        let mut labels: Labels = vec![
            (
                "side",
                match side {
                    Side::Outbound => "outbound",
                    Side::Inbound => "inbound",
                }
                .to_string(),
            ),
            ("proxied", how.to_string()),
        ];
        if let Some(io) = tls {
            let (mode, peer) = match io.peer_identity() {
                Some(id) => ("mutual", id),
                None => ("plaintext", String::new()),
            };
            labels.push(("tls", mode.to_string()));
            labels.push(("peer", peer));
        }
        self.connections.get_or_create(&labels).inc();
    }

    /// The count of one label set (for tests and `/debug` views).
    pub fn get(&self, labels: &[(&'static str, &str)]) -> u64 {
        let labels: Labels = labels.iter().map(|(k, v)| (*k, v.to_string())).collect();
        self.connections.get_or_create(&labels).get()
    }
}

/// Serves one connection a capture listener accepted.
pub(super) async fn serve(
    stream: tokio::net::TcpStream,
    proxy: Arc<Proxy>,
    capture: Arc<Capture>,
    conn: Conn,
) {
    let dst = original_dst(&stream);
    match capture.side {
        Side::Outbound => outbound(stream, dst, proxy, &capture, conn).await,
        Side::Inbound => match dst {
            Some(dst) => inbound(stream, dst, &capture, conn).await,
            // Dialed to the capture port itself: nothing to forward to.
            None => capture.metrics.count(Side::Inbound, "refused", None),
        },
    }
}

/// The app's connection to `dst` (None: dialed to the listener itself, an
/// explicit proxy client).
async fn outbound(
    stream: tokio::net::TcpStream,
    dst: Option<SocketAddr>,
    proxy: Arc<Proxy>,
    capture: &Capture,
    conn: Conn,
) {
    let peer = conn.peer;
    let Some(dst) = dst else {
        // Not redirected: the app called the proxy port as its HTTP proxy.
        return http(Io::Plain(stream), proxy, None, conn).await;
    };
    let target = proxy
        .routing
        .load()
        .destination(&dst)
        .map(|(c, kind)| (c.clone(), kind));
    let Some((cluster, kind)) = target else {
        capture.metrics.count(Side::Outbound, "passthrough", None);
        if let Err(e) = crate::tcp::passthrough(stream, dst, capture.connect_timeout).await {
            debug!(%peer, %dst, error = %e, "passthrough failed");
        }
        return;
    };
    let http_port = match kind {
        PortProtocol::Http => true,
        PortProtocol::Tcp => false,
        PortProtocol::Detect => match detect(&stream, capture.detect_timeout).await {
            Ok(Some(d)) => d == Detected::Http,
            _ => return,
        },
    };
    if http_port {
        capture.metrics.count(Side::Outbound, "http", None);
        return http(Io::Plain(stream), proxy, Some(dst), conn).await;
    }
    capture.metrics.count(Side::Outbound, "tcp", None);
    if let Err(e) = crate::tcp::to_cluster(stream, peer, &cluster).await {
        debug!(%peer, %dst, error = %e, "captured TCP connection not proxied");
    }
}

/// A caller's connection to the app's port `dst.port()`.
async fn inbound(stream: tokio::net::TcpStream, dst: SocketAddr, capture: &Capture, conn: Conn) {
    let peer = conn.peer;
    let Some(io) = capture
        .tls
        .accept_inbound(stream, peer, HANDSHAKE_TIMEOUT)
        .await
    else {
        capture.metrics.count(Side::Inbound, "refused", None);
        return;
    };
    let is_http = match &io {
        Io::Plain(tcp) => match detect(tcp, capture.detect_timeout).await {
            Ok(Some(d)) => d == Detected::Http,
            _ => return,
        },
        // A sidecar says what the connection carries.
        tls => tls.alpn() != Some(crate::tls::ALPN_TCP),
    };
    let app = SocketAddr::from((Ipv4Addr::LOCALHOST, dst.port()));
    if is_http {
        if let Some(proxy) = capture.app_proxy(dst.port()) {
            capture.metrics.count(Side::Inbound, "http", Some(&io));
            return http(io, proxy, None, conn).await;
        }
    }
    capture.metrics.count(Side::Inbound, "tcp", Some(&io));
    if let Err(e) = crate::tcp::passthrough(io, app, capture.connect_timeout).await {
        debug!(%peer, %app, error = %e, "inbound TCP connection not proxied");
    }
}

/// Serves HTTP on a captured connection, in the version its first bytes
/// say (which it must send within the client idle timeout).
async fn http(io: Io, proxy: Arc<Proxy>, dst: Option<SocketAddr>, conn: Conn) {
    let speaks = match &io {
        Io::Plain(tcp) => {
            let first = match proxy.client_idle_timeout {
                Some(idle) => tokio::time::timeout(idle, sniff::speaks(tcp)).await,
                None => Ok(sniff::speaks(tcp).await),
            };
            match first {
                Ok(Ok(Some(s))) => s,
                _ => return,
            }
        }
        _ => Speaks::Unsure,
    };
    serve_http(io, speaks, proxy, dst, conn).await;
}
