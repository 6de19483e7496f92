//! Connected proxies and what each has ACKed and NACKed, like `istioctl
//! proxy-status`. Updated on stream events, never on a request path.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use minimesh_proto::v1::Node;
use serde::Serialize;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Per-type state keyed by type name: a few entries at most (one per
/// resource type), so a vector. A map node would cost over a kilobyte per
/// connected sidecar, and the control plane holds thousands of them.
#[derive(Clone, Debug)]
pub struct TypeMap<V>(Vec<(&'static str, V)>);

impl<V> Default for TypeMap<V> {
    fn default() -> Self {
        TypeMap(Vec::new())
    }
}

impl<V: Default> TypeMap<V> {
    /// The entry for `key`, inserted with the default value if missing.
    pub fn entry(&mut self, key: &'static str) -> &mut V {
        let i = match self.0.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.0.push((key, V::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[i].1
    }
}

impl<V> TypeMap<V> {
    /// True when `key` has an entry.
    pub fn contains_key(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| *k == key)
    }

    /// The entry for `key`, if any.
    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        self.0.iter_mut().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The keys, in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.0.iter().map(|(k, _)| *k)
    }
}

impl<V: Serialize> Serialize for TypeMap<V> {
    /// As a JSON object sorted by key, as the map it stands for.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut sorted: Vec<&(&'static str, V)> = self.0.iter().collect();
        sorted.sort_by_key(|(k, _)| *k);
        s.collect_map(sorted.into_iter().map(|(k, v)| (k, v)))
    }
}

/// A rejected response.
#[derive(Clone, Debug, Serialize)]
pub struct Nack {
    /// Version that was rejected.
    pub version: String,
    /// The proxy's reason.
    pub message: String,
    /// When, in ms since the epoch.
    pub at_ms: u64,
}

/// Per-type state of one proxy.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TypeStatus {
    /// Version last sent.
    pub sent: Option<String>,
    /// Version last ACKed.
    pub acked: Option<String>,
    /// Last NACK, if any.
    pub last_nack: Option<Nack>,
    /// Responses sent.
    pub pushes: u64,
}

/// One connected proxy.
#[derive(Clone, Debug, Serialize)]
pub struct ProxyStatus {
    /// Stream id, unique in this control-plane process.
    pub stream: u64,
    /// `sotw` or `delta`.
    pub protocol: &'static str,
    /// Node id.
    pub id: String,
    /// Workload name.
    pub workload: String,
    /// Namespace.
    pub namespace: String,
    /// Address.
    pub address: String,
    /// Zone.
    pub zone: String,
    /// Connected since (ms since the epoch).
    pub connected_ms: u64,
    /// By short type name (`Cluster`, `ClusterLoadAssignment`, `Route`).
    pub types: TypeMap<TypeStatus>,
}

/// All connected proxies.
#[derive(Default)]
pub struct Registry {
    next: AtomicU64,
    proxies: Mutex<BTreeMap<u64, ProxyStatus>>,
}

/// The short name of a type URL (`…/minimesh.v1.Cluster` → `Cluster`).
pub fn short_type(type_url: &str) -> &str {
    type_url.rsplit('.').next().unwrap_or(type_url)
}

impl Registry {
    /// Registers a new stream and returns its handle; the entry goes away
    /// when the handle is dropped.
    pub fn connect(self: &Arc<Self>, protocol: &'static str) -> StreamHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let status = ProxyStatus {
            stream: id,
            protocol,
            id: String::new(),
            workload: String::new(),
            namespace: String::new(),
            address: String::new(),
            zone: String::new(),
            connected_ms: now_ms(),
            types: TypeMap::default(),
        };
        self.lock().insert(id, status);
        StreamHandle {
            registry: self.clone(),
            id,
        }
    }

    /// Every connected proxy, by stream id.
    pub fn list(&self) -> Vec<ProxyStatus> {
        self.lock().values().cloned().collect()
    }

    /// Number of connected proxies.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no proxy is connected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, ProxyStatus>> {
        // A panic elsewhere cannot leave this map inconsistent: recover it.
        self.proxies.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A stream's entry in the registry.
pub struct StreamHandle {
    registry: Arc<Registry>,
    id: u64,
}

impl StreamHandle {
    /// Records the node identity.
    pub fn set_node(&self, node: &Node) {
        if let Some(p) = self.registry.lock().get_mut(&self.id) {
            p.id = node.id.clone();
            p.workload = node.workload.clone();
            p.namespace = node.namespace.clone();
            p.address = node.address.clone();
            p.zone = node.zone.clone();
        }
    }

    /// Applies `f` to the status of a type.
    pub fn update(&self, type_url: &'static str, f: impl FnOnce(&mut TypeStatus)) {
        if let Some(p) = self.registry.lock().get_mut(&self.id) {
            f(p.types.entry(short_type(type_url)));
        }
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.id);
    }
}
