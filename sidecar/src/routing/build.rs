//! Building the routing table from discovery resources: the clusters,
//! endpoint assignments and routes last accepted, validated on the way in,
//! and rebuilt incrementally (a cluster whose inputs did not change keeps
//! its balancer, endpoint states and counters; the host and destination maps
//! are kept while the routes and the set of clusters stay the same).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, HealthStatus, Node, Route, UpstreamProtocol,
};

use super::host_map::HostMap;
use super::routes::RouteTable;
use super::tables::{destination_map, gateway_hosts, host_map, route_tables, DestinationMap};
use super::{Balancer, ClusterHandle, HashPolicy, PickHistogram, Routing};
use crate::balance::Policy;
use crate::endpoint::EndpointState;
use crate::pool::PoolSettings;

/// Where requests for hosts outside the mesh's names go (gateway mode).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostAliases {
    /// Extra authority -> `service.namespace`.
    pub aliases: Vec<(String, String)>,
    /// `service.namespace` for any other authority.
    pub fallback: Option<String>,
    /// Only these hosts (the gateway): the mesh's own Service names are not
    /// routed, so that a Host naming an internal Service reaches none from
    /// outside (404) unless an alias or the fallback says so. Such a
    /// gateway also serves the hosts of the Istio Gateways its `labels`
    /// match.
    pub only: bool,
    /// The gateway's labels (`--labels`).
    pub labels: Vec<(String, String)>,
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
    built_tables: Arc<Vec<Option<RouteTable>>>,
    built_fallback: Option<u32>,
    inflight: HashMap<String, Arc<std::sync::atomic::AtomicU32>>,
    retries_inflight: HashMap<String, Arc<std::sync::atomic::AtomicU32>>,
    budgets: HashMap<String, Arc<crate::retry::Budget>>,
    picks: HashMap<String, Arc<PickHistogram>>,
    /// This sidecar's mesh TLS, which dials the endpoints that run a
    /// sidecar (none: every endpoint plaintext).
    mesh: Option<Arc<crate::tls::Mesh>>,
    /// The sidecar's event loops: each endpoint keeps its counters and idle
    /// connections per loop.
    loops: usize,
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

/// Checks a route: each of its ports' HTTP routes compiles.
pub fn validate_route(r: &Route) -> Result<(), String> {
    for pc in &r.ports {
        RouteTable::compile(&pc.http_routes, &|_| Some(0))
            .map_err(|e| format!("port {}: {e}", pc.port))?;
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
            .map(|r| match r.gateway.as_str() {
                "" => (format!("{}.{}", r.service, r.namespace), r),
                gw => (format!("{gw}|{}", r.service), r),
            })
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

    /// The resources of a sidecar served by `loops` event loops, whose
    /// endpoints that run a sidecar are dialed with `mesh` (its mesh TLS;
    /// none: plaintext).
    pub fn of_sidecar(mesh: Option<Arc<crate::tls::Mesh>>, loops: usize) -> Resources {
        Resources {
            mesh,
            loops,
            ..Resources::default()
        }
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
                        EndpointState::joined(addr, e.pod.clone(), self.loops)
                    } else {
                        // Present when the cluster first arrived: no slow start.
                        EndpointState::present_from_start(addr, e.pod.clone(), self.loops)
                    }
                });
                state
                    .pool()
                    .set_mtls(e.mtls, &e.service_accounts, self.mesh.as_ref());
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
            let (mut hosts, fallback) = host_map(&self.routes, &clusters, node, aliases);
            let mut tables = route_tables(&self.routes, &clusters);
            if aliases.only {
                gateway_hosts(&self.routes, &clusters, aliases, &mut hosts, &mut tables);
            }
            self.built_hosts = Arc::new(hosts);
            self.built_destinations = Arc::new(destination_map(&self.routes, &clusters));
            self.built_tables = Arc::new(tables);
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
            tables: self.built_tables.clone(),
            handles,
            clusters,
            fallback,
            zone,
        }
    }
}
