//! `envoy.service.discovery.v3.AggregatedDiscoveryService`: the discovery
//! streams of [`crate::discovery::server::Discovery`], serving the cache's
//! Envoy resources, with each request and response converted at the edge
//! ([`super::wire`]). Subscriptions, versions, nonces, ACKs and NACKs, and
//! what `/debug/proxies` shows are the minimesh streams' own.

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use futures_util::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use super::wire;
use crate::discovery::server::Discovery;
use crate::discovery::session::BoxStream;

/// The xDS v3 aggregated discovery service.
#[derive(Clone)]
pub struct Ads(pub Discovery);

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let inbound = request.into_inner().map(|r| r.map(wire::sotw_request));
        let out = self.0.sotw_v3(inbound).map(|r| r.map(wire::sotw_response));
        Ok(Response::new(Box::pin(out)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let inbound = request.into_inner().map(|r| r.map(wire::delta_request));
        let out = self
            .0
            .delta_v3(inbound)
            .map(|r| r.map(wire::delta_response));
        Ok(Response::new(Box::pin(out)))
    }
}
