//! The minimesh sidecar: an outbound listener the app calls (HTTP/1.1,
//! HTTP/2 cleartext, proxy-style absolute-form or Host-routed), an inbound
//! listener in front of the app, balancing per the control plane's config.
//! The same binary in gateway mode is the ingress.

pub mod admin;
pub mod app_probe;
mod args;
pub mod authz;
pub mod balance;
pub mod capture;
pub mod clock;
pub mod coarse_timer;
pub mod endpoint;
pub mod fuzz;
#[cfg(not(feature = "hyper-h1"))]
pub mod h1;
/// The A/B arm on hyper's client (`--features hyper-h1`).
#[cfg(feature = "hyper-h1")]
#[path = "h1_hyper.rs"]
pub mod h1;
pub mod h2;
pub mod health;
pub mod histogram;
pub mod identity;
pub mod listener;
pub mod message;
pub mod metrics;
pub mod outlier;
pub mod pool;
pub mod proxy;
pub mod retry;
pub mod routing;
pub mod tcp;
pub mod tls;
pub mod upstream;
pub mod xds;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use minimesh_proto::v1::Node;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::info;

pub use args::{duration, Args, DEFAULT_XDS_MAX_MESSAGE_SIZE};

use crate::proxy::Proxy;
use crate::routing::{HostAliases, Routing};

/// None for a zero duration ("never").
fn nonzero(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

/// Closes expired idle connections of every endpoint, once a second.
async fn sweep_pools_forever(routing: Arc<ArcSwap<Routing>>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // The sweeper is the one clock reader of an idle sidecar.
        let now = clock::tick();
        let routing = routing.load();
        for c in routing.clusters.values() {
            for e in c.balancer.endpoints() {
                e.pool().sweep(&c.pool, now);
            }
        }
    }
}

/// Runs the sidecar until SIGINT or SIGTERM, then drains.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let running = start(args).await?;
    shutdown_signal().await;
    info!("shutting down: draining requests in flight");
    running.stop().await;
    info!("sidecar stopped");
    Ok(())
}

/// A started sidecar: its listeners and the tasks that feed them.
pub struct Running {
    stop: watch::Sender<bool>,
    /// The listeners, each ending after its drain once told to stop.
    servers: Vec<tokio::task::JoinHandle<()>>,
    /// The admin server, discovery, load reports, certificate renewal, the
    /// pools' sweeper.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops accepting, drains the requests in flight (`--drain` at most),
    /// then ends the admin server, discovery, load reports and renewal.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for s in self.servers {
            let _ = s.await;
        }
        for t in &self.tasks {
            t.abort();
        }
        // Each ends (its sockets closed) once dropped.
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// What the listeners, the admin server and the discovery client share.
struct Shared {
    node: Node,
    routing: Arc<ArcSwap<Routing>>,
    ready: Arc<AtomicBool>,
    /// The AuthorizationPolicies the inbound listeners enforce, replaced by
    /// the discovery client.
    authz: Arc<authz::Shared>,
    pool_defaults: pool::PoolSettings,
    head_limits: proxy::HeadLimits,
    loops: usize,
    /// Its mutual TLS: the identity (`--ca-root`) and the inbound mode.
    tls: Arc<tls::Tls>,
}

