//! Config changes under load, and bad config.

use std::time::Duration;

use tokio::time::Instant;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_rule_under_load_takes_effect_within_a_second_without_failures() {
    let net = Net::new(21);
    let _b: Vec<_> = futures_util::future::join_all(
        (1..=3).map(|h| net.backend(h, &[("TIMING_50_PERCENTILE", "5ms")])),
    )
    .await;
    net.service("backend", &[1, 2, 3]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let loader = Background::start(net.addr(100, 15001), "backend", 20);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, policy) in ["RANDOM", "LEAST_REQUEST", "ROUND_ROBIN"]
        .iter()
        .enumerate()
    {
        net.rule("rule.yaml", "backend", &format!("simple: {policy}"));
        let took = wait_sidecar(net.addr(100, 15000), Duration::from_secs(5), |v| {
            policy_of(v, "backend") == *policy
        })
        .await;
        assert!(
            took < Duration::from_secs(1),
            "change {i} to {policy} took {took:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let c = loader.finish().await;
    assert!(c.ok > 500, "too little load: {}", c.ok);
    assert_no_failures(&c, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_added_and_removed_under_load_without_failures() {
    let net = Net::new(22);
    let _b: Vec<_> = futures_util::future::join_all(
        (1..=3).map(|h| net.backend(h, &[("TIMING_50_PERCENTILE", "5ms")])),
    )
    .await;
    net.service("backend", &[1, 2]);
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let loader = Background::start(net.addr(100, 15001), "backend", 20);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let added = Instant::now();
    net.service("backend", &[1, 2, 3]);
    let new_ep = net.addr(3, 9090).to_string();
    loop {
        if let Some(t) = loader.first_seen.lock().expect("lock").get(&new_ep) {
            let took = t.duration_since(added);
            assert!(
                took < Duration::from_secs(1),
                "new endpoint first served after {took:?}"
            );
            break;
        }
        assert!(
            added.elapsed() < Duration::from_secs(5),
            "new endpoint never served"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    net.service("backend", &[2, 3]);
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(2), |v| {
        endpoints_of(v, "backend").len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = loader.finish().await;
    assert_no_failures(&c, "");
    assert!(c.by_endpoint.contains_key(&new_ep));
}

fn pushes(proxies: &serde_json::Value, ty: &str) -> u64 {
    proxies[0]["types"][ty]["pushes"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rule_is_rejected_with_file_field_and_reason_and_the_old_policy_stays() {
    let net = Net::new(23);
    let _b1 = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let before = get_json(net.cp_admin(), "/debug/proxies").await;

    net.rule("rule.yaml", "backend", "simple: ROUND_ROBBIN");
    let file = net.config().join("rule.yaml");
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        let cfg = get_json(net.cp_admin(), "/debug/config").await;
        if let Some(e) = cfg["errors"].as_array().and_then(|a| a.first().cloned()) {
            break e;
        }
        assert!(Instant::now() < deadline, "no error reported: {cfg:#}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(err["file"], path_str(&file));
    assert_eq!(err["field"], "spec.trafficPolicy.loadBalancer.simple");
    let reason = err["reason"].as_str().expect("reason");
    assert!(
        reason.starts_with("unknown variant `ROUND_ROBBIN`, expected one of"),
        "{reason}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "ROUND_ROBIN");
    let after = get_json(net.cp_admin(), "/debug/proxies").await;
    for ty in ["Cluster", "ClusterLoadAssignment", "Route"] {
        assert_eq!(
            pushes(&before, ty),
            pushes(&after, ty),
            "{ty} was pushed again"
        );
    }

    // An unknown field is rejected the same way.
    net.rule(
        "rule.yaml",
        "backend",
        "simple: RANDOM\nconsistentHashh: {}",
    );
    let cfg = wait_cp_config(&net, |c| {
        c["errors"][0]["field"] != serde_json::json!("spec.trafficPolicy.loadBalancer.simple")
    })
    .await;
    assert_eq!(
        cfg["errors"][0]["field"],
        "spec.trafficPolicy.loadBalancer.consistentHashh"
    );
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "ROUND_ROBIN");

    // `minimesh apply` refuses the same file with the same message, and exits non-zero.
    let bad = net.dir.join("bad.yaml");
    std::fs::write(&bad, "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: x\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer:\n      simple: ROUND_ROBBIN\n").expect("write");
    let out = std::process::Command::new(bin("minimesh"))
        .args([
            "--home",
            &path_str(&net.dir),
            "apply",
            "-f",
            &path_str(&bad),
        ])
        .output()
        .expect("minimesh runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "minimesh apply: {}: DestinationRule default/x: spec.trafficPolicy.loadBalancer.simple: unknown variant `ROUND_ROBBIN`, expected one of `UNSPECIFIED`, `ROUND_ROBIN`",
            bad.display()
        )),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_yaml_unknown_kinds_and_deleted_files_never_crash_the_control_plane() {
    let net = Net::new(24);
    let _b1 = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    let mut cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;

    net.write(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: [unclosed\n",
    );
    net.write(
        "deploy.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {}\n",
    );
    net.write("garbage.yaml", "\u{0}\u{1}just text: : :\n- - -\n");
    net.write("list.yaml", "- 1\n- 2\n");
    // Every file read: an error or a warning for each of them.
    let cfg = wait_cp_config(&net, |c| {
        let text = c.to_string();
        [
            "broken.yaml",
            "list.yaml",
            "garbage.yaml",
            "Deployment default/web",
        ]
        .iter()
        .all(|f| text.contains(f))
    })
    .await;
    cp.assert_running();
    let messages: Vec<String> = cfg["errors"]
        .as_array()
        .expect("errors")
        .iter()
        .map(|e| e["message"].as_str().unwrap_or("").to_string())
        .collect();
    let broken = path_str(&net.config().join("broken.yaml"));
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with(&format!("{broken}: invalid YAML: "))),
        "{messages:?}"
    );
    let list = path_str(&net.config().join("list.yaml"));
    assert!(
        messages
            .iter()
            .any(|m| m == &format!("{list}: document 1 is not a mapping with apiVersion and kind")),
        "{messages:?}"
    );
    let warnings = cfg["warnings"].to_string();
    assert!(
        warnings.contains("Deployment default/web (apps/v1): not a kind minimesh reads"),
        "{warnings}"
    );

    // Break the rule file itself, then delete it: the first keeps the old
    // rule, the second removes it (the default policy comes back).
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\n  bad indent: [\n",
    );
    let rule_file = format!(
        "{}: invalid YAML",
        path_str(&net.config().join("rule.yaml"))
    );
    wait_cp_config(&net, |c| c["errors"].to_string().contains(&rule_file)).await;
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "RANDOM");
    net.remove("rule.yaml");
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(2), |v| {
        policy_of(v, "backend") == "LEAST_REQUEST"
    })
    .await;
    net.remove("broken.yaml");
    wait_cp_config(&net, |c| !c["errors"].to_string().contains("broken.yaml")).await;
    cp.assert_running();
    let log = cp.log_text();
    assert!(log.contains("broken.yaml: invalid YAML"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let (status, _, _) = get(net.addr(100, 15001), "backend", "/")
        .await
        .expect("request");
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_prime_maglev_table_never_leaves_the_control_plane() {
    let net = Net::new(25);
    let _b1 = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    net.rule(
        "rule.yaml",
        "backend",
        "consistentHash:\n  httpHeaderName: x-user\n  maglev:\n    tableSize: 65536",
    );
    let cfg = wait_cp_config(&net, |c| c["errors"][0]["field"].is_string()).await;
    assert_eq!(
        cfg["errors"][0]["field"],
        "spec.trafficPolicy.loadBalancer.consistentHash.maglev.tableSize"
    );
    assert_eq!(
        cfg["errors"][0]["reason"],
        "65536 must be a prime no larger than 5000011"
    );
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "RANDOM");
}

/// Rule scope, Istio's lookup: a caller gets its own namespace's rule,
/// else the service's namespace's, else the root namespace's, each as its
/// `exportTo` allows. Sidecars in three namespaces: `default` (the
/// service's), `aaa` (which writes a rule of its own) and `bbb` (none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_apply_to_callers_as_istio_looks_them_up_and_as_export_to_allows() {
    let net = Net::new(149);
    let _b = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    let _cp = net.control_plane().await;
    let _in_default = net.sidecar(100, &[]).await;
    let _in_aaa = net.sidecar_in(101, "aaa", &[]).await;
    let _in_bbb = net.sidecar_in(102, "bbb", &[]).await;
    let rule = |ns: &str, name: &str, policy: &str, export_to: &str| {
        format!("apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  host: backend.default.svc.cluster.local\n  exportTo: {export_to}\n  trafficPolicy:\n    loadBalancer: {{simple: {policy}}}\n    tls: {{mode: DISABLE}}\n")
    };
    // The policy each of the three gets, once it is `want`.
    let expect = |want: [&'static str; 3]| {
        let net = &net;
        async move {
            for (host, policy) in [100, 101, 102].into_iter().zip(want) {
                wait_sidecar(net.addr(host, 15000), Duration::from_secs(10), |v| {
                    policy_of(v, "backend") == policy
                })
                .await;
            }
        }
    };
    // A rule of aaa's: aaa's callers only.
    net.write("aaa.yaml", &rule("aaa", "mine", "RANDOM", "[]"));
    expect(["LEAST_REQUEST", "RANDOM", "LEAST_REQUEST"]).await;
    let config = wait_cp_config(&net, |c| {
        c["rules"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["name"] == "mine"))
    })
    .await;
    let mine = config["rules"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == "mine"))
        .expect("listed");
    assert_eq!(mine["accepted"], true, "{mine:#}");
    assert!(
        mine["message"].as_str().is_some_and(|m| m.starts_with(
            "applies to callers in namespace aaa only (Istio's lookup: the caller's namespace, then the service's, then minimesh-system)"
        )),
        "{mine:#}"
    );
    // The root namespace's: everyone else. The service's own, for its
    // namespace only (exportTo: ["."]): default's callers; bbb's keep the
    // root's, aaa's their own.
    net.write(
        "root.yaml",
        &rule("minimesh-system", "mesh-default", "ROUND_ROBIN", "[]"),
    );
    expect(["ROUND_ROBIN", "RANDOM", "ROUND_ROBIN"]).await;
    net.write("own.yaml", &rule("default", "own", "PEAK_EWMA", "['.']"));
    expect(["PEAK_EWMA", "RANDOM", "ROUND_ROBIN"]).await;
    // Exported to every namespace, the service's own shadows the root's
    // for every caller but aaa's.
    net.write("own.yaml", &rule("default", "own", "PEAK_EWMA", "['*']"));
    expect(["PEAK_EWMA", "RANDOM", "PEAK_EWMA"]).await;
    // The root namespace's callers get the root's: their own namespace's.
    let scope = serde_json::json!([{"service": "backend.default", "callers": [
        {"namespace": "*", "rule": "default/own"},
        {"namespace": "aaa", "rule": "aaa/mine"},
        {"namespace": "minimesh-system", "rule": "minimesh-system/mesh-default"},
    ]}]);
    wait_cp_config(&net, |c| c["ruleScope"] == scope).await;
    // `minimesh get rules` says which rule each caller namespace gets.
    let admin = net.cp_admin().to_string();
    let out = std::process::Command::new(bin("minimesh"))
        .args(["get", "rules", "--control-plane-admin", &admin])
        .output()
        .expect("minimesh get rules");
    let out = String::from_utf8_lossy(&out.stdout);
    for line in [
        "backend.default                          (other namespaces)   default/own",
        "backend.default                          aaa                  aaa/mine",
    ] {
        assert!(out.contains(line), "{line:?} not in:\n{out}");
    }
}
