//! The Kubernetes Gateway API's HTTPRoute through the real control plane,
//! gateway and sidecar: the cases of the Gateway API conformance suite's
//! core HTTPRoute tests (simple same-namespace route, path and header
//! matching, weights, header modifiers, rewrite, redirect, timeouts) as
//! our own, at a Gateway of class `minimesh` and on a Service (GAMMA);
//! status conditions as the spec defines them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use http::Method;

use super::harness::*;

const GATEWAY: &str = "apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: same-namespace}
spec:
  gatewayClassName: minimesh
  listeners:
  - {name: http, port: 80, protocol: HTTP}
";

const ROUTES: &str = r#"apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: gateway-conformance}
spec:
  parentRefs: [{name: same-namespace}]
  rules:
  - backendRefs: [{name: infra-backend-v1, port: 80}]
  - matches: [{path: {type: PathPrefix, value: /v2}}]
    backendRefs: [{name: infra-backend-v2, port: 80}]
  - matches: [{headers: [{name: version, value: three}]}]
    backendRefs: [{name: infra-backend-v3, port: 80}]
  - matches: [{path: {type: PathPrefix, value: /prefix/one}}]
    filters:
    - type: URLRewrite
      urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /one}}
    - type: ResponseHeaderModifier
      responseHeaderModifier: {add: [{name: X-Header-Add, value: added}]}
    backendRefs: [{name: infra-backend-v1, port: 80}]
  - matches: [{path: {type: Exact, value: /redirect}}]
    filters:
    - type: RequestRedirect
      requestRedirect: {hostname: example.org, statusCode: 301}
  - matches: [{path: {type: Exact, value: /slow}}]
    timeouts: {request: 500ms}
    backendRefs: [{name: slow, port: 80}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: mesh-split}
spec:
  parentRefs: [{group: "", kind: Service, name: web, port: 80}]
  rules:
  - matches: [{headers: [{name: x-canary, value: "yes"}]}]
    backendRefs: [{name: infra-backend-v2, port: 80}]
  - backendRefs:
    - {name: infra-backend-v1, port: 80, weight: 90}
    - {name: infra-backend-v2, port: 80, weight: 10}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: missing-backend}
spec:
  parentRefs: [{name: same-namespace}]
  hostnames: [missing.example.com]
  rules:
  - backendRefs: [{name: no-such-service, port: 80}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: conflicting}
spec:
  parentRefs: [{group: "", kind: Service, name: routed}]
  rules:
  - backendRefs: [{name: infra-backend-v3, port: 80}]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: routed}
spec:
  hosts: [routed]
  http:
  - route: [{destination: {host: infra-backend-v1}}]
"#;

