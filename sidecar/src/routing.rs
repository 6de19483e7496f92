//! The sidecar's view of the mesh: authority -> cluster -> balancer. Built
//! from discovery resources off the request path and swapped in atomically;
//! a request holds the snapshot it started with until it completes, so a
//! config change never fails a request in flight.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, HealthStatus, Node, Route, UpstreamProtocol,
};

use crate::balance::{Balancer, Policy};
use crate::endpoint::EndpointState;
use crate::pool::PoolSettings;

/// What a consistent-hash cluster hashes on.
#[derive(Clone, Debug)]
pub enum HashPolicy {
    /// A request header (lower-case name).
    Header(http::HeaderName),
    /// A cookie, set on the response when the request has none.
    Cookie {
        /// Cookie name.
        name: String,
        /// Cookie path (empty: none).
        path: String,
        /// Lifetime (None: session cookie).
        ttl: Option<Duration>,
    },
    /// The caller's address.
    SourceIp,
    /// A query parameter.
    Query(String),
}

impl HashPolicy {
    fn from_wire(k: &minimesh_proto::v1::HashKey) -> Option<HashPolicy> {
        use minimesh_proto::v1::hash_key::Key;
        Some(match k.key.as_ref()? {
            Key::Header(h) => HashPolicy::Header(http::HeaderName::from_bytes(h.as_bytes()).ok()?),
            Key::Cookie(c) => HashPolicy::Cookie {
                name: c.name.clone(),
                path: c.path.clone(),
                ttl: (c.ttl_ms > 0).then(|| Duration::from_millis(c.ttl_ms)),
            },
            Key::SourceIp(_) => HashPolicy::SourceIp,
            Key::QueryParameter(q) => HashPolicy::Query(q.clone()),
        })
    }
}

/// A cluster ready to serve requests.
pub struct ClusterHandle {
    /// Hash key of a consistent-hash policy.
    pub hash: Option<HashPolicy>,
    /// Cluster name.
    pub name: Arc<str>,
    /// Endpoints and picker.
    pub balancer: Balancer,
    /// Retries after the first attempt on connect failure.
    pub retry_attempts: u32,
    /// Whole-request timeout.
    pub timeout: Option<Duration>,
    /// Timeout of each attempt.
    pub per_try_timeout: Option<Duration>,
    /// Limits retries to a share of requests.
    pub budget: Arc<crate::retry::Budget>,
    /// Time each pick took, nanoseconds; kept across config updates.
    pub pick_ns: Arc<PickHistogram>,
    /// Passive outlier detection, when configured.
    pub outlier: Option<minimesh_proto::v1::OutlierDetection>,
    /// Requests in flight at most (0 = unlimited).
    pub max_requests: u32,
    /// When to retry (bits of the wire `RetryOn`).
    pub retry_on: u32,
    /// Requests in flight now; shared across config updates.
    pub inflight: Arc<std::sync::atomic::AtomicU32>,
    /// Retries in flight at most (0 = unlimited; `connectionPool.http.maxRetries`).
    pub max_retries: u32,
    /// Retries in flight now; shared across config updates.
    pub retries_inflight: Arc<std::sync::atomic::AtomicU32>,
    /// Upstream connection settings.
    pub pool: PoolSettings,
    /// The rule in force (`namespace/name`), empty for the default policy.
    pub rule: String,
    /// The HTTP version spoken to the endpoints.
    pub protocol: UpstreamProtocol,
    /// The inbound listener's cluster: its one endpoint is the pod's own
    /// app, whose responses may not claim to be minimesh's own.
    pub local_app: bool,
}

impl ClusterHandle {
    /// True when a request that arrived as `version` goes to the endpoints
    /// over HTTP/2.
    #[inline]
    pub fn upstream_h2(&self, version: http::Version) -> bool {
        match self.protocol {
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::Http2 => true,
            UpstreamProtocol::Client => version == http::Version::HTTP_2,
        }
    }
}

/// Immutable routing table.
#[derive(Default)]
pub struct Routing {
    /// Lower-case authority (`svc`, `svc.ns`, … with or without `:port`) -> cluster.
    pub hosts: HashMap<String, Arc<ClusterHandle>>,
    /// Clusters by name.
    pub clusters: BTreeMap<String, Arc<ClusterHandle>>,
    /// Cluster for authorities that match nothing (gateway catch-all).
    pub fallback: Option<Arc<ClusterHandle>>,
    /// The zone that zone failover prefers (empty: unknown, no preference).
    pub zone: String,
}

impl Routing {
    /// The cluster for an authority, case-insensitively, ignoring a trailing dot.
    #[inline]
    pub fn lookup(&self, authority: &str) -> Option<&Arc<ClusterHandle>> {
        let a = authority.strip_suffix('.').unwrap_or(authority);
        let found = if a.bytes().any(|b| b.is_ascii_uppercase()) {
            self.hosts.get(&a.to_ascii_lowercase())
        } else {
            self.hosts.get(a)
        };
        found.or(self.fallback.as_ref())
    }
}

