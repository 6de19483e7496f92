//! The versioned resource cache the discovery streams read. Versions are
//! content hashes: a resource keeps its version while it is unchanged, and a
//! restarted control plane hands out the same versions for the same content,
//! so reconnecting delta clients are not sent what they already have.

use std::collections::BTreeMap;
use std::sync::Arc;

use minimesh_proto::v1::ClusterLoadAssignment;
use minimesh_proto::{
    prost::Message, prost_types::Any, to_any, xds_v3, ALL_TYPES, AUTHZ_TYPE, CLUSTER_TYPE,
    ENDPOINTS_TYPE, PEER_AUTH_TYPE, ROUTE_TYPE,
};
use tokio::sync::watch;

use crate::translate::Resources;

/// One resource as sent.
#[derive(Debug, PartialEq)]
pub struct Entry {
    /// Content version (hex of a 64-bit FNV-1a of the encoding).
    pub version: String,
    /// The encoded resource.
    pub any: Any,
    /// The snapshot generation that published this content: a stream
    /// whose client ACKed generation `g` lacks exactly the entries with
    /// `changed > g` (and has entries since removed).
    pub changed: u64,
    /// The namespaces whose proxies may see it (its Service's `exportTo`);
    /// None: every proxy.
    pub visible: Option<Arc<[String]>>,
}

impl Entry {
    /// Whether a proxy of `namespace` (None: unknown) may see this.
    pub fn visible_to(&self, namespace: Option<&str>) -> bool {
        match (&self.visible, namespace) {
            (None, _) => true,
            (Some(to), Some(ns)) => to.iter().any(|n| n == ns),
            (Some(_), None) => false,
        }
    }
}

/// Every resource of one type.
#[derive(Debug, Default, PartialEq)]
pub struct TypeSnapshot {
    /// Version of the whole set.
    pub version: String,
    /// Resources by name.
    pub resources: BTreeMap<String, Arc<Entry>>,
    /// Some resource is visible to some namespaces only: a stream's view
    /// of the set has a version of its own.
    pub restricted: bool,
}

impl TypeSnapshot {
    /// The version of what a proxy of `namespace` sees of this type.
    pub fn version_for(&self, namespace: Option<&str>) -> String {
        if !self.restricted {
            return self.version.clone();
        }
        let mut set = Vec::new();
        for (name, e) in &self.resources {
            if e.visible_to(namespace) {
                set.extend_from_slice(name.as_bytes());
                set.push(0);
                set.extend_from_slice(e.version.as_bytes());
            }
        }
        fnv(&set)
    }
}

/// Every resource of every type, immutable once published.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// By type URL.
    pub types: BTreeMap<&'static str, Arc<TypeSnapshot>>,
    /// Increases with every publication that changed anything.
    pub generation: u64,
}

impl Snapshot {
    /// Every endpoint address of every cluster, by cluster.
    pub fn endpoint_addresses(&self) -> BTreeMap<String, Vec<String>> {
        let mut out = BTreeMap::new();
        if let Some(eps) = self.get(ENDPOINTS_TYPE) {
            for (name, entry) in &eps.resources {
                if let Ok(cla) = ClusterLoadAssignment::decode(entry.any.value.as_slice()) {
                    out.insert(
                        name.clone(),
                        cla.endpoints.into_iter().map(|e| e.address).collect(),
                    );
                }
            }
        }
        out
    }

    /// The resources of a type (empty for an unknown type).
    pub fn get(&self, type_url: &str) -> Option<&Arc<TypeSnapshot>> {
        self.types.get(type_url)
    }
}

/// Holds the current snapshot and tells streams when it changes.
pub struct Cache {
    tx: watch::Sender<Arc<Snapshot>>,
    /// How the xDS v3 encoding is written.
    v3: crate::xds_v3::Options,
}

impl Default for Cache {
    fn default() -> Self {
        let mut snap = Snapshot::default();
        for t in ALL_TYPES.into_iter().chain(xds_v3::ALL_TYPES) {
            snap.types.insert(
                t,
                Arc::new(TypeSnapshot {
                    version: fnv(&[]),
                    ..Default::default()
                }),
            );
        }
        let (tx, _) = watch::channel(Arc::new(snap));
        Cache {
            tx,
            v3: Default::default(),
        }
    }
}

impl Cache {
    /// An empty cache writing the xDS v3 encoding with `v3`.
    pub fn new(v3: crate::xds_v3::Options) -> Self {
        Cache {
            v3,
            ..Cache::default()
        }
    }

    /// A receiver that sees every published snapshot.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// The current snapshot.
    pub fn current(&self) -> Arc<Snapshot> {
        self.tx.borrow().clone()
    }

