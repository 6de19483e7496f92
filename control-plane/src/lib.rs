//! The minimesh control plane: reads desired state from a config source,
//! validates and translates it, and pushes the result to sidecars over the
//! aggregated discovery stream.
//!
//! ```text
//! source (files, Kubernetes) -> Store -> publish: translate -> Cache -> discovery streams
//!                                                          load reports -> load -> load_aware
//! ```
//!
//! The modules form layers, each naming only its own and those below
//! (`tests/layers.rs` checks it): `config` and `load` (types, parsing, the
//! load view) → `store`, `load_aware` → `source` → `translate` (the one
//! route and cluster model, and every status) → `xds_v3` (Envoy's encoding)
//! → `cache` → `ca` (who callers are) → `discovery`, `lrs` (the streams) →
//! `grpc`, `admin`, `webhook` (what listens) → `publish` → `args`, `fuzz`,
//! and this file, the wiring: [`run`] in named steps.

pub mod admin;
mod args;
pub mod ca;
pub mod cache;
pub mod config;
pub mod discovery;
pub mod fuzz;
pub mod grpc;
pub mod load;
pub mod load_aware;
pub mod lrs;
pub mod publish;
pub mod source;
pub mod store;
pub mod translate;
pub mod webhook;
pub mod xds_v3;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;
use tracing::{info, warn};

pub use args::{duration, Args};

use crate::admin::{Admin, ConfigView};
use crate::cache::Cache;
use crate::load_aware::LoadAwareState;
use crate::source::files::FileSource;
use crate::store::Store;

/// Runs the control plane until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    run_until(args, shutdown_signal()).await
}

/// Runs the control plane until `shutdown` resolves, then drains as on
/// SIGTERM (a test runs several in one process this way).
pub async fn run_until(
    args: Args,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    check_source_flags(&args)?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let core = Core::new(&args, registry, metrics.publish.clone());
    // Admin first: liveness answers while the source syncs, readiness once it has.
    let admin_listener = admin::bind(args.admin_addr)
        .await
        .with_context(|| format!("binding admin address {}", args.admin_addr))?;
    tokio::spawn(admin::serve(admin_listener, core.admin.clone()));
    // Read everything once before serving, so that no sidecar is ever sent a
    // half-read config.
    let source = if args.source == "kubernetes" {
        start_kubernetes(&args, &core, &metrics).await?
    } else {
        start_files(&args, &core, &metrics).await?
    };
    tokio::spawn(core.publisher.clone().debounce(
        source.store,
        core.weights.subscribe(),
        args.debounce,
        args.debounce_max,
    ));
    tokio::spawn(load_aware::run(
        core.aggregator.clone(),
        core.la.clone(),
        source.computes,
        core.weights.clone(),
    ));
    let (identity, forward) = (source.identity, source.forward);
    serve_discovery(&args, &core, metrics, identity, forward, shutdown).await?;
    if let Some((client, lease, campaign)) = source.election {
        campaign.abort();
        let _ = campaign.await;
        source::kubernetes::lease::release(client, &lease).await;
    }
    info!("control plane stopped");
    Ok(())
}

/// Refuses the Kubernetes source's flags with another source.
fn check_source_flags(args: &Args) -> anyhow::Result<()> {
    if args.source != "kubernetes"
        && (args.watch_namespaces.is_some() || args.namespace_selector.is_some())
    {
        anyhow::bail!(
            "--watch-namespaces and --namespace-selector scope the Kubernetes source; with --source {} they would do nothing",
            args.source
        );
    }
    Ok(())
}

/// Every module's metrics, on the one registry (names prefixed `minimesh_`).
struct Metrics {
    discovery: Arc<discovery::metrics::Metrics>,
    ca: ca::metrics::Metrics,
    admission_reviews: webhook::metrics::Reviews,
    load_reporters: prometheus_client::metrics::gauge::Gauge,
    publish: Arc<publish::Metrics>,
}