/// Where requests for hosts outside the mesh's names go (gateway mode).
#[derive(Clone, Debug, Default)]
pub struct HostAliases {
    /// Extra authority -> `service.namespace`.
    pub aliases: Vec<(String, String)>,
    /// `service.namespace` for any other authority.
    pub fallback: Option<String>,
}

/// The raw resources last accepted, and the endpoint states to keep across
/// rebuilds.
#[derive(Default)]
pub struct Resources {
    /// Clusters by name.
    pub clusters: BTreeMap<String, Cluster>,
    /// Endpoint assignments by cluster name.
    pub endpoints: BTreeMap<String, ClusterLoadAssignment>,
    /// Routes by `service.namespace`.
    pub routes: BTreeMap<String, Route>,
    states: HashMap<(String, SocketAddr), Arc<EndpointState>>,
    inflight: HashMap<String, Arc<std::sync::atomic::AtomicU32>>,
    retries_inflight: HashMap<String, Arc<std::sync::atomic::AtomicU32>>,
    budgets: HashMap<String, Arc<crate::retry::Budget>>,
    picks: HashMap<String, Arc<PickHistogram>>,
}

/// Histogram of pick durations (nanoseconds).
pub struct PickHistogram(pub crate::histogram::Histogram<8>);

impl Default for PickHistogram {
    fn default() -> Self {
        PickHistogram(crate::histogram::Histogram::new(
            &crate::histogram::PICK_BUCKET_BOUNDS_NS,
        ))
    }
}

/// Checks a cluster the sidecar is about to accept.
pub fn validate_cluster(c: &Cluster) -> Result<(), String> {
    let policy = Policy::from_wire(c.policy)?;
    UpstreamProtocol::try_from(c.upstream_protocol).map_err(|_| {
        format!(
            "unknown upstream protocol number {} (a newer control plane?)",
            c.upstream_protocol
        )
    })?;
    if matches!(policy, Policy::RingHash | Policy::Maglev) {
        if c.hash_key
            .as_ref()
            .and_then(HashPolicy::from_wire)
            .is_none()
        {
            return Err(format!("{} needs a valid hash key", policy.as_str()));
        }
        let size = c.minimum_ring_size.max(c.table_size);
        if size > crate::balance::ring_hash::MAX_RING {
            return Err(format!(
                "table size {size} is more than {}",
                crate::balance::ring_hash::MAX_RING
            ));
        }
    }
    Ok(())
}

/// Checks an endpoint assignment.
pub fn validate_endpoints(cla: &ClusterLoadAssignment) -> Result<(), String> {
    for e in &cla.endpoints {
        e.address
            .parse::<SocketAddr>()
            .map_err(|_| format!("endpoint address {:?} is not ip:port", e.address))?;
    }
    Ok(())
}

impl Resources {
    /// The zone of the proxy `node`: its own (`--zone`), else the zone of
    /// its workload's endpoint in any cluster of its namespace (a pod that
    /// backs a Service finds itself in the EndpointSlices, which carry the
    /// node's zone; the downward API cannot give a pod its node's labels).
    pub fn zone_of(&self, node: &Node) -> String {
        if !node.zone.is_empty() {
            return node.zone.clone();
        }
        self.clusters
            .iter()
            .filter(|(_, c)| c.namespace == node.namespace)
            .filter_map(|(name, _)| self.endpoints.get(name))
            .flat_map(|cla| &cla.endpoints)
            .find(|e| !e.pod.is_empty() && e.pod == node.workload && !e.zone.is_empty())
            .map(|e| e.zone.clone())
            .unwrap_or_default()
    }

