//! The aggregated load view as Prometheus series (`minimesh_load_*`): a
//! collector registered on the control plane's registry, reading the
//! aggregator at each scrape.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde_json::Value;
use tokio::sync::watch;

use super::Aggregator;
use crate::cache::Snapshot;

/// The `minimesh_load_*` series, per cluster and endpoint.
#[derive(Debug)]
pub struct LoadMetrics {
    /// Where the load view comes from.
    pub aggregator: Arc<Aggregator>,
    /// The resources in force, for endpoints nobody reports on.
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
}

impl LoadMetrics {
    /// Registers the series on `registry`.
    pub fn register(self, registry: &mut Registry) {
        registry.register_collector(Box::new(self));
    }
}

/// Series name, field of the JSON view, help.
const SERIES: [(&str, &str, &str); 7] = [
    (
        "minimesh_load_rps",
        "rps",
        "Requests per second to the endpoint, from every sidecar",
    ),
    (
        "minimesh_load_success_ratio",
        "success_ratio",
        "Share of the endpoint's responses that succeeded",
    ),
    (
        "minimesh_load_in_flight",
        "in_flight",
        "Requests in flight to the endpoint, all sidecars",
    ),
    (
        "minimesh_load_share",
        "share",
        "The endpoint's share of its service's requests",
    ),
    (
        "minimesh_load_latency_p50_ms",
        "p50_ms",
        "Median latency, ms (within 1.6%)",
    ),
    (
        "minimesh_load_latency_p95_ms",
        "p95_ms",
        "95th percentile latency, ms (within 1.6%)",
    ),
    (
        "minimesh_load_latency_p99_ms",
        "p99_ms",
        "99th percentile latency, ms (within 1.6%)",
    ),
];

impl Collector for LoadMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let known = self.snapshots.borrow().endpoint_addresses();
        let view = self.aggregator.view(&known);
        for (name, field, help) in SERIES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            let clusters = view["clusters"].as_object().into_iter().flatten();
            for (cluster, eps) in clusters {
                for (ep, v) in eps.as_object().into_iter().flatten() {
                    if let Some(x) = v.get(field).and_then(Value::as_f64) {
                        let labels = [("cluster", cluster.as_str()), ("endpoint", ep.as_str())];
                        family.encode_family(&labels)?.encode_gauge(&x)?;
                    }
                }
            }
        }
        Ok(())
    }
}