    /// Publishes `resources`, in minimesh's encoding and Envoy's (xDS v3);
    /// returns true when anything changed (an unchanged set publishes
    /// nothing and wakes no stream).
    pub fn update(&self, resources: &Resources) -> bool {
        let v3 = crate::xds_v3::encode(resources, self.v3);
        let old = self.current();
        let mut next = Snapshot {
            types: BTreeMap::new(),
            generation: old.generation,
        };
        let generation = old.generation + 1;
        let mut changed = false;
        for t in ALL_TYPES.into_iter().chain(xds_v3::ALL_TYPES) {
            let prev = old.types.get(t).map(|p| p.as_ref());
            let new_type = match t {
                CLUSTER_TYPE => build(
                    t,
                    &resources.clusters,
                    prev,
                    generation,
                    &resources.exported,
                ),
                ENDPOINTS_TYPE => build(
                    t,
                    &resources.endpoints,
                    prev,
                    generation,
                    &resources.exported,
                ),
                ROUTE_TYPE => build(t, &resources.routes, prev, generation, &resources.exported),
                PEER_AUTH_TYPE => build_with(t, &resources.peer_auth, prev, generation, |ns| {
                    // A namespace's is its own proxies'; the mesh-wide one
                    // every proxy's.
                    match resources.peer_auth.get(ns) {
                        Some(p) if !p.mesh_wide => Some(Arc::from([ns.to_string()])),
                        _ => None,
                    }
                }),
                AUTHZ_TYPE => build_with(t, &resources.authz, prev, generation, |name| {
                    // A namespace's policy is its own proxies'; one of the
                    // root namespace every proxy's.
                    match resources.authz.get(name) {
                        Some(a) if !a.mesh_wide => Some(Arc::from([a.namespace.clone()])),
                        _ => None,
                    }
                }),
                xds_v3::CLUSTER_TYPE => {
                    build(t, &v3.clusters, prev, generation, &resources.exported)
                }
                xds_v3::ENDPOINTS_TYPE => {
                    build(t, &v3.endpoints, prev, generation, &resources.exported)
                }
                xds_v3::LISTENER_TYPE => {
                    build(t, &v3.listeners, prev, generation, &resources.exported)
                }
                xds_v3::ROUTE_CONFIG_TYPE => {
                    build(t, &v3.routes, prev, generation, &resources.exported)
                }
                _ => unreachable!("the type lists name nine types"),
            };
            match old.types.get(t) {
                Some(prev) if prev.version == new_type.version => {
                    next.types.insert(t, prev.clone());
                }
                _ => {
                    changed = true;
                    next.types.insert(t, Arc::new(new_type));
                }
            }
        }
        if changed {
            next.generation = generation;
            self.tx.send_replace(Arc::new(next));
        }
        changed
    }
}

/// The resources of one type as `generation` publishes them: an entry
/// whose content is as in `prev` is `prev`'s (and keeps its `changed`).
fn build<M: Message>(
    type_url: &str,
    items: &BTreeMap<String, M>,
    prev: Option<&TypeSnapshot>,
    generation: u64,
    exported: &BTreeMap<String, Arc<[String]>>,
) -> TypeSnapshot {
    build_with(type_url, items, prev, generation, |name| {
        crate::translate::service_of(name).and_then(|s| exported.get(s).cloned())
    })
}

/// [`build`], with the namespaces that may see each resource, by name.
fn build_with<M: Message>(
    type_url: &str,
    items: &BTreeMap<String, M>,
    prev: Option<&TypeSnapshot>,
    generation: u64,
    visible_to: impl Fn(&str) -> Option<Arc<[String]>>,
) -> TypeSnapshot {
    let mut resources = BTreeMap::new();
    let mut set = Vec::new();
    let mut restricted = false;
    for (name, msg) in items {
        let any = to_any(type_url, msg);
        let version = fnv(&any.value);
        let visible = visible_to(name);
        set.extend_from_slice(name.as_bytes());
        set.push(0);
        set.extend_from_slice(version.as_bytes());
        if let Some(to) = &visible {
            restricted = true;
            set.push(1);
            for ns in to.iter() {
                set.extend_from_slice(ns.as_bytes());
                set.push(0);
            }
        }
        let entry = match prev.and_then(|p| p.resources.get(name)) {
            Some(e) if e.version == version && e.visible == visible => e.clone(),
            _ => Arc::new(Entry {
                version,
                any,
                changed: generation,
                visible,
            }),
        };
        resources.insert(name.clone(), entry);
    }
    TypeSnapshot {
        version: fnv(&set),
        resources,
        restricted,
    }
}

/// Hex FNV-1a 64 of `bytes`: stable across builds and restarts.
pub fn fnv(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}
