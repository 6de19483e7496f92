//! Envoy's ADS and LRS as tonic services on the discovery port, with
//! minimesh's codec ([`minimesh_proto::Codec`]: 256-byte starting buffers
//! where tonic's default codec, which `envoy-types`' generated servers use,
//! starts each stream's encode and decode buffers at 8 KiB). At 10,000
//! connected xDS v3 clients the generated servers cost the control plane
//! 47.0 KiB per client; these, 32.0 KiB (a sidecar costs 30.2 KiB; BENCHMARKS.md).
//!
//! Each is a tonic `Grpc` per call around one of [`super::ads`]'s or
//! [`super::lrs`]'s stream functions: what the generated code does, with
//! the codec chosen here.

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::load_stats::v3::{LoadStatsRequest, LoadStatsResponse};
use minimesh_proto::Codec;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::server::{Grpc, NamedService};
use tonic::{Request, Response, Status, Streaming};

use super::MAX_MESSAGE_BYTES;
use crate::ca::streams::Authenticated;
use crate::discovery::server::Discovery;
use crate::discovery::session::BoxStream;
use crate::discovery::v3 as ads;
use crate::lrs::v3 as lrs;
use crate::lrs::LoadReports;

/// A call's HTTP response, to come.
pub type HttpFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

/// One streaming method: the client's request stream in, the response
/// stream out.
struct Method<F>(F);

impl<F, Req, Resp> Service<Request<Streaming<Req>>> for Method<F>
where
    F: FnMut(Streaming<Req>, Option<Authenticated>) -> BoxStream<Resp>,
{
    type Response = Response<BoxStream<Resp>>;
    type Error = Status;
    type Future = Ready<Result<Self::Response, Status>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Status>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Streaming<Req>>) -> Self::Future {
        let caller = request.extensions().get::<Authenticated>().cloned();
        ready(Ok(Response::new((self.0)(request.into_inner(), caller))))
    }
}

/// Serves `method` on `req` with minimesh's codec and message limit.
fn serve<Req, Resp, F>(req: http::Request<Body>, method: F) -> HttpFuture
where
    Req: minimesh_proto::prost::Message + Default + Send + 'static,
    Resp: minimesh_proto::prost::Message + Send + 'static,
    F: FnMut(Streaming<Req>, Option<Authenticated>) -> BoxStream<Resp> + Send + 'static,
{
    Box::pin(async move {
        let mut grpc = Grpc::new(Codec::<Resp, Req>::default())
            .apply_max_message_size_config(Some(MAX_MESSAGE_BYTES), None);
        Ok(grpc.streaming(Method(method), req).await)
    })
}

fn unimplemented(path: &str) -> HttpFuture {
    let status = Status::unimplemented(format!("no service serves {path}"));
    Box::pin(async move { Ok(status.into_http()) })
}

/// A gRPC service of Envoy's: its name, and which call serves a path.
pub trait Methods: Clone + Send + 'static {
    /// The service's full name.
    const NAME: &'static str;
    /// Serves `req`, a call of one of its methods.
    fn serve(&self, req: http::Request<Body>) -> HttpFuture;
}

/// A [`Methods`] as a tonic service on the discovery port.
#[derive(Clone)]
pub struct Server<M>(pub M);

impl<M: Methods> NamedService for Server<M> {
    const NAME: &'static str = M::NAME;
}

impl<M: Methods> Service<http::Request<Body>> for Server<M> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = HttpFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> HttpFuture {
        self.0.serve(req)
    }
}

/// `envoy.service.discovery.v3.AggregatedDiscoveryService`.
#[derive(Clone)]
pub struct Ads(pub Discovery);

impl Methods for Ads {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";

    fn serve(&self, req: http::Request<Body>) -> HttpFuture {
        let d = self.0.clone();
        match req.uri().path() {
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources" => {
                serve(
                    req,
                    move |s: Streaming<DiscoveryRequest>, who| -> BoxStream<DiscoveryResponse> {
                        ads::sotw(&d, s, who)
                    },
                )
            }
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources" => {
                serve(
                    req,
                    move |s: Streaming<DeltaDiscoveryRequest>,
                          who|
                          -> BoxStream<DeltaDiscoveryResponse> {
                        ads::delta(&d, s, who)
                    },
                )
            }
            path => unimplemented(path),
        }
    }
}

/// `envoy.service.load_stats.v3.LoadReportingService`.
#[derive(Clone)]
pub struct Lrs(pub LoadReports);

impl Methods for Lrs {
    const NAME: &'static str = "envoy.service.load_stats.v3.LoadReportingService";

    fn serve(&self, req: http::Request<Body>) -> HttpFuture {
        let r = self.0.clone();
        match req.uri().path() {
            "/envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats" => serve(
                req,
                move |s: Streaming<LoadStatsRequest>, who| -> BoxStream<LoadStatsResponse> {
                    lrs::stream(&r, s, who)
                },
            ),
            path => unimplemented(path),
        }
    }
}
