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
    /// Version of the whole set, the namespaces' own entries included.
    pub version: String,
    /// Version of the default view (what a namespace without entries of
    /// its own sees, when nothing is restricted).
    pub base_version: String,
    /// Resources by name, as most namespaces see them.
    pub resources: BTreeMap<String, Arc<Entry>>,
    /// The entries that differ for the proxies of some namespaces (their
    /// DestinationRules differ), by namespace and name; None: the
    /// resource is not there for them.
    pub scoped: BTreeMap<String, BTreeMap<String, Option<Arc<Entry>>>>,
    /// Some resource is visible to some namespaces only: a stream's view
    /// of the set has a version of its own.
    pub restricted: bool,
}

impl TypeSnapshot {
    /// The resource `name` as a proxy of `namespace` sees it, if it may.
    pub fn get_for(&self, name: &str, namespace: Option<&str>) -> Option<&Arc<Entry>> {
        let own = namespace.and_then(|ns| self.scoped.get(ns)?.get(name));
        let entry = match own {
            Some(e) => e.as_ref()?,
            None => self.resources.get(name)?,
        };
        entry.visible_to(namespace).then_some(entry)
    }

    /// Every resource a proxy of `namespace` sees, by name in order.
    pub fn iter_for<'a>(
        &'a self,
        namespace: Option<&'a str>,
    ) -> Box<dyn Iterator<Item = (&'a String, &'a Arc<Entry>)> + 'a> {
        let visible = move |(_, e): &(&String, &Arc<Entry>)| e.visible_to(namespace);
        let Some(own) = namespace.and_then(|ns| self.scoped.get(ns)) else {
            return Box::new(self.resources.iter().filter(visible));
        };
        let mut merged: BTreeMap<&String, &Arc<Entry>> = self.resources.iter().collect();
        for (name, e) in own {
            match e {
                Some(e) => merged.insert(name, e),
                None => merged.remove(name),
            };
        }
        Box::new(merged.into_iter().filter(visible))
    }

    /// The version of what a proxy of `namespace` sees of this type.
    pub fn version_for(&self, namespace: Option<&str>) -> String {
        let own = namespace.is_some_and(|ns| self.scoped.contains_key(ns));
        if !self.restricted && !own {
            return self.base_version.clone();
        }
        let mut set = Vec::new();
        for (name, e) in self.iter_for(namespace) {
            set.extend_from_slice(name.as_bytes());
            set.push(0);
            set.extend_from_slice(e.version.as_bytes());
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
                    base_version: fnv(&[]),
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

    /// Publishes `resources`, in minimesh's encoding and Envoy's (xDS v3),
    /// with the views of the namespaces that see other rules; returns true
    /// when anything changed (an unchanged set publishes nothing and wakes
    /// no stream).
    pub fn update(&self, resources: &Resources) -> bool {
        let v3 = crate::xds_v3::encode(resources, self.v3);
        let views: Vec<(&String, &Resources, crate::xds_v3::Encoded)> = resources
            .scoped
            .iter()
            .map(|(ns, r)| (ns, r, crate::xds_v3::encode(r, self.v3)))
            .collect();
        let old = self.current();
        let mut next = Snapshot {
            types: BTreeMap::new(),
            generation: old.generation,
        };
        let generation = old.generation + 1;
        let mut changed = false;
        for t in ALL_TYPES.into_iter().chain(xds_v3::ALL_TYPES) {
            let prev = old.types.get(t).map(|p| p.as_ref());
            // Peer authentications and authorization policies are the same
            // in every view (rules do not touch them): no view of their own.
            let per_view = !matches!(t, PEER_AUTH_TYPE | AUTHZ_TYPE);
            let scoped: Vec<(&String, BTreeMap<String, Any>)> = views
                .iter()
                .filter(|_| per_view)
                .map(|(ns, r, v3)| (*ns, items(t, r, v3)))
                .collect();
            let visible_to: VisibleTo<'_> = match t {
                // A namespace's is its own proxies'; the mesh-wide one
                // every proxy's.
                PEER_AUTH_TYPE => Box::new(|ns| match resources.peer_auth.get(ns) {
                    Some(p) if !p.mesh_wide => Some(Arc::from([ns.to_string()])),
                    _ => None,
                }),
                // A namespace's policy is its own proxies'; one of the
                // root namespace every proxy's.
                AUTHZ_TYPE => Box::new(|name| match resources.authz.get(name) {
                    Some(a) if !a.mesh_wide => Some(Arc::from([a.namespace.clone()])),
                    _ => None,
                }),
                // A Service's `exportTo`.
                _ => Box::new(|name| {
                    crate::translate::service_of(name)
                        .and_then(|s| resources.exported.get(s).cloned())
                }),
            };
            let new_type = build(
                items(t, resources, &v3),
                &scoped,
                prev,
                generation,
                visible_to,
            );
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

/// The namespaces that may see a resource, by its name (None: every one).
type VisibleTo<'a> = Box<dyn Fn(&str) -> Option<Arc<[String]>> + 'a>;

/// The resources of type `t` in `r` (and its xDS v3 encoding), encoded.
fn items(t: &str, r: &Resources, v3: &crate::xds_v3::Encoded) -> BTreeMap<String, Any> {
    fn encode<M: Message>(t: &str, m: &BTreeMap<String, M>) -> BTreeMap<String, Any> {
        m.iter().map(|(k, v)| (k.clone(), to_any(t, v))).collect()
    }
    match t {
        CLUSTER_TYPE => encode(t, &r.clusters),
        ENDPOINTS_TYPE => encode(t, &r.endpoints),
        ROUTE_TYPE => encode(t, &r.routes),
        PEER_AUTH_TYPE => encode(t, &r.peer_auth),
        AUTHZ_TYPE => encode(t, &r.authz),
        xds_v3::CLUSTER_TYPE => encode(t, &v3.clusters),
        xds_v3::ENDPOINTS_TYPE => encode(t, &v3.endpoints),
        xds_v3::LISTENER_TYPE => encode(t, &v3.listeners),
        xds_v3::ROUTE_CONFIG_TYPE => encode(t, &v3.routes),
        _ => unreachable!("the type lists name nine types"),
    }
}

/// The resources of one type as `generation` publishes them, the default
/// view's `items` and, for each namespace in `scoped`, the entries its view
/// holds otherwise; `visible_to` gives the namespaces that may see each
/// resource, by name. An entry whose content is as in `prev` is `prev`'s
/// (and keeps its `changed`).
fn build(
    items: BTreeMap<String, Any>,
    scoped: &[(&String, BTreeMap<String, Any>)],
    prev: Option<&TypeSnapshot>,
    generation: u64,
    visible_to: impl Fn(&str) -> Option<Arc<[String]>>,
) -> TypeSnapshot {
    let entry = |name: &str, any: &Any, prev: Option<&Arc<Entry>>| {
        let version = fnv(&any.value);
        let visible = visible_to(name);
        match prev {
            Some(e) if e.version == version && e.visible == visible => e.clone(),
            _ => Arc::new(Entry {
                version,
                any: any.clone(),
                changed: generation,
                visible,
            }),
        }
    };
    let mut resources = BTreeMap::new();
    let mut set = Vec::new();
    let mut restricted = false;
    for (name, any) in &items {
        let e = entry(name, any, prev.and_then(|p| p.resources.get(name)));
        set.extend_from_slice(name.as_bytes());
        set.push(0);
        set.extend_from_slice(e.version.as_bytes());
        if let Some(to) = &e.visible {
            restricted = true;
            set.push(1);
            for ns in to.iter() {
                set.extend_from_slice(ns.as_bytes());
                set.push(0);
            }
        }
        resources.insert(name.clone(), e);
    }
    let base_version = fnv(&set);
    let mut out_scoped = BTreeMap::new();
    for (ns, view) in scoped {
        let prev_ns = prev.and_then(|p| p.scoped.get(*ns));
        let mut own = BTreeMap::new();
        let names: std::collections::BTreeSet<&String> = items.keys().chain(view.keys()).collect();
        for name in names {
            let (d, v) = (items.get(name), view.get(name));
            if d.map(|a| &a.value) == v.map(|a| &a.value) {
                continue;
            }
            let e = v.map(|any| {
                let before = prev_ns.and_then(|m| m.get(name)).and_then(Option::as_ref);
                entry(name, any, before)
            });
            set.push(2);
            set.extend_from_slice(ns.as_bytes());
            set.push(0);
            set.extend_from_slice(name.as_bytes());
            set.push(0);
            set.extend_from_slice(e.as_ref().map_or(b"-".as_slice(), |e| e.version.as_bytes()));
            own.insert(name.clone(), e);
        }
        if !own.is_empty() {
            out_scoped.insert((*ns).clone(), own);
        }
    }
    TypeSnapshot {
        version: fnv(&set),
        base_version,
        resources,
        scoped: out_scoped,
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
