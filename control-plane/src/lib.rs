//! The minimesh control plane: reads desired state from a config source,
//! validates and translates it, and pushes the result to sidecars over the
//! aggregated discovery stream.
//!
//! ```text
//! source (files) -> Store -> translate -> Cache --(debounce)--> discovery streams
//! ```

pub mod admin;
pub mod ca;
pub mod cache;
pub mod config;
pub mod discovery;
pub mod fuzz;
pub mod grpc;
pub mod load;
pub mod load_aware;
pub mod metrics;
pub mod source;
pub mod store;
pub mod translate;
pub mod webhook;
pub mod xds_v3;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::admin::{Admin, ConfigView};
use crate::cache::Cache;
use crate::metrics::Metrics;
use crate::source::files::FileSource;
use crate::store::Store;

/// Command-line flags of the `control-plane` binary.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "control-plane",
    version,
    about = "minimesh control plane: watches rules and endpoints, pushes config to sidecars"
)]
pub struct Args {
    /// Where desired state comes from: `files` (a directory of YAML, watched) or
    /// `kubernetes` (the API server: in-cluster config, else KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "MINIMESH_SOURCE", default_value = "files", value_parser = ["files", "kubernetes"])]
    pub source: String,
    /// Kubernetes: name of the Lease that elects the replica writing rule status.
    #[arg(
        long,
        env = "MINIMESH_LEASE_NAME",
        default_value = "minimesh-control-plane"
    )]
    pub lease_name: String,
    /// Kubernetes: namespace of that Lease (the control plane's own; the Downward API sets POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", default_value = "minimesh-system")]
    pub lease_namespace: String,
    /// Kubernetes: this replica's identity in the election (the Downward API sets POD_NAME).
    #[arg(long, env = "POD_NAME", default_value = "control-plane")]
    pub identity: String,
    /// Kubernetes: a lease not renewed for this long passes to another replica.
    #[arg(long, env = "MINIMESH_LEASE_DURATION", default_value = "15s", value_parser = duration)]
    pub lease_duration: Duration,
    /// Kubernetes: how often the leader renews and the others check the lease.
    #[arg(long, env = "MINIMESH_LEASE_RETRY", default_value = "2s", value_parser = duration)]
    pub lease_retry: Duration,
    /// Kubernetes: a leader that has not renewed the lease for this long (its
    /// requests failing or hanging) stops writing status; shorter than
    /// --lease-duration, longer than --lease-retry. Default: two thirds of
    /// --lease-duration (10s).
    #[arg(long, env = "MINIMESH_LEASE_RENEW_DEADLINE", value_parser = duration)]
    pub lease_renew_deadline: Option<Duration>,
    /// On SIGTERM, how long this replica stays up not ready first (`/readyz`
    /// 503) while it keeps serving admission webhooks, discovery and
    /// certificates, so that the API server and the sidecars stop sending it
    /// work before it stops (Istio's `terminationDrainDuration`): longer than
    /// the Service's endpoints take to drop a pod. Default: 5s with
    /// `--source kubernetes`, 0 (stop at once) with `files`.
    #[arg(long, env = "MINIMESH_TERMINATION_DRAIN", value_parser = minimesh_proto::duration::parse)]
    pub termination_drain: Option<Duration>,
    /// Kubernetes: watch rules, Services and EndpointSlices in these namespaces only
    /// (comma-separated), so that the control plane needs read access to no others.
    /// Unset: the whole cluster.
    #[arg(long, env = "MINIMESH_WATCH_NAMESPACES", value_delimiter = ',')]
    pub watch_namespaces: Option<Vec<String>>,
    /// Kubernetes: serve only the objects of namespaces whose labels match this
    /// selector (kubectl's -l syntax, e.g. `minimesh.io/discovery=enabled`), as
    /// Istio's discoverySelectors; a namespace that gains or loses a label comes
    /// into or leaves the mesh at once. Unset: every namespace watched.
    #[arg(long, env = "MINIMESH_NAMESPACE_SELECTOR")]
    pub namespace_selector: Option<String>,
    /// Kubernetes: where the other replicas reach this one's load-report service
    /// (the discovery port) when it leads, to pass on their sidecars' reports
    /// (LOAD_AWARE weights come from every report). Default: http://$POD_IP:<--xds-addr port>.
    #[arg(long, env = "MINIMESH_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// Kubernetes: the ConfigMap (in the control plane's namespace) where the leader
    /// publishes LOAD_AWARE weights and every other replica reads them.
    #[arg(
        long,
        env = "MINIMESH_LOAD_AWARE_CONFIGMAP",
        default_value = "minimesh-load-aware"
    )]
    pub load_aware_configmap: String,
    /// Files source: directory of YAML files (DestinationRule, Service, EndpointSlice; multi-document; watched).
    #[arg(long, env = "MINIMESH_CONFIG_DIR", default_value = "config")]
    pub config_dir: PathBuf,
    /// Files source: namespace of objects whose metadata names none (like kubectl's context namespace).
    #[arg(long, env = "MINIMESH_DEFAULT_NAMESPACE", default_value = "default")]
    pub default_namespace: String,
    /// Address of the discovery (gRPC) server.
    #[arg(long, env = "MINIMESH_XDS_ADDR", default_value = "127.0.0.1:15010")]
    pub xds_addr: SocketAddr,
    /// Address of the admin HTTP server (/healthz, /metrics, /debug/*).
    #[arg(long, env = "MINIMESH_ADMIN_ADDR", default_value = "127.0.0.1:15014")]
    pub admin_addr: SocketAddr,
    /// The mesh's certificate authority.
    #[command(flatten)]
    pub ca: ca::setup::CaArgs,
    /// Serve the admin port's `/debug/*` views (every rule, endpoint and
    /// proxy of the mesh) to every caller. Off, they answer loopback
    /// callers only (`kubectl port-forward`, `minimesh get` on the same
    /// host) and 403 anyone else; `/healthz`, `/readyz` and `/metrics`
    /// answer everyone.
    #[arg(long, env = "MINIMESH_ADMIN_DEBUG")]
    pub admin_debug: bool,
    /// Quiet window: changes are pushed once nothing changed for this long.
    #[arg(long, env = "MINIMESH_DEBOUNCE", default_value = "100ms", value_parser = duration)]
    pub debounce: Duration,
    /// Upper bound: changes are pushed at most this long after the first one, however busy.
    #[arg(long, env = "MINIMESH_DEBOUNCE_MAX", default_value = "1s", value_parser = duration)]
    pub debounce_max: Duration,
    /// Files source: how often the config directory is checked for changes.
    #[arg(long, env = "MINIMESH_POLL_INTERVAL", default_value = "50ms", value_parser = duration)]
    pub poll_interval: Duration,
    /// How often sidecars report load (served on the discovery address).
    #[arg(long, env = "MINIMESH_LOAD_REPORT_INTERVAL", default_value = "10s", value_parser = duration)]
    pub load_report_interval: Duration,
    /// Sliding window of the aggregated load view.
    #[arg(long, env = "MINIMESH_LOAD_WINDOW", default_value = "10s", value_parser = duration)]
    pub load_window: Duration,
    /// xDS v3 (Envoy, proxyless gRPC): send each cluster's policy alone, with no
    /// standard fallback, so that a client lacking it (gRPC has no RANDOM,
    /// MAGLEV or PEAK_EWMA) rejects the cluster, visibly in `minimesh get
    /// proxies`, and keeps its last good config. Off: such a client is sent the
    /// nearest policy it implements (see the README's policy mapping).
    #[arg(long, env = "MINIMESH_XDS_V3_EXACT_POLICIES")]
    pub xds_v3_exact_policies: bool,
    /// The validating admission webhook (Kubernetes).
    #[command(flatten)]
    pub webhook: webhook::WebhookArgs,
}

