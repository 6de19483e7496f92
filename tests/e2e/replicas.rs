//! One truth across control-plane replicas: a replica that starts after an
//! invalid version of a rule was stored keeps the same last good version the
//! others keep (the leader records it in the rule's status), and where an
//! Istio rule and a minimesh rule of the same name name one service, every
//! replica applies the minimesh rule and its status says so.

use std::time::Duration;

use serde_json::json;

use crate::admission::kubectl;
use crate::fake_kube::FakeKube;
use crate::harness::*;
use crate::kubernetes::{control_plane, service, slice, wait_leader};

fn maglev(table_size: u64) -> serde_json::Value {
    json!({
        "apiVersion": "minimesh.io/v1alpha1", "kind": "DestinationRule",
        "metadata": {"name": "backend-dr", "namespace": NS},
        "spec": {"host": "backend", "trafficPolicy": {"loadBalancer": {
            "consistentHash": {"httpHeaderName": "x-user", "maglev": {"tableSize": table_size}}}}}
    })
}

async fn status_where(
    fake: &FakeKube,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let obj = fake
            .get("minimesh.io/v1alpha1", "DestinationRule", NS, "backend-dr")
            .expect("rule");
        if pred(&obj["status"]) {
            return obj["status"].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {:#}",
            obj["status"]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn condition<'a>(status: &'a serde_json::Value, type_: &str) -> &'a serde_json::Value {
    status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_))
        .unwrap_or(&serde_json::Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_after_an_invalid_rule_serves_the_last_good_one_like_the_others() {
    let net = Net::new(111);
    let fake = FakeKube::start_with(net.addr(250, 6443), true).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true), (2, true)]));
    let cp0 = net.addr(254, 15010);
    let _cp0 = control_plane(&net, &fake, "cp-0", 254, &[]).await;
    let _sc0 = net.sidecar_of(100, cp0, &[]).await;

    // A good version, then (past admission: no webhook here, as with one
    // set to Ignore) an invalid one.
    fake.apply(maglev(65537));
    let st = status_where(&fake, "the good version recorded", |s| {
        s["lastGood"]["generation"] == 1
    })
    .await;
    assert_eq!(st["lastGood"]["spec"]["host"], "backend");
    fake.apply(maglev(1000));
    let st = status_where(&fake, "the invalid version reported", |s| {
        s["observedGeneration"] == 2
    })
    .await;
    assert_eq!(condition(&st, "Accepted")["reason"], "Invalid", "{st:#}");
    assert_eq!(st["lastGood"]["generation"], 1, "the record stays: {st:#}");

    // A replica started now has never seen the good version: it takes it
    // from the status, as the running one keeps it from memory.
    let cp1 = net.addr(253, 15010);
    let cp1_proc = control_plane(&net, &fake, "cp-1", 253, &[]).await;
    let _sc1 = net.sidecar_of(101, cp1, &[]).await;
    for admin in [net.addr(100, 15000), net.addr(101, 15000)] {
        wait_sidecar(admin, Duration::from_secs(10), |v| {
            policy_of(v, "backend") == "MAGLEV"
        })
        .await;
    }
    assert!(
        cp1_proc
            .log_text()
            .contains("the last good version recorded in its status stays in force"),
        "{}",
        cp1_proc.log_text()
    );

    // Istio's rule of the same name for the same service: keyed apart, so
    // both replicas still apply minimesh's, and its status warns of Istio's.
    let mut istio = maglev(65537);
    istio["apiVersion"] = "networking.istio.io/v1".into();
    istio["spec"]["trafficPolicy"]["loadBalancer"] = json!({"simple": "RANDOM"});
    fake.apply(istio);
    fake.apply(maglev(65537));
    let st = status_where(&fake, "the override reported", |s| {
        condition(s, "Warnings")["status"] == "True" && s["observedGeneration"] == 3
    })
    .await;
    assert_eq!(condition(&st, "Accepted")["status"], "True", "{st:#}");
    assert_eq!(
        condition(&st, "Warnings")["message"],
        "Istio's DestinationRule default/backend-dr (networking.istio.io) also names service backend.default; this rule is applied and that one is ignored"
    );
    for admin in [net.addr(100, 15000), net.addr(101, 15000)] {
        let v = get_json(admin, "/debug/config").await;
        assert_eq!(policy_of(&v, "backend"), "MAGLEV");
    }
    // kubectl shows the warning: its column, and the message with -o wide.
    let kubeconfig = net.dir.join("kubeconfig");
    fake.write_kubeconfig(&kubeconfig);
    let (ok, out, err) = kubectl(&net, &["get", "mdr", "-o", "wide"], None).await;
    assert!(ok && err.is_empty(), "{out}{err}");
    let header: Vec<&str> = out
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        ["NAME", "HOST", "POLICY", "ACCEPTED", "WARNINGS", "MESSAGE", "AGE"],
        "{out}"
    );
    assert!(
        out.lines().nth(1).is_some_and(|l| l
            .contains("MAGLEV   True       True       Istio's DestinationRule default/backend-dr")),
        "{out}"
    );
    // Istio's short name stays Istio's: `dr` lists Istio's rule, in its
    // own columns, with no ambiguity for kubectl to warn of.
    let (ok, out, err) = kubectl(&net, &["get", "dr"], None).await;
    assert!(ok && err.is_empty(), "{out}{err}");
    assert!(
        out.lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("backend-dr ")),
        "{out}"
    );
    assert!(!out.contains("POLICY"), "{out}");
}