fn condition<'a>(route: &'a serde_json::Value, parent: usize, kind: &str) -> &'a serde_json::Value {
    route["parents"][parent]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == kind))
        .unwrap_or(&serde_json::Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_suites_core_httproute_cases_hold() {
    let net = Net::new(140);
    let _v1 = net.backend(1, &[]).await;
    let _v2 = net.backend(2, &[]).await;
    let _v3 = net.backend(3, &[]).await;
    let _slow = net.backend(4, &[("TIMING_50_PERCENTILE", "1s")]).await;
    for (name, host) in [
        ("infra-backend-v1", 1),
        ("infra-backend-v2", 2),
        ("infra-backend-v3", 3),
        ("slow", 4),
        ("web", 1),
        ("routed", 1),
    ] {
        net.service(name, &[host]);
    }
    net.write("gateway.yaml", GATEWAY);
    net.write("routes.yaml", ROUTES);
    let _cp = net.control_plane().await;
    let _gw = net
        .sidecar(
            100,
            &[
                "--mode",
                "gateway",
                "--labels",
                "gateway.networking.k8s.io/gateway-name=same-namespace",
                "--debug-headers",
            ],
        )
        .await;
    let _sc = net.sidecar(101, &[]).await;
    let ep = |h: u8| Some(net.addr(h, 9090).to_string());
    let mut gw = Conn::open(net.addr(100, 15001)).await.expect("connect");
    // Simple same-namespace route: any host, to v1 (once it is served).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, e) = gw
            .get_with("any.example.com", "/", &[])
            .await
            .expect("answer");
        if status == 200 {
            assert_eq!(e, ep(1));
            break;
        }
        assert!(Instant::now() < deadline, "never routed: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Matching: a path prefix, a header.
    for (path, headers, want) in [
        ("/v2", &[][..], 2),
        ("/v2/example", &[], 2),
        ("/v2example", &[], 1),
        ("/", &[("version", "three")][..], 3),
        ("/v2", &[("version", "three")], 2),
    ] {
        let (status, e) = gw
            .get_with("any.example.com", path, headers)
            .await
            .expect("answer");
        assert_eq!((status, e), (200, ep(want)), "{path} {headers:?}");
    }
    // Rewrite and response header modifier.
    let (status, headers, body) = gw
        .send(
            Method::GET,
            "any.example.com",
            "/prefix/one/two",
            &[],
            Default::default(),
        )
        .await
        .expect("answer");
    assert_eq!(status, 200, "{body}");
    let echoed: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(echoed["uri"], "/one/two");
    assert_eq!(
        headers.get("x-header-add").and_then(|v| v.to_str().ok()),
        Some("added")
    );
    // Redirect.
    let (status, headers, _) = gw
        .send(
            Method::GET,
            "any.example.com",
            "/redirect",
            &[],
            Default::default(),
        )
        .await
        .expect("answer");
    assert_eq!(status, 301);
    assert_eq!(
        headers.get("location").and_then(|v| v.to_str().ok()),
        Some("http://example.org/redirect")
    );
    // Timeouts: the request ends at 500 ms with 504.
    let started = Instant::now();
    let (status, _) = gw
        .get_with("any.example.com", "/slow", &[])
        .await
        .expect("answer");
    let took = started.elapsed();
    assert_eq!(status, 504);
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(900),
        "{took:?}"
    );

    // GAMMA: the Service's callers split 90/10 (within 2 points over 2,000)
    // and the header match takes every tester's call.
    let mut sc = Conn::open(net.addr(101, 15001)).await.expect("connect");
    let mut by: BTreeMap<Option<String>, u32> = BTreeMap::new();
    for _ in 0..2000 {
        let (status, e) = sc.get_with("web", "/", &[]).await.expect("answer");
        assert_eq!(status, 200);
        *by.entry(e).or_default() += 1;
    }
    let v2 = f64::from(by.get(&ep(2)).copied().unwrap_or(0)) / 2000.0;
    assert!((0.08..=0.12).contains(&v2), "v2 took {v2:.3}: {by:?}");
    for _ in 0..20 {
        let (_, e) = sc
            .get_with("web", "/", &[("x-canary", "yes")])
            .await
            .expect("answer");
        assert_eq!(e, ep(2));
    }
    // The VirtualService for `routed` takes precedence over the HTTPRoute.
    let (_, e) = sc.get_with("routed", "/", &[]).await.expect("answer");
    assert_eq!(e, ep(1));

    // Status, as the spec's conditions.
    let cfg = get_json(net.cp_admin(), "/debug/config").await;
    let route = |name: &str| {
        cfg["httpRoutes"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("{name} in {cfg:#}"))
    };
    let ok = route("gateway-conformance");
    assert_eq!(condition(&ok, 0, "Accepted")["status"], "True");
    assert_eq!(condition(&ok, 0, "ResolvedRefs")["status"], "True");
    let missing = route("missing-backend");
    assert_eq!(condition(&missing, 0, "Accepted")["status"], "True");
    assert_eq!(condition(&missing, 0, "ResolvedRefs")["status"], "False");
    assert_eq!(
        condition(&missing, 0, "ResolvedRefs")["reason"],
        "BackendNotFound"
    );
    let (status, _) = gw
        .get_with("missing.example.com", "/", &[])
        .await
        .expect("answer");
    assert_eq!(status, 503);
    let out = std::process::Command::new(bin("minimesh"))
        .args(["get", "routes", "--control-plane-admin"])
        .arg(net.cp_admin().to_string())
        .output()
        .expect("minimesh get");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == [
                    "default",
                    "missing-backend",
                    "Gateway",
                    "default/same-namespace",
                    "Accepted=True",
                    "(Accepted),",
                    "ResolvedRefs=False",
                    "(BackendNotFound)"
                ]),
        "{text}"
    );
    let conflicting = route("conflicting");
    assert_eq!(condition(&conflicting, 0, "Accepted")["status"], "False");
    assert_eq!(
        condition(&conflicting, 0, "Accepted")["message"],
        "VirtualService default/routed routes Service default/routed: it takes precedence, and this route is not applied to it"
    );
}

