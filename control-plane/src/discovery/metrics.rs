//! The discovery streams' metrics: streams connected, responses pushed and
//! NACKed by type, registered on the control plane's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::registry::short_type;

/// Label set naming a resource type.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    /// Short type name (`Cluster`, `ClusterLoadAssignment`, `Route`).
    pub r#type: String,
}

/// The discovery streams' metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Connected discovery streams.
    pub connected: Gauge,
    /// Responses sent, by type.
    pub pushes: Family<TypeLabel, Counter>,
    /// NACKs received, by type.
    pub nacks: Family<TypeLabel, Counter>,
}

impl Metrics {
    /// Creates the metrics and registers them on `registry` (the control
    /// plane's, prefixed `minimesh_`).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register(
            "xds_connected_proxies",
            "Connected discovery streams",
            m.connected.clone(),
        );
        registry.register(
            "xds_pushes",
            "Discovery responses sent, by type",
            m.pushes.clone(),
        );
        registry.register(
            "xds_nacks",
            "Discovery responses rejected by proxies, by type",
            m.nacks.clone(),
        );
        // Every type's counters exist from the start at 0, so that a rate or
        // an increase over them reads 0 rather than no data.
        for t in minimesh_proto::ALL_TYPES
            .into_iter()
            .chain(minimesh_proto::xds_v3::ALL_TYPES)
        {
            let _ = m.pushes.get_or_create(&label(t));
            let _ = m.nacks.get_or_create(&label(t));
        }
        m
    }

    /// Counts a push of `type_url`.
    pub fn push(&self, type_url: &str) {
        self.pushes.get_or_create(&label(type_url)).inc();
    }

    /// Counts a NACK of `type_url`.
    pub fn nack(&self, type_url: &str) {
        self.nacks.get_or_create(&label(type_url)).inc();
    }
}

/// minimesh's types by their short name (`Cluster`); Envoy's, served to
/// xDS v3 clients, by their full name (`envoy.config.cluster.v3.Cluster`),
/// so that the two encodings' pushes and NACKs are counted apart.
fn label(type_url: &str) -> TypeLabel {
    let name = type_url
        .strip_prefix("type.googleapis.com/")
        .unwrap_or(type_url);
    TypeLabel {
        r#type: if name.starts_with("envoy.") {
            name.to_string()
        } else {
            short_type(type_url).to_string()
        },
    }
}
