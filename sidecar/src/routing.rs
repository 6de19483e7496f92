//! The sidecar's view of the mesh: authority -> cluster -> balancer. Built
//! from discovery resources off the request path and swapped in atomically;
//! a request holds the snapshot it started with until it completes, so a
//! config change never fails a request in flight.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, HealthStatus, Node, PortProtocol, Route, UpstreamProtocol,
};

use crate::balance::Policy;
use crate::endpoint::EndpointState;

/// A cluster's balancer, over the sidecar's endpoint states.
pub type Balancer = crate::balance::Balancer<EndpointState>;
use crate::pool::PoolSettings;

mod host_map;
use host_map::HostMap;

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
    /// When to retry.
    pub retry_on: crate::retry::Conditions,
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
    /// Each endpoint's weight as assigned (what `/debug/config` shows).
    pub weights: std::collections::HashMap<SocketAddr, u32>,
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

/// The inbound side's cluster: the pod's own app at `addr`, its one
/// endpoint. No retries to the app: it is the pod's only endpoint, and a
/// dead one is the caller's sidecar's to route around, at once (the 503
/// says whether the app saw the request).
pub fn app_cluster(
    addr: SocketAddr,
    workload: &str,
    protocol: UpstreamProtocol,
    pool: PoolSettings,
) -> Arc<ClusterHandle> {
    Arc::new(ClusterHandle {
        name: "inbound|app".into(),
        hash: None,
        balancer: Balancer::new(
            Policy::LeastRequest,
            0,
            vec![(EndpointState::new(addr, workload.to_string()), 1)],
        ),
        retry_attempts: 0,
        timeout: None,
        per_try_timeout: None,
        budget: Arc::new(crate::retry::Budget::new(20, 10)),
        pick_ns: Default::default(),
        outlier: None,
        max_requests: 0,
        retry_on: crate::retry::Conditions::new(
            minimesh_proto::v1::RetryOn::ConnectFailure as u32,
            &[],
        ),
        inflight: Default::default(),
        max_retries: 0,
        retries_inflight: Default::default(),
        pool,
        rule: String::new(),
        protocol,
        local_app: true,
        weights: HashMap::from([(addr, 1)]),
    })
}

/// Immutable routing table.
#[derive(Default)]
pub struct Routing {
    /// Lower-case authority (`svc`, `svc.ns`, … with or without `:port`) ->
    /// index in `handles`. Shared by the tables built while the routes and
    /// the set of clusters stay the same (an endpoint change does not touch it).
    hosts: Arc<HostMap>,
    /// Service addresses (`<cluster IP>:<port>`) -> index in `handles`
    /// and how a captured connection to it is proxied.
    destinations: Arc<DestinationMap>,
    /// Clusters in name order, as `hosts` indexes them.
    handles: Vec<Arc<ClusterHandle>>,
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
        found
            .and_then(|i| self.handles.get(*i as usize))
            .or(self.fallback.as_ref())
    }

    /// The cluster of a Service address a captured connection was sent to
    /// (`<cluster IP>:<port>`), and how to proxy it; None for an address
    /// that is no Service's (passed through to it).
    #[inline]
    pub fn destination(&self, addr: &SocketAddr) -> Option<(&Arc<ClusterHandle>, PortProtocol)> {
        let &(i, kind) = self.destinations.get(addr)?;
        Some((self.handles.get(i as usize)?, kind))
    }

    /// How many Service addresses captured connections are routed by.
    pub fn destination_count(&self) -> usize {
        self.destinations.len()
    }

    /// A table that sends every request to `cluster` (the inbound side).
    pub fn only(cluster: Arc<ClusterHandle>) -> Routing {
        Routing {
            fallback: Some(cluster),
            ..Default::default()
        }
    }

    /// The authorities routed, unordered.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        self.hosts.keys().map(String::as_str)
    }
}

/// Where requests for hosts outside the mesh's names go (gateway mode).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostAliases {
    /// Extra authority -> `service.namespace`.
    pub aliases: Vec<(String, String)>,
    /// `service.namespace` for any other authority.
    pub fallback: Option<String>,
}