/// Starts the sidecar: the admin server, the listeners, and the discovery,
/// load-report and certificate clients.
pub async fn start(args: Args) -> anyhow::Result<Running> {
    check_flags(&args)?;
    clock::start();
    let loops = event_loops(&args);
    let shared = Shared {
        node: node(&args),
        routing: Arc::new(ArcSwap::from_pointee(Routing::default())),
        ready: Arc::new(AtomicBool::new(false)),
        authz: match args.inbound_before_config.as_str() {
            "allow" => authz::Shared::allowing_until_config(),
            _ => authz::Shared::new(),
        },
        pool_defaults: pool::PoolSettings {
            connect_timeout: args.connect_timeout,
            idle_timeout: pool::DEFAULT_IDLE_TIMEOUT,
            max_requests_per_connection: 0,
            max_connection_ms: 0,
            max_streams: 0,
        },
        head_limits: proxy::HeadLimits {
            bytes: args.max_request_headers_kb as usize * 1024,
            count: args.max_request_headers as usize,
        },
        loops,
        tls: tls::Tls::new(mesh(&args)?),
    };
    let listeners = Listeners::new(&args, loops);
    let mut registry = prometheus_client::registry::Registry::default();
    let capture_metrics = listener::captured::CaptureMetrics::register(&mut registry);
    let admin = serve_admin(&args, &shared, &listeners, registry).await?;
    let (stop, stop_rx) = watch::channel(false);
    let servers = serve_listeners(&args, &shared, listeners, capture_metrics, &stop_rx)?;
    let mut tasks = vec![
        admin,
        tokio::spawn(sweep_pools_forever(shared.routing.clone())),
    ];
    tasks.extend(start_control_plane_clients(&args, shared)?);
    info!(mode = args.mode, outbound = %args.outbound, inbound = ?args.inbound, capture = args.capture, inbound_capture = ?args.inbound_capture, admin = %args.admin, xds = args.xds_addr, "sidecar started");
    Ok(Running {
        stop,
        servers,
        tasks,
    })
}

/// Refuses flags that would do nothing in this mode.
fn check_flags(args: &Args) -> anyhow::Result<()> {
    if args.debug_headers && args.mode != "gateway" {
        anyhow::bail!(
            "--debug-headers applies to --mode gateway only (a sidecar's app always sees the mesh headers)"
        );
    }
    if args.capture && args.mode == "gateway" {
        anyhow::bail!(
            "--capture is for sidecars: a gateway takes outside traffic on its own address"
        );
    }
    Ok(())
}

/// Who this proxy is to the control plane.
fn node(args: &Args) -> Node {
    Node {
        id: args
            .node_id
            .clone()
            .unwrap_or_else(|| format!("{}.{}", args.workload, args.namespace)),
        workload: args.workload.clone(),
        namespace: args.namespace.clone(),
        address: args.outbound.ip().to_string(),
        zone: args.zone.clone(),
        // The discovery client keeps what an endpoints response leaves out.
        client_features: vec![minimesh_proto::PARTIAL_ENDPOINTS.to_string()],
    }
}

/// The mesh's TLS with `--ca-root` (the root that signs every sidecar's
/// certificate, and the trust domain); none without.
fn mesh(args: &Args) -> anyhow::Result<Option<Arc<tls::Mesh>>> {
    let Some(path) = &args.ca_root else {
        return Ok(None);
    };
    let pem = std::fs::read_to_string(path)
        .with_context(|| format!("--ca-root: reading {}", path.display()))?;
    let mesh = tls::Mesh::new(&pem, &args.trust_domain)
        .with_context(|| format!("--ca-root {}", path.display()))?;
    Ok(Some(Arc::new(mesh)))
}

/// Each listener's event loops (and connection limit), named as the
/// metrics name them.
struct Listeners {
    /// `outbound`, or `gateway` in gateway mode.
    name: &'static str,
    outbound: Arc<listener::Loops>,
    inbound: Arc<listener::Loops>,
    capture: Arc<listener::Loops>,
}

impl Listeners {
    fn new(args: &Args, loops: usize) -> Listeners {
        let max = args.max_connections as usize;
        Listeners {
            name: if args.mode == "gateway" {
                "gateway"
            } else {
                "outbound"
            },
            outbound: listener::Loops::with_max(loops, max),
            inbound: listener::Loops::with_max(loops, max),
            capture: listener::Loops::with_max(loops, max),
        }
    }

    /// The listeners `args` starts, for the metrics.
    fn serving(&self, args: &Args) -> Vec<(&'static str, Arc<listener::Loops>)> {
        let mut listeners = vec![(self.name, self.outbound.clone())];
        if args.inbound.is_some() && args.app.is_some() {
            listeners.push(("inbound", self.inbound.clone()));
        }
        if args.inbound_capture.is_some() {
            listeners.push(("inbound-capture", self.capture.clone()));
        }
        listeners
    }
}

