//! Load reporters bound to who they are: what a token proves is what a
//! report counts as, whatever the ids it names.

use std::time::Duration;

use futures_util::StreamExt;

use crate::harness::*;
use crate::workload::*;

/// Reporters bound to who they are: a token bound to pod `web-1` reports
/// as that pod only. Six streams naming six node ids count as one reporter;
/// another proxy's workload, or the forwarder's node id prefix (the control
/// plane's own), is refused with the reason; a sequence far ahead of the
/// clock (which would silence the reporter's next honest reports) is
/// dropped; and a report on a Service not exported to the reporter's
/// namespace counts for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reports_count_as_the_pod_the_token_proves_whatever_ids_they_name() {
    use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
    use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest, Node};
    let net = Net::new(223);
    let dir = net.config().parent().expect("dir").to_path_buf();
    let tokens = dir.join("tokens.yaml");
    std::fs::write(
        &tokens,
        format!(
            "tokens:\n- token: {WEB_TOKEN}\n  namespace: {NS}\n  serviceAccount: web\n  pod: web-1\n"
        ),
    )
    .expect("tokens");
    net.service("backend", &[1]);
    net.write(
        "private.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: private\n  namespace: default\n  annotations: {networking.istio.io/exportTo: other}\nspec:\n  ports: [{name: http, port: 80, targetPort: 9090}]\n",
    );
    let ca = dir.join("ca");
    let (ca_dir, tokens) = (ca.display().to_string(), tokens.display().to_string());
    let _cp = net
        .control_plane_with(&["--ca-dir", &ca_dir, "--workload-tokens", &tokens])
        .await;
    let ep = net.addr(1, 9090).to_string();
    let node = |id: &str, workload: &str| Node {
        id: id.into(),
        workload: workload.into(),
        namespace: NS.into(),
        ..Default::default()
    };
    let stats = |issued: u64, sequence: u64| ClusterStats {
        cluster_name: "backend.default.svc.cluster.local:80".into(),
        endpoint_stats: vec![EndpointStats {
            address: ep.clone(),
            requests_issued: issued,
            requests_succeeded: issued,
            sequence,
            ..Default::default()
        }],
        load_report_interval_ms: 1000,
    };
    // A stream's answer to its first report, which carries `first`'s load.
    let open = |node: Node, first: Vec<ClusterStats>| {
        let net = &net;
        async move {
            let req = LoadStatsRequest {
                node: Some(node),
                cluster_stats: first,
            };
            let mut call = tonic::Request::new(
                futures_util::stream::iter([req]).chain(futures_util::stream::pending()),
            );
            with_token(&mut call, Some(WEB_TOKEN));
            let mut s = LoadReportingServiceClient::new(channel(net).await)
                .stream_load_stats(call)
                .await?
                .into_inner();
            match tokio::time::timeout(Duration::from_secs(5), s.message()).await {
                Ok(Ok(_)) => Ok(s),
                Ok(Err(status)) => Err(status),
                Err(_) => Err(tonic::Status::deadline_exceeded("no response")),
            }
        }
    };
    let now_seq = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
        * 1000;
    let mut held = Vec::new();
    let mut hidden = stats(1_000, now_seq + 50);
    hidden.cluster_name = "private.default.svc.cluster.local:80".into();
    for i in 0..6u64 {
        let s = open(
            node(&format!("web-{i}.default"), "web-1"),
            if i == 0 {
                vec![stats(10, now_seq + i), hidden.clone()]
            } else {
                vec![stats(10, now_seq + i)]
            },
        )
        .await
        .expect("the pod's own streams are taken");
        held.push(s);
    }
    let view = wait_cp_json(&net, "/debug/load", |v| {
        v["clusters"]["backend.default.svc.cluster.local:80"][&ep]["requests"].as_u64() >= Some(60)
    })
    .await;
    let e = &view["clusters"]["backend.default.svc.cluster.local:80"][&ep];
    assert_eq!(e["reporters"], 1, "six streams, one reporter: {view:#}");
    assert!(
        view["clusters"]["private.default.svc.cluster.local:80"]
            .as_object()
            .is_none_or(|endpoints| endpoints.is_empty()),
        "a report on a Service not exported to the reporter's namespace counted: {view:#}"
    );
    // Another proxy's workload, and the forwarder's prefix: refused.
    let Err(other) = open(node("backend-1.default", "backend-1"), vec![]).await else {
        panic!("another proxy's workload was taken");
    };
    assert_eq!(
        other.message(),
        "the token is bound to pod \"web-1\"; the node names workload \"backend-1\""
    );
    let Err(forwarder) = open(node("minimesh-forwarder/web-1", "web-1"), vec![]).await else {
        panic!("the forwarder prefix was taken");
    };
    assert_eq!(
        forwarder.message(),
        format!("node id \"minimesh-forwarder/web-1\": the prefix minimesh-forwarder/ is the control plane's own (replicas passing on load reports); the token's identity (ns/{NS}/sa/web) is not")
    );
    // A sequence a day ahead of the clock is dropped: the next honest
    // report still counts.
    let ahead = now_seq + 86_400_000 * 1000;
    let _liar = open(node("web-1.default", "web-1"), vec![stats(1_000, ahead)])
        .await
        .expect("stream");
    let _honest = open(
        node("web-1.default", "web-1"),
        vec![stats(5, now_seq + 100)],
    )
    .await
    .expect("stream");
    wait_cp_json(&net, "/debug/load", |v| {
        v["clusters"]["backend.default.svc.cluster.local:80"][&ep]["requests"].as_u64() == Some(65)
    })
    .await;
    assert!(logs().contains("absurd load report dropped"));
}

