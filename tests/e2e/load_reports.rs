//! Load reports: the control plane's view of every endpoint as all callers see it.

use std::time::Duration;

use crate::harness::*;

fn requests(view: &serde_json::Value, ep: &str) -> u64 {
    view["clusters"]["backend.default.svc.cluster.local:80"][ep]["requests"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_view_matches_the_clients_and_survives_a_restart() {
    let net = Net::new(71);
    let _b: Vec<_> = futures_util::future::join_all(
        (1..=3).map(|h| net.backend(h, &[("TIMING_50_PERCENTILE", "5ms")])),
    )
    .await;
    net.service("backend", &[1, 2, 3]);
    // A service nobody calls: every sidecar knows it, none reports it.
    net.service("idle", &[4]);
    let flags = ["--load-report-interval", "300ms", "--load-window", "60s"];
    let mut cp = net.control_plane_with(&flags).await;
    let _s1 = net.sidecar(100, &[]).await;
    let _s2 = net.sidecar(101, &[]).await;
    // Counts made before a reporter's stream is up belong to no report.
    gauge_becomes(&net, "minimesh_load_reporters_connected", 2).await;
    let (a, b) = tokio::join!(
        load(net.addr(100, 15001), "backend", 5, 900),
        load(net.addr(101, 15001), "backend", 5, 600)
    );
    assert_no_failures(&a, "");
    assert_no_failures(&b, "");
    // The requests reported, by both reporters (a few intervals).
    let sent = (a.ok + b.ok) as f64;
    let view = wait_cp_json(&net, "/debug/load", |v| {
        let eps = (1..=3).map(|h| net.addr(h, 9090).to_string());
        let seen: u64 = eps.clone().map(|ep| requests(v, &ep)).sum();
        let both = eps
            .clone()
            .all(|ep| v["clusters"]["backend.default.svc.cluster.local:80"][&ep]["reporters"] == 2);
        both && seen as f64 >= 0.95 * sent
    })
    .await;
    let mut total = 0;
    for h in 1..=3 {
        let ep = net.addr(h, 9090).to_string();
        let clients = a.by_endpoint.get(&ep).copied().unwrap_or(0)
            + b.by_endpoint.get(&ep).copied().unwrap_or(0);
        let seen = requests(&view, &ep);
        total += seen;
        assert!(
            (seen as f64 - clients as f64).abs() <= 0.05 * clients as f64,
            "{ep}: control plane {seen}, clients {clients}: {view:#}"
        );
        let e = &view["clusters"]["backend.default.svc.cluster.local:80"][&ep];
        assert_eq!(e["reporters"], 2);
        assert_eq!(e["success_ratio"], 1.0);
        assert!(e["p95_ms"].as_f64().is_some_and(|p| p <= 250.0), "{e}");
    }
    assert!((total as f64 - 1500.0).abs() <= 75.0, "total {total}");
    // Listed from the config, with nothing counted and no reporter: a
    // sidecar reports only the endpoints it called.
    let idle =
        &view["clusters"]["idle.default.svc.cluster.local:80"][net.addr(4, 9090).to_string()];
    assert_eq!(
        (&idle["requests"], &idle["reporters"]),
        (&serde_json::json!(0), &serde_json::json!(0)),
        "{view:#}"
    );
    let (_, _, metrics) = get(net.cp_admin(), "localhost", "/metrics")
        .await
        .expect("metrics");
    let line = format!("minimesh_load_success_ratio{{cluster=\"backend.default.svc.cluster.local:80\",endpoint=\"{}\"}} 1", net.addr(1, 9090));
    assert!(metrics.contains(&line), "{metrics}");
    assert!(metrics.ends_with("# EOF\n"));

    // Restart: the view rebuilds from new reports only; nothing is counted twice.
    cp.kill();
    let _cp2 = net.control_plane_with(&flags).await;
    // Both reporters back (backoff ≤ 1 s).
    gauge_becomes(&net, "minimesh_load_reporters_connected", 2).await;
    let c = load(net.addr(100, 15001), "backend", 5, 600).await;
    assert_no_failures(&c, "");
    let view = wait_cp_json(&net, "/debug/load", |v| {
        let seen: u64 = (1..=3)
            .map(|h| requests(v, &net.addr(h, 9090).to_string()))
            .sum();
        seen as f64 >= 0.95 * c.ok as f64
    })
    .await;
    let total: u64 = (1..=3)
        .map(|h| requests(&view, &net.addr(h, 9090).to_string()))
        .sum();
    assert!(
        (570..=630).contains(&total),
        "after restart the view holds {total} for 600 requests: {view:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_reports_are_dropped_and_logged() {
    use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
    use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest, Node};
    let net = Net::new(72);
    net.service("backend", &[1]);
    let cp = net
        .control_plane_with(&["--load-report-interval", "300ms"])
        .await;
    let mut client = LoadReportingServiceClient::connect(format!("http://{}", net.cp_xds()))
        .await
        .expect("connect");
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let node = Node {
        id: "liar.default".into(),
        ..Default::default()
    };
    tx.send(LoadStatsRequest {
        node: Some(node),
        cluster_stats: vec![],
    })
    .await
    .expect("send");
    let mut s = client
        .stream_load_stats(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let first = s.message().await.expect("ok").expect("response");
    assert_eq!(first.load_reporting_interval_ms, 300);
    let ep = net.addr(1, 9090).to_string();
    let report = |issued: u64, sum: f64, seq: u64| LoadStatsRequest {
        node: None,
        cluster_stats: vec![ClusterStats {
            cluster_name: "backend.default.svc.cluster.local:80".into(),
            endpoint_stats: vec![EndpointStats {
                address: ep.clone(),
                requests_issued: issued,
                requests_succeeded: issued.min(1_000),
                latency_sum_ms: sum,
                sequence: seq,
                ..Default::default()
            }],
            load_report_interval_ms: 300,
        }],
    };
    tx.send(report(u64::MAX, 1.0, 1)).await.expect("send");
    tx.send(report(10, f64::NAN, 2)).await.expect("send");
    tx.send(report(10, -5.0, 3)).await.expect("send");
    tx.send(report(7, 1.0, 4)).await.expect("send");
    tx.send(report(7, 1.0, 4)).await.expect("send"); // a repeat is not counted again
                                                     // One more, so that the repeat was read once this one is counted.
    tx.send(report(1, 1.0, 5)).await.expect("send");
    let view = wait_cp_json(&net, "/debug/load", |v| requests(v, &ep) >= 8).await;
    assert_eq!(requests(&view, &ep), 8, "{view:#}");
    assert!(cp.log_text().contains("absurd load report dropped"));
}

fn weights(endpoints: &serde_json::Value, net: &Net) -> Vec<u64> {
    backend_weights(&endpoints["backend.default.svc.cluster.local:80"], net)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_aware_converges_to_weights_ordered_by_capacity_without_failures() {
    let net = Net::new(73);
    let _procs = mesh(&net, &UNEQUAL, "simple: LOAD_AWARE", &[100, 101]).await;
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "LOAD_AWARE");
    let l1 = Background::start(net.addr(100, 15001), "backend", 60);
    let l2 = Background::start(net.addr(101, 15001), "backend", 60);
    let start = tokio::time::Instant::now();
    let mut ordered_at = None;
    while start.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let w = weights(&get_json(net.cp_admin(), "/debug/endpoints").await, &net);
        if w[0] > w[1] && w[1] > w[2] {
            ordered_at.get_or_insert(start.elapsed());
        } else {
            ordered_at = None;
        }
    }
    let (a, b) = (l1.finish().await, l2.finish().await);
    assert_no_failures(&a, "sidecar 1: ");
    assert_no_failures(&b, "sidecar 2: ");
    let w = weights(&get_json(net.cp_admin(), "/debug/endpoints").await, &net);
    let at = ordered_at.unwrap_or_else(|| panic!("weights never settled in capacity order: {w:?}"));
    assert!(at < Duration::from_secs(15), "ordered after {at:?}");
    // Every endpoint keeps a minimum share.
    assert!(w[2] * 100 >= w[0], "{w:?}");
    eprintln!(
        "LOAD_AWARE weights {w:?}, ordered after {at:?}; {} + {} requests",
        a.ok, b.ok
    );
}