impl Metrics {
    fn new(registry: &mut prometheus_client::registry::Registry) -> Metrics {
        let mesh = registry.sub_registry_with_prefix("minimesh");
        Metrics {
            discovery: Arc::new(discovery::metrics::Metrics::new(mesh)),
            ca: ca::metrics::Metrics::new(mesh),
            admission_reviews: webhook::metrics::reviews(mesh),
            load_reporters: lrs::reporters(mesh),
            publish: Arc::new(publish::Metrics::new(mesh)),
        }
    }
}

/// What every source publishes to and every server reads from.
struct Core {
    cache: Arc<Cache>,
    proxies: Arc<discovery::registry::Registry>,
    aggregator: Arc<load::Aggregator>,
    admin: Arc<Admin>,
    la: Arc<LoadAwareState>,
    publisher: publish::Publisher,
    /// Counts each step of the LOAD_AWARE weights (computed here, or the
    /// leader's followed), so that publication picks it up at once.
    weights: watch::Sender<u64>,
}

impl Core {
    fn new(
        args: &Args,
        mut registry: prometheus_client::registry::Registry,
        publish_metrics: Arc<publish::Metrics>,
    ) -> Core {
        let cache = Arc::new(Cache::new(xds_v3::Options {
            exact_policies: args.xds_v3_exact_policies,
        }));
        let proxies = Arc::new(discovery::registry::Registry::default());
        let aggregator = Arc::new(load::Aggregator::new(args.load_window));
        lrs::metrics::LoadMetrics {
            aggregator: aggregator.clone(),
            snapshots: cache.subscribe(),
        }
        .register(&mut registry);
        let admin = Arc::new(Admin {
            load: aggregator.clone(),
            metrics: registry,
            proxies: proxies.clone(),
            snapshots: cache.subscribe(),
            config: RwLock::new(Arc::new(ConfigView::default())),
            status: watch::Sender::new(Arc::default()),
            route_status: watch::Sender::new(Arc::default()),
            debug_for_all: args.admin_debug,
            draining: Default::default(),
            waiting_for: watch::Sender::new(Vec::new()),
        });
        let la = Arc::new(LoadAwareState {
            default_interval_ms: args.load_report_interval.as_millis() as u64,
            ..Default::default()
        });
        let publisher = publish::Publisher {
            cache: cache.clone(),
            admin: admin.clone(),
            metrics: publish_metrics,
            la: la.clone(),
        };
        Core {
            cache,
            proxies,
            aggregator,
            admin,
            la,
            publisher,
            weights: watch::Sender::new(0),
        }
    }
}

/// A source started and its first config published.
struct Started {
    /// Each later config.
    store: watch::Receiver<Store>,
    /// The CA and how callers are checked (both or neither).
    identity: Option<(ca::Ca, ca::service::Auth)>,
    /// Whether this replica computes the LOAD_AWARE weights (the leader on
    /// Kubernetes; else always).
    computes: watch::Receiver<bool>,
    /// On Kubernetes: where load reports go to reach the leader.
    forward: Option<tokio::sync::mpsc::Sender<minimesh_proto::v1::LoadStatsRequest>>,
    /// On Kubernetes: the election, to end and release on shutdown.
    election: Option<(
        kube::Client,
        source::kubernetes::lease::LeaseConfig,
        tokio::task::JoinHandle<()>,
    )>,
}

/// The files source: the CA and webhooks as flagged, the directory read
/// once and published, then polled.
async fn start_files(args: &Args, core: &Core, metrics: &Metrics) -> anyhow::Result<Started> {
    let ca = args.ca.load(None, &args.lease_namespace).await?;
    let identity = match ca {
        Some(ca) => Some((ca, args.ca.auth(None, &args.lease_namespace, &metrics.ca)?)),
        None => None,
    };
    webhook::start(
        &args.webhook,
        None,
        &args.identity,
        &args.lease_namespace,
        None,
        metrics.admission_reviews.clone(),
    )
    .await?;
    let mut source = FileSource::new(&args.config_dir, &args.default_namespace);
    if !args.config_dir.is_dir() {
        warn!(dir = %args.config_dir.display(), "config directory does not exist (yet); serving an empty config until it does");
    }
    source.scan();
    let initial = source.store();
    core.publisher.publish(&initial);
    let (store_tx, store) = watch::channel(initial);
    tokio::spawn(source.run(args.poll_interval, store_tx));
    Ok(Started {
        store,
        identity,
        computes: watch::channel(true).1,
        forward: None,
        election: None,
    })
}

