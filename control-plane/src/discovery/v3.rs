//! `envoy.service.discovery.v3.AggregatedDiscoveryService`: the discovery
//! streams of [`crate::discovery::server::Discovery`], serving the cache's
//! Envoy resources, with each request and response converted at the edge
//! ([`super::wire`]). Subscriptions, versions, nonces, ACKs and NACKs, and
//! what `/debug/proxies` shows are the minimesh streams' own. Mounted on
//! the discovery port by [`super::server`].

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use futures_util::{Stream, StreamExt};
use tonic::Status;

use super::server::Discovery;
use super::session::BoxStream;
use crate::ca::streams::{check, Authenticated};
use crate::xds_v3::wire;

/// A state-of-the-world stream answering the requests of `inbound`.
/// The caller (with a CA) may speak only for its namespace.
pub fn sotw<I>(
    discovery: &Discovery,
    inbound: I,
    caller: Option<Authenticated>,
) -> BoxStream<DiscoveryResponse>
where
    I: Stream<Item = Result<DiscoveryRequest, Status>> + Send + Unpin + 'static,
{
    let inbound = check(
        caller,
        inbound.map(|r| r.map(wire::sotw_request)),
        "discovery",
    );
    Box::pin(
        discovery
            .sotw_v3(inbound)
            .map(|r| r.map(wire::sotw_response)),
    )
}

/// An incremental stream answering the requests of `inbound`.
pub fn delta<I>(
    discovery: &Discovery,
    inbound: I,
    caller: Option<Authenticated>,
) -> BoxStream<DeltaDiscoveryResponse>
where
    I: Stream<Item = Result<DeltaDiscoveryRequest, Status>> + Send + Unpin + 'static,
{
    let inbound = check(
        caller,
        inbound.map(|r| r.map(wire::delta_request)),
        "discovery",
    );
    Box::pin(
        discovery
            .delta_v3(inbound)
            .map(|r| r.map(wire::delta_response)),
    )
}
