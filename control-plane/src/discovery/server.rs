//! The aggregated discovery service. Each stream is a [`Session`]: it reads
//! requests (subscriptions, ACKs, NACKs) and watches the cache, and sends
//! each stream only what changed for its subscriptions.
//!
//! Semantics (Envoy's xDS): a request whose `response_nonce` is not the last
//! nonce sent for its type is stale and ignored; a request with
//! `error_detail` NACKs the last response, and that version is not sent
//! again; the next change produces a new version.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use minimesh_proto::v1::aggregated_discovery_service_server::AggregatedDiscoveryService;
use minimesh_proto::v1::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use minimesh_proto::ALL_TYPES;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use super::registry::{now_ms, Nack, Registry, StreamHandle, TypeMap};
use super::session::{drive, BoxStream, Session};
use crate::cache::{fnv, Snapshot, TypeSnapshot};
use crate::metrics::Metrics;

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
        self.metrics.connected.inc();
        let stream = SotwStream {
            handle: self.registry.connect("sotw"),
            metrics: self.metrics.clone(),
            types: TypeMap::default(),
            nonce: 0,
        };
        Ok(Response::new(drive(
            stream,
            request.into_inner(),
            self.snapshots.clone(),
        )))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.metrics.connected.inc();
        let stream = DeltaStream {
            handle: self.registry.connect("delta"),
            metrics: self.metrics.clone(),
            types: TypeMap::default(),
            nonce: 0,
        };
        Ok(Response::new(drive(
            stream,
            request.into_inner(),
            self.snapshots.clone(),
        )))
    }
}

