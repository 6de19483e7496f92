//! Authenticated discovery and load reports: with `--workload-tokens`,
//! every call on the discovery port but the certificate service's carries a
//! token ([`crate::grpc`] checks it before routing), and a proxy may name
//! itself only as its identity allows (checked here on every request of the
//! stream: minimesh's protocol, and Envoy's, whose node names its namespace
//! in the metadata key `NAMESPACE`): in its identity's namespace, as the
//! pod its token is bound to (when it is), and with the forwarder's node id
//! prefix only with the control plane's own identity.

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

/// A request that names the proxy (its node).
pub trait NodeNamespace {
    /// The node it names, if it names one.
    fn node(&self) -> Option<&minimesh_proto::v1::Node>;
}

impl NodeNamespace for minimesh_proto::v1::DiscoveryRequest {
    fn node(&self) -> Option<&minimesh_proto::v1::Node> {
        self.node.as_ref()
    }
}

impl NodeNamespace for minimesh_proto::v1::DeltaDiscoveryRequest {
    fn node(&self) -> Option<&minimesh_proto::v1::Node> {
        self.node.as_ref()
    }
}

impl NodeNamespace for minimesh_proto::v1::LoadStatsRequest {
    fn node(&self) -> Option<&minimesh_proto::v1::Node> {
        self.node.as_ref()
    }
}

/// Whose voice a call's load reports are, and its namespace: its proven
/// identity's (None when the call was not authenticated).
pub fn reporter<I>(request: &tonic::Request<I>) -> Option<(String, String)> {
    request
        .extensions()
        .get::<Authenticated>()
        .map(|c| (c.who.reporter(), c.who.namespace.clone()))
}

/// A call's request stream, ended with the refusal at the first request
/// whose node its identity may not name (unchanged when the call was not
/// authenticated: no CA).
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
        match req.node() {
            Some(node) => c.auth.check_node(service, &c.who, node).and(r),
            None => r,
        }
    })
}
