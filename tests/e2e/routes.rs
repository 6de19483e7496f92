//! The route model through the real control plane and sidecar: a
//! VirtualService's canary split between a DestinationRule's subsets
//! (selected by pod labels), a header match, a redirect, a direct
//! response, a rewrite, header changes and an injected abort, each as a
//! caller sees it.

use std::collections::BTreeMap;
use std::time::Duration;

use http::Method;

use super::harness::*;

/// A Pod of the fake mesh: its name (as the EndpointSlice's targetRef),
/// address and labels.
fn pod(name: &str, ip: std::net::Ipv4Addr, version: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\n  labels: {{app: backend, version: {version}}}\nstatus:\n  podIP: \"{ip}\"\n---\n"
    )
}

const RULE: &str = "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: backend}\nspec:\n  host: backend\n  subsets:\n  - name: v1\n    labels: {version: v1}\n  - name: v2\n    labels: {version: v2}\n";

const ROUTES: &str = r#"apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: backend}
spec:
  hosts: [backend]
  http:
  - name: old-paths
    match: [{uri: {prefix: /old}}]
    redirect: {uri: /new, redirectCode: 302}
  - name: teapot
    match: [{uri: {exact: /teapot}}]
    directResponse: {status: 418}
  - name: broken
    match: [{uri: {exact: /broken}}]
    fault: {abort: {httpStatus: 503, percentage: {value: 100}}}
    route: [{destination: {host: backend, subset: v1}}]
  - name: api
    match: [{uri: {prefix: /api/}, method: {exact: GET}}]
    rewrite: {uri: /}
    headers: {request: {set: {x-routed: api}}}
    route: [{destination: {host: backend, subset: v1}}]
  - name: testers
    match:
    - headers: {x-canary: {exact: "yes"}}
    route: [{destination: {host: backend, subset: v2}}]
  - name: canary
    route:
    - destination: {host: backend, subset: v1}
      weight: 90
    - destination: {host: backend, subset: v2}
      weight: 10
      headers: {response: {set: {x-version: v2}}}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_split_and_matches_route_as_written() {
    let net = Net::new(136);
    let _v1 = net.backend(1, &[]).await;
    let _v2 = net.backend(2, &[]).await;
    net.service("backend", &[1, 2]);
    net.write(
        "pods.yaml",
        &(pod("backend-1", net.ip(1), "v1") + &pod("backend-2", net.ip(2), "v2")),
    );
    net.write("rule.yaml", RULE);
    net.write("vs.yaml", ROUTES);
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let subset = |s: &str| format!("backend.default.svc.cluster.local:80|{s}");
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(10), |v| {
        v["clusters"][subset("v1")]["endpoints"]
            .as_array()
            .is_some_and(|e| e.len() == 1)
            && v["clusters"][subset("v2")]["endpoints"]
                .as_array()
                .is_some_and(|e| e.len() == 1)
    })
    .await;
    let v1 = net.addr(1, 9090).to_string();
    let v2 = net.addr(2, 9090).to_string();

    // The split: 90/10 within 2 points over 2,000 requests; v2's answers
    // carry the header its destination sets.
    let mut c = Conn::open(net.addr(100, 15001)).await.expect("connect");
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..2000 {
        let (status, headers, body) = c
            .send(Method::GET, "backend", "/", &[], Default::default())
            .await
            .expect("answer");
        assert_eq!(status, 200, "request {i}: {body}");
        let ep = headers
            .get("x-minimesh-endpoint")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let marked = headers.get("x-version").is_some();
        assert_eq!(marked, ep == v2, "only v2's answers are marked ({ep})");
        *by.entry(ep).or_default() += 1;
    }
    let share = by.get(&v2).copied().unwrap_or(0) as f64 / 2000.0;
    assert!((0.08..=0.12).contains(&share), "v2 took {share:.3}: {by:?}");
    assert_eq!(by.len(), 2, "{by:?}");

    // The header match: every tester's request to v2.
    for _ in 0..50 {
        let (status, ep) = c
            .get_with("backend", "/", &[("x-canary", "yes")])
            .await
            .expect("answer");
        assert_eq!((status, ep.as_deref()), (200, Some(v2.as_str())));
    }

    // A redirect, a direct response and an abort answered by the sidecar.
    let (status, headers, _) = c
        .send(
            Method::GET,
            "backend",
            "/old/page?q=1",
            &[],
            Default::default(),
        )
        .await
        .expect("answer");
    assert_eq!(status, 302);
    assert_eq!(
        headers.get("location").and_then(|v| v.to_str().ok()),
        Some("http://backend/new?q=1")
    );
    let (status, _, _) = c
        .send(Method::GET, "backend", "/teapot", &[], Default::default())
        .await
        .expect("answer");
    assert_eq!(status, 418);
    let (status, _, body) = c
        .send(Method::GET, "backend", "/broken", &[], Default::default())
        .await
        .expect("answer");
    assert_eq!((status, body.trim()), (503, "minimesh: fault filter abort"));

    // The rewrite and the request header: fake-service echoes the path.
    let (status, ep, body) = {
        let (s, h, b) = c
            .send(
                Method::GET,
                "backend",
                "/api/users",
                &[],
                Default::default(),
            )
            .await
            .expect("answer");
        let ep = h
            .get("x-minimesh-endpoint")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        (s, ep, b)
    };
    assert_eq!((status, ep.as_deref()), (200, Some(v1.as_str())), "{body}");
    let echoed: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(echoed["uri"], "/users", "{body}");
    // A POST to /api/ meets no match of `api`: it takes the split.
    let (status, _, _) = c
        .send(
            Method::POST,
            "backend",
            "/api/users",
            &[],
            Default::default(),
        )
        .await
        .expect("answer");
    assert_eq!(status, 200);

    // `minimesh get routes` shows each route as it applies.
    let text = get_routes(&net);
    for line in [
        "  VirtualService/default/backend/testers: header x-canary=exact:yes -> backend.default subset v2 (100)",
        "  VirtualService/default/backend/api: path prefix:/api/ and method GET -> backend.default subset v1 (100)",
        "  VirtualService/default/backend/canary: every request -> backend.default subset v1 (90), backend.default subset v2 (10)",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} not in:\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["default", "backend", "backend.default", "mesh", "6", "true"]),
        "{text}"
    );
}