/// The raw resources last accepted, and what to keep across rebuilds: the
/// endpoint states, the clusters' shared counters, and the clusters and host
/// map of the last build, reused where their inputs did not change.
#[derive(Default)]
pub struct Resources {
    clusters: BTreeMap<String, Cluster>,
    endpoints: BTreeMap<String, ClusterLoadAssignment>,
    routes: BTreeMap<String, Route>,
    /// Clusters whose resource or endpoints changed since the last build.
    changed: HashSet<String>,
    /// The routes changed since the last build.
    routes_changed: bool,
    /// What the last build was for; another zone, node or default settings
    /// rebuild everything.
    built_for: Option<BuiltFor>,
    /// The last build's clusters, with their endpoints' states.
    built: BTreeMap<String, Built>,
    /// The last build's host map and fallback (indexes in name order).
    built_hosts: Arc<HostMap>,
    built_destinations: Arc<DestinationMap>,
    built_fallback: Option<u32>,
    inflight: HashMap<String, Arc<std::sync::atomic::AtomicU32>>,
    retries_inflight: HashMap<String, Arc<std::sync::atomic::AtomicU32>>,
    budgets: HashMap<String, Arc<crate::retry::Budget>>,
    picks: HashMap<String, Arc<PickHistogram>>,
}

/// A cluster as last built.
struct Built {
    handle: Arc<ClusterHandle>,
    /// Its endpoints' states by address, kept across rebuilds.
    states: HashMap<SocketAddr, Arc<EndpointState>>,
}

#[derive(PartialEq)]
struct BuiltFor {
    namespace: String,
    zone: String,
    aliases: HostAliases,
    defaults: PoolSettings,
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
    /// Clusters by name.
    pub fn clusters(&self) -> &BTreeMap<String, Cluster> {
        &self.clusters
    }

    /// Endpoint assignments by cluster name.
    pub fn endpoints(&self) -> &BTreeMap<String, ClusterLoadAssignment> {
        &self.endpoints
    }

    /// Routes by `service.namespace`.
    pub fn routes(&self) -> &BTreeMap<String, Route> {
        &self.routes
    }

    /// Replaces the clusters; an assignment goes with its cluster.
    pub fn set_clusters(&mut self, clusters: impl IntoIterator<Item = Cluster>) {
        let clusters: BTreeMap<String, Cluster> =
            clusters.into_iter().map(|c| (c.name.clone(), c)).collect();
        for (name, c) in &clusters {
            if self.clusters.get(name) != Some(c) {
                self.changed.insert(name.clone());
            }
        }
        self.clusters = clusters;
        let clusters = &self.clusters;
        self.endpoints.retain(|name, _| clusters.contains_key(name));
    }

    /// Replaces the assignments of the clusters they name; the others stay.
    pub fn set_endpoints(&mut self, assignments: impl IntoIterator<Item = ClusterLoadAssignment>) {
        for a in assignments {
            if self.endpoints.get(&a.cluster_name) != Some(&a) {
                self.changed.insert(a.cluster_name.clone());
                self.endpoints.insert(a.cluster_name.clone(), a);
            }
        }
    }

    /// Replaces the routes.
    pub fn set_routes(&mut self, routes: impl IntoIterator<Item = Route>) {
        let routes: BTreeMap<String, Route> = routes
            .into_iter()
            .map(|r| (format!("{}.{}", r.service, r.namespace), r))
            .collect();
        if routes != self.routes {
            self.routes = routes;
            self.routes_changed = true;
        }
    }

