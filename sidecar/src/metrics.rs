//! The sidecar's Prometheus metrics, registered on the prometheus-client
//! `Registry` the admin server encodes. Endpoint, cluster and listener state
//! lives in atomics on the request path; a [`Collector`] reads them at each
//! scrape from the routing snapshot in force, so a series comes and goes
//! with its endpoint and nothing is copied per request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::endpoint::EndpointState;
use crate::histogram::Histogram;
use crate::listener::Loops;
use crate::routing::Routing;

/// What the sidecar's series are read from.
pub struct ProxyMetrics {
    /// The routing in force: clusters, their endpoints and counters.
    pub routing: Arc<ArcSwap<Routing>>,
    /// Config received.
    pub ready: Arc<AtomicBool>,
    /// Each proxy listener's event loops, for their connection counts.
    pub listeners: Vec<(&'static str, Arc<Loops>)>,
}

impl std::fmt::Debug for ProxyMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyMetrics").finish_non_exhaustive()
    }
}

impl ProxyMetrics {
    /// Registers every sidecar series on `registry`.
    pub fn register(self, registry: &mut Registry) {
        registry.register_collector(Box::new(self));
    }
}

/// The labels of an endpoint's series.
fn endpoint_labels<'a>(cluster: &'a str, e: &'a EndpointState) -> [(&'static str, String); 3] {
    [
        ("cluster", cluster.to_string()),
        ("endpoint", e.addr.to_string()),
        ("pod", e.pod.clone()),
    ]
}

/// A per-endpoint value of one series.
type EndpointValue = fn(&EndpointState) -> u64;

/// Gauges and counters with one value per endpoint: name (counters without
/// `_total`, which the encoder adds), help, type, value.
const ENDPOINT_SERIES: [(&str, &str, MetricType, EndpointValue); 7] = [
    (
        "minimesh_endpoint_connections",
        "Upstream connections open to the endpoint (busy and idle)",
        MetricType::Gauge,
        |e| u64::from(e.pool().open_connections()),
    ),
    (
        "minimesh_endpoint_ejected",
        "1 while ejected by outlier detection",
        MetricType::Gauge,
        |e| u64::from(e.is_ejected()),
    ),
    (
        "minimesh_endpoint_requests",
        "Requests sent to the endpoint",
        MetricType::Counter,
        |e| e.counters().issued(),
    ),
    (
        "minimesh_endpoint_active_requests",
        "Requests in flight to the endpoint",
        MetricType::Gauge,
        |e| u64::from(e.active()),
    ),
    (
        "minimesh_endpoint_connect_failures",
        "Refused or failed connections",
        MetricType::Counter,
        |e| e.counters().connect_failures(),
    ),
    (
        "minimesh_endpoint_failing",
        "1 while the endpoint is skipped after a connect failure",
        MetricType::Gauge,
        |e| u64::from(e.is_failing()),
    ),
    (
        "minimesh_endpoint_identity_refused",
        "Mutual TLS connections refused for secure naming: the endpoint's certificate named an identity its pod does not have",
        MetricType::Counter,
        |e| e.pool().peer().map_or(0, |p| p.refused()),
    ),
];

fn value(mut m: MetricEncoder<'_>, kind: MetricType, v: u64) -> Result<(), std::fmt::Error> {
    match kind {
        MetricType::Counter => m.encode_counter::<NoLabelSet, _, u64>(&v, None),
        _ => m.encode_gauge(&v),
    }
}

fn histogram<const N: usize>(
    mut m: MetricEncoder<'_>,
    h: &Histogram<N>,
    per_second: f64,
) -> Result<(), std::fmt::Error> {
    let (sum, count, buckets) = h.snapshot(per_second);
    m.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
}

impl Collector for ProxyMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let routing = self.routing.load();
        let endpoints = || {
            routing.clusters.iter().flat_map(|(name, c)| {
                c.balancer
                    .endpoints()
                    .iter()
                    .map(move |e| (name.as_str(), e.as_ref()))
            })
        };
        for (name, help, kind, read) in ENDPOINT_SERIES {
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for (cluster, e) in endpoints() {
                let labels = endpoint_labels(cluster, e);
                value(family.encode_family(&labels)?, kind, read(e))?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "minimesh_endpoint_responses",
            "Responses and failures by outcome",
            None,
            MetricType::Counter,
        )?;
        for (cluster, e) in endpoints() {
            let [c, ep, pod] = endpoint_labels(cluster, e);
            for (outcome, n) in [
                ("success", e.counters().succeeded()),
                ("failure", e.counters().failed()),
            ] {
                let labels = [
                    c.clone(),
                    ep.clone(),
                    pod.clone(),
                    ("outcome", outcome.into()),
                ];
                value(family.encode_family(&labels)?, MetricType::Counter, n)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "minimesh_endpoint_request_duration_seconds",
            "Time to response headers",
            None,
            MetricType::Histogram,
        )?;
        for (cluster, e) in endpoints() {
            let labels = endpoint_labels(cluster, e);
            let (sum, count, buckets) = e.counters().latency_snapshot();
            family
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        let mut family = encoder.encode_descriptor(
            "minimesh_pick_duration_seconds",
            "Time to pick an endpoint (one pick in 16 per event loop is timed)",
            None,
            MetricType::Histogram,
        )?;
        for (name, c) in &routing.clusters {
            let labels = [
                ("cluster", name.as_str()),
                ("policy", c.balancer.policy().as_str()),
            ];
            histogram(family.encode_family(&labels)?, &c.pick_ns.0, 1e9)?;
        }
        let mut family = encoder.encode_descriptor(
            "minimesh_listener_connections",
            "Client connections each event loop of a listener serves",
            None,
            MetricType::Gauge,
        )?;
        for (listener, loops) in &self.listeners {
            for i in 0..loops.len() {
                let labels = [("listener", listener.to_string()), ("loop", i.to_string())];
                value(
                    family.encode_family(&labels)?,
                    MetricType::Gauge,
                    loops.open(i) as u64,
                )?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "minimesh_listener_connections_refused",
            "Client connections a listener closed at once for being beyond --max-connections",
            None,
            MetricType::Counter,
        )?;
        for (listener, loops) in &self.listeners {
            let labels = [("listener", listener.to_string())];
            value(
                family.encode_family(&labels)?,
                MetricType::Counter,
                loops.refused(),
            )?;
        }
        type BudgetValue = fn(&crate::retry::Budget) -> u64;
        let cluster_series: [(&str, &str, BudgetValue); 2] = [
            ("minimesh_cluster_retries", "Retries made", |b| {
                b.retried.load(Ordering::Relaxed)
            }),
            (
                "minimesh_cluster_retry_budget_exhausted",
                "Retries refused by the retry budget",
                |b| b.exhausted.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, read) in cluster_series {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (cluster, c) in &routing.clusters {
                let labels = [("cluster", cluster.as_str())];
                value(
                    family.encode_family(&labels)?,
                    MetricType::Counter,
                    read(&c.budget),
                )?;
            }
        }
        let family = encoder.encode_descriptor(
            "minimesh_config_ready",
            "1 once config arrived",
            None,
            MetricType::Gauge,
        )?;
        value(
            family,
            MetricType::Gauge,
            u64::from(self.ready.load(Ordering::Relaxed)),
        )
    }
}