/// `minimesh get routes` against the test's control plane.
fn get_routes(net: &Net) -> String {
    let out = std::process::Command::new(bin("minimesh"))
        .args(["get", "routes", "--control-plane-admin"])
        .arg(net.cp_admin().to_string())
        .output()
        .expect("minimesh get");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The chapter's `simple-web-gateway-retry.yaml` in shape: a Gateway for
/// Istio's ingress gateway binding `simple-web.istioinaction.io` on port
/// 80, and a VirtualService bound to it routing that host to simple-web.
const GATEWAY: &str = r#"apiVersion: networking.istio.io/v1alpha3
kind: Gateway
metadata:
  name: simple-web-gateway
spec:
  selector:
    istio: ingressgateway
  servers:
  - port:
      number: 80
      name: http
      protocol: HTTP
    hosts:
    - "simple-web.istioinaction.io"
---
apiVersion: networking.istio.io/v1alpha3
kind: VirtualService
metadata:
  name: simple-web-vs-for-gateway
spec:
  hosts:
  - "simple-web.istioinaction.io"
  gateways:
  - simple-web-gateway
  http:
  - route:
    - destination:
        host: simple-web
    retries:
      attempts: 2
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingress_serves_only_the_hosts_its_gateway_binds() {
    let net = Net::new(138);
    let _web = net.backend(1, &[]).await;
    let _backend = net.backend(2, &[]).await;
    net.service("simple-web", &[1]);
    net.service("simple-backend", &[2]);
    net.write("gateway.yaml", GATEWAY);
    net.write(
        "unbound.yaml",
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: unbound}\nspec:\n  hosts: [unbound.istioinaction.io]\n  gateways: [nope]\n  http:\n  - route: [{destination: {host: simple-web}}]\n",
    );
    let _cp = net.control_plane().await;
    let gateway =
        |labels: &'static str| ["--mode", "gateway", "--labels", labels, "--debug-headers"];
    let _ingress = net
        .sidecar(100, &gateway("istio=ingressgateway,app=ingress"))
        .await;
    let _other = net.sidecar(101, &gateway("istio=egressgateway")).await;
    let web = net.addr(1, 9090).to_string();
    let mut c = Conn::open(net.addr(100, 15001)).await.expect("connect");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, ep) = c
            .get_with("simple-web.istioinaction.io", "/", &[])
            .await
            .expect("answer");
        if status == 200 {
            assert_eq!(ep.as_deref(), Some(web.as_str()));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never routed: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for host in [
        "simple-backend.default.svc.cluster.local",
        "simple-web.default.svc.cluster.local",
        "simple-web",
        "unbound.istioinaction.io",
    ] {
        let (status, _, body) = c
            .send(Method::GET, host, "/", &[], Default::default())
            .await
            .expect("answer");
        assert_eq!(
            (status, body.trim()),
            (404, format!("minimesh: no route for host {host}").as_str())
        );
    }
    // Status: the VirtualService bound to a Gateway that does not exist says so.
    let text = get_routes(&net);
    assert!(
        text.contains("  warning: spec.gateways: Gateway default/nope does not exist; its hosts are not served until it does"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l
                .starts_with("default          simple-web-gateway           istio=ingressgateway")),
        "{text}"
    );
    // A gateway the Gateway's selector does not pick serves none of it.
    let (status, _, _) = get(net.addr(101, 15001), "simple-web.istioinaction.io", "/")
        .await
        .expect("answer");
    assert_eq!(status, 404);
}

