//! Envoy's side of xDS v3, spoken with Envoy's own messages (the
//! `envoy-types` crate's generated client) as Envoy with
//! deploy/envoy/bootstrap.yaml speaks it: clusters and endpoints by
//! incremental (delta) ADS, the outbound route configuration by state of the
//! world, and load reports per endpoint. Envoy itself cannot be installed on
//! these machines; gRPC's xDS client, the other real v3 client, is in
//! xds_v3.rs.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address::PortSpecifier, Address, Node, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint::HostIdentifier, ClusterLoadAssignment, ClusterStats, UpstreamEndpointStats,
    UpstreamLocalityStats,
};
use envoy_types::pb::envoy::config::route::v3::{route, RouteConfiguration};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest,
};
use envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_client::LoadReportingServiceClient;
use envoy_types::pb::envoy::service::load_stats::v3::LoadStatsRequest;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use minimesh_proto::prost::Message;
use minimesh_proto::xds_v3::{
    CLUSTER_TYPE, ENDPOINTS_TYPE, OUTBOUND_ROUTE_CONFIG, ROUTE_CONFIG_TYPE,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::harness::*;
use crate::protocol::next;

const CLUSTER: &str = "backend.default.svc.cluster.local:80";

fn node() -> Node {
    Node {
        id: "envoy-1".into(),
        cluster: "envoy".into(),
        ..Default::default()
    }
}

/// The first resource of a delta response, decoded.
fn first_of<M: Message + Default>(resp: &DeltaDiscoveryResponse) -> M {
    let any = resp.resources[0].resource.as_ref().expect("a resource");
    M::decode(any.value.as_slice()).expect("the response's type")
}

/// The first policy Envoy would take from a cluster's list (it skips
/// `WrrLocality`, which is for gRPC).
fn envoy_policy(c: &Cluster) -> String {
    c.load_balancing_policy
        .as_ref()
        .expect("load_balancing_policy")
        .policies
        .iter()
        .filter_map(|p| p.typed_extension_config.as_ref()?.typed_config.as_ref())
        .map(|a| {
            a.type_url
                .rsplit('.')
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .find(|t| t != "WrrLocality")
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_client_gets_clusters_by_delta_and_routes_by_state_of_the_world() {
    let net = Net::new(107);
    net.service("backend", &[1, 2]);
    net.rule(
        "rule.yaml",
        "backend",
        "consistentHash:\n  httpHeaderName: x-user",
    );
    let _cp = net.control_plane().await;
    let mut ads = AggregatedDiscoveryServiceClient::connect(format!("http://{}", net.cp_xds()))
        .await
        .expect("connect");

    // Delta: clusters (wildcard), then the endpoints of the one it got.
    let (tx, rx) = mpsc::channel(8);
    tx.send(DeltaDiscoveryRequest {
        node: Some(node()),
        type_url: CLUSTER_TYPE.into(),
        ..Default::default()
    })
    .await
    .expect("send");
    let mut delta = ads
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("delta stream")
        .into_inner();
    let clusters = next(&mut delta).await;
    assert_eq!(clusters.type_url, CLUSTER_TYPE);
    let names: Vec<&str> = clusters.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, [CLUSTER]);
    let c: Cluster = first_of(&clusters);
    assert_eq!(envoy_policy(&c), "RingHash");
    assert_eq!(
        c.eds_cluster_config
            .as_ref()
            .map(|e| e.service_name.as_str()),
        Some(CLUSTER)
    );
    assert!(c.lrs_server.is_some(), "load is reported to minimesh");
    tx.send(DeltaDiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        response_nonce: clusters.nonce.clone(),
        ..Default::default()
    })
    .await
    .expect("ack");
    tx.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE.into(),
        resource_names_subscribe: vec![CLUSTER.into()],
        ..Default::default()
    })
    .await
    .expect("subscribe");
    let eps = next(&mut delta).await;
    assert_eq!(eps.type_url, ENDPOINTS_TYPE);
    let cla = ClusterLoadAssignment::decode(
        eps.resources[0]
            .resource
            .as_ref()
            .expect("resource")
            .value
            .as_slice(),
    )
    .expect("a ClusterLoadAssignment");
    let mut addrs: Vec<String> = cla
        .endpoints
        .iter()
        .flat_map(|l| &l.lb_endpoints)
        .filter_map(|e| match &e.host_identifier {
            Some(HostIdentifier::Endpoint(ep)) => match &ep.address.as_ref()?.address {
                Some(address::Address::SocketAddress(s)) => Some(format!(
                    "{}:{}",
                    s.address,
                    match s.port_specifier {
                        Some(PortSpecifier::PortValue(p)) => p,
                        _ => 0,
                    }
                )),
                _ => None,
            },
            _ => None,
        })
        .collect();
    addrs.sort();
    assert_eq!(
        addrs,
        [net.addr(1, 9090).to_string(), net.addr(2, 9090).to_string()]
    );
    tx.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE.into(),
        response_nonce: eps.nonce.clone(),
        ..Default::default()
    })
    .await
    .expect("ack");

    // A rule change: the changed cluster comes first (alone: there is one).
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    let changed = next(&mut delta).await;
    assert_eq!(changed.type_url, CLUSTER_TYPE);
    assert_eq!(changed.resources.len(), 1);
    let c: Cluster = first_of(&changed);
    assert_eq!(envoy_policy(&c), "Random");
    tx.send(DeltaDiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        response_nonce: changed.nonce.clone(),
        ..Default::default()
    })
    .await
    .expect("ack");

    // PEAK_EWMA has no standard policy: Envoy is sent least request, and the
    // rule's status says so.
    net.rule("rule.yaml", "backend", "simple: PEAK_EWMA");
    let changed = loop {
        // The previous change's endpoints (their layout follows the policy).
        let r = next(&mut delta).await;
        if r.type_url == CLUSTER_TYPE {
            break r;
        }
    };
    let c: Cluster = first_of(&changed);
    assert_eq!(envoy_policy(&c), "LeastRequest");
    let config = wait_cp_config(&net, |v| v["rules"][0]["policy"] == "PEAK_EWMA").await;
    assert_eq!(
        config["rules"][0]["message"],
        "xDS v3 clients (Envoy, proxyless gRPC) have no PEAK_EWMA: they are sent LEAST_REQUEST, the nearest standard policy (gRPC's C core, which lacks it, balances round robin)",
        "{config:#}"
    );

    // State of the world: the outbound route configuration that
    // deploy/envoy/bootstrap.yaml names.
    let bootstrap = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/envoy/bootstrap.yaml"),
    )
    .expect("bootstrap");
    assert!(
        bootstrap.contains(&format!("route_config_name: {OUTBOUND_ROUTE_CONFIG}")),
        "{bootstrap}"
    );
    assert!(bootstrap.contains("port_value: 15010"), "{bootstrap}");
    let (tx, rx) = mpsc::channel(8);
    tx.send(DiscoveryRequest {
        node: Some(node()),
        type_url: ROUTE_CONFIG_TYPE.into(),
        resource_names: vec![OUTBOUND_ROUTE_CONFIG.into()],
        ..Default::default()
    })
    .await
    .expect("send");
    let mut sotw = ads
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("sotw stream")
        .into_inner();
    let routes = next(&mut sotw).await;
    assert_eq!(routes.resources.len(), 1);
    let rc = RouteConfiguration::decode(routes.resources[0].value.as_slice())
        .expect("a RouteConfiguration");
    let vh = rc
        .virtual_hosts
        .iter()
        .find(|v| v.name == CLUSTER)
        .expect("a virtual host for the backend");
    for d in [
        "backend.default.svc.cluster.local:80",
        "backend.default:80",
        "backend.default",
    ] {
        assert!(vh.domains.iter().any(|x| x == d), "{d} in {:?}", vh.domains);
    }
    match &vh.routes[0].action {
        Some(route::Action::Route(a)) => {
            assert_eq!(
                a.timeout.as_ref().map(|t| t.seconds),
                Some(0),
                "no route timeout"
            );
        }
        other => panic!("{other:?}"),
    }

    // Both streams are listed as proxies, with Envoy's protocol.
    let proxies = wait_cp_json(&net, "/debug/proxies", |v| {
        v.as_array().is_some_and(|a| a.len() == 2)
    })
    .await;
    let mut kinds: Vec<&str> = proxies
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["protocol"].as_str())
        .collect();
    kinds.sort();
    assert_eq!(kinds, ["xds-v3 delta", "xds-v3 sotw"]);
    // What a sidecar ACKs (`minimesh up` waits for it) is minimesh's five
    // types only, though the cache holds Envoy's too.
    let versions = get_json(net.cp_admin(), "/debug/versions").await;
    let types: Vec<&String> = versions.as_object().expect("object").keys().collect();
    assert_eq!(
        types,
        [
            "Authorization",
            "Cluster",
            "ClusterLoadAssignment",
            "PeerAuthentication",
            "Route"
        ],
        "{versions}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_load_reports_per_endpoint_are_counted() {
    let net = Net::new(108);
    net.service("backend", &[1, 2]);
    let _cp = net
        .control_plane_with(&["--load-report-interval", "1s", "--load-window", "60s"])
        .await;
    let mut lrs = LoadReportingServiceClient::connect(format!("http://{}", net.cp_xds()))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(8);
    tx.send(LoadStatsRequest {
        node: Some(node()),
        cluster_stats: vec![],
    })
    .await
    .expect("send");
    let mut resp = lrs
        .stream_load_stats(ReceiverStream::new(rx))
        .await
        .expect("lrs stream")
        .into_inner();
    let asked = next(&mut resp).await;
    assert!(asked.send_all_clusters && asked.report_endpoint_granularity);
    assert_eq!(asked.load_reporting_interval.map(|d| d.seconds), Some(1));
    let endpoint = |h: u8, ok: u64, err: u64| UpstreamEndpointStats {
        address: Some(Address {
            address: Some(address::Address::SocketAddress(SocketAddress {
                address: net.ip(h).to_string(),
                port_specifier: Some(PortSpecifier::PortValue(9090)),
                ..Default::default()
            })),
        }),
        total_issued_requests: ok + err,
        total_successful_requests: ok,
        total_error_requests: err,
        ..Default::default()
    };
    tx.send(LoadStatsRequest {
        node: None,
        cluster_stats: vec![ClusterStats {
            cluster_name: CLUSTER.into(),
            upstream_locality_stats: vec![UpstreamLocalityStats {
                upstream_endpoint_stats: vec![endpoint(1, 90, 10), endpoint(2, 50, 0)],
                ..Default::default()
            }],
            load_report_interval: Some(PbDuration {
                seconds: 1,
                nanos: 0,
            }),
            ..Default::default()
        }],
    })
    .await
    .expect("report");
    let view = wait_cp_json(&net, "/debug/load", |v| {
        v["clusters"][CLUSTER][net.addr(2, 9090).to_string()]["requests"] == 50
    })
    .await;
    let e1 = &view["clusters"][CLUSTER][net.addr(1, 9090).to_string()];
    assert_eq!(
        (
            &e1["requests"],
            &e1["succeeded"],
            &e1["failed"],
            &e1["reporters"]
        ),
        (
            &serde_json::json!(100),
            &serde_json::json!(90),
            &serde_json::json!(10),
            &serde_json::json!(1)
        ),
        "{view:#}"
    );
    gauge_becomes(&net, "minimesh_load_reporters_connected", 1).await;
}

