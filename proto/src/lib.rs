//! The minimesh wire protocol (generated from `proto/minimesh/v1/discovery.proto`)
//! and the type URLs that identify its resources.

#![allow(missing_docs)] // generated code carries the .proto comments instead

/// Messages and services of `minimesh.v1`.
pub mod v1 {
    #![allow(clippy::all, clippy::pedantic, clippy::unwrap_used)]
    tonic::include_proto!("minimesh.v1");
}

pub use prost;
pub use prost_types;

/// Type URL of [`v1::Cluster`].
pub const CLUSTER_TYPE: &str = "type.googleapis.com/minimesh.v1.Cluster";
/// Type URL of [`v1::ClusterLoadAssignment`].
pub const ENDPOINTS_TYPE: &str = "type.googleapis.com/minimesh.v1.ClusterLoadAssignment";
/// Type URL of [`v1::Route`].
pub const ROUTE_TYPE: &str = "type.googleapis.com/minimesh.v1.Route";

/// Every resource type, in the order a client should apply them (clusters
/// before their endpoints, routes last so that they never point at a cluster
/// the client does not know yet).
pub const ALL_TYPES: [&str; 3] = [CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE];

/// Packs a message into an `Any` with the given type URL.
pub fn to_any(type_url: &str, msg: &impl prost::Message) -> prost_types::Any {
    prost_types::Any {
        type_url: type_url.to_string(),
        value: msg.encode_to_vec(),
    }
}
