//! Subscribes to every resource type, validates what arrives, and swaps in a
//! new routing table for each accepted response. A response with anything
//! this sidecar cannot use is NACKed as a whole with the reason, and the last
//! good config stays in force. Losing the control plane changes nothing for
//! requests: the last config keeps serving while the client reconnects.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use minimesh_proto::prost::Message;
use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, DiscoveryRequest, DiscoveryResponse, ErrorDetail, Node, Route,
};
use minimesh_proto::v1::{MtlsMode, PeerAuthentication};
use minimesh_proto::{
    ALL_TYPES, AUTHZ_TYPE, CLUSTER_TYPE, ENDPOINTS_TYPE, PEER_AUTH_TYPE, ROUTE_TYPE,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{info, warn};

use crate::balance::rng;
use crate::routing::{
    validate_cluster, validate_endpoints, validate_route, HostAliases, Resources, Routing,
};

/// First reconnect delay; doubles up to [`MAX_BACKOFF`], each delay jittered
/// to between half and all of it so that sidecars do not reconnect in step.
const BASE_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// The discovery client of one sidecar.
pub struct XdsClient {
    /// `http://host:port` of the control plane.
    pub address: String,
    /// The connection to the control plane, shared with load reporting.
    pub channel: tonic::transport::Channel,
    /// Largest response accepted (`--xds-max-message-size`).
    pub max_message_size: usize,
    /// This proxy's identity.
    pub node: Node,
    /// Extra host names (gateway mode).
    pub aliases: HostAliases,
    /// Where accepted config goes.
    pub routing: Arc<ArcSwap<Routing>>,
    /// Set once every type has been received.
    pub ready: Arc<AtomicBool>,
    /// Where the AuthorizationPolicies that apply to this workload go.
    pub authz: Arc<crate::authz::Shared>,
    /// Connection settings of clusters whose rule sets none.
    pub pool_defaults: crate::pool::PoolSettings,
    /// The workload's token (`--token-file`), sent when the file exists.
    pub token_file: std::path::PathBuf,
    /// The sidecar's mutual TLS: the inbound mode is set here; its mesh
    /// TLS dials the endpoints that run a sidecar.
    pub tls: Arc<crate::tls::Tls>,
    /// How many event loops serve the proxy listeners.
    pub event_loops: usize,
}

impl XdsClient {
    /// Runs forever, reconnecting as needed.
    pub async fn run(self) {
        let mut resources = Resources::of_sidecar(self.tls.mesh().cloned(), self.event_loops);
        let mut health = crate::health::HealthCheckers::default();
        let mut versions: BTreeMap<&'static str, String> = BTreeMap::new();
        let mut backoff = BASE_BACKOFF;
        loop {
            match self
                .session(&mut resources, &mut versions, &mut health)
                .await
            {
                Ok(true) => backoff = BASE_BACKOFF,
                Ok(false) => {}
                Err(e)
                    if e.downcast_ref::<tonic::Status>()
                        .is_some_and(|s| s.code() == tonic::Code::OutOfRange) =>
                {
                    warn!(control_plane = %self.address, limit = self.max_message_size, error = %e,
                        "a discovery response is larger than --xds-max-message-size; raise it (MINIMESH_XDS_MAX_MESSAGE_SIZE); keeping the last config")
                }
                Err(e) => {
                    warn!(control_plane = %self.address, error = %e, "discovery stream failed; keeping the last config")
                }
            }
            let half = backoff.as_millis() as u64 / 2;
            let delay = Duration::from_millis(half + (rng::next() % (half + 1)));
            tokio::time::sleep(delay).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One stream. Ok(true) when it got at least one response (so the next
    /// reconnect starts from the base backoff).
    async fn session(
        &self,
        resources: &mut Resources,
        versions: &mut BTreeMap<&'static str, String>,
        health: &mut crate::health::HealthCheckers,
    ) -> anyhow::Result<bool> {
        let mut client = AggregatedDiscoveryServiceClient::new(self.channel.clone())
            .max_decoding_message_size(self.max_message_size);
        let (tx, rx) = mpsc::channel(16);
        for t in ALL_TYPES {
            tx.send(DiscoveryRequest {
                version_info: versions.get(t).cloned().unwrap_or_default(),
                node: Some(self.node.clone()),
                type_url: t.to_string(),
                ..Default::default()
            })
            .await?;
        }
        let mut inbound = client
            .stream_aggregated_resources({
                let mut req = tonic::Request::new(ReceiverStream::new(rx));
                crate::identity::authorize(&mut req, &self.token_file);
                req
            })
            .await?
            .into_inner();
        info!(control_plane = %self.address, "discovery stream open");
        let mut got_any = false;
        let mut received: BTreeMap<&'static str, bool> = BTreeMap::new();
        while let Some(resp) = inbound.message().await? {
            got_any = true;
            let Some(t) = ALL_TYPES.iter().copied().find(|t| *t == resp.type_url) else {
                warn!(
                    type_url = resp.type_url,
                    "ignoring response of a type never requested"
                );
                continue;
            };
            let applied = if t == PEER_AUTH_TYPE {
                inbound_mode(&resp, &self.node.namespace)
                    .map(|mode| self.tls.set_inbound_mode(mode))
            } else if t == AUTHZ_TYPE {
                decode_all::<minimesh_proto::v1::Authorization>(&resp).map(|all| {
                    let a = crate::authz::Authz::compile(
                        &all,
                        &self.node.namespace,
                        &self.aliases.labels,
                    );
                    let (deny, allow) = a.counts();
                    info!(deny, allow, "authorization policies applied");
                    self.authz.set(a);
                })
            } else {
                apply(t, &resp, resources)
            };
            let req = match applied {
                Ok(()) => {
                    versions.insert(t, resp.version_info.clone());
                    received.insert(t, true);
                    let routing = resources.build(&self.node, &self.aliases, &self.pool_defaults);
                    info!(
                        type_url = t,
                        version = resp.version_info,
                        clusters = routing.clusters.len(),
                        "config applied"
                    );
                    self.routing.store(Arc::new(routing));
                    health.reconcile(resources.clusters(), &self.routing);
                    // Ready with routing and the authorization policies
                    // (until they arrive, the inbound listener lets nothing
                    // in); a control plane that serves no PeerAuthentication
                    // (an older one) leaves PERMISSIVE.
                    if [CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE, AUTHZ_TYPE]
                        .iter()
                        .all(|t| received.contains_key(t))
                    {
                        self.ready.store(true, Ordering::Relaxed);
                    }
                    DiscoveryRequest {
                        version_info: resp.version_info.clone(),
                        node: None,
                        type_url: t.to_string(),
                        response_nonce: resp.nonce.clone(),
                        ..Default::default()
                    }
                }
                Err(reason) => {
                    warn!(type_url = t, version = resp.version_info, %reason, "rejecting config (NACK); the last good config stays");
                    DiscoveryRequest {
                        version_info: versions.get(t).cloned().unwrap_or_default(),
                        node: None,
                        type_url: t.to_string(),
                        response_nonce: resp.nonce.clone(),
                        error_detail: Some(ErrorDetail {
                            code: 3,
                            message: reason,
                        }),
                        ..Default::default()
                    }
                }
            };
            tx.send(req).await?;
        }
        info!(control_plane = %self.address, "discovery stream closed by the control plane");
        Ok(got_any)
    }
}

/// The inbound listener's mutual TLS mode for a proxy of `namespace`: its
/// namespace's PeerAuthentication, else the mesh-wide one, else PERMISSIVE.
fn inbound_mode(resp: &DiscoveryResponse, namespace: &str) -> Result<MtlsMode, String> {
    let items: Vec<PeerAuthentication> = decode_all(resp)?;
    let set = |p: &PeerAuthentication| {
        MtlsMode::try_from(p.mode)
            .ok()
            .filter(|m| *m != MtlsMode::Unset)
    };
    let own = items
        .iter()
        .find(|p| p.namespace == namespace)
        .and_then(set);
    let mesh = items.iter().find(|p| p.mesh_wide).and_then(set);
    Ok(own.or(mesh).unwrap_or(MtlsMode::MtlsPermissive))
}

fn decode_all<M: Message + Default>(resp: &DiscoveryResponse) -> Result<Vec<M>, String> {
    resp.resources
        .iter()
        .map(|any| {
            if any.type_url != resp.type_url {
                return Err(format!(
                    "resource of type {} in a {} response",
                    any.type_url, resp.type_url
                ));
            }
            M::decode(any.value.as_slice()).map_err(|e| format!("cannot decode resource: {e}"))
        })
        .collect()
}

/// Validates a whole response and, only if all of it is usable, applies it:
/// clusters and routes are replaced; endpoint assignments are replaced by
/// name and the others kept (the node announces
/// [`minimesh_proto::PARTIAL_ENDPOINTS`], so the control plane sends those
/// that changed), and an assignment goes when its cluster does.
fn apply(t: &str, resp: &DiscoveryResponse, res: &mut Resources) -> Result<(), String> {
    match t {
        CLUSTER_TYPE => {
            let items: Vec<Cluster> = decode_all(resp)?;
            let mut errors = Vec::new();
            for c in &items {
                if let Err(e) = validate_cluster(c) {
                    errors.push(format!("cluster {}: {e}", c.name));
                }
            }
            if !errors.is_empty() {
                return Err(errors.join("; "));
            }
            res.set_clusters(items);
        }
        ENDPOINTS_TYPE => {
            let items: Vec<ClusterLoadAssignment> = decode_all(resp)?;
            let mut errors = Vec::new();
            for c in &items {
                if let Err(e) = validate_endpoints(c) {
                    errors.push(format!("endpoints of {}: {e}", c.cluster_name));
                }
            }
            if !errors.is_empty() {
                return Err(errors.join("; "));
            }
            res.set_endpoints(items);
        }
        ROUTE_TYPE => {
            let items: Vec<Route> = decode_all(resp)?;
            let errors: Vec<String> = items
                .iter()
                .filter_map(|r| {
                    validate_route(r)
                        .err()
                        .map(|e| format!("route {}.{}: {e}", r.service, r.namespace))
                })
                .collect();
            if !errors.is_empty() {
                return Err(errors.join("; "));
            }
            res.set_routes(items);
        }
        _ => return Err(format!("unknown type {t}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimesh_proto::to_any;
    use minimesh_proto::v1::Endpoint;

    fn response(t: &str, items: &[impl Message]) -> DiscoveryResponse {
        DiscoveryResponse {
            version_info: "v".into(),
            resources: items.iter().map(|m| to_any(t, m)).collect(),
            type_url: t.into(),
            nonce: "1".into(),
        }
    }

    fn cluster(name: &str) -> Cluster {
        Cluster {
            name: name.into(),
            ..Default::default()
        }
    }

    fn assignment(cluster: &str, addresses: &[&str]) -> ClusterLoadAssignment {
        ClusterLoadAssignment {
            cluster_name: cluster.into(),
            endpoints: addresses
                .iter()
                .map(|a| Endpoint {
                    address: a.to_string(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn held(res: &Resources) -> Vec<(String, usize)> {
        res.endpoints()
            .iter()
            .map(|(n, c)| (n.clone(), c.endpoints.len()))
            .collect()
    }

    #[test]
    fn a_namespace_mode_overrides_the_mesh_wide_one() {
        let pa = |ns: &str, mode: MtlsMode, mesh_wide| PeerAuthentication {
            namespace: ns.into(),
            mode: mode as i32,
            mesh_wide,
        };
        let mesh = pa("minimesh-system", MtlsMode::MtlsStrict, true);
        let both = response(
            PEER_AUTH_TYPE,
            &[mesh.clone(), pa("web", MtlsMode::MtlsPermissive, false)],
        );
        assert_eq!(inbound_mode(&both, "web"), Ok(MtlsMode::MtlsPermissive));
        assert_eq!(inbound_mode(&both, "other"), Ok(MtlsMode::MtlsStrict));
        let unset = response(PEER_AUTH_TYPE, &[mesh, pa("web", MtlsMode::Unset, false)]);
        assert_eq!(inbound_mode(&unset, "web"), Ok(MtlsMode::MtlsStrict));
        let none = response(PEER_AUTH_TYPE, &[] as &[PeerAuthentication]);
        assert_eq!(inbound_mode(&none, "web"), Ok(MtlsMode::MtlsPermissive));
    }

    #[test]
    fn an_endpoints_response_replaces_what_it_names_and_a_cluster_takes_its_endpoints_when_it_goes()
    {
        let mut res = Resources::default();
        apply(
            CLUSTER_TYPE,
            &response(CLUSTER_TYPE, &[cluster("x"), cluster("y")]),
            &mut res,
        )
        .expect("clusters");
        let both = [
            assignment("x", &["10.0.0.1:80"]),
            assignment("y", &["10.0.0.2:80", "10.0.0.3:80"]),
        ];
        apply(ENDPOINTS_TYPE, &response(ENDPOINTS_TYPE, &both), &mut res).expect("endpoints");
        assert_eq!(held(&res), [("x".into(), 1), ("y".into(), 2)]);

        // Only x changed: y is kept as it was.
        let x = [assignment("x", &["10.0.0.1:80", "10.0.0.4:80"])];
        apply(ENDPOINTS_TYPE, &response(ENDPOINTS_TYPE, &x), &mut res).expect("endpoints");
        assert_eq!(held(&res), [("x".into(), 2), ("y".into(), 2)]);

        // A response with a bad assignment changes nothing.
        let bad = [assignment("x", &["nowhere"])];
        let err = apply(ENDPOINTS_TYPE, &response(ENDPOINTS_TYPE, &bad), &mut res)
            .expect_err("a bad address");
        assert_eq!(
            err,
            "endpoints of x: endpoint address \"nowhere\" is not ip:port"
        );
        assert_eq!(held(&res), [("x".into(), 2), ("y".into(), 2)]);

        // y's cluster goes: so do its endpoints.
        apply(
            CLUSTER_TYPE,
            &response(CLUSTER_TYPE, &[cluster("x")]),
            &mut res,
        )
        .expect("clusters");
        assert_eq!(held(&res), [("x".into(), 2)]);
    }
}
