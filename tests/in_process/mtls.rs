//! Mutual TLS between sidecars: the control plane as the mesh's CA, each
//! sidecar's certificate naming its SPIFFE ID, PeerAuthentication's modes,
//! and rotation under load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use minimesh_proto::v1::certificate_service_client::CertificateServiceClient;
use minimesh_proto::v1::IssueRequest;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;
use crate::workload::*;

/// A mesh with mutual TLS: a backend app at .1:8080 behind its sidecar's
/// inbound listener .1:9090 (its pod labelled as running a sidecar), and a
/// caller's sidecar at .10; the control plane is the CA.
struct Mesh {
    net: Net,
    /// The app, the control plane and the two sidecars, stopped when dropped.
    _parts: Vec<Box<dyn std::any::Any + Send>>,
}

impl Mesh {
    async fn start(octet: u8, cp_extra: &[&str]) -> Mesh {
        let net = Net::new(octet);
        let dir = net.config().parent().expect("dir").to_path_buf();
        let tokens = dir.join("tokens.yaml");
        std::fs::write(
            &tokens,
            format!(
                "tokens:\n- token: {BACKEND_TOKEN}\n  namespace: {NS}\n  serviceAccount: backend\n- token: {WEB_TOKEN}\n  namespace: {NS}\n  serviceAccount: web\n"
            ),
        )
        .expect("tokens");
        std::fs::write(dir.join("backend.token"), BACKEND_TOKEN).expect("token");
        std::fs::write(dir.join("web.token"), WEB_TOKEN).expect("token");
        net.service("backend", &[1]);
        net.write(
            "pods.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: backend-1\n  namespace: {NS}\n  labels: {{minimesh.io/proxy: sidecar}}\nspec:\n  serviceAccountName: backend\nstatus:\n  podIP: \"{}\"\n",
                net.ip(1)
            ),
        );
        let app = net.app(1).await;
        let ca = dir.join("ca");
        let mut cp_args = vec![
            "--ca-dir".to_string(),
            ca.display().to_string(),
            "--workload-tokens".into(),
            tokens.display().to_string(),
        ];
        cp_args.extend(cp_extra.iter().map(|s| s.to_string()));
        let cp_refs: Vec<&str> = cp_args.iter().map(String::as_str).collect();
        let cp = net.control_plane_with(&cp_refs).await;
        let root = ca.join("root-cert.pem").display().to_string();
        let backend_token = dir.join("backend.token").display().to_string();
        let web_token = dir.join("web.token").display().to_string();
        let inbound = net.inbound_flags(1);
        let mut flags: Vec<&str> = inbound.iter().map(String::as_str).collect();
        flags.extend(["--ca-root", &root, "--token-file", &backend_token]);
        let server = sidecar(&net, 1, &flags).await;
        let client = sidecar(&net, 10, &["--ca-root", &root, "--token-file", &web_token]).await;
        // The caller knows the endpoint runs a sidecar.
        wait_sidecar(net.addr(10, 15000), Duration::from_secs(10), |v| {
            v["clusters"]
                .as_object()
                .into_iter()
                .flat_map(|c| c.values())
                .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
                .any(|e| e["mtls"] == true)
        })
        .await;
        Mesh {
            net,
            _parts: vec![
                Box::new(app),
                Box::new(cp),
                Box::new(server),
                Box::new(client),
            ],
        }
    }

    /// Puts a mesh-wide PeerAuthentication with `mode` in force and waits
    /// until the backend's sidecar applies it.
    async fn mesh_mode(&self, mode: &str) {
        self.net.write(
            "peer-authentication.yaml",
            &format!(
                "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata:\n  name: default\n  namespace: minimesh-system\nspec:\n  mtls:\n    mode: {mode}\n"
            ),
        );
        wait_sidecar(self.net.addr(1, 15000), Duration::from_secs(10), |v| {
            v["mtls"]["inbound_mode"] == mode
        })
        .await;
    }

    /// A certificate for `token`'s identity, as a sidecar gets one: a key,
    /// a signing request, the CA's answer.
    async fn certificate(&self, token: Option<&str>) -> Result<Identity, tonic::Status> {
        let key = rcgen::KeyPair::generate().expect("key");
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)
            .and_then(|c| c.pem())
            .expect("csr");
        let mut req = tonic::Request::new(IssueRequest { csr_pem: csr });
        with_token(&mut req, token);
        let resp = CertificateServiceClient::new(channel(&self.net).await)
            .issue(req)
            .await?
            .into_inner();
        Ok(Identity {
            chain: resp
                .cert_chain_pem
                .iter()
                .map(|p| CertificateDer::from_pem_slice(p.as_bytes()).expect("pem"))
                .collect(),
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        })
    }
}

