//! Workload identity on Kubernetes: two control-plane replicas share one
//! root through a Secret; sidecars prove who they are with projected
//! service-account tokens the API server reviews (TokenReview); the Pods
//! that run a sidecar are called over mutual TLS; a PeerAuthentication
//! applied through the API makes the mesh STRICT; and a follower passes its
//! sidecars' load reports to the leader with its own token.

use std::time::Duration;

use base64::Engine;
use minimesh_proto::v1::certificate_service_client::CertificateServiceClient;
use minimesh_proto::v1::IssueRequest;
use serde_json::json;

use crate::fake_kube::FakeKube;
use crate::harness::*;
use crate::kubernetes::{control_plane, service, slice, wait_leader};

const BACKEND_TOKEN: &str = "projected-backend-token";
const WEB_TOKEN: &str = "projected-web-token";
const CP_TOKEN: &str = "projected-control-plane-token";
/// A token the kubelet mounts for the API server, not for minimesh.
const API_TOKEN: &str = "api-server-audience-token";

/// A sidecar at .host taking its config from `xds` over TLS, with `token`.
async fn sidecar(
    net: &Net,
    host: u8,
    xds: std::net::SocketAddr,
    token: &str,
    extra: &[&str],
) -> Proc {
    let dir = net.dir.clone();
    let token_file = dir.join(format!("token-{host}"));
    std::fs::write(&token_file, token).expect("token");
    let mut args = vec![
        "--xds-addr".to_string(),
        format!("https://{xds}"),
        "--workload".into(),
        format!("pod-{host}"),
        "--namespace".into(),
        NS.into(),
        "--outbound".into(),
        net.addr(host, 15001).to_string(),
        "--admin".into(),
        net.addr(host, 15000).to_string(),
        "--ca-root".into(),
        dir.join("root-cert.pem").display().to_string(),
        "--token-file".into(),
        token_file.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let p = net.spawn(&format!("sidecar-{host}"), "sidecar", &args, &[]);
    wait_http(net.addr(host, 15000), "/ready").await;
    p
}

/// A TLS connection to the control plane at `xds`, trusting the mesh's
/// root (written beside the test's files).
async fn channel(net: &Net, xds: std::net::SocketAddr) -> tonic::transport::Channel {
    let root = std::fs::read(net.dir.join("root-cert.pem")).expect("root");
    tonic::transport::Endpoint::from_shared(format!("https://{xds}"))
        .expect("uri")
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(root)),
        )
        .expect("tls")
        .connect()
        .await
        .expect("control plane")
}

/// A certificate request to the control plane at `xds` with `token`: the
/// SPIFFE ID it names, or the refusal.
async fn issue(net: &Net, xds: std::net::SocketAddr, token: &str) -> Result<String, tonic::Status> {
    let channel = channel(net, xds).await;
    let key = rcgen::KeyPair::generate().expect("key");
    let csr = rcgen::CertificateParams::default()
        .serialize_request(&key)
        .and_then(|c| c.pem())
        .expect("csr");
    let mut req = tonic::Request::new(IssueRequest { csr_pem: csr });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("value"),
    );
    let resp = CertificateServiceClient::new(channel).issue(req).await?;
    Ok(resp.into_inner().spiffe_id)
}

