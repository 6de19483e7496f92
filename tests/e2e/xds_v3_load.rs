//! gRPC's xDS client reporting load (LRS) to the control plane, per
//! endpoint, and following the LOAD_AWARE weights the reports move.

use std::collections::BTreeMap;

use crate::harness::*;
use crate::xds_v3::{
    backends, echo_yaml, failures, minimesh, rule, rule_in_force, Flow, CLUSTER, PORT,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_reach_the_control_plane_per_endpoint() {
    let net = Net::new(104);
    let _b = backends(&net, &[(1, 0), (2, 0), (3, 0)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2, 3]));
    // Unequal weights: each endpoint in a locality of its own, so that
    // gRPC's per-locality reports are per endpoint. No retries: every call
    // is one attempt, as the client counts it.
    net.write(
        "rule.yaml",
        &format!(
            "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: echo-dr\nspec:\n  host: echo\n  trafficPolicy:\n    retries: {{attempts: 0}}\n    loadBalancer:\n      simple: ROUND_ROBIN\n      endpointWeights:\n      - address: \"{}\"\n        weight: 2\n",
            net.ip(1)
        ),
    );
    let flags = ["--load-report-interval", "1s", "--load-window", "60s"];
    let _cp = net.control_plane_with(&flags).await;
    rule_in_force(&net, "ROUND_ROBIN").await;
    // Flaky: echo-3 answers UNAVAILABLE, the others their name. The client
    // stays connected after its calls so that its last report is sent.
    let flow = Flow::start(
        &net,
        &[("XDS_CLIENT_METHOD", "Flaky"), ("XDS_CLIENT_LINGER", "3")],
        &["flow", "100", "4"],
    )
    .await;
    let calls = flow.finish().await;
    let mut sent: BTreeMap<u8, (u64, u64)> = BTreeMap::new();
    for (_, r) in &calls {
        let (h, ok) = match r.as_str() {
            "echo-1" => (1, true),
            "echo-2" => (2, true),
            "ERROR UNAVAILABLE" => (3, false),
            other => panic!("unexpected result {other}"),
        };
        let e = sent.entry(h).or_default();
        if ok {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    let total = calls.len() as u64;
    let view = wait_cp_json(&net, "/debug/load", |v| {
        let seen: u64 = (1..=3)
            .map(|h| {
                v["clusters"][CLUSTER][net.addr(h, PORT).to_string()]["requests"]
                    .as_u64()
                    .unwrap_or(0)
            })
            .sum();
        seen >= total
    })
    .await;
    for (h, (ok, failed)) in &sent {
        let e = &view["clusters"][CLUSTER][net.addr(*h, PORT).to_string()];
        eprintln!(
            "echo-{h}: client sent {ok} ok + {failed} failed; control plane: {} requests, {} succeeded, {} failed",
            e["requests"], e["succeeded"], e["failed"]
        );
        let within = |got: &serde_json::Value, want: u64| {
            let got = got.as_u64().unwrap_or(0);
            got.abs_diff(want) as f64 <= 0.02 * want as f64
        };
        assert!(
            within(&e["requests"], ok + failed),
            "echo-{h} {e}: sent {ok} ok, {failed} failed"
        );
        assert!(within(&e["succeeded"], *ok), "echo-{h} {e}: sent {ok} ok");
        assert!(
            within(&e["failed"], *failed),
            "echo-{h} {e}: sent {failed} failed"
        );
        assert_eq!(e["reporters"], 1, "{e}");
    }
    // `minimesh top` shows them.
    let text = minimesh(&net, &["top", "--once"]);
    assert!(text.contains(&net.addr(3, PORT).to_string()), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_shifts_a_proxyless_clients_traffic_to_the_fast_backend() {
    let net = Net::new(105);
    let _b = backends(&net, &[(1, 20), (2, 100), (3, 100)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2, 3]));
    rule(&net, "simple: LOAD_AWARE");
    let _cp = net.control_plane().await;
    rule_in_force(&net, "LOAD_AWARE").await;
    // 16 callers back to back for 20 s. gRPC's reports carry no latency:
    // the control plane estimates it from requests in flight (Little's law),
    // a noisy sample each second, so the weights take some seconds to move.
    let flow = Flow::start(&net, &[], &["busy", "16", "20"]).await;
    let calls = flow.finish().await;
    assert!(failures(&calls).is_empty(), "{:?}", failures(&calls));
    let end = calls.last().expect("calls").0;
    let share = |from: u64, to: u64| {
        let window: Vec<_> = calls
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .collect();
        window.iter().filter(|(_, r)| r == "echo-1").count() as f64 / window.len().max(1) as f64
    };
    let (first, last) = (share(0, calls[0].0 + 2000), share(end - 5000, end + 1));
    eprintln!("fast backend's share: {first:.2} in the first 2 s, {last:.2} in the last 5 s");
    assert!(
        last >= 0.7 && last > first + 0.2,
        "first {first:.2}, last {last:.2}"
    );
}