/// On Kubernetes, the elected control plane writes each HTTPRoute's
/// `status.parents` (its own entries, beside other controllers'), as the
/// Gateway API defines them, and the real kubectl reads them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_writes_httproute_status_for_its_parents() {
    use crate::admission::kubectl;
    use crate::fake_kube::FakeKube;
    use crate::kubernetes::{control_plane, service, slice};
    let net = Net::new(141);
    let fake = FakeKube::start_with(net.addr(250, 6443), true).await;
    fake.apply(service("web"));
    fake.apply(slice(&net, "web", &[(1, true)]));
    let _cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let objects = format!(
        "{GATEWAY}---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: web}}\nspec:\n  parentRefs: [{{name: same-namespace}}, {{group: \"\", kind: Service, name: web, port: 80}}]\n  rules:\n  - backendRefs: [{{name: web, port: 80, weight: 9}}, {{name: web-v2, port: 80}}]\n"
    );
    let (ok, out, err) = kubectl(&net, &["apply", "-n", NS, "-f", "-"], Some(&objects)).await;
    assert!(ok, "{out}{err}");
    let deadline = Instant::now() + Duration::from_secs(15);
    let route = loop {
        let r = fake
            .get("gateway.networking.k8s.io/v1", "HTTPRoute", NS, "web")
            .expect("the HTTPRoute");
        if r["status"]["parents"]
            .as_array()
            .is_some_and(|p| p.len() == 2)
        {
            break r;
        }
        assert!(Instant::now() < deadline, "no status written: {r:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let parents = route["status"]["parents"].as_array().expect("parents");
    for p in parents {
        assert_eq!(p["controllerName"], "minimesh.io/gateway-controller");
        let accepted = &p["conditions"][0];
        assert_eq!(
            (accepted["type"].as_str(), accepted["status"].as_str()),
            (Some("Accepted"), Some("True")),
            "{p:#}"
        );
        let resolved = &p["conditions"][1];
        assert_eq!(resolved["reason"], "BackendNotFound", "{p:#}");
        assert_eq!(
            resolved["message"],
            "no Service default/web-v2: its share of requests is answered 503"
        );
        assert!(resolved["lastTransitionTime"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')));
    }
    assert_eq!(parents[0]["parentRef"]["kind"], "Gateway");
    assert_eq!(
        parents[1]["parentRef"],
        serde_json::json!({"group": "", "kind": "Service", "namespace": NS, "name": "web", "port": 80})
    );
    // The backend appears: ResolvedRefs turns True.
    fake.apply(service("web-v2"));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = fake
            .get("gateway.networking.k8s.io/v1", "HTTPRoute", NS, "web")
            .expect("the HTTPRoute");
        if r["status"]["parents"][0]["conditions"][1]["status"] == "True" {
            break;
        }
        assert!(Instant::now() < deadline, "ResolvedRefs never True: {r:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ok, out, err) = kubectl(
        &net,
        &[
            "get",
            "httproute",
            "web",
            "-n",
            NS,
            "-o",
            "jsonpath={.status.parents[0].conditions[1].reason}",
        ],
        None,
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out, "ResolvedRefs");

    // The Gateway's own status: accepted, programmed, one route attached
    // to its listener; kubectl reads it back.
    let (ok, out, err) = kubectl(
        &net,
        &[
            "get",
            "gateway.gateway.networking.k8s.io",
            "same-namespace",
            "-n",
            NS,
            "-o",
            "jsonpath={.status.conditions[*].type}={.status.conditions[*].status} {.status.listeners[0].name}:{.status.listeners[0].attachedRoutes}",
        ],
        None,
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out, "Accepted Programmed=True True http:1");
    // A Gateway of class minimesh that minimesh refuses says why.
    let tls = "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: tls}\nspec:\n  gatewayClassName: minimesh\n  listeners:\n  - {name: https, port: 443, protocol: HTTPS}\n";
    let (ok, out, err) = kubectl(&net, &["apply", "-n", NS, "-f", "-"], Some(tls)).await;
    assert!(ok, "{out}{err}");
    let deadline = Instant::now() + Duration::from_secs(15);
    let g = loop {
        let g = fake
            .get("gateway.networking.k8s.io/v1", "Gateway", NS, "tls")
            .expect("the Gateway");
        if g["status"]["conditions"].is_array() {
            break g;
        }
        assert!(Instant::now() < deadline, "no status written: {g:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let accepted = &g["status"]["conditions"][0];
    assert_eq!(
        (&accepted["type"], &accepted["status"], &accepted["reason"]),
        (&"Accepted".into(), &"False".into(), &"Invalid".into()),
        "{g:#}"
    );
    assert!(
        accepted["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("spec.listeners[0].protocol: ")),
        "{g:#}"
    );
}