    /// Builds the routing table for the proxy `node` (short names resolve
    /// in its namespace; zone failover prefers its zone, see
    /// [`Resources::zone_of`]); `defaults` are the connection settings of
    /// clusters whose rule sets none.
    pub fn build(
        &mut self,
        node: &Node,
        aliases: &HostAliases,
        defaults: &PoolSettings,
    ) -> Routing {
        let namespace = node.namespace.as_str();
        let zone = self.zone_of(node);
        let zone = zone.as_str();
        let mut clusters = BTreeMap::new();
        let mut states = HashMap::new();
        // Clusters that already had endpoints: only endpoints joining those
        // get slow start.
        let populated: std::collections::HashSet<String> =
            self.states.keys().map(|(c, _)| c.clone()).collect();
        for (name, c) in &self.clusters {
            let Ok(policy) = Policy::from_wire(c.policy) else {
                continue; // validated on receipt; unreachable in practice
            };
            let cla = self.endpoints.get(name);
            let all: Vec<_> = cla
                .map(|c| c.endpoints.as_slice())
                .unwrap_or(&[])
                .iter()
                .collect();
            let healthy: Vec<_> = all
                .iter()
                .filter(|e| {
                    matches!(
                        HealthStatus::try_from(e.health),
                        Ok(HealthStatus::Healthy) | Ok(HealthStatus::HealthUnknown)
                    )
                })
                .copied()
                .collect();
            // Draining endpoints serve only when nothing healthy is left.
            let chosen = if healthy.is_empty() {
                all.iter()
                    .filter(|e| e.health == HealthStatus::Draining as i32)
                    .copied()
                    .collect()
            } else {
                healthy
            };
            let known_cluster = populated.contains(name.as_str());
            let mut eps = Vec::with_capacity(chosen.len());
            let mut in_zone = Vec::with_capacity(chosen.len());
            for e in chosen {
                let Ok(addr) = e.address.parse::<SocketAddr>() else {
                    continue;
                };
                let key = (name.clone(), addr);
                let state = self.states.get(&key).cloned().unwrap_or_else(|| {
                    let s = EndpointState::new(addr, e.pod.clone());
                    if !known_cluster {
                        // Present when the cluster first arrived: no slow start.
                        s.joined_ms.store(0, std::sync::atomic::Ordering::Relaxed);
                    }
                    s
                });
                states.insert(key, state.clone());
                eps.push((state, e.weight.max(1)));
                in_zone.push(!zone.is_empty() && e.zone == zone);
            }
            let size = c.minimum_ring_size.max(c.table_size);
            let warmup = (c.warmup_ms > 0).then(|| crate::balance::Warmup {
                window_ms: c.warmup_ms,
                min: (c.warmup_min_percent / 100.0).clamp(0.0, 1.0),
                inv_aggression: 1.0 / c.warmup_aggression.max(0.01),
            });
            let balancer = if c.zone_failover {
                Balancer::zoned(policy, size, eps, &in_zone, warmup)
            } else {
                Balancer::new(policy, size, eps).with_warmup(warmup)
            };
            clusters.insert(
                name.clone(),
                Arc::new(ClusterHandle {
                    name: name.as_str().into(),
                    hash: c.hash_key.as_ref().and_then(HashPolicy::from_wire),
                    balancer,
                    retry_attempts: c.retry_attempts,
                    timeout: (c.timeout_ms > 0).then(|| Duration::from_millis(c.timeout_ms)),
                    per_try_timeout: (c.per_try_timeout_ms > 0)
                        .then(|| Duration::from_millis(c.per_try_timeout_ms)),
                    outlier: c.outlier_detection,
                    max_requests: c.max_requests,
                    retry_on: c.retry_on,
                    inflight: self.inflight.entry(name.clone()).or_default().clone(),
                    max_retries: c.max_retries,
                    retries_inflight: self
                        .retries_inflight
                        .entry(name.clone())
                        .or_default()
                        .clone(),
                    pool: PoolSettings {
                        connect_timeout: match c.connect_timeout_ms {
                            0 => defaults.connect_timeout,
                            ms => Duration::from_millis(ms),
                        },
                        idle_timeout: match c.idle_timeout_ms {
                            0 => defaults.idle_timeout,
                            ms => Duration::from_millis(ms),
                        },
                        max_requests_per_connection: c.max_requests_per_connection,
                        max_connection_ms: c.max_connection_duration_ms,
                        max_streams: c.max_concurrent_streams,
                    },
                    budget: {
                        let b = self.budgets.entry(name.clone()).or_insert_with(|| {
                            Arc::new(crate::retry::Budget::new(
                                c.retry_budget_percent,
                                c.retry_budget_min_per_second,
                            ))
                        });
                        if !b.has_params(c.retry_budget_percent, c.retry_budget_min_per_second) {
                            *b = Arc::new(crate::retry::Budget::new(
                                c.retry_budget_percent,
                                c.retry_budget_min_per_second,
                            ));
                        }
                        b.clone()
                    },
                    pick_ns: self.picks.entry(name.clone()).or_default().clone(),
                    rule: c.rule.clone(),
                    protocol: UpstreamProtocol::try_from(c.upstream_protocol)
                        .unwrap_or(UpstreamProtocol::Http1),
                    local_app: false,
                }),
            );
        }
        self.states = states;

        let mut hosts = HashMap::new();
        let mut default_of = HashMap::new();
        for r in self.routes.values() {
            let mut names = vec![
                format!("{}.{}", r.service, r.namespace),
                format!("{}.{}.svc", r.service, r.namespace),
                format!("{}.{}.svc.cluster.local", r.service, r.namespace),
            ];
            if r.namespace == namespace {
                names.push(r.service.clone());
            }
            for pc in &r.ports {
                let Some(c) = clusters.get(&pc.cluster) else {
                    continue;
                };
                for n in &names {
                    hosts.insert(format!("{n}:{}", pc.port), c.clone());
                    if pc.port == r.default_port {
                        hosts.insert(n.clone(), c.clone());
                    }
                }
                if pc.port == r.default_port {
                    default_of.insert(format!("{}.{}", r.service, r.namespace), c.clone());
                }
            }
        }
        for (alias, svc) in &aliases.aliases {
            if let Some(c) = default_of.get(svc) {
                hosts.insert(alias.to_ascii_lowercase(), c.clone());
                hosts
                    .entry(format!("{}:80", alias.to_ascii_lowercase()))
                    .or_insert(c.clone());
            }
        }
        let fallback = aliases
            .fallback
            .as_ref()
            .and_then(|s| default_of.get(s).cloned());
        Routing {
            hosts,
            clusters,
            fallback,
            zone: zone.to_string(),
        }
    }
}
