//! Envoy's xDS v3, served beside minimesh's own protocol so that Envoy and
//! gRPC's built-in xDS clients ("proxyless" gRPC) take their policy from
//! minimesh and report their load to it.
//!
//! There is one pipeline: the config is translated once into minimesh's
//! resources ([`crate::translate`]), and [`encode`] writes those same
//! resources as Envoy's (a pure step, run when the cache publishes). The
//! cache holds both encodings; the discovery streams, their push decisions,
//! ACK and NACK bookkeeping and `/debug/proxies` are the same code for
//! both ([`crate::discovery::v3`] only converts the envelope), and load reports from either
//! go to the one aggregator ([`crate::lrs::v3`]).
//!
//! The mapping, policy by policy, is in the README's rule reference
//! ("Envoy and proxyless gRPC"); [`clusters`] states why each choice.

pub mod clusters;
pub mod endpoints;
pub mod http_routes;
pub mod routes;
pub mod wire;

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::google::protobuf::{Any, Duration};

use crate::translate::Resources;

/// minimesh's resources written as Envoy's, by resource name.
#[derive(Debug, Default)]
pub struct Encoded {
    /// One per service port and name a client may dial it by.
    pub listeners: BTreeMap<String, Listener>,
    /// One per service port, and [`minimesh_proto::xds_v3::OUTBOUND_ROUTE_CONFIG`].
    pub routes: BTreeMap<String, RouteConfiguration>,
    /// One per minimesh cluster, under the same name.
    pub clusters: BTreeMap<String, Cluster>,
    /// One per cluster, under the cluster's name.
    pub endpoints: BTreeMap<String, ClusterLoadAssignment>,
}

/// How minimesh's resources are written as Envoy's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Serve each cluster's policy alone, with no standard fallback: a
    /// client that does not implement it rejects the cluster (a NACK, shown
    /// in `minimesh get proxies`) and keeps its last good config, rather than
    /// balancing in a way the rule did not ask for (`--xds-v3-exact-policies`).
    pub exact_policies: bool,
}

/// Writes `r` as Envoy's resources.
pub fn encode(r: &Resources, opts: Options) -> Encoded {
    let mut out = Encoded::default();
    for (name, c) in &r.clusters {
        let cla = r.endpoints.get(name);
        out.clusters
            .insert(name.clone(), clusters::cluster(c, cla, opts.exact_policies));
        out.endpoints
            .insert(name.clone(), endpoints::assignment(c, cla));
    }
    routes::encode(r, &mut out);
    out
}

/// Packs `msg` as an `Any`.
pub(crate) fn any<M: minimesh_proto::prost::Message + minimesh_proto::prost::Name>(msg: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: msg.encode_to_vec(),
    }
}

/// Milliseconds as a protobuf duration.
pub(crate) fn millis(ms: u64) -> Duration {
    Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// A protobuf duration in milliseconds (negative: 0).
pub(crate) fn to_millis(d: &Duration) -> u64 {
    let ms = d.seconds.saturating_mul(1000) + i64::from(d.nanos / 1_000_000);
    u64::try_from(ms).unwrap_or(0)
}
