//! The aggregated discovery service. Each stream is a [`Session`]: it reads
//! requests (subscriptions, ACKs, NACKs) and watches the cache, and sends
//! each stream only what changed for its subscriptions.
//!
//! Semantics (Envoy's xDS): a request whose `response_nonce` is not the last
//! nonce sent for its type is stale and ignored; a request with
//! `error_detail` NACKs the last response, and that version is not sent
//! again; the next change produces a new version.

use crate::ca::streams::checked;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use futures_util::Stream;
use minimesh_proto::v1::aggregated_discovery_service_server::AggregatedDiscoveryService;
use minimesh_proto::v1::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    ErrorDetail, Node, Resource,
};
use minimesh_proto::{xds_v3, ALL_TYPES, ENDPOINTS_TYPE, PARTIAL_ENDPOINTS};
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use super::metrics::Metrics;
use super::registry::{now_ms, Nack, Registry, StreamHandle, TypeMap};
use super::session::{drive, BoxStream, Session};
use crate::cache::{fnv, Snapshot, TypeSnapshot};

/// The discovery service.
#[derive(Clone)]
pub struct Discovery {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
}

impl Discovery {
    /// A service reading `snapshots` and recording into `registry`.
    pub fn new(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Discovery {
            snapshots,
            registry,
            metrics,
        }
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Discovery {
    type StreamAggregatedResourcesStream = BoxStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = BoxStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        Ok(Response::new(self.sotw(checked(request, "discovery"))))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Ok(Response::new(self.delta(checked(request, "discovery"))))
    }
}

impl Discovery {
    /// A state-of-the-world stream answering the requests of `inbound`.
    pub(crate) fn sotw<I>(&self, inbound: I) -> BoxStream<DiscoveryResponse>
    where
        I: Stream<Item = Result<DiscoveryRequest, Status>> + Send + Unpin + 'static,
    {
        self.open::<Sotw, _>(inbound, Encoding::Minimesh)
    }

    /// A state-of-the-world stream serving Envoy's resources (xDS v3); its
    /// envelopes are converted by the caller ([`super::v3`]).
    pub(crate) fn sotw_v3<I>(&self, inbound: I) -> BoxStream<DiscoveryResponse>
    where
        I: Stream<Item = Result<DiscoveryRequest, Status>> + Send + Unpin + 'static,
    {
        self.open::<Sotw, _>(inbound, Encoding::EnvoyV3)
    }

    /// An incremental stream serving Envoy's resources (xDS v3).
    pub(crate) fn delta_v3<I>(&self, inbound: I) -> BoxStream<DeltaDiscoveryResponse>
    where
        I: Stream<Item = Result<DeltaDiscoveryRequest, Status>> + Send + Unpin + 'static,
    {
        self.open::<Delta, _>(inbound, Encoding::EnvoyV3)
    }

    /// A delta stream answering the requests of `inbound`.
    pub(crate) fn delta<I>(&self, inbound: I) -> BoxStream<DeltaDiscoveryResponse>
    where
        I: Stream<Item = Result<DeltaDiscoveryRequest, Status>> + Send + Unpin + 'static,
    {
        self.open::<Delta, _>(inbound, Encoding::Minimesh)
    }

    /// A stream of protocol `P` reading the client's requests from `inbound`.
    fn open<P, I>(&self, inbound: I, encoding: Encoding) -> BoxStream<P::Response>
    where
        P: Protocol,
        I: Stream<Item = Result<P::Request, Status>> + Send + Unpin + 'static,
    {
        self.metrics.connected.inc();
        let (served, name) = match encoding {
            Encoding::Minimesh => (&ALL_TYPES[..], P::NAME),
            Encoding::EnvoyV3 => (&xds_v3::ALL_TYPES[..], P::V3_NAME),
        };
        let stream = XdsStream::<P> {
            served,
            ledger: Ledger {
                handle: self.registry.connect(name),
                metrics: self.metrics.clone(),
                nonce: 0,
            },
            types: TypeMap::default(),
            partial_endpoints: false,
            namespace: None,
        };
        drive(stream, inbound, self.snapshots.clone())
    }
}

/// Which resources a stream serves: minimesh's own, or Envoy's (xDS v3).
/// Both come from the same cache and the same translation.
#[derive(Clone, Copy)]
enum Encoding {
    Minimesh,
    EnvoyV3,
}

/// What differs between the state-of-the-world and the delta protocol; the
/// rest (the registry, metrics, nonces, ACK/NACK bookkeeping) is
/// [`XdsStream`]'s.
trait Protocol: Send + Unpin + Sized + 'static {
    /// As the registry and `/debug/proxies` name it.
    const NAME: &'static str;
    /// The same, for a stream of Envoy's resources.
    const V3_NAME: &'static str;
    type Request: Send + 'static;
    type Response: Send + Unpin + 'static;
    /// What the stream knows of one resource type.
    type State: Default + Send + Unpin + 'static;