    /// The zone of the proxy `node`: its own (`--zone`), else the zone of
    /// its workload's endpoint in any cluster of its namespace (a pod that
    /// backs a Service finds itself in the EndpointSlices, which carry the
    /// node's zone; the downward API cannot give a pod its node's labels).
    pub fn zone_of(&self, node: &Node) -> String {
        if !node.zone.is_empty() || node.workload.is_empty() {
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
    ///
    /// Only what changed since the last build is built again: a cluster
    /// whose resource and endpoints are as they were keeps its handle (its
    /// balancer, with a round robin's position), and the host map stays
    /// while the routes and the set of clusters do. So an update of one
    /// service's endpoints costs that service, not the mesh.
    pub fn build(
        &mut self,
        node: &Node,
        aliases: &HostAliases,
        defaults: &PoolSettings,
    ) -> Routing {
        let built_for = BuiltFor {
            namespace: node.namespace.clone(),
            zone: self.zone_of(node),
            aliases: aliases.clone(),
            defaults: *defaults,
        };
        let same_inputs = self.built_for.as_ref() == Some(&built_for);
        let zone = built_for.zone.as_str();
        // Both in name order: walk the last build beside the clusters.
        let last_len = self.built.len();
        let mut last = std::mem::take(&mut self.built).into_iter().peekable();
        let mut found = 0;
        let mut built = Vec::with_capacity(self.clusters.len());
        for (name, c) in &self.clusters {
            while last.next_if(|(k, _)| k < name).is_some() {}
            let prev = last.next_if(|(k, _)| k == name).map(|(_, b)| b);
            found += usize::from(prev.is_some());
            let (old, tables) = match prev {
                Some(b) if same_inputs && !self.changed.contains(name) => {
                    built.push((name.clone(), b));
                    continue;
                }
                Some(b) => (b.states, b.handle.balancer.hash_tables()),
                None => (HashMap::new(), Vec::new()),
            };
            let Ok(policy) = Policy::from_wire(c.policy) else {
                continue; // validated on receipt; unreachable in practice
            };
            // Only endpoints joining a cluster that already had some get
            // slow start.
            let known_cluster = !old.is_empty();
            let mut kept = HashMap::new();
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
            let mut eps = Vec::with_capacity(chosen.len());
            let mut weights = std::collections::HashMap::with_capacity(chosen.len());
            let mut in_zone = Vec::with_capacity(chosen.len());
            for e in chosen {
                let Ok(addr) = e.address.parse::<SocketAddr>() else {
                    continue;
                };
                let state = old.get(&addr).cloned().unwrap_or_else(|| {
                    if known_cluster {
                        EndpointState::new(addr, e.pod.clone())
                    } else {
                        // Present when the cluster first arrived: no slow start.
                        EndpointState::present_from_start(addr, e.pod.clone())
                    }
                });
                state.pool().set_mtls(e.mtls);
                kept.insert(addr, state.clone());
                weights.insert(addr, e.weight.max(1));
                eps.push((state, e.weight.max(1)));
                in_zone.push(!zone.is_empty() && e.zone == zone);
            }
            let size = c.minimum_ring_size.max(c.table_size);
            let warmup = (c.warmup_ms > 0).then(|| crate::balance::Warmup {
                window_ms: c.warmup_ms,
                min: (c.warmup_min_percent / 100.0).clamp(0.0, 1.0),
                inv_aggression: 1.0 / c.warmup_aggression.max(0.01),
            });
            // A hash table built from the same endpoints, weights and size
            // is taken from the cluster's last balancer, not built again.
            let balancer = if c.zone_failover {
                Balancer::zoned_reusing(policy, size, eps, &in_zone, warmup, &tables)
            } else {
                Balancer::reusing(policy, size, eps, &tables).with_warmup(warmup)
            };
            let handle = Arc::new(ClusterHandle {
                name: name.as_str().into(),
                hash: c.hash_key.as_ref().and_then(HashPolicy::from_wire),
                balancer,
                retry_attempts: c.retry_attempts,
                timeout: (c.timeout_ms > 0).then(|| Duration::from_millis(c.timeout_ms)),
                per_try_timeout: (c.per_try_timeout_ms > 0)
                    .then(|| Duration::from_millis(c.per_try_timeout_ms)),
                outlier: c.outlier_detection,
                max_requests: c.max_requests,
                retry_on: crate::retry::Conditions::new(c.retry_on, &c.retriable_status_codes),
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
                weights,
            });
            built.push((
                name.clone(),
                Built {
                    handle,
                    states: kept,
                },
            ));
        }
        drop(last);
        self.changed.clear();
        let same_clusters = found == last_len && found == built.len();
        let clusters: BTreeMap<String, Arc<ClusterHandle>> = built
            .iter()
            .map(|(name, b)| (name.clone(), b.handle.clone()))
            .collect();
        if !same_clusters {
            // Counters of clusters that went are not kept (a request still
            // in flight holds its own).
            for map in [&mut self.inflight, &mut self.retries_inflight] {
                map.retain(|name, _| clusters.contains_key(name));
            }
            self.budgets.retain(|name, _| clusters.contains_key(name));
            self.picks.retain(|name, _| clusters.contains_key(name));
        }
        if !(same_inputs && same_clusters && !self.routes_changed) {
            let (hosts, fallback) = host_map(&self.routes, &clusters, node, aliases);
            self.built_hosts = Arc::new(hosts);
            self.built_destinations = Arc::new(destination_map(&self.routes, &clusters));
            self.built_fallback = fallback;
            self.routes_changed = false;
        }
        let handles: Vec<Arc<ClusterHandle>> = clusters.values().cloned().collect();
        let fallback = self
            .built_fallback
            .and_then(|i| handles.get(i as usize).cloned());
        self.built = built.into_iter().collect();
        let zone = built_for.zone.clone();
        self.built_for = Some(built_for);
        Routing {
            hosts: self.built_hosts.clone(),
            destinations: self.built_destinations.clone(),
            handles,
            clusters,
            fallback,
            zone,
        }
    }
}

/// The authorities of every route's service, each to the index (in name
/// order) of the cluster of its port, and the fallback's index.
fn host_map(
    routes: &BTreeMap<String, Route>,
    clusters: &BTreeMap<String, Arc<ClusterHandle>>,
    node: &Node,
    aliases: &HostAliases,
) -> (HostMap, Option<u32>) {
    let index: HashMap<&str, u32> = clusters
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i as u32))
        .collect();
    let mut hosts = HostMap::default();
    let mut default_of = HashMap::new();
    for r in routes.values() {
        let mut names = vec![
            format!("{}.{}", r.service, r.namespace),
            format!("{}.{}.svc", r.service, r.namespace),
            format!("{}.{}.svc.cluster.local", r.service, r.namespace),
        ];
        if r.namespace == node.namespace {
            names.push(r.service.clone());
        }
        for pc in &r.ports {
            let Some(&c) = index.get(pc.cluster.as_str()) else {
                continue;
            };
            for n in &names {
                hosts.insert(format!("{n}:{}", pc.port), c);
                if pc.port == r.default_port {
                    hosts.insert(n.clone(), c);
                }
            }
            if pc.port == r.default_port {
                default_of.insert(format!("{}.{}", r.service, r.namespace), c);
            }
        }
    }
    for (alias, svc) in &aliases.aliases {
        if let Some(&c) = default_of.get(svc) {
            hosts.insert(alias.to_ascii_lowercase(), c);
            hosts
                .entry(format!("{}:80", alias.to_ascii_lowercase()))
                .or_insert(c);
        }
    }
    let fallback = aliases
        .fallback
        .as_ref()
        .and_then(|s| default_of.get(s).copied());
    (hosts, fallback)
}