/// The chapter's gateway file (in shape) applied with the real kubectl to
/// an API server with Istio's CRDs: the control plane reads the Gateway and
/// the VirtualService, the ingress serves the host and 404s the rest, and
/// `kubectl delete` takes them away again. The file is the book's shape
/// at the book's version (`v1alpha3`), which the API server serves beside
/// the stored `v1`, as Istio's CRDs do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_the_books_gateway_and_deletes_it() {
    let gateway = GATEWAY;
    use crate::admission::kubectl;
    use crate::fake_kube::FakeKube;
    use crate::kubernetes::{control_plane, service, slice};
    let net = Net::new(139);
    let fake = FakeKube::start_with(net.addr(250, 6443), true).await;
    let _web = net.backend(1, &[]).await;
    fake.apply(service("simple-web"));
    fake.apply(slice(&net, "simple-web", &[(1, true)]));
    let _cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let (ok, out, err) = kubectl(&net, &["apply", "-n", NS, "-f", "-"], Some(gateway)).await;
    assert!(ok, "{out}{err}");
    assert_eq!(
        out.trim(),
        "gateway.networking.istio.io/simple-web-gateway created\nvirtualservice.networking.istio.io/simple-web-vs-for-gateway created"
    );
    let (ok, out, err) = kubectl(&net, &["get", "vs,gw", "-n", NS, "-o", "name"], None).await;
    assert!(ok, "{out}{err}");
    let _ingress = net
        .sidecar(
            100,
            &["--mode", "gateway", "--labels", "istio=ingressgateway"],
        )
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, _) = get(net.addr(100, 15001), "simple-web.istioinaction.io", "/")
            .await
            .expect("answer");
        if status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never routed: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _, _) = get(
        net.addr(100, 15001),
        "simple-web.default.svc.cluster.local",
        "/",
    )
    .await
    .expect("answer");
    assert_eq!(status, 404);
    let (ok, out, err) = kubectl(&net, &["delete", "-n", NS, "-f", "-"], Some(gateway)).await;
    assert!(ok, "{out}{err}");
    wait_cp_config(&net, |c| {
        c["virtualServices"]
            .as_array()
            .is_some_and(|v| v.is_empty())
            && c["gateways"].as_array().is_some_and(|g| g.is_empty())
    })
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, _) = get(net.addr(100, 15001), "simple-web.istioinaction.io", "/")
            .await
            .expect("answer");
        if status == 404 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still routed: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// On Kubernetes, a subset selects endpoints by the labels of their Pods,
/// meshed or not (the control plane watches every Pod, with no CA too),
/// and follows a Pod's labels as they change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kubernetes_subsets_select_unmeshed_pods_by_their_labels() {
    use crate::fake_kube::FakeKube;
    use crate::kubernetes::{control_plane, service, slice};
    let net = Net::new(143);
    let fake = FakeKube::start_with(net.addr(250, 6443), true).await;
    let _v1 = net.backend(1, &[]).await;
    let _v2 = net.backend(2, &[]).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true), (2, true)]));
    let pod = |h: u8, version: &str| {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("backend-{h}"), "namespace": NS,
                         "labels": {"app": "backend", "version": version}},
            "spec": {"containers": [{"name": "app", "image": "backend"}]},
            "status": {"podIP": net.ip(h).to_string()}
        })
    };
    fake.apply(pod(1, "v1"));
    fake.apply(pod(2, "v2"));
    let to_v2 = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: backend}\nspec:\n  hosts: [backend]\n  http:\n  - route: [{destination: {host: backend, subset: v2}}]\n";
    for doc in [RULE, to_v2] {
        let mut v: serde_json::Value = serde_saphyr::from_str(doc).expect("YAML");
        v["metadata"]["namespace"] = NS.into();
        fake.apply(v);
    }
    let _cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let _sc = net.sidecar(100, &[]).await;
    let (v1, v2) = (net.addr(1, 9090).to_string(), net.addr(2, 9090).to_string());
    let mut c = Conn::open(net.addr(100, 15001)).await.expect("connect");
    // Routed to v2's pod only.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, ep) = c.get_with("backend", "/", &[]).await.expect("answer");
        if status == 200 && ep.as_deref() == Some(v2.as_str()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never routed: {status} {ep:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..50 {
        let (status, ep) = c.get_with("backend", "/", &[]).await.expect("answer");
        assert_eq!(
            (status, ep.as_deref()),
            (200, Some(v2.as_str())),
            "request {i}"
        );
    }
    // Pod backend-1 relabelled v2: the subset now has both.
    fake.apply(pod(1, "v2"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, ep) = c.get_with("backend", "/", &[]).await.expect("answer");
        assert_eq!(status, 200);
        if ep.as_deref() == Some(v1.as_str()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "backend-1 never joined subset v2"
        );
    }
}
