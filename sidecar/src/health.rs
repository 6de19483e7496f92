//! Active health checks: per cluster with a `healthCheck`, one task probes
//! every endpoint with `GET path` each interval; `unhealthyThreshold`
//! failures in a row take an endpoint out of rotation, `healthyThreshold`
//! successes bring it back. Endpoints start healthy, so a new config never
//! blacks a cluster out while the first probes run.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, Method, Uri};
use minimesh_proto::v1::{Cluster, HealthCheck};
use tokio::task::JoinHandle;
use tracing::info;

use crate::endpoint::EndpointState;
use crate::h1::encode;
use crate::pool::{ConnPool, PoolSettings};
use crate::routing::Routing;

/// The running checkers, one per cluster that asks for one.
#[derive(Default)]
pub struct HealthCheckers {
    tasks: HashMap<String, (HealthCheck, JoinHandle<()>)>,
}

impl HealthCheckers {
    /// Starts, restarts or stops checkers so that they match `clusters`.
    pub fn reconcile(
        &mut self,
        clusters: &BTreeMap<String, Cluster>,
        routing: &Arc<ArcSwap<Routing>>,
    ) {
        self.tasks.retain(|name, (hc, task)| {
            let keep = clusters.get(name).and_then(|c| c.health_check.as_ref()) == Some(hc);
            if !keep {
                task.abort();
            }
            keep
        });
        for (name, c) in clusters {
            let Some(hc) = &c.health_check else { continue };
            if self.tasks.contains_key(name) {
                continue;
            }
            let task = tokio::spawn(check_loop(name.clone(), hc.clone(), routing.clone()));
            self.tasks.insert(name.clone(), (hc.clone(), task));
        }
    }
}

impl Drop for HealthCheckers {
    fn drop(&mut self) {
        for (_, (_, t)) in self.tasks.drain() {
            t.abort();
        }
    }
}

async fn check_loop(cluster: String, hc: HealthCheck, routing: Arc<ArcSwap<Routing>>) {
    let interval = Duration::from_millis(hc.interval_ms.max(100));
    let timeout = Duration::from_millis(hc.timeout_ms.max(1));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let endpoints: Vec<Arc<EndpointState>> = match routing.load().clusters.get(&cluster) {
            Some(c) => c.balancer.endpoints().to_vec(),
            None => continue,
        };
        let probes = endpoints.into_iter().map(|ep| {
            let hc = hc.clone();
            let cluster = cluster.clone();
            async move {
                let ok = probe(&ep, &hc.path, timeout).await;
                record(&cluster, &ep, ok, &hc);
            }
        });
        futures_util::future::join_all(probes).await;
    }
}

/// One probe on a connection of its own (closed after it), as Envoy keeps
/// health-check traffic apart from requests.
async fn probe(ep: &EndpointState, path: &str, timeout: Duration) -> bool {
    let Ok(uri) = path.parse::<Uri>() else {
        return false;
    };
    let mut headers = http::HeaderMap::with_capacity(2);
    headers.insert(
        header::USER_AGENT,
        http::HeaderValue::from_static("minimesh-health-check"),
    );
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let body = crate::pool::UpstreamBody::Buffered(Bytes::new());
    let mut req = encode(&Method::GET, target, &headers, ep.authority.as_str(), body);
    let settings = PoolSettings {
        connect_timeout: timeout,
        idle_timeout: timeout,
        max_requests_per_connection: 1,
        max_connection_ms: 0,
        max_streams: 0,
    };
    let conns = ConnPool::default();
    matches!(tokio::time::timeout(timeout, conns.send(ep.addr, &settings, &mut req)).await, Ok(Ok(r)) if r.status().is_success())
}

fn record(cluster: &str, ep: &EndpointState, ok: bool, hc: &HealthCheck) {
    let unhealthy = ep.hc_unhealthy.load(Ordering::Relaxed);
    if ok != unhealthy {
        // The outcome agrees with the current state.
        ep.hc_streak.store(0, Ordering::Relaxed);
        return;
    }
    let streak = ep.hc_streak.fetch_add(1, Ordering::Relaxed) + 1;
    let threshold = if unhealthy {
        hc.healthy_threshold
    } else {
        hc.unhealthy_threshold
    };
    if streak >= threshold.max(1) {
        ep.hc_unhealthy.store(!unhealthy, Ordering::Relaxed);
        ep.hc_streak.store(0, Ordering::Relaxed);
        info!(cluster, endpoint = %ep.addr, healthy = unhealthy, "health check changed the endpoint's state");
    }
}
