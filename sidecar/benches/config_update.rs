//! What a config update costs a sidecar in a mesh of many services: the
//! routing table's first build, and its rebuild after one service's
//! endpoints change (the median of 21), for 10, 100 and 1,000 services of
//! 10 endpoints each (one port, LEAST_REQUEST). The rebuild runs on an
//! event loop, between requests.
//! `cargo bench -p minimesh-sidecar --bench config_update`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, Endpoint, HealthStatus, LbPolicy, Node, PortCluster, Route,
};
use minimesh_sidecar::pool::PoolSettings;
use minimesh_sidecar::routing::{HostAliases, Resources};

fn mesh(services: usize) -> Resources {
    let (mut clusters, mut endpoints, mut routes) = (vec![], vec![], vec![]);
    for s in 0..services {
        let service = format!("svc-{s}");
        let name = format!("{service}.default.svc.cluster.local:80");
        clusters.push(Cluster {
            name: name.clone(),
            service: service.clone(),
            namespace: "default".into(),
            port: 80,
            policy: LbPolicy::LeastRequest as i32,
            ..Default::default()
        });
        endpoints.push(assignment(&name, s, 0));
        routes.push(Route {
            service,
            namespace: "default".into(),
            ports: vec![PortCluster {
                port: 80,
                cluster: name,
                ..Default::default()
            }],
            default_port: 80,
            ..Default::default()
        });
    }
    let mut r = Resources::default();
    r.set_clusters(clusters);
    r.set_endpoints(endpoints);
    r.set_routes(routes);
    r
}

fn assignment(name: &str, s: usize, generation: u32) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: (0..10)
            .map(|i| Endpoint {
                address: format!("10.{}.{}.{}:9090", s >> 8, s & 255, i + 1),
                weight: 1 + generation % 2,
                health: HealthStatus::Healthy as i32,
                zone: String::new(),
                pod: format!("svc-{s}-{i}"),
                mtls: false,
                service_accounts: vec![],
            })
            .collect(),
    }
}

fn main() {
    let node = Node {
        namespace: "default".into(),
        ..Default::default()
    };
    let aliases = HostAliases::default();
    let defaults = PoolSettings {
        connect_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(3600),
        max_requests_per_connection: 0,
        max_connection_ms: 0,
        max_streams: 0,
    };
    println!(
        "{:>9} {:>14} {:>28}",
        "services", "first build", "one service changed (median)"
    );
    for services in [10, 100, 1_000] {
        let mut r = mesh(services);
        let first = Instant::now();
        black_box(r.build(&node, &aliases, &defaults));
        let first = first.elapsed();
        let name = "svc-0.default.svc.cluster.local:80".to_string();
        let mut times: Vec<Duration> = (0..21u32)
            .map(|g| {
                r.set_endpoints([assignment(&name, 0, g + 1)]);
                let t = Instant::now();
                black_box(r.build(&node, &aliases, &defaults));
                t.elapsed()
            })
            .collect();
        times.sort();
        println!("{services:>9} {first:>14.1?} {:>28.1?}", times[10]);
    }
}