/// Parses a flag duration (`100ms`, `1s`, `2m`).
pub fn duration(s: &str) -> Result<Duration, String> {
    config::rule::parse_duration(s)
}

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
    let metrics = Arc::new(Metrics::new(&mut registry));
    let cache = Arc::new(Cache::new(xds_v3::Options {
        exact_policies: args.xds_v3_exact_policies,
    }));
    let proxies = Arc::new(discovery::registry::Registry::default());
    let aggregator = Arc::new(load::Aggregator::new(args.load_window));
    load::metrics::LoadMetrics {
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
        debug_for_all: args.admin_debug,
        draining: Default::default(),
        waiting_for: watch::Sender::new(Vec::new()),
    });

    let la = Arc::new(LoadAwareState {
        default_interval_ms: args.load_report_interval.as_millis() as u64,
        ..Default::default()
    });
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
                    .auth(Some(&client), &args.lease_namespace, &metrics)?,
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
            metrics.admission_reviews.clone(),
        )
        .await?;
        let (tx, mut rx) = watch::channel(Store::default());
        let scope = source::kubernetes::Scope {
            namespaces: args.watch_namespaces.clone(),
            selector: args.namespace_selector.clone(),
            pods: ca.is_some(),
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
        publish(&initial, &cache, &admin, &metrics, &la);
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
        let (forward_tx, forward_rx) = tokio::sync::mpsc::channel(load::replicas::FORWARD_QUEUE);
        forward = Some(forward_tx);
        tokio::spawn(load::replicas::forward(
            forward_rx,
            args.identity.clone(),
            ca.as_ref().map(|ca| ca::setup::ToLeader {
                root_pem: ca.root_pem().to_string(),
                token_file: args.ca.token_file.clone(),
            }),
            leader_rx.clone(),
            leader_addr_rx,
        ));
        tokio::spawn(load::replicas::publish_weights(
            client.clone(),
            args.lease_namespace.clone(),
            args.load_aware_configmap.clone(),
            la.clone(),
            leader_rx.clone(),
            weights_rx.clone(),
        ));
        tokio::spawn(load::replicas::follow_weights(
            client.clone(),
            args.lease_namespace.clone(),
            args.load_aware_configmap.clone(),
            la.clone(),
            leader_rx.clone(),
            weights_tx.clone(),
        ));
        computes = leader_rx.clone();
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
            auth = Some(args.ca.auth(None, &args.lease_namespace, &metrics)?);
        }
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
        publish(&initial, &cache, &admin, &metrics, &la);
        let (store_tx, store_rx) = watch::channel(initial);
        tokio::spawn(source.run(args.poll_interval, store_tx));
        store_rx
    };

    tokio::spawn(debounce(
        store_rx,
        weights_rx,
        args.debounce,
        args.debounce_max,
        cache.clone(),
        admin.clone(),
        metrics.clone(),
        la.clone(),
    ));
    tokio::spawn(load_aware_loop(
        aggregator.clone(),
        la.clone(),
        computes,
        weights_tx,
    ));

    let xds_listener = tokio::net::TcpListener::bind(args.xds_addr)
        .await
        .with_context(|| format!("binding discovery address {}", args.xds_addr))?;
    info!(xds = %args.xds_addr, admin = %args.admin_addr, source = %args.source, "control plane serving");

    let lrs = load::LoadReports {
        aggregator,
        la: la.clone(),
        reporters: metrics.load_reporters.clone(),
        forward,
    };
    let discovery = discovery::server::Discovery::new(cache.subscribe(), proxies, metrics.clone());
    let (certificates, tls) = match (ca, auth) {
        (Some(ca), Some(auth)) => {
            let (c, tls) = ca::service::Certificates::serve(ca, auth, &metrics, args.xds_addr)?;
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

/// Every second, steps the LOAD_AWARE controller of every cluster from its
/// published weights (those the sidecars balance with) and publishes the
/// step when it moves a weight past the dead band ([`load_aware::moved`]).
/// Only while `computes`: on Kubernetes, the leader's weights are everyone's.
async fn load_aware_loop(
    agg: Arc<load::Aggregator>,
    la: Arc<LoadAwareState>,
    computes: watch::Receiver<bool>,
    tx: watch::Sender<u64>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        // A follower takes the leader's weights (load::replicas).
        if !*computes.borrow() {
            continue;
        }
        let clusters = la
            .clusters
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut changed = false;
        {
            let mut weights = la.weights.write().unwrap_or_else(|e| e.into_inner());
            weights.retain(|c, _| clusters.contains_key(c));
            for (cluster, eps) in &clusters {
                let next = load_aware::next_weights(&agg, cluster, eps, weights.get(cluster));
                if load_aware::moved(weights.get(cluster), &next) {
                    info!(cluster, weights = ?next, "LOAD_AWARE weights");
                    weights.insert(cluster.clone(), next);
                    changed = true;
                }
            }
        }
        if changed {
            tx.send_modify(|v| *v += 1);
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn debounce(
    mut rx: watch::Receiver<Store>,
    mut weights_rx: watch::Receiver<u64>,
    quiet: Duration,
    max: Duration,
    cache: Arc<Cache>,
    admin: Arc<Admin>,
    metrics: Arc<Metrics>,
    la: Arc<LoadAwareState>,
) {
    loop {
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            changed = weights_rx.changed() => {
                if changed.is_err() { return }
                // New weights: publish now; they are already rate-limited.
                let store = rx.borrow().clone();
                publish(&store, &cache, &admin, &metrics, &la);
                continue;
            }
        }
        let first = Instant::now();
        let mut last = first;
        loop {
            let deadline = (last + quiet).min(first + max);
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => last = Instant::now(),
                Ok(Err(_)) => return,
                Err(_) => break,
            }
        }
        let store = rx.borrow_and_update().clone();
        publish(&store, &cache, &admin, &metrics, &la);
        metrics
            .debounce_seconds
            .observe(first.elapsed().as_secs_f64());
    }
}

/// What the LOAD_AWARE loop needs from each publication.
#[derive(Default)]
pub struct LoadAwareState {
    /// Weights in force.
    pub weights: load_aware::Weights,
    /// LOAD_AWARE clusters and their endpoint addresses.
    pub clusters: RwLock<BTreeMap<String, Vec<String>>>,
    /// Load-report interval sidecars are asked for, ms.
    /// (A watch, so each load-report stream wakes only when it changes.)
    pub report_interval_ms: watch::Sender<u64>,
    /// The flag value.
    pub default_interval_ms: u64,
}

fn publish(store: &Store, cache: &Cache, admin: &Admin, metrics: &Metrics, la: &LoadAwareState) {
    let weights = la.weights.read().unwrap_or_else(|e| e.into_inner()).clone();
    let (resources, status) = translate::translate(store, &weights);
    let aware: BTreeMap<String, Vec<String>> = resources
        .clusters
        .iter()
        .filter(|(_, c)| c.policy == minimesh_proto::v1::LbPolicy::LoadAware as i32)
        .map(|(name, _)| {
            let eps = resources
                .endpoints
                .get(name)
                .map(|c| c.endpoints.iter().map(|e| e.address.clone()).collect())
                .unwrap_or_default();
            (name.clone(), eps)
        })
        .collect();
    // LOAD_AWARE wants fresh reports: one a second.
    let interval = if aware.is_empty() {
        la.default_interval_ms
    } else {
        la.default_interval_ms.min(1000)
    };
    la.report_interval_ms.send_if_modified(|v| {
        let changed = *v != interval;
        *v = interval;
        changed
    });
    *la.clusters.write().unwrap_or_else(|e| e.into_inner()) = aware;
    let changed = cache.update(&resources);
    if changed {
        metrics.config_updates.inc();
    }
    metrics.config_errors.set(store.errors.len() as i64);
    for (key, st) in &status {
        if !st.accepted {
            warn!(rule = %key, reason = st.reason, "{}", st.message);
        }
    }
    admin
        .status
        .send_replace(Arc::new(source::kubernetes::status::desired(
            store, &status,
        )));
    let rules = store
        .rules
        .iter()
        .map(|(key, (rule, origin))| {
            let st = status.get(key);
            json!({
                "namespace": key.namespace,
                "name": key.name,
                "file": origin,
                "host": rule.rule.spec.host,
                "policy": rule.resolved.policy.as_str(),
                "portPolicies": rule
                    .resolved
                    .ports
                    .iter()
                    .map(|(port, r)| (port.to_string(), r.policy.as_str()))
                    .collect::<BTreeMap<_, _>>(),
                "accepted": st.is_none_or(|s| s.accepted),
                "reason": st.map_or("Accepted", |s| s.reason.as_str()),
                "message": st.map_or("", |s| s.message.as_str()),
                "clusters": st.map(|s| s.clusters.clone()).unwrap_or_default(),
                "warnings": rule.warnings,
            })
        })
        .collect();
    let peer_authentications = config::security::view(&store.peer_auth);
    admin.set_config(ConfigView {
        rules,
        peer_authentications,
        virtual_services: store
            .virtual_services
            .iter()
            .map(|(k, (v, _))| config::virtual_service::view(&k.namespace, &k.name, v))
            .collect(),
        errors: store.errors.clone(),
        warnings: store.warnings.clone(),
        synced: true,
    });
    info!(
        changed,
        clusters = resources.clusters.len(),
        routes = resources.routes.len(),
        rules = store.rules.len(),
        errors = store.errors.len(),
        "config translated"
    );
}