/// The attack on LOAD_AWARE, measured as weights: three honest
/// sidecars report the three backends alike; then one workload opens six
/// report streams under six node ids and reports backend 1 a hundred times
/// slower. Its streams count as one reporter of four (its pod), so the
/// medians, and the weights, stay where the honest reports put them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_report_streams_of_one_workload_move_no_load_aware_weight() {
    use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
    use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest, Node};
    let net = Net::new(224);
    let dir = net.config().parent().expect("dir").to_path_buf();
    let tokens = dir.join("tokens.yaml");
    let token = |pod: &str| format!("{pod}-token-0123456789abcdef");
    let mut list = String::from("tokens:\n");
    for pod in ["web-1", "web-2", "web-3", "evil-1"] {
        let sa = pod.split('-').next().unwrap_or(pod);
        list.push_str(&format!(
            "- token: {}\n  namespace: {NS}\n  serviceAccount: {sa}\n  pod: {pod}\n",
            token(pod)
        ));
    }
    std::fs::write(&tokens, list).expect("tokens");
    net.service("backend", &[1, 2, 3]);
    net.write(
        "dr.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: backend}\nspec:\n  host: backend\n  trafficPolicy: {loadBalancer: {simple: LOAD_AWARE}}\n",
    );
    let ca = dir.join("ca");
    let (ca_dir, tokens) = (ca.display().to_string(), tokens.display().to_string());
    let _cp = net
        .control_plane_with(&["--ca-dir", &ca_dir, "--workload-tokens", &tokens])
        .await;
    let cluster = "backend.default.svc.cluster.local:80";
    // One stream: a report every 200 ms, `slow_ms` for backend 1 and 50 ms
    // for the others, 50 requests each.
    let stream = |pod: &'static str, id: String, slow_ms: f64| {
        let net = &net;
        let token = token(pod);
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<LoadStatsRequest>(4);
            let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            with_token(&mut call, Some(&token));
            let mut client = LoadReportingServiceClient::new(channel(net).await);
            let node = Node {
                id,
                workload: pod.into(),
                namespace: NS.into(),
                ..Default::default()
            };
            let addrs: Vec<String> = (1..=3).map(|h| net.addr(h, 9090).to_string()).collect();
            tokio::spawn(async move {
                loop {
                    let seq = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .expect("clock")
                        .as_micros() as u64;
                    let endpoint_stats = addrs
                        .iter()
                        .enumerate()
                        .map(|(i, a)| {
                            let ms = if i == 0 { slow_ms } else { 50.0 };
                            EndpointStats {
                                address: a.clone(),
                                requests_issued: 50,
                                requests_succeeded: 50,
                                latency_sum_ms: 50.0 * ms,
                                latency_count: 50,
                                sequence: seq,
                                ..Default::default()
                            }
                        })
                        .collect();
                    let req = LoadStatsRequest {
                        node: Some(node.clone()),
                        cluster_stats: vec![ClusterStats {
                            cluster_name: cluster.into(),
                            endpoint_stats,
                            load_report_interval_ms: 200,
                        }],
                    };
                    if tx.send(req).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            });
            let mut s = client
                .stream_load_stats(call)
                .await
                .expect("the pod's own stream is taken")
                .into_inner();
            tokio::time::timeout(Duration::from_secs(5), s.message())
                .await
                .expect("an answer")
                .expect("a response");
            s
        }
    };
    let weights_now = || async {
        let v = get_json(net.cp_admin(), "/debug/endpoints").await;
        backend_weights(&v[cluster], &net)
    };
    let reporters = || async {
        let v = get_json(net.cp_admin(), "/debug/load").await;
        v["clusters"][cluster][net.addr(1, 9090).to_string()]["reporters"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut held = Vec::new();
    for pod in ["web-1", "web-2", "web-3"] {
        held.push(stream(pod, format!("{pod}.{NS}"), 50.0).await);
    }
    // Honest reports alike: equal weights.
    wait_cp_json(&net, "/debug/load", |v| {
        v["clusters"][cluster][net.addr(1, 9090).to_string()]["reporters"].as_u64() == Some(3)
    })
    .await;
    let honest = poll_cp_json(&net, "/debug/endpoints", Duration::from_secs(10), |v| {
        let w = backend_weights(&v[cluster], &net);
        w[0] > 0 && w.iter().all(|x| *x == w[0])
    })
    .await;
    let honest = backend_weights(&honest[cluster], &net);
    // The attack: six streams of one workload under six ids, backend 1 at
    // 5 s, for three control windows more.
    for i in 0..6 {
        held.push(stream("evil-1", format!("evil-{i}.{NS}"), 5_000.0).await);
    }
    assert_eq!(
        reporters().await,
        4,
        "six streams of one pod are one reporter"
    );
    // What must not happen cannot be polled for: three control windows
    // (2 s each), in which a counted attack moves the weight at once (by
    // half of the gap each window, LOAD_AWARE's gain).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let attacked = weights_now().await;
    for (a, h) in attacked.iter().zip(&honest) {
        let moved = (*a as f64 - *h as f64).abs() / *h as f64;
        assert!(
            moved <= 0.05,
            "weights {attacked:?} under attack, {honest:?} before: moved {:.1}%",
            moved * 100.0
        );
    }
    eprintln!(
        "LOAD_AWARE weights: honest {honest:?}, under six streams of one workload {attacked:?}"
    );
    drop(held);
}
