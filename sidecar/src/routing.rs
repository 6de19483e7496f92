//! The sidecar's view of the mesh: authority -> cluster -> balancer. Built
//! from discovery resources off the request path and swapped in atomically;
//! a request holds the snapshot it started with until it completes, so a
//! config change never fails a request in flight.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use minimesh_proto::v1::{PortProtocol, UpstreamProtocol};

use crate::balance::Policy;
use crate::endpoint::EndpointState;

/// A cluster's balancer, over the sidecar's endpoint states.
pub type Balancer = crate::balance::Balancer<EndpointState>;
use crate::pool::PoolSettings;

mod build;
mod host_map;
pub mod routes;
mod tables;
pub use build::{validate_cluster, validate_endpoints, validate_route, HostAliases, Resources};
use host_map::HostMap;
use routes::RouteTable;
use tables::DestinationMap;

/// Where a request goes: a cluster, or a Service port's routes.
pub enum Target<'a> {
    /// Every request to this cluster.
    Cluster(&'a Arc<ClusterHandle>),
    /// The first route the request meets says.
    Routes(&'a RouteTable),
}

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
    loops: usize,
) -> Arc<ClusterHandle> {
    Arc::new(ClusterHandle {
        name: "inbound|app".into(),
        hash: None,
        balancer: Balancer::new(
            Policy::LeastRequest,
            0,
            vec![(EndpointState::joined(addr, workload.to_string(), loops), 1)],
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
    /// The routes of a Service port, by the index of the port's cluster
    /// (empty, or shorter than `handles`, where no port has routes).
    tables: Arc<Vec<Option<RouteTable>>>,
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

    /// Where a request goes: by the Service address a captured connection
    /// was sent to (`dst`), else by its authority, else the fallback.
    #[inline]
    pub fn target(&self, dst: Option<&SocketAddr>, authority: Option<&str>) -> Option<Target<'_>> {
        let by_dst = dst.and_then(|d| self.destinations.get(d)).map(|(i, _)| *i);
        let index = by_dst
            .or_else(|| {
                let a = authority?;
                let a = a.strip_suffix('.').unwrap_or(a);
                if a.bytes().any(|b| b.is_ascii_uppercase()) {
                    self.hosts.get(&a.to_ascii_lowercase()).copied()
                } else {
                    self.hosts.get(a).copied()
                }
            })
            // A gateway's routes for any host (a Gateway listener and
            // route with no hostname), only where nothing else matched.
            .or_else(|| self.hosts.get("*").copied());
        let Some(i) = index else {
            return self.fallback.as_ref().map(Target::Cluster);
        };
        if let Some(Some(t)) = self.tables.get(i as usize) {
            return Some(Target::Routes(t));
        }
        self.handles.get(i as usize).map(Target::Cluster)
    }

    /// The cluster at `index` (as routes name them).
    #[inline]
    pub fn handle(&self, index: u32) -> Option<&Arc<ClusterHandle>> {
        self.handles.get(index as usize)
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

/// Histogram of pick durations (nanoseconds).
pub struct PickHistogram(pub crate::histogram::Histogram<8>);

impl Default for PickHistogram {
    fn default() -> Self {
        PickHistogram(crate::histogram::Histogram::new(
            &crate::histogram::PICK_BUCKET_BOUNDS_NS,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimesh_proto::v1::{Cluster, ClusterLoadAssignment, Node, Route};
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
    fn a_gateway_routes_its_hosts_and_no_internal_name() {
        let mut res = Resources::default();
        res.set_clusters([
            cluster("web", LbPolicy::RoundRobin),
            cluster("backend", LbPolicy::RoundRobin),
        ]);
        res.set_endpoints([assignment("web", &[1]), assignment("backend", &[1])]);
        res.set_routes([route("web"), route("backend")]);
        let gateway = HostAliases {
            aliases: vec![("Web.Example".into(), "web.default".into())],
            fallback: None,
            only: true,
            labels: vec![],
        };
        let r = res.build(&node(), &gateway, &defaults(60));
        let to = |host: &str| r.lookup(host).map(|c| c.name.to_string());
        assert_eq!(to("web.example"), Some("web:80".into()));
        assert_eq!(to("web.example:80"), Some("web:80".into()));
        for internal in [
            "backend",
            "backend.default",
            "backend.default.svc.cluster.local:80",
            "web",
        ] {
            assert_eq!(to(internal), None, "{internal}");
        }
        // A sidecar routes every Service name, as before.
        let sidecar = HostAliases {
            only: false,
            ..gateway
        };
        let r = res.build(&node(), &sidecar, &defaults(60));
        assert_eq!(
            r.lookup("backend.default.svc.cluster.local")
                .map(|c| c.name.to_string()),
            Some("backend:80".into())
        );
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
