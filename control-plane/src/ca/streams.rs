//! Authenticated discovery and load reports: with `--workload-tokens`,
//! every call on the discovery port but the certificate service's carries a
//! token ([`crate::grpc`] checks it before routing), and a proxy may name
//! itself only in its identity's namespace (checked here on every request
//! of the stream: minimesh's protocol, and Envoy's, whose node names its
//! namespace in the metadata key `NAMESPACE`).

use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use tonic::Status;

use super::service::Auth;
use super::Identity;

/// A call's proven identity, put in its request's extensions.
#[derive(Clone)]
pub struct Authenticated {
    /// Who.
    pub who: Identity,
    /// Where refusals are logged and counted.
    pub auth: Arc<Auth>,
}

/// A request that names the proxy's namespace.
pub trait NodeNamespace {
    /// The namespace its node names, if it names a node.
    fn node_namespace(&self) -> Option<&str>;
}

impl NodeNamespace for minimesh_proto::v1::DiscoveryRequest {
    fn node_namespace(&self) -> Option<&str> {
        self.node.as_ref().map(|n| n.namespace.as_str())
    }
}

impl NodeNamespace for minimesh_proto::v1::DeltaDiscoveryRequest {
    fn node_namespace(&self) -> Option<&str> {
        self.node.as_ref().map(|n| n.namespace.as_str())
    }
}

impl NodeNamespace for minimesh_proto::v1::LoadStatsRequest {
    fn node_namespace(&self) -> Option<&str> {
        self.node.as_ref().map(|n| n.namespace.as_str())
    }
}

/// A call's request stream, ended with the refusal at the first request
/// whose node names a namespace other than the call's identity's
/// (unchanged when the call was not authenticated: no CA).
pub fn checked<I, R>(
    request: tonic::Request<I>,
    service: &'static str,
) -> impl Stream<Item = Result<R, Status>> + Send + Unpin + 'static
where
    I: Stream<Item = Result<R, Status>> + Send + Unpin + 'static,
    R: NodeNamespace + Send + 'static,
{
    let caller = request.extensions().get::<Authenticated>().cloned();
    check(caller, request.into_inner(), service)
}

/// The same for a stream already taken from its call (Envoy's, converted
/// to minimesh's messages), with the call's `caller`.
pub fn check<I, R>(
    caller: Option<Authenticated>,
    inbound: I,
    service: &'static str,
) -> impl Stream<Item = Result<R, Status>> + Send + Unpin + 'static
where
    I: Stream<Item = Result<R, Status>> + Send + Unpin + 'static,
    R: NodeNamespace + Send + 'static,
{
    inbound.map(move |r| {
        let (Some(c), Ok(req)) = (&caller, &r) else {
            return r;
        };
        match req.node_namespace() {
            Some(ns) => c.auth.check_namespace(service, &c.who, ns).and(r),
            None => r,
        }
    })
}