/// The Kubernetes source: the CA and the webhooks first (once this replica
/// is ready the API server calls them), the first complete list published,
/// then the election and what the leader alone does.
async fn start_kubernetes(args: &Args, core: &Core, metrics: &Metrics) -> anyhow::Result<Started> {
    let client = source::kubernetes::client().await?;
    let ca = args.ca.load(Some(&client), &args.lease_namespace).await?;
    let identity = match ca {
        Some(ca) => {
            let auth = args
                .ca
                .auth(Some(&client), &args.lease_namespace, &metrics.ca)?;
            Some((ca, auth))
        }
        None => None,
    };
    webhook::start(
        &args.webhook,
        Some(client.clone()),
        &args.identity,
        &args.lease_namespace,
        identity.as_ref().map(|(ca, _)| webhook::inject::Identity {
            root_pem: ca.root_pem().to_string(),
            trust_domain: ca.trust_domain.clone(),
            audience: args.ca.token_audience.clone(),
        }),
        metrics.admission_reviews.clone(),
    )
    .await?;
    let (tx, mut store) = watch::channel(Store::default());
    let scope = source::kubernetes::Scope {
        namespaces: args.watch_namespaces.clone(),
        selector: args.namespace_selector.clone(),
    };
    scope.check(&client).await?;
    tokio::spawn(source::kubernetes::run(
        client.clone(),
        scope,
        tx,
        core.admin.waiting_for.clone(),
    ));
    info!("waiting for the first complete list of rules, Services and EndpointSlices");
    store
        .changed()
        .await
        .context("Kubernetes source stopped before it synced")?;
    let initial = store.borrow_and_update().clone();
    core.publisher.publish(&initial);
    let lease = lease_config(args, identity.is_some())?;
    let (leader_tx, leader) = watch::channel(false);
    let (leader_addr_tx, leader_addr) = watch::channel(None);
    let campaign = tokio::spawn(source::kubernetes::lease::run(
        client.clone(),
        lease.clone(),
        leader_tx,
        leader_addr_tx,
    ));
    let forward = follow_the_leader(args, core, &client, &identity, &leader, leader_addr);
    Ok(Started {
        store,
        identity,
        computes: leader,
        forward: Some(forward),
        election: Some((client, lease, campaign)),
    })
}

/// The Lease this replica campaigns for, advertising where the others pass
/// it their sidecars' load reports when it leads.
fn lease_config(args: &Args, tls: bool) -> anyhow::Result<source::kubernetes::lease::LeaseConfig> {
    let advertise = args.advertise_addr.clone().or_else(|| {
        std::env::var("POD_IP")
            .ok()
            .filter(|ip| !ip.is_empty())
            .map(|ip| {
                let scheme = if tls { "https" } else { "http" };
                format!("{scheme}://{ip}:{}", args.xds_addr.port())
            })
    });
    if advertise.is_none() {
        warn!("no --advertise-addr and no POD_IP: when this replica leads, the others cannot pass it their sidecars' load reports");
    }
    let lease = source::kubernetes::lease::LeaseConfig {
        namespace: args.lease_namespace.clone(),
        name: args.lease_name.clone(),
        identity: args.identity.clone(),
        duration: args.lease_duration,
        retry: args.lease_retry,
        renew_deadline: args
            .lease_renew_deadline
            .unwrap_or(args.lease_duration * 2 / 3),
        advertise,
    };
    lease.check().map_err(anyhow::Error::msg)?;
    Ok(lease)
}

