//! Publication: each config the source hands over (and each step of the
//! LOAD_AWARE weights) translated once and published to the cache, which
//! every discovery stream reads, and to the admin server's views and the
//! statuses written back; changes debounced.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::admin::{Admin, ConfigView};
use crate::cache::Cache;
use crate::load_aware::LoadAwareState;
use crate::store::Store;
use crate::{config, source, translate};

/// The publication's metrics.
#[derive(Debug)]
pub struct Metrics {
    /// Config changes that produced new resources.
    pub config_updates: Counter,
    /// Rejected objects in the current config.
    pub config_errors: Gauge,
    /// Seconds from the first change of a debounce window to publication.
    pub debounce_seconds: Histogram,
}

impl Metrics {
    /// Creates the metrics and registers them on `registry` (the control
    /// plane's, prefixed `minimesh_`).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            config_updates: Counter::default(),
            config_errors: Gauge::default(),
            debounce_seconds: Histogram::new([0.01, 0.05, 0.1, 0.15, 0.2, 0.5, 1.0, 2.0]),
        };
        registry.register(
            "config_updates",
            "Config changes that produced new resources",
            m.config_updates.clone(),
        );
        registry.register(
            "config_errors",
            "Rejected objects in the current config",
            m.config_errors.clone(),
        );
        registry.register(
            "config_debounce_seconds",
            "Time from the first change in a debounce window to publication",
            m.debounce_seconds.clone(),
        );
        m
    }
}

/// Where each translation goes.
#[derive(Clone)]
pub struct Publisher {
    /// The resources every discovery stream reads.
    pub cache: Arc<Cache>,
    /// The views and statuses.
    pub admin: Arc<Admin>,
    /// The publication's metrics.
    pub metrics: Arc<Metrics>,
    /// The LOAD_AWARE weights translated with, and the clusters and report
    /// interval published for the load side.
    pub la: Arc<LoadAwareState>,
}

impl Publisher {
    /// Publishes every change of `rx` once it has been quiet for `quiet`
    /// (at most `max` after its first change), and new LOAD_AWARE weights
    /// (`weights_rx`) at once.
    pub async fn debounce(
        self,
        mut rx: watch::Receiver<Store>,
        mut weights_rx: watch::Receiver<u64>,
        quiet: Duration,
        max: Duration,
    ) {
        loop {
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                changed = weights_rx.changed() => {
                    if changed.is_err() { return }
                    // New weights: publish now; they are already rate-limited.
                    let store = rx.borrow().clone();
                    self.publish(&store);
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
            self.publish(&store);
            self.metrics
                .debounce_seconds
                .observe(first.elapsed().as_secs_f64());
        }
    }

    /// Translates `store` and publishes the result: the resources to the
    /// cache (and so to every stream), the views and statuses to the admin
    /// server, the LOAD_AWARE clusters and report interval to the load side.
    pub fn publish(&self, store: &Store) {
        let Publisher {
            cache,
            admin,
            metrics,
            la,
        } = self;
        let weights = la.weights.read().unwrap_or_else(|e| e.into_inner()).clone();
        let (resources, status) = translate::translate(store, &weights);
        // A namespace's own rule may make a cluster LOAD_AWARE for its callers.
        let aware: BTreeMap<String, Vec<String>> = std::iter::once(&resources)
            .chain(resources.scoped.values())
            .flat_map(|r| {
                r.clusters
                    .iter()
                    .filter(|(_, c)| c.policy == minimesh_proto::v1::LbPolicy::LoadAware as i32)
                    .map(move |(name, _)| {
                        let eps = r
                            .endpoints
                            .get(name)
                            .map(|c| c.endpoints.iter().map(|e| e.address.clone()).collect())
                            .unwrap_or_default();
                        (name.clone(), eps)
                    })
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
        admin.route_status.send_if_modified(|current| {
            let next = translate::http_route_desired_status(store);
            let changed = **current != next;
            if changed {
                *current = Arc::new(next);
            }
            changed
        });
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
            rule_scope: translate::rule_scope(store),
            peer_authentications,
            virtual_services: store
                .virtual_services
                .iter()
                .map(|(k, (v, _))| {
                    let mut view = config::virtual_service::view(&k.namespace, &k.name, v);
                    view["warnings"] = translate::route_warnings(store, k, v).into();
                    view
                })
                .collect(),
            gateways: store
                .gateways
                .iter()
                .map(|(k, g)| config::gateway::view(&k.namespace, &k.name, g))
                .collect(),
            http_routes: store
                .http_routes
                .iter()
                .map(|(k, r)| translate::http_route_status(store, k, r))
                .collect(),
            authorization_policies: store
                .authorizations
                .iter()
                .map(|(k, a)| config::authorization::view(k, a))
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
}