/// Service addresses to cluster indexes (in name order) and port protocols.
type DestinationMap = HashMap<SocketAddr, (u32, PortProtocol)>;

/// Every route's `<cluster IP>:<port>` to the index of that port's cluster.
fn destination_map(
    routes: &BTreeMap<String, Route>,
    clusters: &BTreeMap<String, Arc<ClusterHandle>>,
) -> DestinationMap {
    let index: HashMap<&str, u32> = clusters
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i as u32))
        .collect();
    let mut map = DestinationMap::new();
    for r in routes.values() {
        let ips: Vec<std::net::IpAddr> = r
            .cluster_ips
            .iter()
            .filter_map(|ip| ip.parse().ok())
            .collect();
        for pc in &r.ports {
            let (Some(&c), Ok(port)) = (index.get(pc.cluster.as_str()), u16::try_from(pc.port))
            else {
                continue;
            };
            let kind = PortProtocol::try_from(pc.protocol).unwrap_or(PortProtocol::Detect);
            for ip in &ips {
                map.insert(SocketAddr::new(*ip, port), (c, kind));
            }
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimesh_proto::v1::{Endpoint, LbPolicy, PortCluster};

    fn cluster(service: &str, policy: LbPolicy) -> Cluster {
        Cluster {
            name: format!("{service}:80"),
            service: service.into(),
            namespace: "default".into(),
            port: 80,
            policy: policy as i32,
            ..Default::default()
        }
    }

    fn assignment(service: &str, weights: &[u32]) -> ClusterLoadAssignment {
        ClusterLoadAssignment {
            cluster_name: format!("{service}:80"),
            endpoints: weights
                .iter()
                .enumerate()
                .map(|(i, w)| Endpoint {
                    address: format!("10.0.0.{}:80", i + 1),
                    weight: *w,
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn route(service: &str) -> Route {
        Route {
            service: service.into(),
            namespace: "default".into(),
            ports: vec![PortCluster {
                port: 80,
                cluster: format!("{service}:80"),
                ..Default::default()
            }],
            default_port: 80,
            ..Default::default()
        }
    }

    fn defaults(idle_s: u64) -> PoolSettings {
        PoolSettings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(idle_s),
            max_requests_per_connection: 0,
            max_connection_ms: 0,
            max_streams: 0,
        }
    }

    fn node() -> Node {
        Node {
            namespace: "default".into(),
            ..Default::default()
        }
    }

    /// Picks of each endpoint in 40 round-robin picks.
    fn shares(r: &Routing, service: &str) -> Vec<usize> {
        let b = &r.lookup(service).expect("routed").balancer;
        let picks: Vec<_> = (0..40)
            .filter_map(|_| b.pick(None, &[], crate::clock::now_ms()))
            .collect();
        b.endpoints()
            .iter()
            .map(|e| picks.iter().filter(|p| Arc::ptr_eq(p, e)).count())
            .collect()
    }

    #[test]
    fn captured_connections_route_by_service_address_and_port() {
        let mut res = Resources::default();
        res.set_clusters([
            cluster("a", LbPolicy::RoundRobin),
            cluster("b", LbPolicy::RoundRobin),
        ]);
        res.set_endpoints([assignment("a", &[1]), assignment("b", &[1])]);
        let mut a = route("a");
        a.cluster_ips = vec!["198.19.0.10".into(), "fd00::10".into(), "None".into()];
        a.ports[0].protocol = PortProtocol::Http as i32;
        let mut b = route("b");
        b.cluster_ips = vec!["198.19.0.11".into()];
        b.ports[0].protocol = PortProtocol::Tcp as i32;
        res.set_routes([a, b, route("c")]);
        let r = res.build(&node(), &HostAliases::default(), &defaults(60));
        let at = |s: &str| {
            r.destination(&s.parse().expect("addr"))
                .map(|(c, k)| (&*c.name, k))
        };
        assert_eq!(at("198.19.0.10:80"), Some(("a:80", PortProtocol::Http)));
        assert_eq!(at("[fd00::10]:80"), Some(("a:80", PortProtocol::Http)));
        assert_eq!(at("198.19.0.11:80"), Some(("b:80", PortProtocol::Tcp)));
        // Another port of a Service address, or another address: no Service.
        assert_eq!(at("198.19.0.10:81"), None);
        assert_eq!(at("198.18.0.10:80"), None);
        assert_eq!(r.destination_count(), 3);
    }

    #[test]
    fn an_update_rebuilds_only_the_clusters_it_changed() {
        let mut res = Resources::default();
        let services = ["a", "b", "c"];
        res.set_clusters(services.map(|s| cluster(s, LbPolicy::RoundRobin)));
        res.set_endpoints(services.map(|s| assignment(s, &[1, 1])));
        res.set_routes(services.map(route));
        let (node, aliases) = (node(), HostAliases::default());
        let first = res.build(&node, &aliases, &defaults(60));
        // Round robin moves on; a rebuild that keeps the handle keeps its place.
        let a = first.lookup("a").unwrap().clone();
        let next = a
            .balancer
            .pick(None, &[], crate::clock::now_ms())
            .map(|e| e.addr);

        // b's weights change: b alone is built again; the host map is shared.
        res.set_endpoints([assignment("b", &[3, 1])]);
        let second = res.build(&node, &aliases, &defaults(60));
        assert!(Arc::ptr_eq(&a, second.lookup("a").unwrap()));
        assert!(Arc::ptr_eq(
            first.lookup("c").unwrap(),
            second.lookup("c").unwrap()
        ));
        assert!(!Arc::ptr_eq(
            first.lookup("b").unwrap(),
            second.lookup("b").unwrap()
        ));
        assert_eq!(shares(&first, "b"), [20, 20]);
        assert_eq!(shares(&second, "b"), [30, 10]);
        assert!(Arc::ptr_eq(&first.hosts, &second.hosts));
        assert_ne!(
            second
                .lookup("a")
                .unwrap()
                .balancer
                .pick(None, &[], crate::clock::now_ms())
                .map(|e| e.addr),
            next,
            "the reused round robin went on from where it was"
        );
        // b's endpoints keep their states (in-flight counts, ejections).
        assert!(Arc::ptr_eq(
            &first.lookup("b").unwrap().balancer.endpoints()[0],
            &second.lookup("b").unwrap().balancer.endpoints()[0]
        ));

        // The same resources again change nothing; the same content sent
        // again is not a change.
        res.set_clusters(services.map(|s| cluster(s, LbPolicy::RoundRobin)));
        res.set_endpoints([assignment("b", &[3, 1])]);
        res.set_routes(services.map(route));
        let third = res.build(&node, &aliases, &defaults(60));
        for s in services {
            assert!(Arc::ptr_eq(
                second.lookup(s).unwrap(),
                third.lookup(s).unwrap()
            ));
        }
        assert!(Arc::ptr_eq(&second.hosts, &third.hosts));

        // A cluster's own resource changing rebuilds it.
        res.set_clusters([
            cluster("a", LbPolicy::RoundRobin),
            cluster("b", LbPolicy::RoundRobin),
            cluster("c", LbPolicy::LeastRequest),
        ]);
        let fourth = res.build(&node, &aliases, &defaults(60));
        assert_eq!(
            fourth.lookup("c").unwrap().balancer.policy(),
            Policy::LeastRequest
        );
        assert!(Arc::ptr_eq(
            third.lookup("a").unwrap(),
            fourth.lookup("a").unwrap()
        ));

        // Other default settings rebuild every cluster.
        let fifth = res.build(&node, &aliases, &defaults(30));
        for s in services {
            let c = fifth.lookup(s).unwrap();
            assert!(!Arc::ptr_eq(fourth.lookup(s).unwrap(), c));
            assert_eq!(c.pool.idle_timeout, Duration::from_secs(30));
        }

        // A cluster that goes takes its hosts with it; the others stay routed.
        res.set_clusters([
            cluster("a", LbPolicy::RoundRobin),
            cluster("c", LbPolicy::LeastRequest),
        ]);
        let sixth = res.build(&node, &aliases, &defaults(30));
        assert!(sixth.lookup("b").is_none());
        assert!(!res.endpoints().contains_key("b:80"));
        assert_eq!(&*sixth.lookup("c:80").unwrap().name, "c:80");
        assert_eq!(&*sixth.lookup("a.default").unwrap().name, "a:80");
        assert!(Arc::ptr_eq(
            fifth.lookup("c").unwrap(),
            sixth.lookup("c").unwrap()
        ));

        // A new route is routed at once.
        res.set_clusters([
            cluster("a", LbPolicy::RoundRobin),
            cluster("c", LbPolicy::LeastRequest),
            cluster("d", LbPolicy::Random),
        ]);
        res.set_endpoints([assignment("d", &[1])]);
        res.set_routes(["a", "c", "d"].map(route));
        let seventh = res.build(&node, &aliases, &defaults(30));
        assert_eq!(&*seventh.lookup("d.default.svc").unwrap().name, "d:80");
        assert_eq!(&*seventh.lookup("c").unwrap().name, "c:80");
    }
}