    fn request(
        stream: &mut XdsStream<Self>,
        req: Self::Request,
        snap: &Snapshot,
        out: &mut VecDeque<Self::Response>,
    ) -> Result<(), Status>;

    /// Sends type `t` if the client lacks some of it (always if `force`).
    fn push(
        stream: &mut XdsStream<Self>,
        t: &'static str,
        snap: &Snapshot,
        force: bool,
        out: &mut VecDeque<Self::Response>,
    );
}

/// One discovery stream of either protocol.
struct XdsStream<P: Protocol> {
    /// The type URLs this stream serves, in push order.
    served: &'static [&'static str],
    ledger: Ledger,
    types: TypeMap<P::State>,
    /// The client keeps endpoint assignments a state-of-the-world response
    /// leaves out ([`PARTIAL_ENDPOINTS`] in its node's features).
    partial_endpoints: bool,
    /// The client's namespace: what it may see of services exported to
    /// some namespaces only.
    namespace: Option<String>,
}

/// What a stream records of itself, whatever its protocol: its entry in the
/// registry (`/debug/proxies`), the metrics, the last nonce.
struct Ledger {
    handle: StreamHandle,
    metrics: Arc<Metrics>,
    nonce: u64,
}

impl<P: Protocol> Session for XdsStream<P> {
    type Request = P::Request;
    type Response = P::Response;
    type Watched = Arc<Snapshot>;

    fn on_request(
        &mut self,
        req: P::Request,
        snap: &Arc<Snapshot>,
        out: &mut VecDeque<P::Response>,
    ) -> Result<(), Status> {
        P::request(self, req, snap, out)
    }

    fn on_change(&mut self, snap: &Arc<Snapshot>, out: &mut VecDeque<P::Response>) {
        // Clusters before endpoints before routes, as xDS orders pushes.
        for &t in self.served {
            if self.types.contains_key(t) {
                P::push(self, t, snap, false, out);
            }
        }
    }

    fn on_end(&mut self) {
        self.ledger.metrics.connected.dec();
    }
}

impl<P: Protocol> XdsStream<P> {
    /// Whether a state-of-the-world response of type `t` may carry only the
    /// resources that changed since the client's last ACK: minimesh's
    /// endpoint assignments for a client with [`PARTIAL_ENDPOINTS`]; Envoy's
    /// for every xDS v3 client, whose protocol requires it to keep the
    /// assignments a response leaves out (only listeners and clusters are
    /// sent whole).
    fn partial(&self, t: &str) -> bool {
        (t == ENDPOINTS_TYPE && self.partial_endpoints) || t == xds_v3::ENDPOINTS_TYPE
    }

    /// What every request starts with: the node it names (the first of a
    /// stream does), its type, and whether it is the first for that type.
    fn begin(
        &mut self,
        node: Option<&Node>,
        type_url: &str,
    ) -> Result<(&'static str, bool), Status> {
        if let Some(node) = node {
            self.ledger.handle.set_node(node);
            self.partial_endpoints = node.client_features.iter().any(|f| f == PARTIAL_ENDPOINTS);
            self.namespace = Some(node.namespace.clone()).filter(|n| !n.is_empty());
        }
        let t = known_type(type_url, self.served)?;
        Ok((t, !self.types.contains_key(t)))
    }
}

impl Ledger {
    /// Records a request's reply (`nonce`) to the last response of type
    /// `t`, sent with `sent_nonce` and `sent_version`: an ACK of `acked` or,
    /// with `error`, a NACK; a request with no nonce replies to nothing (a
    /// first request). False if the reply is to an older response (stale:
    /// ignore the request).
    fn reply(
        &self,
        t: &'static str,
        sent_nonce: Option<&str>,
        sent_version: Option<&str>,
        nonce: &str,
        acked: &str,
        error: Option<&ErrorDetail>,
    ) -> bool {
        if nonce.is_empty() {
            return true;
        }
        if sent_nonce != Some(nonce) {
            debug!(type_url = t, nonce, "stale request ignored");
            return false;
        }
        if let Some(err) = error {
            let version = sent_version.unwrap_or_default().to_string();
            warn!(type_url = t, %version, reason = err.message, "proxy rejected config (NACK)");
            self.metrics.nack(t);
            self.handle.update(t, |s| {
                s.last_nack = Some(Nack {
                    version,
                    message: err.message.clone(),
                    at_ms: now_ms(),
                })
            });
        } else {
            let v = acked.to_string();
            self.handle.update(t, |s| s.acked = Some(v));
        }
        true
    }