/// A sidecar at .host (outbound :15001, admin :15000) taking its config
/// over TLS, once ready.
pub(crate) async fn sidecar(net: &Net, host: u8, extra: &[&str]) -> Sidecar {
    let xds = format!("https://{}", net.cp_xds());
    net.sidecar_with(host, &net.sidecar_flags(host, &xds, NS, extra))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_refuses_plaintext_and_serves_callers_with_a_mesh_certificate() {
    let mesh = Mesh::start(219, &[]).await;
    let net = &mesh.net;
    let inbound = net.addr(1, 9090);

    // PERMISSIVE (the default): plaintext is served beside mutual TLS.
    assert_eq!(plain_get(inbound).await, Ok(200));
    // A rule's `tls.mode: DISABLE` makes callers dial in plaintext; without
    // it, the endpoint (a sidecar's) gets mutual TLS again.
    let endpoint_mtls = |want: bool| {
        move |v: &serde_json::Value| {
            v["clusters"]
                .as_object()
                .into_iter()
                .flat_map(|c| c.values())
                .flat_map(|c| c["endpoints"].as_array().cloned().unwrap_or_default())
                .any(|e| e["mtls"] == want)
        }
    };
    net.write(
        "rule.yaml",
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata:\n  name: backend\nspec:\n  host: backend\n  trafficPolicy:\n    tls: {mode: DISABLE}\n",
    );
    wait_sidecar(
        net.addr(10, 15000),
        Duration::from_secs(10),
        endpoint_mtls(false),
    )
    .await;
    let (status, _, _) = get(net.addr(10, 15001), "backend", "/")
        .await
        .expect("plaintext");
    assert_eq!(status, 200);
    net.remove("rule.yaml");
    wait_sidecar(
        net.addr(10, 15000),
        Duration::from_secs(10),
        endpoint_mtls(true),
    )
    .await;
    // A plaintext keep-alive connection opened while PERMISSIVE...
    let mut kept = TcpStream::connect(inbound).await.expect("connect");
    kept.write_all(b"GET / HTTP/1.1\r\nhost: backend\r\n\r\n")
        .await
        .expect("write");
    let mut buf = vec![0u8; 4096];
    let n = kept.read(&mut buf).await.expect("read");
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    mesh.mesh_mode("STRICT").await;
    // ... is closed once STRICT is in force (idle: at once).
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match kept.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "a plaintext connection outlived STRICT");

    // STRICT: a plaintext request gets no answer at all.
    let plain = plain_get(inbound).await;
    assert!(plain.is_err(), "plaintext served under STRICT: {plain:?}");
    // Through the caller's sidecar (mutual TLS): served.
    let (status, endpoint, body) = get(net.addr(10, 15001), "backend", "/")
        .await
        .expect("through the sidecar");
    assert_eq!(status, 200, "{body}");
    assert_eq!(endpoint.as_deref(), Some(inbound.to_string().as_str()));

    // A client with a certificate from the mesh's CA sees the backend's
    // SPIFFE ID, and is served.
    let web = mesh
        .certificate(Some(WEB_TOKEN))
        .await
        .expect("a certificate");
    let (cert, response) = tls_get(inbound, web).await;
    let id = cert.as_deref().and_then(spiffe_id);
    assert_eq!(
        id.as_deref(),
        Some(format!("spiffe://cluster.local/ns/{NS}/sa/backend").as_str())
    );
    let response = response.expect("served over mutual TLS");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");

    // The same SPIFFE ID from another CA: refused.
    let (_, response) = tls_get(inbound, foreign_identity()).await;
    assert!(
        response.as_ref().is_err() || response.as_ref().is_ok_and(|r| r.is_empty()),
        "a foreign certificate was served: {response:?}"
    );

    // A certificate request without valid credentials: refused, with the
    // reason in the answer, the control plane's log and its metrics.
    let missing = mesh.certificate(None).await.err().expect("refused");
    assert_eq!(missing.code(), tonic::Code::Unauthenticated);
    assert_eq!(
        missing.message(),
        "missing credentials: the call has no `authorization: Bearer <token>` metadata"
    );
    let invalid = mesh
        .certificate(Some("not-a-token-of-this-mesh"))
        .await
        .err()
        .expect("refused");
    assert_eq!(
        invalid.message(),
        "invalid credentials: the token is not one this control plane knows"
    );
    let log = logs();
    assert!(
        log.contains("refused: invalid credentials: the token is not one this control plane knows"),
        "{log}"
    );

    // Discovery and load reports: no token, refused before any resource;
    // a token whose identity is of another namespace than the node names,
    // refused at that request.
    let refused = discovery(net, None, NS).await.expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(
        refused.message(),
        "missing credentials: the call has no `authorization: Bearer <token>` metadata"
    );
    let other = discovery(net, Some(WEB_TOKEN), "kube-system")
        .await
        .expect_err("refused");
    assert_eq!(
        other.message(),
        format!(
            "the token's identity (ns/{NS}/sa/web) may not speak for namespace \"kube-system\""
        )
    );
    assert!(discovery(net, Some(WEB_TOKEN), NS).await.is_ok());
    let reports = load_reports(net, None).await.expect_err("refused");
    assert_eq!(reports.code(), tonic::Code::Unauthenticated);
    // The discovery port is TLS: a plaintext client gets nothing.
    let plain = plaintext_discovery(net).await;
    assert_ne!(plain, "a stream opened");

    let (_, _, metrics) = get(net.cp_admin(), "localhost", "/metrics")
        .await
        .expect("metrics");
    for (service, reason) in [
        ("certificates", "missing"),
        ("certificates", "invalid"),
        ("discovery", "missing"),
        ("discovery", "namespace"),
        ("load_reports", "missing"),
    ] {
        let series =
            format!("minimesh_auth_refusals_total{{service=\"{service}\",reason=\"{reason}\"}} 1");
        assert!(metrics.contains(&series), "{series} not in:\n{metrics}");
    }
}

