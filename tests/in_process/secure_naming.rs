//! Secure naming: a caller accepts of an endpoint only the identity its
//! pod runs as.

use std::time::Duration;

use crate::harness::*;
use crate::mtls::sidecar;
use crate::workload::*;

/// Secure naming: of a Service's two endpoints, one runs a sidecar whose
/// certificate is valid in the mesh but of another service account than
/// its pod's (a workload answering on an address it should not). The
/// caller refuses that certificate: no request reaches the impostor, every
/// one is answered by the right replica, and the refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_presenting_another_identity_is_refused_and_its_share_goes_elsewhere() {
    const IMPOSTOR_TOKEN: &str = "impostor-token-0123456789";
    let net = Net::new(222);
    let dir = net.config().parent().expect("dir").to_path_buf();
    let tokens = dir.join("tokens.yaml");
    std::fs::write(
        &tokens,
        format!(
            "tokens:\n- token: {BACKEND_TOKEN}\n  namespace: {NS}\n  serviceAccount: backend\n- token: {WEB_TOKEN}\n  namespace: {NS}\n  serviceAccount: web\n- token: {IMPOSTOR_TOKEN}\n  namespace: {NS}\n  serviceAccount: web\n"
        ),
    )
    .expect("tokens");
    for (file, token) in [
        ("backend.token", BACKEND_TOKEN),
        ("web.token", WEB_TOKEN),
        ("impostor.token", IMPOSTOR_TOKEN),
    ] {
        std::fs::write(dir.join(file), token).expect("token");
    }
    net.service("backend", &[1, 2]);
    // Both pods run as service account `backend`, as their Pod objects say.
    let pod = |h: u8| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: backend-{h}\n  namespace: {NS}\n  labels: {{minimesh.io/proxy: sidecar}}\nspec:\n  serviceAccountName: backend\nstatus:\n  podIP: \"{}\"\n---\n",
            net.ip(h)
        )
    };
    net.write("pods.yaml", &(pod(1) + &pod(2)));
    let apps = [net.app(1).await, net.app(2).await];
    let ca = dir.join("ca");
    let (ca_dir, tokens) = (ca.display().to_string(), tokens.display().to_string());
    let _cp = net
        .control_plane_with(&["--ca-dir", &ca_dir, "--workload-tokens", &tokens])
        .await;
    let root = ca.join("root-cert.pem").display().to_string();
    let token = |f: &str| dir.join(f).display().to_string();
    let mut servers = Vec::new();
    for (h, file) in [(1, "backend.token"), (2, "impostor.token")] {
        let inbound = net.inbound_flags(h);
        let t = token(file);
        let mut flags: Vec<&str> = inbound.iter().map(String::as_str).collect();
        flags.extend(["--ca-root", &root, "--token-file", &t]);
        servers.push(sidecar(&net, h, &flags).await);
    }
    let web_token = token("web.token");
    let _client = sidecar(&net, 10, &["--ca-root", &root, "--token-file", &web_token]).await;
    // The caller expects backend's identity of both endpoints.
    wait_sidecar(net.addr(10, 15000), Duration::from_secs(10), |v| {
        let eps = v["clusters"]["backend.default.svc.cluster.local:80"]["endpoints"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        eps.len() == 2
            && eps.iter().all(|e| {
                e["mtls"] == true && e["identities"] == serde_json::json!(["default/backend"])
            })
    })
    .await;
    let mut c = Conn::open(net.addr(10, 15001)).await.expect("connect");
    for i in 0..100 {
        let (status, _, body) = c.get("backend", "/").await.expect("answer");
        assert_eq!(status, 200, "request {i}: {body}");
        assert!(
            body.contains("\"backend-1\""),
            "request {i} answered by {body}"
        );
    }
    let v = get_json(net.addr(10, 15000), "/debug/config").await;
    let eps = v["clusters"]["backend.default.svc.cluster.local:80"]["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let impostor = eps
        .iter()
        .find(|e| e["pod"] == "backend-2")
        .expect("the impostor's endpoint");
    assert!(
        impostor["identity_refused"].as_u64() >= Some(1),
        "{impostor:#}"
    );
    let (_, _, metrics) = get(net.addr(10, 15000), "localhost", "/metrics")
        .await
        .expect("metrics");
    assert!(
        metrics.lines().any(
            |l| l.starts_with("minimesh_endpoint_identity_refused_total{")
                && l.contains("backend-2")
        ),
        "{metrics}"
    );
    drop(apps);
}