/// Endpoint weights of `backend` in a control plane's /debug/endpoints.
fn weights(endpoints: &serde_json::Value, net: &Net) -> Vec<u64> {
    backend_weights(&endpoints["backend.default.svc.cluster.local:80"], net)
}

/// The same, from a sidecar's /debug/config.
fn sidecar_weights(config: &serde_json::Value, net: &Net) -> Vec<u64> {
    backend_weights(
        &config["clusters"]["backend.default.svc.cluster.local:80"],
        net,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_weights_come_from_every_report_and_are_the_same_on_every_replica() {
    let net = Net::new(115);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    let _b: Vec<_> =
        futures_util::future::join_all(UNEQUAL.iter().map(|(h, env)| net.backend(*h, env))).await;
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true), (2, true), (3, true)]));
    fake.apply(json!({
        "apiVersion": "minimesh.io/v1alpha1", "kind": "DestinationRule",
        "metadata": {"name": "backend-dr", "namespace": NS},
        "spec": {"host": "backend", "trafficPolicy": {"loadBalancer": {"simple": "LOAD_AWARE"}}}
    }));
    let flags = |host: u8| {
        vec![
            "--load-report-interval".to_string(),
            "300ms".into(),
            "--advertise-addr".into(),
            format!("http://{}", net.addr(host, 15010)),
        ]
    };
    let f0 = flags(254);
    let f0: Vec<&str> = f0.iter().map(String::as_str).collect();
    let _cp0 = control_plane(&net, &fake, "cp-0", 254, &f0).await;
    // cp-0 was first: it leads.
    wait_leader(&fake, "cp-0").await;
    let f1 = flags(253);
    let f1: Vec<&str> = f1.iter().map(String::as_str).collect();
    let cp1 = control_plane(&net, &fake, "cp-1", 253, &f1).await;
    // Load only through a sidecar of the follower: the leader sees it only
    // through the reports the follower passes on.
    let _sc = net.sidecar_of(101, net.addr(253, 15010), &[]).await;
    // And a sidecar of the leader's, which sends nothing.
    let _idle = net.sidecar_of(100, net.addr(254, 15010), &[]).await;
    let load = Background::start(net.addr(101, 15001), "backend", 60);
    let start = tokio::time::Instant::now();
    let (mut w0, mut w1) = (vec![], vec![]);
    let mut agreed_ordered = false;
    while start.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        w0 = weights(
            &get_json(net.addr(254, 15014), "/debug/endpoints").await,
            &net,
        );
        w1 = weights(
            &get_json(net.addr(253, 15014), "/debug/endpoints").await,
            &net,
        );
        if w0 == w1 && w0[0] > w0[1] && w0[1] > w0[2] {
            agreed_ordered = true;
            break;
        }
    }
    let counts = load.finish().await;
    assert_no_failures(&counts, "through the follower's sidecar: ");
    assert!(
        agreed_ordered,
        "leader {w0:?}, follower {w1:?} (never both ordered by capacity and equal)\n{}",
        cp1.log_text()
    );
    // What each replica pushes is what its sidecars balance with: the
    // sidecars of both hold the leader's current weights.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = weights(
            &get_json(net.addr(254, 15014), "/debug/endpoints").await,
            &net,
        );
        let a = sidecar_weights(&get_json(net.addr(100, 15000), "/debug/config").await, &net);
        let b = sidecar_weights(&get_json(net.addr(101, 15000), "/debug/config").await, &net);
        if a == now && b == now {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leader {now:?}, its sidecar {a:?}, the follower's sidecar {b:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The leader counted the follower's sidecar's requests.
    let view = get_json(net.addr(254, 15014), "/debug/load").await;
    let seen: u64 = (1..=3)
        .map(|h| {
            view["clusters"]["backend.default.svc.cluster.local:80"][net.addr(h, 9090).to_string()]
                ["requests"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    assert!(seen > 0, "{view:#}");
    // And published the weights where every replica reads them.
    let cm = fake
        .get("v1", "ConfigMap", "minimesh-system", "minimesh-load-aware")
        .expect("the weights' ConfigMap");
    assert!(
        cm["data"]["weights.json"]
            .as_str()
            .is_some_and(|w| w.contains("backend.default")),
        "{cm:#}"
    );
    eprintln!(
        "LOAD_AWARE weights, leader {w0:?}, follower {w1:?}, after {:?}",
        start.elapsed()
    );
}