/// An Envoy-shaped ADS stream (xDS v3) with `token`, its node naming
/// `namespace` in its metadata as Istio's proxies do: the first response,
/// or the refusal.
async fn envoy_discovery(
    net: &Net,
    xds: std::net::SocketAddr,
    token: &str,
    namespace: &str,
) -> Result<(), tonic::Status> {
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    use futures_util::StreamExt;
    let channel = channel(net, xds).await;
    let metadata = Struct {
        fields: [(
            "NAMESPACE".to_string(),
            Value {
                kind: Some(Kind::StringValue(namespace.into())),
            },
        )]
        .into(),
    };
    let first = DiscoveryRequest {
        node: Some(Node {
            id: "envoy-1".into(),
            cluster: "envoy".into(),
            metadata: Some(metadata),
            ..Default::default()
        }),
        type_url: minimesh_proto::xds_v3::CLUSTER_TYPE.into(),
        ..Default::default()
    };
    let mut req = tonic::Request::new(
        futures_util::stream::iter([first]).chain(futures_util::stream::pending()),
    );
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("value"),
    );
    let mut stream = AggregatedDiscoveryServiceClient::new(channel)
        .stream_aggregated_resources(req)
        .await?
        .into_inner();
    match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
        Ok(Ok(Some(_))) => Ok(()),
        Ok(Ok(None)) => Err(tonic::Status::unknown("stream ended without a response")),
        Ok(Err(status)) => Err(status),
        Err(_) => Err(tonic::Status::deadline_exceeded("no response in 5 s")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_a_root_and_workloads_prove_who_they_are_with_reviewed_tokens() {
    let net = Net::new(126);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    fake.issue_token(BACKEND_TOKEN, NS, "backend", &["minimesh"]);
    fake.issue_token(WEB_TOKEN, NS, "web", &["minimesh"]);
    fake.issue_token(
        CP_TOKEN,
        "minimesh-system",
        "minimesh-control-plane",
        &["minimesh"],
    );
    fake.issue_token(
        API_TOKEN,
        NS,
        "web",
        &["https://kubernetes.default.svc.cluster.local"],
    );
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true)]));
    // The backend's pod, as the injector labels it.
    fake.apply(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "backend-1", "namespace": NS,
                     "labels": {"app": "backend", "minimesh.io/proxy": "sidecar"}},
        "spec": {"serviceAccountName": "backend",
                 "containers": [{"name": "backend", "image": "backend"}]},
        "status": {"phase": "Running", "podIP": net.ip(1).to_string(),
                   "podIPs": [{"ip": net.ip(1).to_string()}]}
    }));
    let cp_token = net.dir.join("cp.token");
    std::fs::write(&cp_token, CP_TOKEN).expect("token");
    let flags = |host: u8| {
        vec![
            "--ca-secret".to_string(),
            "minimesh-ca".into(),
            "--token-file".into(),
            cp_token.display().to_string(),
            "--load-report-interval".into(),
            "300ms".into(),
            "--advertise-addr".into(),
            format!("https://{}", net.addr(host, 15010)),
        ]
    };
    let f0 = flags(254);
    let f0: Vec<&str> = f0.iter().map(String::as_str).collect();
    let cp0 = control_plane(&net, &fake, "cp-0", 254, &f0).await;
    wait_leader(&fake, "cp-0").await;
    let f1 = flags(253);
    let f1: Vec<&str> = f1.iter().map(String::as_str).collect();
    let cp1 = control_plane(&net, &fake, "cp-1", 253, &f1).await;

    // One root, generated by the first replica, read by the second.
    assert_eq!(
        fake.count("CREATE secrets minimesh-ca"),
        1,
        "{:?}",
        fake.log()
    );
    let secret = fake
        .get("v1", "Secret", "minimesh-system", "minimesh-ca")
        .expect("the root's Secret");
    let root = base64::engine::general_purpose::STANDARD
        .decode(
            secret["data"]["root-cert.pem"]
                .as_str()
                .expect("root-cert.pem"),
        )
        .expect("base64");
    assert!(secret["data"]["root-key.pem"].is_string());
    std::fs::write(net.dir.join("root-cert.pem"), &root).expect("root");
    assert!(cp1
        .log_text()
        .contains("the mesh's root certificate read from its Secret"));

    // The backend's sidecar is served by the leader, the caller's by the
    // follower: a request between them is mutual TLS across two replicas'
    // certificates, trusted through the one root.
    let app = net.app(1).await;
    let inbound = net.addr(1, 9090);
    let flags = net.inbound_flags(1);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let _server = sidecar(&net, 1, net.addr(254, 15010), BACKEND_TOKEN, &flags).await;
    let _client = sidecar(&net, 10, net.addr(253, 15010), WEB_TOKEN, &[]).await;
    // The Pod watch marks the endpoint as a sidecar's.
    wait_sidecar(net.addr(10, 15000), Duration::from_secs(10), |v| {
        v["clusters"]["backend.default.svc.cluster.local:80"]["endpoints"][0]["mtls"] == true
    })
    .await;

    // Mesh-wide STRICT through the API.
    fake.apply(json!({
        "apiVersion": "minimesh.io/v1alpha1", "kind": "PeerAuthentication",
        "metadata": {"name": "default", "namespace": "minimesh-system"},
        "spec": {"mtls": {"mode": "STRICT"}}
    }));
    wait_sidecar(net.addr(1, 15000), Duration::from_secs(10), |v| {
        v["mtls"]["inbound_mode"] == "STRICT"
    })
    .await;
    let plain = get(inbound, "backend", "/").await;
    assert!(plain.is_err(), "plaintext served under STRICT: {plain:?}");
    for _ in 0..20 {
        let (status, endpoint, body) = get(net.addr(10, 15001), "backend", "/")
            .await
            .expect("through the caller's sidecar");
        assert_eq!(status, 200, "{body}");
        assert_eq!(endpoint.as_deref(), Some(inbound.to_string().as_str()));
    }

    // Tokens the API server does not authenticate for minimesh: refused,
    // with the API server's reason, in the answer, the log and the metrics.
    let reviews_before = fake.count("CREATE tokenreviews");
    for _ in 0..5 {
        assert_eq!(
            issue(&net, net.addr(253, 15010), WEB_TOKEN)
                .await
                .map_err(|e| e.to_string()),
            Ok(format!("spiffe://cluster.local/ns/{NS}/sa/web"))
        );
    }
    assert!(
        fake.count("CREATE tokenreviews") - reviews_before <= 1,
        "a known token is reviewed once a minute, not per call"
    );
    let wrong_audience = issue(&net, net.addr(253, 15010), API_TOKEN)
        .await
        .expect_err("refused");
    assert_eq!(wrong_audience.code(), tonic::Code::Unauthenticated);
    let expected = "invalid credentials: the API server did not authenticate the token: [invalid bearer token, token audiences [\"https://kubernetes.default.svc.cluster.local\"] is invalid for the target audiences [\"minimesh\"]]";
    assert_eq!(wrong_audience.message(), expected);
    let unknown = issue(&net, net.addr(253, 15010), "not-a-token")
        .await
        .expect_err("refused");
    assert!(
        unknown
            .message()
            .starts_with("invalid credentials: the API server did not authenticate the token: [invalid bearer token"),
        "{}",
        unknown.message()
    );
    assert!(
        cp1.log_text().contains(&format!("refused: {expected}")),
        "{}",
        cp1.log_text()
    );
    let (_, _, metrics) = get(net.addr(253, 15014), "localhost", "/metrics")
        .await
        .expect("metrics");
    assert!(
        metrics.contains(
            "minimesh_auth_refusals_total{service=\"certificates\",reason=\"invalid\"} 2"
        ),
        "{metrics}"
    );

    // A flood of bad tokens (20,000 in under 10 s, from one address)
    // against the discovery port: the API server is asked at most the
    // peer's allowance (20, then 5 a second), and the known token keeps its
    // cached answer (no review for it).
    let reviews_before = fake.count("CREATE tokenreviews");
    let xds = net.addr(253, 15010);
    let flood_channel = channel(&net, xds).await;
    let started = std::time::Instant::now();
    use futures_util::StreamExt;
    let refused: Vec<tonic::Code> = futures_util::stream::iter(0..20_000)
        .map(|i| {
            let ch = flood_channel.clone();
            async move {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                drop(tx);
                let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
                req.metadata_mut().insert(
                    "authorization",
                    format!("Bearer bad-token-{i}").parse().expect("value"),
                );
                minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient::new(ch)
                    .stream_aggregated_resources(req)
                    .await
                    .map(|_| tonic::Code::Ok)
                    .unwrap_or_else(|s| s.code())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "the flood took {took:?}");
    assert!(
        refused
            .iter()
            .all(|c| matches!(c, tonic::Code::Unauthenticated | tonic::Code::Unavailable)),
        "a bad token got through"
    );
    let reviews = fake.count("CREATE tokenreviews") - reviews_before;
    let allowance = 20 + 5 * (took.as_secs() as usize + 1);
    assert!(
        reviews <= allowance,
        "{reviews} reviews for 20,000 bad tokens in {took:?} (allowance {allowance})"
    );
    let (_, _, metrics) = get(net.addr(253, 15014), "localhost", "/metrics")
        .await
        .expect("metrics");
    assert!(
        metrics.contains("minimesh_token_reviews_total{result=\"rate_limited\"}"),
        "{metrics}"
    );
    let before_known = fake.count("CREATE tokenreviews");
    assert!(issue(&net, xds, WEB_TOKEN).await.is_ok());
    assert_eq!(
        fake.count("CREATE tokenreviews"),
        before_known,
        "the known token was reviewed again"
    );

    // Envoy's protocol is bound to the token's namespace too.
    assert!(envoy_discovery(&net, xds, WEB_TOKEN, NS).await.is_ok());
    let other = envoy_discovery(&net, xds, WEB_TOKEN, "kube-system")
        .await
        .expect_err("refused");
    assert_eq!(
        other.message(),
        format!(
            "the token's identity (ns/{NS}/sa/web) may not speak for namespace \"kube-system\""
        )
    );

    // The follower passed its sidecar's load reports to the leader, with
    // the control plane's token (which speaks for every namespace).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let view = get_json(net.addr(254, 15014), "/debug/load").await;
        let seen = view["clusters"]["backend.default.svc.cluster.local:80"][inbound.to_string()]
            ["requests"]
            .as_u64()
            .unwrap_or(0);
        if seen > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the leader never saw the follower's reports: {view:#}\n{}",
            cp1.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !cp0.log_text().contains("refused"),
        "the leader refused a call: {}",
        cp0.log_text()
    );
    drop(app);
}