/// Binds and serves the admin port: health, readiness, metrics, debug.
async fn serve_admin(
    args: &Args,
    shared: &Shared,
    listeners: &Listeners,
    mut registry: prometheus_client::registry::Registry,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let admin_listener = TcpListener::bind(args.admin)
        .await
        .with_context(|| format!("binding admin address {}", args.admin))?;
    metrics::ProxyMetrics {
        routing: shared.routing.clone(),
        ready: shared.ready.clone(),
        listeners: listeners.serving(args),
    }
    .register(&mut registry);
    shared.authz.register(&mut registry);
    Ok(tokio::spawn(admin::serve(
        admin_listener,
        Arc::new(admin::Admin {
            routing: shared.routing.clone(),
            ready: shared.ready.clone(),
            node_id: shared.node.id.clone(),
            metrics: registry,
            debug_for_all: args.admin_debug,
            app_probes: args.app_probes.clone().unwrap_or_default(),
            authz: shared.authz.clone(),
            tls: shared.tls.clone(),
        }),
    )))
}

/// Binds and serves the outbound (or gateway) listener, and the inbound
/// and inbound-capture listeners when flagged; each stops on `stop`.
fn serve_listeners(
    args: &Args,
    shared: &Shared,
    listeners: Listeners,
    capture_metrics: listener::captured::CaptureMetrics,
    stop: &watch::Receiver<bool>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let (loops, head_limits) = (shared.loops, shared.head_limits);
    let mut servers = Vec::new();
    let outbound = listener::sockets::bind_reuseport(args.outbound, loops)
        .with_context(|| format!("binding outbound address {}", args.outbound))?;
    let out_proxy = Arc::new(Proxy {
        routing: shared.routing.clone(),
        ready: shared.ready.clone(),
        trust_forwarded_for: args.trust_forwarded_for,
        client_idle_timeout: nonzero(args.client_idle_timeout),
        client_body_timeout: nonzero(args.client_body_timeout),
        head_limits,
        inbound: false,
        edge: (args.mode == "gateway").then_some(proxy::Edge {
            debug_headers: args.debug_headers,
        }),
        authz: None,
        tls: shared.tls.clone(),
    });
    let out_capture = args.capture.then(|| {
        Arc::new(listener::captured::Capture::new(
            listener::captured::Side::Outbound,
            args.protocol_detect_timeout,
            args.connect_timeout,
            None,
            capture_metrics.clone(),
            shared.tls.clone(),
        ))
    });
    listener::sockets::serve_on_loops(
        listeners.name,
        outbound,
        listeners.outbound,
        (out_proxy, out_capture),
        stop,
        args.drain,
        &mut servers,
    )?;

    if let (Some(inbound), Some(app)) = (args.inbound, args.app) {
        let listener = listener::sockets::bind_reuseport(inbound, loops)
            .with_context(|| format!("binding inbound address {inbound}"))?;
        let app_cluster = routing::app_cluster(
            app,
            &args.workload,
            args.app_protocol,
            shared.pool_defaults,
            loops,
        );
        let in_proxy = inbound_proxy(
            Routing::only(app_cluster),
            args,
            head_limits,
            (shared.authz.clone(), app.port()),
            &shared.tls,
        );
        listener::sockets::serve_on_loops(
            "inbound",
            listener,
            listeners.inbound,
            (in_proxy, None),
            stop,
            args.drain,
            &mut servers,
        )?;
    }

    if let Some(addr) = args.inbound_capture {
        let listener = listener::sockets::bind_reuseport(addr, loops)
            .with_context(|| format!("binding inbound capture address {addr}"))?;
        let template = listener::captured::AppTemplate {
            loops,
            workload: args.workload.clone(),
            authz: shared.authz.clone(),
            protocol: args.app_protocol,
            pool: shared.pool_defaults,
            client_idle_timeout: nonzero(args.client_idle_timeout),
            client_body_timeout: nonzero(args.client_body_timeout),
            head_limits,
        };
        let capture = Arc::new(listener::captured::Capture::new(
            listener::captured::Side::Inbound,
            args.protocol_detect_timeout,
            args.connect_timeout,
            Some(template),
            capture_metrics,
            shared.tls.clone(),
        ));
        // Each connection goes to the app's proxy for its port (the
        // capture's); this one only carries the listener's settings.
        let proxy = inbound_proxy(
            Routing::default(),
            args,
            head_limits,
            (shared.authz.clone(), 0),
            &shared.tls,
        );
        listener::sockets::serve_on_loops(
            "inbound-capture",
            listener,
            listeners.capture,
            (proxy, Some(capture)),
            stop,
            args.drain,
            &mut servers,
        )?;
    }
    Ok(servers)
}

