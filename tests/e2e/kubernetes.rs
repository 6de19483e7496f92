//! `--source kubernetes` against a fake API server over real HTTP: rules,
//! Services and EndpointSlices reach a real sidecar; status is written back
//! through the status subresource; watches survive expiry and dropped
//! connections; two replicas elect one status writer with a Lease.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::fake_kube::FakeKube;
use crate::harness::*;

pub fn service(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10",
                 "ports": [{"name": "http", "port": 80, "targetPort": 9090, "protocol": "TCP"}]}
    })
}

/// An EndpointSlice with one endpoint per (ip, ready).
pub fn slice(net: &Net, name: &str, hosts: &[(u8, bool)]) -> Value {
    let endpoints: Vec<Value> = hosts
        .iter()
        .map(|(h, ready)| {
            json!({
                "addresses": [net.ip(*h).to_string()],
                "conditions": {"ready": ready, "serving": ready, "terminating": false},
                "targetRef": {"kind": "Pod", "name": format!("{name}-{h}"), "namespace": NS},
                "zone": "zone-a", "nodeName": "kind-worker"
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-x7k2p"), "namespace": NS,
                     "labels": {"kubernetes.io/service-name": name,
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 9090, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

pub(crate) fn rule(name: &str, host: &str, load_balancer: Value) -> Value {
    json!({
        "apiVersion": "minimesh.io/v1alpha1", "kind": "DestinationRule",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"host": host, "trafficPolicy": {"loadBalancer": load_balancer}}
    })
}

/// Starts a control plane reading the fake API.
pub async fn control_plane(net: &Net, fake: &FakeKube, id: &str, host: u8, extra: &[&str]) -> Proc {
    let p = spawn_control_plane(net, fake, id, host, extra);
    wait_http(net.addr(host, 15014), "/readyz").await;
    p
}

/// The same, not waiting until it is ready.
pub fn spawn_control_plane(net: &Net, fake: &FakeKube, id: &str, host: u8, extra: &[&str]) -> Proc {
    // kubectl's, as the cluster's admin (`kubectl` in admission.rs).
    fake.write_kubeconfig(&net.dir.join("kubeconfig"));
    // The control plane's, as its service account: deploy/base/rbac.yaml
    // authorizes every call it makes.
    let kubeconfig = net.dir.join("control-plane.kubeconfig");
    fake.write_control_plane_kubeconfig(&kubeconfig);
    // A call RBAC refused fails the test, whether or not it saw the effect.
    let f = fake.clone();
    net.check_at_end(move || {
        f.denied()
            .into_iter()
            .map(|m| format!("the fake API server refused the control plane (is a rule missing from deploy/base/rbac.yaml?): 403 {m}"))
            .collect()
    });
    let mut args: Vec<String> = [
        "--source",
        "kubernetes",
        "--xds-addr",
        &net.addr(host, 15010).to_string(),
        "--admin-addr",
        &net.addr(host, 15014).to_string(),
        "--lease-namespace",
        "minimesh-system",
        "--identity",
        id,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    net.spawn(
        id,
        "control-plane",
        &args,
        &[("KUBECONFIG", kubeconfig.display().to_string())],
    )
}

/// Waits until replica `id` holds the control plane's Lease.
pub async fn wait_leader(fake: &FakeKube, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while fake
        .get(
            "coordination.k8s.io/v1",
            "Lease",
            "minimesh-system",
            "minimesh-control-plane",
        )
        .is_none_or(|l| l["spec"]["holderIdentity"] != id)
    {
        assert!(Instant::now() < deadline, "{id} never led");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the stored rule's status satisfies `pred`; returns the status.
async fn wait_status(fake: &FakeKube, name: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let obj = fake
            .get("minimesh.io/v1alpha1", "DestinationRule", NS, name)
            .expect("rule exists");
        if pred(&obj["status"]) {
            return obj["status"].clone();
        }
        assert!(
            Instant::now() < deadline,
            "status of {name} never matched: {:#}",
            obj["status"]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn accepted(status: &Value) -> (&str, &str, &str) {
    let c = &status["conditions"][0];
    (
        c["status"].as_str().unwrap_or(""),
        c["reason"].as_str().unwrap_or(""),
        c["message"].as_str().unwrap_or(""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_and_endpoints_from_the_api_reach_the_sidecar_and_status_is_written_back() {
    let net = Net::new(91);
    let fake = FakeKube::start_with(net.addr(250, 6443), true).await;
    // A busy API server: every seventh request is refused with 429 and
    // Retry-After; everything below still holds.
    fake.throttle_every(7);
    let _b: Vec<_> = futures_util::future::join_all((1..=3).map(|h| net.backend(h, &[]))).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true), (2, true), (3, true)]));
    fake.apply(service("other"));
    fake.apply(slice(&net, "other", &[(1, true)]));
    fake.apply(service("third"));
    fake.apply(slice(&net, "third", &[(2, true)]));
    // An Istio user's rule, as is: read, applied, its status left to Istio.
    let mut istio = rule("third-dr", "third", json!({"simple": "RANDOM"}));
    istio["apiVersion"] = "networking.istio.io/v1".into();
    fake.apply(istio);
    let cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let _sc = net.sidecar(100, &[]).await;
    let admin = net.addr(100, 15000);

    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "third") == "RANDOM"
    })
    .await;

    // A rule applied in the API reaches the sidecar and changes its picks.
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"simple": "ROUND_ROBIN"}),
    ));
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "backend") == "ROUND_ROBIN"
    })
    .await;
    let c = load(net.addr(100, 15001), "backend", 2, 600).await;
    assert_no_failures(&c, "round robin from the API");
    for h in 1..=3 {
        let n = c.by_endpoint[&net.addr(h, 9090).to_string()];
        assert!((190..=210).contains(&n), "{:?}", c.by_endpoint);
    }
    let st = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 1).await;
    assert_eq!(
        accepted(&st),
        (
            "True",
            "Accepted",
            "applied to backend.default.svc.cluster.local:80"
        )
    );
    assert_eq!(st["policy"], "ROUND_ROBIN");

    // Consistent hashing on a header: the same user always lands on one endpoint.
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"consistentHash": {"httpHeaderName": "x-user", "maglev": {"tableSize": 65537}}}),
    ));
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "backend") == "MAGLEV"
    })
    .await;
    let st = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 2).await;
    assert_eq!(st["policy"], "MAGLEV");

    // A version minimesh cannot use (a table size that is not prime): the
    // status says why, naming the field; the last good version stays.
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"consistentHash": {"httpHeaderName": "x-user", "maglev": {"tableSize": 1000}}}),
    ));
    let st = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 3).await;
    let (status, reason, message) = accepted(&st);
    assert_eq!((status, reason), ("False", "Invalid"), "{st:#}");
    assert!(
        message.starts_with("spec.trafficPolicy.loadBalancer.consistentHash.maglev.tableSize: ")
            && message.contains("prime")
            && message.ends_with("; the previous good version stays in force"),
        "{message}"
    );
    assert_eq!(st["policy"], "MAGLEV", "the good version is in force");
    // Each verdict is an Event on the rule, as `kubectl describe` lists them
    // (published once the status is written: polled).
    let deadline = Instant::now() + Duration::from_secs(10);
    let events = loop {
        let events = fake.list("events.k8s.io/v1", "Event");
        if events.iter().any(|e| e["reason"] == "Invalid") || Instant::now() > deadline {
            break events;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let said: Vec<(&str, &str)> = events
        .iter()
        .filter(|e| e["regarding"]["name"] == "backend-dr")
        .map(|e| {
            (
                e["type"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or(""),
            )
        })
        .collect();
    // Two versions accepted: one Event, its series counting 2 (as the API's
    // recorders fold repeats); then the refusal.
    assert_eq!(
        said,
        [("Normal", "Accepted"), ("Warning", "Invalid")],
        "{events:#?}"
    );
    assert_eq!(events[0]["series"]["count"], 2, "{events:#?}");
    let invalid = events
        .iter()
        .find(|e| e["reason"] == "Invalid")
        .expect("event");
    assert!(fake.count("THROTTLED") > 0, "no request was throttled");
    assert_eq!(invalid["regarding"]["kind"], "DestinationRule");
    assert_eq!(invalid["reportingController"], "minimesh-control-plane");
    assert!(
        invalid["note"]
            .as_str()
            .is_some_and(|n| n
                .starts_with("spec.trafficPolicy.loadBalancer.consistentHash.maglev.tableSize: ")),
        "{invalid:#}"
    );
    let v = get_json(admin, "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "MAGLEV");

    // A second rule for the same host is refused; a rule for another host
    // is applied regardless of the bad ones.
    fake.apply(rule("backend-dr-2", "backend", json!({"simple": "RANDOM"})));
    fake.apply(rule(
        "other-dr",
        "other",
        json!({"simple": "LEAST_REQUEST"}),
    ));
    let st = wait_status(&fake, "backend-dr-2", |s| s["observedGeneration"] == 1).await;
    assert_eq!(
        accepted(&st),
        (
            "False",
            "Conflict",
            "spec.host: service backend.default already has rule default/backend-dr; this rule is not applied"
        )
    );
    let st = wait_status(&fake, "other-dr", |s| s["observedGeneration"] == 1).await;
    assert_eq!(accepted(&st).0, "True");
    assert_eq!(st["policy"], "LEAST_REQUEST");
    // Pointed at a host that has a rule: refused, and no policy is shown as in force.
    fake.apply(rule(
        "other-dr",
        "backend",
        json!({"simple": "LEAST_REQUEST"}),
    ));
    let st = wait_status(&fake, "other-dr", |s| s["observedGeneration"] == 2).await;
    assert_eq!(accepted(&st).1, "Conflict");
    assert_eq!(st["policy"], Value::Null, "{st:#}");
    fake.apply(rule(
        "other-dr",
        "other",
        json!({"simple": "LEAST_REQUEST"}),
    ));
    let st = wait_status(&fake, "other-dr", |s| s["observedGeneration"] == 3).await;
    assert_eq!(
        (accepted(&st).0, &st["policy"]),
        ("True", &json!("LEAST_REQUEST"))
    );
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "other") == "LEAST_REQUEST" && policy_of(v, "backend") == "MAGLEV"
    })
    .await;

    // Back to a valid version; then an endpoint going not-ready gets no traffic.
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"simple": "ROUND_ROBIN"}),
    ));
    let st = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 4).await;
    assert_eq!(accepted(&st).0, "True");
    fake.apply(slice(&net, "backend", &[(1, true), (2, true), (3, false)]));
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        endpoints_of(v, "backend") == [net.addr(1, 9090).to_string(), net.addr(2, 9090).to_string()]
    })
    .await;
    let c = load(net.addr(100, 15001), "backend", 2, 400).await;
    assert_no_failures(&c, "after endpoint 3 went not-ready");
    assert_eq!(
        c.by_endpoint.get(&net.addr(3, 9090).to_string()),
        None,
        "{:?}",
        c.by_endpoint
    );
    assert_eq!(c.ok, 400);

    // Deleting the rule in the API falls back to the default policy.
    fake.delete(
        "minimesh.io/v1alpha1",
        "DestinationRule",
        NS,
        "backend-dr-2",
    );
    fake.delete("minimesh.io/v1alpha1", "DestinationRule", NS, "backend-dr");
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "backend") == "LEAST_REQUEST"
    })
    .await;
    let istio = fake
        .get("networking.istio.io/v1", "DestinationRule", NS, "third-dr")
        .expect("Istio rule");
    assert_eq!(
        istio["status"],
        Value::Null,
        "minimesh writes no status on Istio's rules"
    );
    assert_eq!(fake.count("PATCH-STATUS destinationrules third-dr"), 0);
    drop(cp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_serve_and_one_elected_writes_status() {
    let net = Net::new(93);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    let _b = net.backend(1, &[]).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true)]));
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"simple": "ROUND_ROBIN"}),
    ));
    // No drain at SIGTERM (5 s by default on Kubernetes): the lease is
    // given up once a replica's drain ends, and this test times that.
    let lease = [
        "--lease-duration",
        "2s",
        "--lease-retry",
        "200ms",
        "--termination-drain",
        "0s",
    ];
    let mut a = control_plane(&net, &fake, "cp-a", 254, &lease).await;
    wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 1).await;
    let patches = fake.count("PATCH-STATUS");
    let b_cp = control_plane(&net, &fake, "cp-b", 253, &lease).await;
    let holder = |fake: &FakeKube| {
        fake.get(
            "coordination.k8s.io/v1",
            "Lease",
            "minimesh-system",
            "minimesh-control-plane",
        )
        .map(|l| {
            l["spec"]["holderIdentity"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
    };
    assert_eq!(holder(&fake).as_deref(), Some("cp-a"));
    // Both replicas serve sidecars the same config.
    for (sidecar, cp) in [(100, 254), (101, 253)] {
        let _sc = net.sidecar_of(sidecar, net.addr(cp, 15010), &[]).await;
        wait_sidecar(net.addr(sidecar, 15000), Duration::from_secs(10), |v| {
            policy_of(v, "backend") == "ROUND_ROBIN"
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        fake.count("PATCH-STATUS"),
        patches,
        "the follower writes no status: {:#?}",
        fake.log()
    );
    assert_eq!(
        holder(&fake).as_deref(),
        Some("cp-a"),
        "the leader keeps renewing"
    );

    // After the leader dies, the follower takes the lease (once 2 s pass
    // without renewal) and writes the next status. A condition whose status
    // did not change keeps the time it last changed, whoever writes it.
    let first = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 1).await;
    let since = first["conditions"][0]["lastTransitionTime"].clone();
    a.kill();
    fake.apply(rule("backend-dr", "backend", json!({"simple": "RANDOM"})));
    let st = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 2).await;
    assert_eq!(holder(&fake).as_deref(), Some("cp-b"));
    assert_eq!(
        (st["policy"].as_str(), accepted(&st).0),
        (Some("RANDOM"), "True")
    );
    assert_eq!(st["conditions"][0]["lastTransitionTime"], since, "{st:#}");
    fake.apply(rule(
        "backend-dr",
        "backend",
        json!({"simple": "PASSTHROUGH"}),
    ));
    let st = wait_status(&fake, "backend-dr", |s| s["observedGeneration"] == 3).await;
    let (status, reason, message) = accepted(&st);
    assert_eq!((status, reason), ("False", "Invalid"));
    assert_eq!(
        message,
        "spec.trafficPolicy.loadBalancer.simple: PASSTHROUGH is not supported: minimesh always balances over the service's endpoints; the previous good version stays in force"
    );
    assert_eq!(st["policy"], "RANDOM");
    let lease = fake
        .get(
            "coordination.k8s.io/v1",
            "Lease",
            "minimesh-system",
            "minimesh-control-plane",
        )
        .expect("lease");
    assert_eq!(lease["spec"]["leaseTransitions"], 1, "{lease:#}");

    // A leader stopped as Kubernetes stops a pod (SIGTERM) gives the lease
    // up, so that the next replica need not wait for it to expire.
    b_cp.signal("TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while holder(&fake).as_deref() != Some("") {
        assert!(
            Instant::now() < deadline,
            "the lease was not released: {:#?}",
            fake.get(
                "coordination.k8s.io/v1",
                "Lease",
                "minimesh-system",
                "minimesh-control-plane"
            )
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_scaled_to_zero_has_no_endpoints_and_no_config_error() {
    let net = Net::new(109);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true), (2, true)]));
    let _cp = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let cluster = format!("backend.{NS}.svc.cluster.local:80");
    let count = |v: &Value| {
        v[&cluster]["endpoints"]
            .as_array()
            .map_or(usize::MAX, Vec::len)
    };
    wait_cp_json(&net, "/debug/endpoints", |v| count(v) == 2).await;
    // Scaled to zero: the EndpointSlice controller leaves the slice with no
    // endpoints and no ports, which the API server sends as
    // `"endpoints": null, "ports": null`.
    let mut empty = slice(&net, "backend", &[]);
    empty["ports"] = json!([]);
    fake.apply(empty);
    let stored = fake
        .get("discovery.k8s.io/v1", "EndpointSlice", NS, "backend-x7k2p")
        .expect("the slice");
    assert!(
        stored["endpoints"].is_null() && stored["ports"].is_null(),
        "{stored}"
    );
    wait_cp_json(&net, "/debug/endpoints", |v| count(v) == 0).await;
    let config = get_json(net.cp_admin(), "/debug/config").await;
    assert_eq!(config["errors"], json!([]), "{config:#}");
    // And back.
    fake.apply(slice(&net, "backend", &[(3, true)]));
    wait_cp_json(&net, "/debug/endpoints", |v| count(v) == 1).await;
}
