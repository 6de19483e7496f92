//! The discovery port: tonic's gRPC server (h2 underneath) serving the
//! discovery and load-report services, with limits chosen for what a control
//! plane holds: thousands of connections, each carrying one sidecar's two
//! long-lived streams (discovery and load reports), idle nearly all the time.
//!
//! The services know nothing of this module: each is a tonic service
//! ([`crate::discovery::server::Discovery`], [`crate::lrs::LoadReports`])
//! that could be mounted on any tonic server.

pub mod v3;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use minimesh_proto::v1::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use minimesh_proto::v1::certificate_service_server::CertificateServiceServer;
use minimesh_proto::v1::load_reporting_service_server::LoadReportingServiceServer;
use tokio::net::TcpListener;
use tonic::codegen::Service;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic::Status;

use crate::ca::service::Auth;
use crate::ca::streams::Authenticated;
use crate::discovery::server::Discovery;
use crate::lrs::LoadReports;
use v3::{Ads, Lrs, Server};

/// The certificate service's paths.
const CERTIFICATES_PATH: &str = "/minimesh.v1.CertificateService/";

/// The largest request message a stream accepts (gRPC's usual 4 MiB); a
/// larger one ends its stream with RESOURCE_EXHAUSTED naming both sizes.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Flow-control window of each stream: how much unread request data one
/// stream may have in flight. A load report of a few hundred endpoints fits;
/// a larger one waits one round trip for a window update. The window, not
/// the message limit, bounds what a client that sends faster than the
/// control plane reads can make it hold.
const STREAM_WINDOW: u32 = 64 << 10;

/// Flow-control window of a connection: both streams' windows at once.
const CONNECTION_WINDOW: u32 = 2 * STREAM_WINDOW;

/// HTTP/2's default frame size; a larger one would size every connection's
/// read buffer up for messages that are rarely that large.
const MAX_FRAME_BYTES: u32 = 16 << 10;

/// A request's header list: a gRPC call's headers are a few hundred bytes.
const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;

/// Streams one connection may have open: a sidecar opens two, Envoy or a
/// gRPC client one ADS and one LRS stream. More are refused (REFUSED_STREAM).
const MAX_CONCURRENT_STREAMS: u32 = 16;

/// Streams a client may open and reset before the server has even accepted
/// them (the HTTP/2 "rapid reset" attack, CVE-2023-44487): past this many
/// at once, h2 closes the connection with GOAWAY(ENHANCE_YOUR_CALM). h2's
/// own default, stated here so that a change of default is a change here.
const MAX_PENDING_ACCEPT_RESETS: usize = 20;

/// Streams the server may reset for a client's protocol errors before it
/// closes the connection (h2's "MadeYouReset" guard; hyper's default).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// A ping every this long on each connection finds a sidecar that vanished
/// without a FIN (a node that lost power, a dropped NAT entry) ...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// ... and closes its connection when the ping goes unanswered this long.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// After a shutdown signal, how long connections are given to receive their
/// GOAWAY before the server stops waiting for their streams, which never end
/// by themselves (clients reconnect, to another replica if there is one).
const SHUTDOWN_GRACE: Duration = Duration::from_millis(200);

/// Serves discovery and load reports on `listener` until `shutdown`
/// resolves.
pub async fn serve(
    listener: TcpListener,
    discovery: Discovery,
    reports: LoadReports,
    certificates: Option<crate::ca::service::Certificates>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let routes = Routes::new(
        AggregatedDiscoveryServiceServer::new(discovery.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
    )
    .add_service(
        LoadReportingServiceServer::new(reports.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
    )
    // Envoy's xDS v3 and LRS, from the same cache and aggregator.
    .add_service(Server(Ads(discovery)))
    .add_service(Server(Lrs(reports)));
    let auth = certificates.as_ref().map(|c| c.auth.clone());
    let routes = match certificates {
        Some(c) => routes.add_service(CertificateServiceServer::new(c)),
        None => routes,
    }
    .prepare();
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(());
    };
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let server = builder
        .accept_http1(false)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .http2_adaptive_window(Some(false))
        .max_frame_size(MAX_FRAME_BYTES)
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESETS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .serve_with_incoming_shutdown(NamedPaths(routes, auth), incoming, signal);
    tokio::select! {
        served = server => served,
        _ = async {
            if stopping_rx.await.is_ok() {
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } else {
                std::future::pending::<()>().await;
            }
        } => Ok(()),
    }
}

/// The routes, with a call to a service or method they do not serve
/// answered UNIMPLEMENTED naming the path (tonic's own answer names
/// nothing, which leaves a client's operator guessing at a typo).
#[derive(Clone)]
struct NamedPaths(Routes, Option<Arc<Auth>>);

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, Infallible>> + Send>>;

impl<B> Service<http::Request<B>> for NamedPaths
where
    B: Send + 'static,
    Routes:
        Service<http::Request<B>, Response = http::Response<tonic::body::Body>, Error = Infallible>,
    <Routes as Service<http::Request<B>>>::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let path = request.uri().path().to_string();
        // The certificate service checks its own callers.
        let auth = self
            .1
            .clone()
            .filter(|_| !path.starts_with(CERTIFICATES_PATH));
        let Some(auth) = auth else {
            return Box::pin(named(self.0.call(request), path));
        };
        // The routes were made ready for this call: take them along, and
        // leave a fresh clone (to be made ready) for the next.
        let ready = self.0.clone();
        let mut routes = std::mem::replace(&mut self.0, ready);
        Box::pin(async move {
            let service = if path.contains("LoadReporting") || path.contains("LoadStats") {
                "load_reports"
            } else {
                "discovery"
            };
            let metadata = tonic::metadata::MetadataMap::from_headers(request.headers().clone());
            match auth.check(service, &metadata, peer_ip(&request)).await {
                Ok(who) => {
                    request.extensions_mut().insert(Authenticated { who, auth });
                }
                Err(status) => return Ok(status.into_http()),
            }
            named(routes.call(request), path).await
        })
    }
}

/// The caller's address, as tonic records it for the connection (over TLS
/// or not).
fn peer_ip<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = request.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(|i| i.remote_addr())
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
        .map(|a| a.ip())
}

/// A call's response, with UNIMPLEMENTED naming the path.
async fn named<F>(
    response: F,
    path: String,
) -> Result<http::Response<tonic::body::Body>, Infallible>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, Infallible>>,
{
    let response = response.await?;
    let headers = response.headers();
    let unimplemented = headers
        .get(Status::GRPC_STATUS)
        .is_some_and(|s| s.as_bytes() == b"12");
    if unimplemented && !headers.contains_key(Status::GRPC_MESSAGE) {
        return Ok(Status::unimplemented(format!("no service serves {path}")).into_http());
    }
    Ok(response)
}