/// The one HTTP/2 connection to the control plane, carrying discovery and
/// load reports (half the connections, and the control plane's memory, of
/// one each); it connects on first use and reconnects when a stream finds it
/// broken. TLS, trusting the mesh's root, for an `https://` address.
fn control_plane_channel(args: &Args) -> anyhow::Result<tonic::transport::Channel> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(args.xds_addr.clone())
        .with_context(|| format!("--xds-addr {:?} is not a URI", args.xds_addr))?;
    if args.xds_addr.starts_with("https://") {
        // The control plane's certificate is signed by the mesh's root.
        let root = args.ca_root.as_ref().with_context(|| {
            format!("--xds-addr {} is TLS: it needs --ca-root (the mesh's root certificate, which signs the control plane's)", args.xds_addr)
        })?;
        let pem = std::fs::read(root)
            .with_context(|| format!("--ca-root: reading {}", root.display()))?;
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(pem));
        endpoint = endpoint
            .tls_config(tls)
            .context("--xds-addr: TLS settings")?;
    }
    Ok(endpoint
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .connect_lazy())
}

/// Starts what talks to the control plane: the certificate renewer (with
/// `--ca-root`), the load reporter and the discovery client.
fn start_control_plane_clients(
    args: &Args,
    shared: Shared,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let channel = control_plane_channel(args)?;
    let mut tasks = Vec::new();
    if let Some(mesh) = shared.tls.mesh() {
        tasks.push(tokio::spawn(
            identity::Renewer {
                channel: channel.clone(),
                token_file: args.token_file.clone(),
                mesh: mesh.clone(),
            }
            .run(),
        ));
    }
    let reporter = xds::load_report::LoadReporter {
        address: args.xds_addr.clone(),
        channel: channel.clone(),
        node: shared.node.clone(),
        routing: shared.routing.clone(),
        token_file: args.token_file.clone(),
    };
    tasks.push(tokio::spawn(reporter.run()));
    let xds = xds::client::XdsClient {
        address: args.xds_addr.clone(),
        channel,
        max_message_size: args.xds_max_message_size as usize,
        node: shared.node,
        aliases: HostAliases {
            aliases: args.routes.clone(),
            fallback: args.default_route.clone(),
            // The ingress serves the hosts it is given, no internal name.
            only: args.mode == "gateway",
            labels: args.labels.clone(),
        },
        routing: shared.routing,
        ready: shared.ready,
        authz: shared.authz,
        pool_defaults: shared.pool_defaults,
        token_file: args.token_file.clone(),
        tls: shared.tls,
        event_loops: shared.loops,
    };
    tasks.push(tokio::spawn(xds.run()));
    Ok(tasks)
}

/// An inbound listener's proxy: to the app, with `routing`, always ready,
/// enforcing `authz` for the app's port.
fn inbound_proxy(
    routing: Routing,
    args: &Args,
    head_limits: proxy::HeadLimits,
    (authz, app_port): (Arc<authz::Shared>, u16),
    tls: &Arc<tls::Tls>,
) -> Arc<Proxy> {
    Arc::new(Proxy {
        routing: Arc::new(ArcSwap::from_pointee(routing)),
        ready: Arc::new(AtomicBool::new(true)),
        trust_forwarded_for: false,
        client_idle_timeout: nonzero(args.client_idle_timeout),
        client_body_timeout: nonzero(args.client_body_timeout),
        head_limits,
        inbound: true,
        edge: None,
        authz: Some((authz, app_port)),
        tls: tls.clone(),
    })
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}

/// How many event loops serve the proxy listeners: `--worker-threads`, or
/// 1 in sidecar mode and one per core in gateway mode (0: one per core).
pub fn event_loops(args: &Args) -> usize {
    match (args.worker_threads, args.mode.as_str()) {
        (Some(0), _) | (None, "gateway") => {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        }
        (Some(n), _) => n,
        (None, _) => 1,
    }
}