    /// Counts a push of `version` of type `t`; its nonce.
    fn pushed(&mut self, t: &'static str, version: &str) -> String {
        self.nonce += 1;
        self.metrics.push(t);
        let v = version.to_string();
        self.handle.update(t, |s| {
            s.sent = Some(v);
            s.pushes += 1;
        });
        self.nonce.to_string()
    }
}

fn known_type(type_url: &str, served: &[&'static str]) -> Result<&'static str, Status> {
    served
        .iter()
        .find(|t| **t == type_url)
        .copied()
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "unknown type_url {type_url:?}; this control plane serves {}",
                served.join(", ")
            ))
        })
}

// ------------------------------------------------------------ state of the world

#[derive(Default)]
struct SotwType {
    /// None: wildcard.
    names: Option<BTreeSet<String>>,
    sent_version: Option<String>,
    nonce: Option<String>,
    /// The snapshot generation of the last response sent.
    sent_generation: u64,
    /// The generation the client last ACKed: what it holds (partial
    /// endpoints only).
    acked_generation: Option<u64>,
}

/// The state-of-the-world protocol: every response carries every
/// subscribed resource of its type, except endpoint assignments to a
/// client with the partial-endpoints feature, and to every xDS v3 client
/// (see `XdsStream::partial`): those that changed since the
/// generation it last ACKed (every one on its first request or a new
/// subscription). Envoy's xDS allows this for every type but listeners and
/// clusters; the client drops an assignment when its cluster goes (the
/// control plane publishes one assignment per cluster, under its name).
struct Sotw;

impl Protocol for Sotw {
    const NAME: &'static str = "sotw";
    const V3_NAME: &'static str = "xds-v3 sotw";
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    type State = SotwType;

    fn request(
        stream: &mut XdsStream<Self>,
        req: DiscoveryRequest,
        snap: &Snapshot,
        out: &mut VecDeque<DiscoveryResponse>,
    ) -> Result<(), Status> {
        let (t, first) = stream.begin(req.node.as_ref(), &req.type_url)?;
        let state = stream.types.entry(t);
        if !stream.ledger.reply(
            t,
            state.nonce.as_deref(),
            state.sent_version.as_deref(),
            &req.response_nonce,
            &req.version_info,
            req.error_detail.as_ref(),
        ) {
            return Ok(());
        }
        if !req.response_nonce.is_empty() && req.error_detail.is_none() {
            state.acked_generation = Some(state.sent_generation);
        }
        let names = if req.resource_names.is_empty() {
            None
        } else {
            Some(req.resource_names.iter().cloned().collect())
        };
        let resubscribed = names != state.names;
        state.names = names;
        if first || resubscribed {
            Self::push(stream, t, snap, true, out);
        }
        Ok(())
    }

    fn push(
        stream: &mut XdsStream<Self>,
        t: &'static str,
        snap: &Snapshot,
        force: bool,
        out: &mut VecDeque<DiscoveryResponse>,
    ) {
        let partial = stream.partial(t);
        let namespace = stream.namespace.as_deref();
        let Some(state) = stream.types.get_mut(t) else {
            return;
        };
        let empty = Arc::new(TypeSnapshot::default());
        let ts = snap.get(t).unwrap_or(&empty);
        // Entries changed after `since` are sent; all when None.
        let since = match (force, partial) {
            (false, true) => state.acked_generation,
            _ => None,
        };
        let lacks = |e: &crate::cache::Entry| since.is_none_or(|g| e.changed > g);
        let (version, resources) = match &state.names {
            None => (
                ts.version_for(namespace),
                ts.iter_for(namespace)
                    .filter(|(_, e)| lacks(e))
                    .map(|(_, e)| e.any.clone())
                    .collect::<Vec<_>>(),
            ),
            Some(names) => {
                let mut set = Vec::new();
                let mut out = Vec::new();
                for n in names {
                    if let Some(e) = ts.get_for(n, namespace) {
                        set.extend_from_slice(n.as_bytes());
                        set.extend_from_slice(e.version.as_bytes());
                        if lacks(e) {
                            out.push(e.any.clone());
                        }
                    }
                }
                (fnv(&set), out)
            }
        };
        if !force && state.sent_version.as_deref() == Some(version.as_str()) {
            return;
        }
        state.sent_version = Some(version.clone());
        state.sent_generation = snap.generation;
        let nonce = stream.ledger.pushed(t, &version);
        state.nonce = Some(nonce.clone());
        out.push_back(DiscoveryResponse {
            version_info: version,
            resources,
            type_url: t.to_string(),
            nonce,
        });
    }
}