fn known_type(type_url: &str) -> Result<&'static str, Status> {
    ALL_TYPES
        .iter()
        .find(|t| **t == type_url)
        .copied()
        .ok_or_else(|| {
            Status::invalid_argument(format!(
                "unknown type_url {type_url:?}; this control plane serves {}",
                ALL_TYPES.join(", ")
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
}

struct SotwStream {
    handle: StreamHandle,
    metrics: Arc<Metrics>,
    types: TypeMap<SotwType>,
    nonce: u64,
}

impl Session for SotwStream {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    type Watched = Arc<Snapshot>;

    fn on_request(
        &mut self,
        req: DiscoveryRequest,
        snap: &Arc<Snapshot>,
        out: &mut VecDeque<DiscoveryResponse>,
    ) -> Result<(), Status> {
        self.request(req, snap, out)
    }

    fn on_change(&mut self, snap: &Arc<Snapshot>, out: &mut VecDeque<DiscoveryResponse>) {
        let types: Vec<&'static str> = self.types.keys().collect();
        for t in types {
            self.maybe_send(t, snap, false, out);
        }
    }

    fn on_end(&mut self) {
        self.metrics.connected.dec();
    }
}

impl SotwStream {
    fn request(
        &mut self,
        req: DiscoveryRequest,
        snap: &Snapshot,
        out: &mut VecDeque<DiscoveryResponse>,
    ) -> Result<(), Status> {
        if let Some(node) = &req.node {
            self.handle.set_node(node);
        }
        let t = known_type(&req.type_url)?;
        let first = !self.types.contains_key(t);
        let state = self.types.entry(t);
        if !req.response_nonce.is_empty() {
            if state.nonce.as_deref() != Some(req.response_nonce.as_str()) {
                debug!(
                    type_url = t,
                    nonce = req.response_nonce,
                    "stale request ignored"
                );
                return Ok(());
            }
            if let Some(err) = &req.error_detail {
                let version = state.sent_version.clone().unwrap_or_default();
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
                let v = req.version_info.clone();
                self.handle.update(t, |s| s.acked = Some(v));
            }
        }
        let names = if req.resource_names.is_empty() {
            None
        } else {
            Some(req.resource_names.iter().cloned().collect())
        };
        let resubscribed = names != state.names;
        state.names = names;
        if first || resubscribed {
            self.maybe_send(t, snap, true, out);
        }
        Ok(())
    }

    fn maybe_send(
        &mut self,
        t: &'static str,
        snap: &Snapshot,
        force: bool,
        out: &mut VecDeque<DiscoveryResponse>,
    ) {
        let Some(state) = self.types.get_mut(t) else {
            return;
        };
        let empty = Arc::new(TypeSnapshot::default());
        let ts = snap.get(t).unwrap_or(&empty);
        let (version, resources) = match &state.names {
            None => (
                ts.version.clone(),
                ts.resources
                    .values()
                    .map(|e| e.any.clone())
                    .collect::<Vec<_>>(),
            ),
            Some(names) => {
                let mut set = Vec::new();
                let mut out = Vec::new();
                for n in names {
                    if let Some(e) = ts.resources.get(n) {
                        set.extend_from_slice(n.as_bytes());
                        set.extend_from_slice(e.version.as_bytes());
                        out.push(e.any.clone());
                    }
                }
                (fnv(&set), out)
            }
        };
        if !force && state.sent_version.as_deref() == Some(version.as_str()) {
            return;
        }
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        state.sent_version = Some(version.clone());
        state.nonce = Some(nonce.clone());
        self.metrics.push(t);
        let v = version.clone();
        self.handle.update(t, |s| {
            s.sent = Some(v);
            s.pushes += 1;
        });
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

struct DeltaStream {
    handle: StreamHandle,
    metrics: Arc<Metrics>,
    types: TypeMap<DeltaType>,
    nonce: u64,
}

impl Session for DeltaStream {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    type Watched = Arc<Snapshot>;

    fn on_request(
        &mut self,
        req: DeltaDiscoveryRequest,
        snap: &Arc<Snapshot>,
        out: &mut VecDeque<DeltaDiscoveryResponse>,
    ) -> Result<(), Status> {
        self.request(req, snap, out)
    }

    fn on_change(&mut self, snap: &Arc<Snapshot>, out: &mut VecDeque<DeltaDiscoveryResponse>) {
        let types: Vec<&'static str> = self.types.keys().collect();
        for t in types {
            self.send_diff(t, snap, false, out);
        }
    }

    fn on_end(&mut self) {
        self.metrics.connected.dec();
    }
}

impl DeltaStream {
    fn request(
        &mut self,
        req: DeltaDiscoveryRequest,
        snap: &Snapshot,
        out: &mut VecDeque<DeltaDiscoveryResponse>,
    ) -> Result<(), Status> {
        if let Some(node) = &req.node {
            self.handle.set_node(node);
        }
        let t = known_type(&req.type_url)?;
        let first = !self.types.contains_key(t);
        let state = self.types.entry(t);
        if first {
            // Envoy's legacy rule: a first request naming nothing is a wildcard.
            state.wildcard = req.resource_names_subscribe.is_empty();
            state.client = req.initial_resource_versions.clone().into_iter().collect();
        }
        if !req.response_nonce.is_empty() {
            if state.nonce.as_deref() != Some(req.response_nonce.as_str()) {
                debug!(
                    type_url = t,
                    nonce = req.response_nonce,
                    "stale delta request ignored"
                );
                return Ok(());
            }
            let version = state.sent_version.clone().unwrap_or_default();
            if let Some(err) = &req.error_detail {
                warn!(
                    type_url = t,
                    reason = err.message,
                    "proxy rejected config (NACK)"
                );
                self.metrics.nack(t);
                self.handle.update(t, |s| {
                    s.last_nack = Some(Nack {
                        version,
                        message: err.message.clone(),
                        at_ms: now_ms(),
                    })
                });
            } else {
                self.handle.update(t, |s| s.acked = Some(version));
            }
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
            self.send_diff(t, snap, first, out);
        }
        Ok(())
    }

    fn send_diff(
        &mut self,
        t: &'static str,
        snap: &Snapshot,
        always: bool,
        out: &mut VecDeque<DeltaDiscoveryResponse>,
    ) {
        let Some(state) = self.types.get_mut(t) else {
            return;
        };
        let empty = Arc::new(TypeSnapshot::default());
        let ts = snap.get(t).unwrap_or(&empty);
        let mut resources = Vec::new();
        for (name, entry) in &ts.resources {
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
                !ts.resources.contains_key(*n) || !(state.wildcard || state.names.contains(*n))
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
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        state.nonce = Some(nonce.clone());
        state.sent_version = Some(ts.version.clone());
        self.metrics.push(t);
        let v = ts.version.clone();
        self.handle.update(t, |s| {
            s.sent = Some(v);
            s.pushes += 1;
        });
        if !resources.is_empty() || !removed.is_empty() {
            info!(
                type_url = t,
                changed = resources.len(),
                removed = removed.len(),
                "delta push"
            );
        }
        out.push_back(DeltaDiscoveryResponse {
            system_version_info: ts.version.clone(),
            resources,
            type_url: t.to_string(),
            removed_resources: removed,
            nonce,
        });
    }
}