/// Certificates rotated under load: each sidecar renews five times while
/// 200 requests a second go through, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotated_every_3s_under_200_requests_per_second_lose_none() {
    // Certificates last 6 s: each sidecar renews every 3 s. Connections
    // to the backend last 50 requests, so new handshakes (with whichever
    // certificate is current) go on throughout.
    let mesh = Mesh::start(220, &["--workload-cert-ttl", "6s"]).await;
    let net = &mesh.net;
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: backend\nspec:\n  host: backend\n  trafficPolicy:\n    connectionPool:\n      http:\n        maxRequestsPerConnection: 50\n",
    );
    mesh.mesh_mode("STRICT").await;
    let issued = async || {
        let (_, _, metrics) = get(net.cp_admin(), "localhost", "/metrics")
            .await
            .expect("metrics");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("minimesh_certificates_issued_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let before = issued().await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(paced(net.addr(10, 15001), 200, stop.clone()));
    let started = Instant::now();
    // Until both sidecars renewed five times each (about 15 s).
    while issued().await < before + 2 * 5 {
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "only {} renewals in 40 s",
            issued().await - before
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let (sent, failed) = load.await.expect("load");
    let secs = started.elapsed().as_secs_f64();
    assert!(
        failed.is_empty(),
        "{} of {sent} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(
        sent as f64 >= 180.0 * secs,
        "only {sent} requests in {secs:.0} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissive_to_strict_under_load_loses_no_request_of_meshed_callers() {
    let mesh = Mesh::start(221, &[]).await;
    let net = &mesh.net;
    mesh.mesh_mode("PERMISSIVE").await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(paced(net.addr(10, 15001), 200, stop.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    mesh.mesh_mode("STRICT").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    mesh.mesh_mode("PERMISSIVE").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let (sent, failed) = load.await.expect("load");
    assert!(
        failed.is_empty(),
        "{} of {sent} failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(sent >= 800, "only {sent} requests");
}