/// One truth across replicas: followers pass their reports to the leader,
/// which computes and publishes the LOAD_AWARE weights they all use, and
/// alone writes statuses. Returns where load reports go to be passed on.
fn follow_the_leader(
    args: &Args,
    core: &Core,
    client: &kube::Client,
    identity: &Option<(ca::Ca, ca::service::Auth)>,
    leader: &watch::Receiver<bool>,
    leader_addr: watch::Receiver<Option<String>>,
) -> tokio::sync::mpsc::Sender<minimesh_proto::v1::LoadStatsRequest> {
    let (forward_tx, forward_rx) = tokio::sync::mpsc::channel(lrs::replicas::FORWARD_QUEUE);
    tokio::spawn(lrs::replicas::forward(
        forward_rx,
        args.identity.clone(),
        identity.as_ref().map(|(ca, _)| ca::setup::ToLeader {
            root_pem: ca.root_pem().to_string(),
            token_file: args.ca.token_file.clone(),
        }),
        leader.clone(),
        leader_addr,
    ));
    tokio::spawn(lrs::replicas::publish_weights(
        client.clone(),
        args.lease_namespace.clone(),
        args.load_aware_configmap.clone(),
        core.la.clone(),
        leader.clone(),
        core.weights.subscribe(),
    ));
    tokio::spawn(lrs::replicas::follow_weights(
        client.clone(),
        args.lease_namespace.clone(),
        args.load_aware_configmap.clone(),
        core.la.clone(),
        leader.clone(),
        core.weights.clone(),
    ));
    tokio::spawn(source::kubernetes::route_status::run(
        client.clone(),
        core.admin.route_status.subscribe(),
        leader.clone(),
    ));
    tokio::spawn(source::kubernetes::status::run(
        client.clone(),
        args.identity.clone(),
        core.admin.status.subscribe(),
        leader.clone(),
    ));
    forward_tx
}

/// Serves discovery, load reports and (with a CA) certificates on the
/// discovery port until the shutdown signal and its drain.
async fn serve_discovery(
    args: &Args,
    core: &Core,
    metrics: Metrics,
    identity: Option<(ca::Ca, ca::service::Auth)>,
    forward: Option<tokio::sync::mpsc::Sender<minimesh_proto::v1::LoadStatsRequest>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let xds_listener = tokio::net::TcpListener::bind(args.xds_addr)
        .await
        .with_context(|| format!("binding discovery address {}", args.xds_addr))?;
    info!(xds = %args.xds_addr, admin = %args.admin_addr, source = %args.source, "control plane serving");
    let lrs = lrs::LoadReports {
        aggregator: core.aggregator.clone(),
        la: core.la.clone(),
        reporters: metrics.load_reporters,
        forward,
        published: core.cache.subscribe(),
    };
    let discovery = discovery::server::Discovery::new(
        core.cache.subscribe(),
        core.proxies.clone(),
        metrics.discovery,
    );
    let (certificates, tls) = match identity {
        Some((ca, auth)) => {
            let (c, tls) = ca::service::Certificates::serve(ca, auth, &metrics.ca, args.xds_addr)?;
            (Some(c), Some(tls))
        }
        None => (None, None),
    };
    let drain = args
        .termination_drain
        .unwrap_or(match args.source.as_str() {
            "kubernetes" => Duration::from_secs(5),
            _ => Duration::ZERO,
        });
    grpc::serve(
        xds_listener,
        discovery,
        lrs,
        certificates,
        tls,
        drained(shutdown, drain, core.admin.clone()),
    )
    .await
    .context("discovery server")
}

/// Resolves `drain` after `signal`, not ready meanwhile (`/readyz` 503): the
/// webhooks, discovery and certificates keep serving while the endpoints
/// drop this replica.
async fn drained(
    signal: impl std::future::Future<Output = ()>,
    drain: Duration,
    admin: Arc<Admin>,
) {
    signal.await;
    if drain.is_zero() {
        return;
    }
    admin
        .draining
        .store(true, std::sync::atomic::Ordering::Relaxed);
    info!(
        ?drain,
        "shutting down: not ready, still serving webhooks, discovery and certificates while endpoints drop this replica"
    );
    tokio::time::sleep(drain).await;
}

/// Resolves on SIGINT or SIGTERM. SIGTERM is watched from the call, not from
/// the first poll, so a caller that creates it once and polls it between
/// other work (`minimesh up`'s supervision loop) keeps a signal that arrives
/// in between.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
            return;
        }
        let _ = ctrl_c.await;
    }
}
