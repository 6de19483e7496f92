//! The minimesh control plane: reads desired state from a config source,
//! validates and translates it, and pushes the result to sidecars over the
//! aggregated discovery stream.
//!
//! ```text
//! source (files) -> Store -> translate -> Cache --(debounce)--> discovery streams
//! ```

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
    if args.source != "kubernetes"
        && (args.watch_namespaces.is_some() || args.namespace_selector.is_some())
    {
        anyhow::bail!(
            "--watch-namespaces and --namespace-selector scope the Kubernetes source; with --source {} they would do nothing",
            args.source
        );
    }
    let mut registry = prometheus_client::registry::Registry::default();
    // Each module's metrics, on the one registry (names prefixed `minimesh_`).
    let mesh = registry.sub_registry_with_prefix("minimesh");
    let discovery_metrics = Arc::new(discovery::metrics::Metrics::new(mesh));
    let ca_metrics = ca::metrics::Metrics::new(mesh);
    let admission_reviews = webhook::metrics::reviews(mesh);
    let load_reporters = lrs::reporters(mesh);
    let publish_metrics = Arc::new(publish::Metrics::new(mesh));
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
    // Admin first: liveness answers while the source syncs, readiness once it has.
    let admin_listener = admin::bind(args.admin_addr)
        .await
        .with_context(|| format!("binding admin address {}", args.admin_addr))?;
    tokio::spawn(admin::serve(admin_listener, admin.clone()));

    // Read everything once before serving, so that no sidecar is ever sent a
    // half-read config.
    // On Kubernetes: the election, to end and release on shutdown.
    let mut election = None;
    // Who computes LOAD_AWARE weights: the leader on Kubernetes, else this one.
    let (weights_tx, weights_rx) = watch::channel(0u64);
    let mut computes = watch::channel(true).1;
    let mut forward = None;
    // The CA and how callers are checked (both or neither).
    let ca: Option<ca::Ca>;
    let mut auth = None;
    let store_rx = if args.source == "kubernetes" {
        let client = source::kubernetes::client().await?;
        ca = args.ca.load(Some(&client), &args.lease_namespace).await?;
        if ca.is_some() {
            auth = Some(
                args.ca
                    .auth(Some(&client), &args.lease_namespace, &ca_metrics)?,
            );
        }
        // The webhooks first: once this replica is ready, the API server
        // can call them (their CA bundle is set).
        webhook::start(
            &args.webhook,
            Some(client.clone()),
            &args.identity,
            &args.lease_namespace,
            ca.as_ref().map(|ca| webhook::inject::Identity {
                root_pem: ca.root_pem().to_string(),
                trust_domain: ca.trust_domain.clone(),
                audience: args.ca.token_audience.clone(),
            }),
            admission_reviews.clone(),
        )
        .await?;
        let (tx, mut rx) = watch::channel(Store::default());
        let scope = source::kubernetes::Scope {
            namespaces: args.watch_namespaces.clone(),
            selector: args.namespace_selector.clone(),
        };
        scope.check(&client).await?;
        tokio::spawn(source::kubernetes::run(
            client.clone(),
            scope,
            tx,
            admin.waiting_for.clone(),
        ));
        info!("waiting for the first complete list of rules, Services and EndpointSlices");
        rx.changed()
            .await
            .context("Kubernetes source stopped before it synced")?;
        let initial = rx.borrow_and_update().clone();
        publisher.publish(&initial);
        let (leader_tx, leader_rx) = watch::channel(false);
        let (leader_addr_tx, leader_addr_rx) = watch::channel(None);
        let advertise = args.advertise_addr.clone().or_else(|| {
            std::env::var("POD_IP")
                .ok()
                .filter(|ip| !ip.is_empty())
                .map(|ip| {
                    let scheme = if ca.is_some() { "https" } else { "http" };
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
        let campaign = tokio::spawn(source::kubernetes::lease::run(
            client.clone(),
            lease.clone(),
            leader_tx,
            leader_addr_tx,
        ));
        election = Some((client.clone(), lease, campaign));
        // LOAD_AWARE, one truth: followers pass their reports to the
        // leader, which computes and publishes the weights they all use.
        let (forward_tx, forward_rx) = tokio::sync::mpsc::channel(lrs::replicas::FORWARD_QUEUE);
        forward = Some(forward_tx);
        tokio::spawn(lrs::replicas::forward(
            forward_rx,
            args.identity.clone(),
            ca.as_ref().map(|ca| ca::setup::ToLeader {
                root_pem: ca.root_pem().to_string(),
                token_file: args.ca.token_file.clone(),
            }),
            leader_rx.clone(),
            leader_addr_rx,
        ));
        tokio::spawn(lrs::replicas::publish_weights(
            client.clone(),
            args.lease_namespace.clone(),
            args.load_aware_configmap.clone(),
            la.clone(),
            leader_rx.clone(),
            weights_rx.clone(),
        ));
        tokio::spawn(lrs::replicas::follow_weights(
            client.clone(),
            args.lease_namespace.clone(),
            args.load_aware_configmap.clone(),
            la.clone(),
            leader_rx.clone(),
            weights_tx.clone(),
        ));
        computes = leader_rx.clone();
        tokio::spawn(source::kubernetes::route_status::run(
            client.clone(),
            admin.route_status.subscribe(),
            leader_rx.clone(),
        ));
        tokio::spawn(source::kubernetes::status::run(
            client,
            args.identity.clone(),
            admin.status.subscribe(),
            leader_rx,
        ));
        rx
    } else {
        ca = args.ca.load(None, &args.lease_namespace).await?;
        if ca.is_some() {
            auth = Some(args.ca.auth(None, &args.lease_namespace, &ca_metrics)?);
        }
        webhook::start(
            &args.webhook,
            None,
            &args.identity,
            &args.lease_namespace,
            None,
            admission_reviews.clone(),
        )
        .await?;
        let mut source = FileSource::new(&args.config_dir, &args.default_namespace);
        if !args.config_dir.is_dir() {
            warn!(dir = %args.config_dir.display(), "config directory does not exist (yet); serving an empty config until it does");
        }
        source.scan();
        let initial = source.store();
        publisher.publish(&initial);
        let (store_tx, store_rx) = watch::channel(initial);
        tokio::spawn(source.run(args.poll_interval, store_tx));
        store_rx
    };

    tokio::spawn(publisher.debounce(store_rx, weights_rx, args.debounce, args.debounce_max));
    tokio::spawn(load_aware::run(
        aggregator.clone(),
        la.clone(),
        computes,
        weights_tx,
    ));

    let xds_listener = tokio::net::TcpListener::bind(args.xds_addr)
        .await
        .with_context(|| format!("binding discovery address {}", args.xds_addr))?;
    info!(xds = %args.xds_addr, admin = %args.admin_addr, source = %args.source, "control plane serving");

    let lrs = lrs::LoadReports {
        aggregator,
        la: la.clone(),
        reporters: load_reporters,
        forward,
        published: cache.subscribe(),
    };
    let discovery =
        discovery::server::Discovery::new(cache.subscribe(), proxies, discovery_metrics);
    let (certificates, tls) = match (ca, auth) {
        (Some(ca), Some(auth)) => {
            let (c, tls) = ca::service::Certificates::serve(ca, auth, &ca_metrics, args.xds_addr)?;
            (Some(c), Some(tls))
        }
        _ => (None, None),
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
        drained(shutdown_signal(), drain, admin.clone()),
    )
    .await
    .context("discovery server")?;
    if let Some((client, lease, campaign)) = election {
        campaign.abort();
        let _ = campaign.await;
        source::kubernetes::lease::release(client, &lease).await;
    }
    info!("control plane stopped");
    Ok(())
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
