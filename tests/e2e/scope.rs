//! Scoping the control plane to some namespaces, as Istio's
//! discoverySelectors: `--namespace-selector` serves only namespaces whose
//! labels match (a namespace labelled or unlabelled comes in or goes at
//! once); `--watch-namespaces` watches only the listed ones.

use std::time::Duration;

use serde_json::{json, Value};

use crate::fake_kube::FakeKube;
use crate::harness::*;
use crate::kubernetes::{control_plane, spawn_control_plane};

fn namespace(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// A Service `web` in `ns` with one endpoint, `host`.
fn web_in(fake: &FakeKube, net: &Net, ns: &str, host: u8) {
    fake.apply(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 9090}]}
    }));
    fake.apply(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-abc", "namespace": ns, "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 9090}],
        "endpoints": [{"addresses": [net.ip(host).to_string()], "conditions": {"ready": true}}]
    }));
}

/// The namespaces whose `web` a sidecar has a cluster for.
fn served(config: &Value) -> Vec<String> {
    let mut out: Vec<String> = config["clusters"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(name, _)| {
            name.strip_prefix("web.")?
                .strip_suffix(".svc.cluster.local:80")
                .map(str::to_string)
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_selector_serves_only_the_labelled_namespaces() {
    let net = Net::new(113);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    let mesh = json!({"minimesh.io/discovery": "enabled"});
    fake.apply(namespace("a", mesh.clone()));
    fake.apply(namespace("b", json!({"team": "b"})));
    fake.apply(namespace("c", mesh.clone()));
    for (ns, host) in [("a", 1), ("b", 2), ("c", 3)] {
        web_in(&fake, &net, ns, host);
    }
    let _cp = control_plane(
        &net,
        &fake,
        "cp-0",
        254,
        &["--namespace-selector", "minimesh.io/discovery=enabled"],
    )
    .await;
    let _sc = net.sidecar(100, &[]).await;
    let admin = net.addr(100, 15000);
    wait_sidecar(admin, Duration::from_secs(10), |v| served(v) == ["a", "c"]).await;

    // b joins when labelled; a leaves when its label goes.
    fake.apply(namespace(
        "b",
        json!({"team": "b", "minimesh.io/discovery": "enabled"}),
    ));
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        served(v) == ["a", "b", "c"]
    })
    .await;
    fake.apply(namespace("a", json!({})));
    wait_sidecar(admin, Duration::from_secs(10), |v| served(v) == ["b", "c"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watched_namespaces_are_the_only_ones_read() {
    let net = Net::new(114);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    for (ns, host) in [("a", 1), ("b", 2), ("c", 3)] {
        web_in(&fake, &net, ns, host);
    }
    // Bound by namespaced Roles only, as docs/kubernetes.md offers, and
    // Istio's CRDs absent: discovery (not a forbidden cluster-wide list)
    // says Istio's rules are not served, so initial sync ends and the
    // control plane becomes ready (control_plane waits for /readyz).
    fake.namespaced_roles();
    let cp = control_plane(&net, &fake, "cp-0", 254, &["--watch-namespaces", "a,c"]).await;
    let _sc = net.sidecar(100, &[]).await;
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(10), |v| {
        served(v) == ["a", "c"]
    })
    .await;
    // Every list and watch of rules, Services and EndpointSlices named a
    // watched namespace: none was cluster-wide.
    let log = fake.log();
    let reads: Vec<&String> = log
        .iter()
        .filter(|l| l.starts_with("LIST ") || l.starts_with("WATCH "))
        .filter(|l| {
            ["destinationrules", "services", "endpointslices"]
                .iter()
                .any(|k| l.contains(k))
        })
        .collect();
    assert!(!reads.is_empty());
    assert!(
        reads
            .iter()
            .all(|l| l.contains(" in a") || l.contains(" in c")),
        "{reads:#?}\n{}",
        cp.log_text()
    );
}

/// A sidecar of namespace `ns` at .host, on the net's control plane.
async fn sidecar_in(net: &Net, host: u8, ns: &str) -> Proc {
    let args: Vec<String> = [
        "--xds-addr",
        &format!("http://{}", net.cp_xds()),
        "--workload",
        &format!("client-{host}"),
        "--namespace",
        ns,
        "--outbound",
        &net.addr(host, 15001).to_string(),
        "--admin",
        &net.addr(host, 15000).to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let p = net.spawn(&format!("sidecar-{host}"), "sidecar", &args, &[]);
    wait_http(net.addr(host, 15000), "/ready").await;
    p
}

/// The services (`name.namespace`) a sidecar has clusters for.
fn services(config: &Value) -> Vec<String> {
    let mut out: Vec<String> = config["clusters"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(name, _)| {
            name.strip_suffix(".svc.cluster.local:80")
                .map(str::to_string)
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_exported_to_some_namespaces_reaches_only_their_sidecars() {
    let net = Net::new(116);
    let svc = |name: &str, ns: &str, export: Option<&str>, host: u8| {
        let annotations = export
            .map(|e| format!("  annotations:\n    networking.istio.io/exportTo: \"{e}\"\n"))
            .unwrap_or_default();
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\n{annotations}spec:\n  ports:\n  - {{name: http, port: 80, targetPort: 9090}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-x\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: http, port: 9090}}]\nendpoints:\n- addresses: [\"{}\"]\n",
            net.ip(host)
        )
    };
    net.write(
        "a.yaml",
        &format!(
            "{}---\n{}",
            svc("web", "a", Some("."), 1),
            svc("api", "a", Some("c, b"), 2)
        ),
    );
    net.write("b.yaml", &svc("web", "b", None, 3));
    let _cp = net.control_plane().await;
    let _in_a = sidecar_in(&net, 100, "a").await;
    let _in_c = sidecar_in(&net, 101, "c").await;
    let _in_d = sidecar_in(&net, 102, "d").await;
    let expect = [
        // api.a is exported to c and b only, not to its own namespace
        // (that takes "."), as in Istio.
        (100, vec!["web.a", "web.b"]),
        (101, vec!["api.a", "web.b"]),
        (102, vec!["web.b"]),
    ];
    for (host, want) in &expect {
        wait_sidecar(net.addr(*host, 15000), Duration::from_secs(10), |v| {
            services(v) == *want
        })
        .await;
    }
    // Exported everywhere: now every sidecar gets it.
    net.write(
        "a.yaml",
        &format!(
            "{}---\n{}",
            svc("web", "a", Some("*"), 1),
            svc("api", "a", Some("c, b"), 2)
        ),
    );
    wait_sidecar(net.addr(102, 15000), Duration::from_secs(10), |v| {
        services(v) == ["web.a", "web.b"]
    })
    .await;
    // And traffic from a sidecar that may not see a service is not sent there.
    let (status, _, _) = get(net.addr(102, 15001), "api.a", "/")
        .await
        .expect("answer");
    assert_ne!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selector_the_api_server_cannot_parse_stops_the_start_naming_the_flag() {
    let net = Net::new(117);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    let mut cp = spawn_control_plane(
        &net,
        &fake,
        "cp",
        254,
        &["--namespace-selector", "team in (a, b"],
    );
    let status = cp.exited(Duration::from_secs(20)).await;
    assert!(!status.success());
    let log = cp.log_text();
    assert!(
        log.contains("--namespace-selector \"team in (a, b\": unable to parse requirement"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_namespaced_roles_istios_rules_are_read_where_installed() {
    let net = Net::new(121);
    let fake = FakeKube::start_with(net.addr(250, 6443), true).await;
    web_in(&fake, &net, "a", 1);
    fake.apply(json!({
        "apiVersion": "networking.istio.io/v1", "kind": "DestinationRule",
        "metadata": {"name": "web", "namespace": "a"},
        "spec": {"host": "web", "trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}}
    }));
    fake.namespaced_roles();
    // Ready (control_plane waits for /readyz), and Istio's rule, read in
    // the watched namespace, reaches the sidecars.
    let cp = control_plane(&net, &fake, "cp-0", 254, &["--watch-namespaces", "a"]).await;
    let _sc = sidecar_in(&net, 100, "a").await;
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(10), |v| {
        v["clusters"]["web.a.svc.cluster.local:80"]["policy"] == "RANDOM"
    })
    .await;
    assert!(
        !cp.log_text().contains("Forbidden"),
        "no forbidden read: {}",
        cp.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_says_what_it_waits_for() {
    let net = Net::new(123);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    // An API server answering nothing but 429: no list completes.
    fake.throttle_every(1);
    let cp = spawn_control_plane(&net, &fake, "cp-0", 254, &["--watch-namespaces", "a"]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let said = loop {
        if let Ok((503, _, body)) = get(net.addr(254, 15014), "localhost", "/readyz").await {
            if body.contains("waiting for") {
                break body;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "{}", cp.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        said,
        "config not synced yet: waiting for API discovery of networking.istio.io/v1\n"
    );
    // The API server answers again: ready.
    fake.throttle_every(0);
    wait_http(net.addr(254, 15014), "/readyz").await;
}
