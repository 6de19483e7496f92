//! The minimesh wire protocol (generated from `proto/minimesh/v1/discovery.proto`)
//! and the type URLs that identify its resources.

#![allow(missing_docs)] // generated code carries the .proto comments instead

/// Messages and services of `minimesh.v1`.
pub mod v1 {
    #![allow(clippy::all, clippy::pedantic, clippy::unwrap_used)]
    tonic::include_proto!("minimesh.v1");
}

pub mod admin;
pub mod capture;
pub mod duration;
pub mod headers;
pub mod latency;
pub mod policy;
pub mod retry_on;

pub use policy::Policy;
pub use prost;
pub use prost_types;

/// The protobuf codec of every minimesh RPC: prost with 256-byte starting
/// buffers instead of tonic's 8 KiB. A control plane holds one discovery and
/// one load-report stream per sidecar, each with an encode and a decode
/// buffer, all idle between pushes; an ACK fits in 256 bytes, and a buffer
/// grows in one step for a larger message. At 2,000 sidecars, 1 KiB buffers
/// cost the control plane 2.1 KiB more per sidecar than these.
#[derive(Debug, Clone)]
pub struct Codec<T, U>(std::marker::PhantomData<(T, U)>);

/// Starting size of each stream's encode and decode buffer.
pub const CODEC_BUFFER_SIZE: usize = 256;

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(std::marker::PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = tonic_prost::ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::new(buffer_settings())
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(buffer_settings())
    }
}

fn buffer_settings() -> tonic::codec::BufferSettings {
    // Yield to the runtime after 32 KiB of encoded messages, as tonic's default.
    tonic::codec::BufferSettings::new(CODEC_BUFFER_SIZE, 32 * 1024)
}

/// The client feature (in [`v1::Node::client_features`]) of a client that
/// keeps, in a state-of-the-world stream, the endpoint assignments a response
/// does not name (dropping one only with its cluster): the server then sends
/// only the assignments that changed since the client's last ACK.
pub const PARTIAL_ENDPOINTS: &str = "minimesh.io/partial-endpoints";

/// The prefix of the node id another control-plane replica opens a load-report
/// stream with, to pass on the reports its sidecars send (LOAD_AWARE weights
/// are computed by one replica, from every report): each report on such a
/// stream names, in its own `node`, the sidecar that sent it.
pub const FORWARDER_NODE_PREFIX: &str = "minimesh-forwarder/";

/// Type URL of [`v1::Cluster`].
pub const CLUSTER_TYPE: &str = "type.googleapis.com/minimesh.v1.Cluster";
/// Type URL of [`v1::ClusterLoadAssignment`].
pub const ENDPOINTS_TYPE: &str = "type.googleapis.com/minimesh.v1.ClusterLoadAssignment";
/// Type URL of [`v1::PeerAuthentication`].
pub const PEER_AUTH_TYPE: &str = "type.googleapis.com/minimesh.v1.PeerAuthentication";
/// Type URL of [`v1::Route`].
pub const ROUTE_TYPE: &str = "type.googleapis.com/minimesh.v1.Route";
/// Type URL of [`v1::Authorization`].
pub const AUTHZ_TYPE: &str = "type.googleapis.com/minimesh.v1.Authorization";

/// Every resource type, in the order a client should apply them (clusters
/// before their endpoints, routes last so that they never point at a cluster
/// the client does not know yet), then the inbound listener's mTLS mode and
/// authorization policies.
pub const ALL_TYPES: [&str; 5] = [
    CLUSTER_TYPE,
    ENDPOINTS_TYPE,
    ROUTE_TYPE,
    PEER_AUTH_TYPE,
    AUTHZ_TYPE,
];

/// Packs a message into an `Any` with the given type URL.
pub fn to_any(type_url: &str, msg: &impl prost::Message) -> prost_types::Any {
    prost_types::Any {
        type_url: type_url.to_string(),
        value: msg.encode_to_vec(),
    }
}

/// Type URLs of Envoy's xDS v3 resources, as the control plane serves them to
/// Envoy and to gRPC's xDS clients (the messages are Envoy's, from the
/// `envoy-types` crate; only the names live here, beside minimesh's own).
pub mod xds_v3 {
    /// `envoy.config.listener.v3.Listener`.
    pub const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    /// `envoy.config.route.v3.RouteConfiguration`.
    pub const ROUTE_CONFIG_TYPE: &str =
        "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    /// `envoy.config.cluster.v3.Cluster`.
    pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    /// `envoy.config.endpoint.v3.ClusterLoadAssignment`.
    pub const ENDPOINTS_TYPE: &str =
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    /// Every type, in the order xDS pushes them so that nothing points at
    /// what the client does not have yet: clusters, their endpoints, then
    /// listeners and the route configurations they name.
    pub const ALL_TYPES: [&str; 4] = [
        CLUSTER_TYPE,
        ENDPOINTS_TYPE,
        LISTENER_TYPE,
        ROUTE_CONFIG_TYPE,
    ];

    /// The RouteConfiguration holding a virtual host for every service port,
    /// for a proxy whose own listener routes by authority (Envoy with
    /// `deploy/envoy/bootstrap.yaml`); gRPC clients use the per-port ones.
    pub const OUTBOUND_ROUTE_CONFIG: &str = "minimesh-outbound";
}