// ------------------------------------------------------------------- delta

#[derive(Default)]
struct DeltaType {
    wildcard: bool,
    names: BTreeSet<String>,
    /// What the client has: name -> version.
    client: BTreeMap<String, String>,
    nonce: Option<String>,
    sent_version: Option<String>,
}

/// The incremental protocol: responses carry what changed and what was
/// removed, by name.
struct Delta;

/// Resource names of one type that one delta stream may subscribe to, or
/// say it has: far beyond any mesh's services, and a bound on what one
/// client can make the control plane hold (names it subscribes to are kept
/// even when no such resource exists).
pub const MAX_DELTA_NAMES: usize = 100_000;

fn too_many_names(t: &str) -> Status {
    Status::resource_exhausted(format!(
        "more than {MAX_DELTA_NAMES} resource names of type {t} on one stream"
    ))
}

impl Protocol for Delta {
    const NAME: &'static str = "delta";
    const V3_NAME: &'static str = "xds-v3 delta";
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    type State = DeltaType;

    fn request(
        stream: &mut XdsStream<Self>,
        req: DeltaDiscoveryRequest,
        snap: &Snapshot,
        out: &mut VecDeque<DeltaDiscoveryResponse>,
    ) -> Result<(), Status> {
        let (t, first) = stream.begin(req.node.as_ref(), &req.type_url)?;
        let state = stream.types.entry(t);
        if first {
            if req.initial_resource_versions.len() > MAX_DELTA_NAMES {
                return Err(too_many_names(t));
            }
            // Envoy's legacy rule: a first request naming nothing is a wildcard.
            state.wildcard = req.resource_names_subscribe.is_empty();
            state.client = req.initial_resource_versions.clone().into_iter().collect();
        }
        // A delta ACK names no version: it is the one last sent.
        let sent = state.sent_version.as_deref();
        if !stream.ledger.reply(
            t,
            state.nonce.as_deref(),
            sent,
            &req.response_nonce,
            sent.unwrap_or_default(),
            req.error_detail.as_ref(),
        ) {
            return Ok(());
        }
        let mut changed = first;
        for n in &req.resource_names_subscribe {
            if n == "*" {
                changed |= !state.wildcard;
                state.wildcard = true;
            } else {
                changed |= state.names.insert(n.clone());
            }
        }
        if state.names.len() > MAX_DELTA_NAMES {
            return Err(too_many_names(t));
        }
        for n in &req.resource_names_unsubscribe {
            if n == "*" {
                state.wildcard = false;
            } else {
                state.names.remove(n);
                if !state.wildcard {
                    state.client.remove(n);
                }
            }
        }
        if changed {
            Self::push(stream, t, snap, first, out);
        }
        Ok(())
    }

    fn push(
        stream: &mut XdsStream<Self>,
        t: &'static str,
        snap: &Snapshot,
        always: bool,
        out: &mut VecDeque<DeltaDiscoveryResponse>,
    ) {
        let namespace = stream.namespace.as_deref();
        let Some(state) = stream.types.get_mut(t) else {
            return;
        };
        let empty = Arc::new(TypeSnapshot::default());
        let ts = snap.get(t).unwrap_or(&empty);
        let mut resources = Vec::new();
        for (name, entry) in ts.iter_for(namespace) {
            if !(state.wildcard || state.names.contains(name)) {
                continue;
            }
            if state.client.get(name) != Some(&entry.version) {
                resources.push(Resource {
                    name: name.clone(),
                    version: entry.version.clone(),
                    resource: Some(entry.any.clone()),
                });
            }
        }
        let removed: Vec<String> = state
            .client
            .keys()
            .filter(|n| {
                ts.get_for(n, namespace).is_none() || !(state.wildcard || state.names.contains(*n))
            })
            .cloned()
            .collect();
        if resources.is_empty() && removed.is_empty() && !always {
            return;
        }
        for r in &resources {
            state.client.insert(r.name.clone(), r.version.clone());
        }
        for n in &removed {
            state.client.remove(n);
        }
        let version = ts.version_for(namespace);
        state.sent_version = Some(version.clone());
        let nonce = stream.ledger.pushed(t, &version);
        state.nonce = Some(nonce.clone());
        if !resources.is_empty() || !removed.is_empty() {
            info!(
                type_url = t,
                changed = resources.len(),
                removed = removed.len(),
                "delta push"
            );
        }
        out.push_back(DeltaDiscoveryResponse {
            system_version_info: version,
            resources,
            type_url: t.to_string(),
            removed_resources: removed,
            nonce,
        });
    }
}