/// deploy/envoy/bootstrap.yaml is a valid `envoy.config.bootstrap.v3.Bootstrap`
/// by Envoy's own descriptors (which `envoy-types` ships): every field name,
/// type, enum value and `@type` is one Envoy knows. Envoy's semantic checks
/// (its protoc-gen-validate rules) are not run here: Envoy cannot be
/// installed where the tests run.
#[test]
fn the_envoy_bootstrap_is_envoys() {
    // Envoy's descriptors nest deeply: reading them takes more than a test
    // thread's stack.
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(check_envoy_bootstrap)
        .expect("thread")
        .join()
        .expect("the bootstrap check passed");
}

fn check_envoy_bootstrap() {
    // Where cargo keeps envoy-types: this platform's dependency graph, as
    // already downloaded for the build.
    let rustc = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc runs");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("rustc names its host");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let meta = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--offline",
            "--filter-platform",
            &host,
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    let meta: serde_json::Value = serde_json::from_slice(&meta.stdout).expect("metadata");
    let manifest = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "envoy-types")
        .and_then(|p| p["manifest_path"].as_str())
        .expect("envoy-types in the dependency graph");
    let types = std::path::Path::new(manifest).with_file_name("src/generated/types.bin");
    let pool = prost_reflect::DescriptorPool::decode(
        std::fs::read(&types)
            .expect("envoy-types' descriptors")
            .as_slice(),
    )
    .expect("descriptors");
    let bootstrap = pool
        .get_message_by_name("envoy.config.bootstrap.v3.Bootstrap")
        .expect("Bootstrap");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/envoy/bootstrap.yaml");
    let text = std::fs::read_to_string(&path).expect("bootstrap");
    let parse = |text: &str| {
        let yaml: serde_json::Value = serde_saphyr::from_str(text).expect("YAML");
        prost_reflect::DynamicMessage::deserialize(bootstrap.clone(), yaml)
    };
    // A misspelt field is refused, as Envoy refuses it.
    let typo = parse(&text.replace("route_config_name:", "route_config_nam:"))
        .expect_err("a misspelt field is refused");
    assert!(typo.to_string().contains("route_config_nam"), "{typo}");
    let msg = parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let bytes = minimesh_proto::prost::Message::encode_to_vec(&msg);
    let b = envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap::decode(bytes.as_slice())
        .expect("a Bootstrap");
    // What minimesh relies on: clusters over ADS, load reports, and the
    // outbound listener routing with minimesh's outbound routes.
    let dynamic = b.dynamic_resources.expect("dynamic_resources");
    assert!(dynamic.ads_config.is_some() && dynamic.cds_config.is_some());
    assert!(b
        .cluster_manager
        .is_some_and(|c| c.load_stats_config.is_some()));
    let listener = &b.static_resources.expect("static_resources").listeners[0];
    let hcm = listener.filter_chains[0].filters[0]
        .config_type
        .as_ref()
        .and_then(|c| match c {
            envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(a) => {
                Some(a)
            }
            _ => None,
        })
        .expect("typed config");
    let hcm = envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager::decode(hcm.value.as_slice())
        .expect("an HttpConnectionManager");
    match hcm.route_specifier {
        Some(envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::RouteSpecifier::Rds(rds)) => {
            assert_eq!(rds.route_config_name, OUTBOUND_ROUTE_CONFIG)
        }
        other => panic!("{other:?}"),
    }
}
