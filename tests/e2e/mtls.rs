//! Mutual TLS between sidecars: the control plane as the mesh's CA, each
//! sidecar's certificate naming its SPIFFE ID, PeerAuthentication's modes,
//! and rotation under load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use minimesh_proto::v1::certificate_service_client::CertificateServiceClient;
use minimesh_proto::v1::IssueRequest;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use futures_util::StreamExt;

use crate::harness::*;

/// Token of the backend's sidecar (service account `backend`).
const BACKEND_TOKEN: &str = "backend-token-0123456789";
/// Token of the caller's sidecar (service account `web`).
const WEB_TOKEN: &str = "web-token-0123456789abcd";

/// A mesh with mutual TLS: a backend app at .1:8080 behind its sidecar's
/// inbound listener .1:9090 (its pod labelled as running a sidecar), and a
/// caller's sidecar at .10; the control plane is the CA.
struct Mesh {
    net: Net,
    _procs: Vec<Proc>,
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
            _procs: vec![app, cp, server, client],
        }
    }

    fn dir(&self) -> std::path::PathBuf {
        self.net.config().parent().expect("dir").to_path_buf()
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
async fn sidecar(net: &Net, host: u8, extra: &[&str]) -> Proc {
    let mut args = vec![
        "--xds-addr".to_string(),
        format!("https://{}", net.cp_xds()),
        "--workload".into(),
        format!("pod-{host}"),
        "--namespace".into(),
        NS.into(),
        "--outbound".into(),
        net.addr(host, 15001).to_string(),
        "--admin".into(),
        net.addr(host, 15000).to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let p = net.spawn(&format!("sidecar-{host}"), "sidecar", &args, &[]);
    wait_http(net.addr(host, 15000), "/ready").await;
    p
}

/// A certificate and its key.
struct Identity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivatePkcs8KeyDer<'static>,
}

/// A certificate for the same SPIFFE ID from a CA the mesh does not trust.
fn foreign_identity() -> Identity {
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let mut leaf = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    leaf.subject_alt_names = vec![rcgen::SanType::URI(
        format!("spiffe://cluster.local/ns/{NS}/sa/web")
            .try_into()
            .expect("uri"),
    )];
    leaf.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    ];
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = leaf.signed_by(&key, &issuer).expect("leaf");
    let _ = ca_cert;
    Identity {
        chain: vec![cert.der().clone()],
        key: PrivatePkcs8KeyDer::from(key.serialize_der()),
    }
}

/// Accepts any server certificate: the test reads what the server presents.
#[derive(Debug)]
struct Anything(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for Anything {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Opens TLS to `addr` as `who`, sends a GET and reads until the server
/// closes: the server's certificate, and the response (Err: the handshake
/// or the exchange failed).
async fn tls_get(
    addr: std::net::SocketAddr,
    who: Identity,
) -> (Option<CertificateDer<'static>>, Result<String, String>) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Anything(provider)))
        .with_client_auth_cert(who.chain, PrivateKeyDer::Pkcs8(who.key))
        .expect("client cert");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut tls = match connector
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await
    {
        Ok(t) => t,
        Err(e) => return (None, Err(e.to_string())),
    };
    let cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first().cloned());
    let exchange = async {
        tls.write_all(b"GET / HTTP/1.1\r\nHost: backend\r\nConnection: close\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        tls.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    };
    let result = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .unwrap_or(Err("timed out".into()));
    (cert, result)
}

/// The SPIFFE ID of a certificate.
fn spiffe_id(cert: &[u8]) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert).ok()?;
    let san = x509.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    })
}

/// A plaintext GET straight to `addr`: the status, or why there was none.
async fn plain_get(addr: std::net::SocketAddr) -> Result<u16, String> {
    let (status, _, _) = get(addr, "backend", "/").await.map_err(|e| e.to_string())?;
    Ok(status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_refuses_plaintext_and_serves_callers_with_a_mesh_certificate() {
    let mesh = Mesh::start(121, &[]).await;
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
    let log =
        std::fs::read_to_string(mesh.dir().join("logs").join("control-plane.log")).expect("log");
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

/// A TLS connection to the control plane's discovery port, trusting the
/// mesh's root.
async fn channel(net: &Net) -> tonic::transport::Channel {
    let dir = net.config().parent().expect("dir").to_path_buf();
    let root = std::fs::read(dir.join("ca").join("root-cert.pem")).expect("root");
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(root));
    tonic::transport::Endpoint::from_shared(format!("https://{}", net.cp_xds()))
        .expect("uri")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .expect("control plane")
}

/// A plaintext gRPC call to the TLS discovery port: the error.
async fn plaintext_discovery(net: &Net) -> String {
    use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", net.cp_xds()))
        .expect("uri")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    let req = tonic::Request::new(futures_util::stream::pending::<
        minimesh_proto::v1::DiscoveryRequest,
    >());
    match AggregatedDiscoveryServiceClient::new(channel)
        .stream_aggregated_resources(req)
        .await
    {
        Ok(_) => "a stream opened".into(),
        Err(e) => e.to_string(),
    }
}

fn with_token<T>(req: &mut tonic::Request<T>, token: Option<&str>) {
    if let Some(t) = token {
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {t}").parse().expect("value"),
        );
    }
}

/// Opens a discovery stream as a proxy of `namespace` and reads its first
/// response.
async fn discovery(net: &Net, token: Option<&str>, namespace: &str) -> Result<(), tonic::Status> {
    use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    use minimesh_proto::v1::{DiscoveryRequest, Node};
    let first = DiscoveryRequest {
        node: Some(Node {
            id: "probe".into(),
            namespace: namespace.into(),
            ..Default::default()
        }),
        type_url: minimesh_proto::CLUSTER_TYPE.into(),
        ..Default::default()
    };
    let mut req = tonic::Request::new(
        futures_util::stream::iter([first]).chain(futures_util::stream::pending()),
    );
    with_token(&mut req, token);
    let mut stream = AggregatedDiscoveryServiceClient::new(channel(net).await)
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

/// Opens a load-report stream and reads its first response.
async fn load_reports(net: &Net, token: Option<&str>) -> Result<(), tonic::Status> {
    use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
    use minimesh_proto::v1::{LoadStatsRequest, Node};
    let first = LoadStatsRequest {
        node: Some(Node {
            id: "probe".into(),
            namespace: NS.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut req = tonic::Request::new(
        futures_util::stream::iter([first]).chain(futures_util::stream::pending()),
    );
    with_token(&mut req, token);
    let mut stream = LoadReportingServiceClient::new(channel(net).await)
        .stream_load_stats(req)
        .await?
        .into_inner();
    match tokio::time::timeout(Duration::from_secs(5), stream.message()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(status)) => Err(status),
        Err(_) => Err(tonic::Status::deadline_exceeded("no response in 5 s")),
    }
}

/// Requests at `rate` per second through `proxy` until `stop`: the
/// failures (a status other than 200, or no answer).
async fn paced(
    proxy: std::net::SocketAddr,
    rate: u32,
    stop: Arc<AtomicBool>,
) -> (u64, Vec<String>) {
    let sent = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    const CLIENTS: u32 = 4;
    for _ in 0..CLIENTS {
        let (stop, sent) = (stop.clone(), sent.clone());
        tasks.push(tokio::spawn(async move {
            let mut failed = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1) * CLIENTS / rate);
            let mut conn = Conn::open(proxy).await.ok();
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                sent.fetch_add(1, Ordering::Relaxed);
                let c = match conn.as_mut() {
                    Some(c) => c,
                    None => {
                        conn = Conn::open(proxy).await.ok();
                        match conn.as_mut() {
                            Some(c) => c,
                            None => {
                                failed.push("cannot connect to the sidecar".to_string());
                                continue;
                            }
                        }
                    }
                };
                match c.get("backend", "/").await {
                    Ok((200, _, _)) => {}
                    Ok((status, _, body)) => failed.push(format!("{status}: {body}")),
                    Err(e) => {
                        failed.push(e.to_string());
                        conn = None;
                    }
                }
            }
            failed
        }));
    }
    let mut failed = Vec::new();
    for t in tasks {
        failed.extend(t.await.expect("load task"));
    }
    (sent.load(Ordering::Relaxed), failed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotated_every_10s_under_200_requests_per_second_lose_none() {
    // Certificates last 20 s: each sidecar renews every 10 s. Connections
    // to the backend last 50 requests, so new handshakes (with whichever
    // certificate is current) go on throughout.
    let mesh = Mesh::start(122, &["--workload-cert-ttl", "20s"]).await;
    let net = &mesh.net;
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: backend\nspec:\n  host: backend\n  trafficPolicy:\n    connectionPool:\n      http:\n        maxRequestsPerConnection: 50\n",
    );
    mesh.mesh_mode("STRICT").await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(paced(net.addr(10, 15001), 200, stop.clone()));
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(60)).await;
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
    // Each sidecar renewed at least five times in the minute.
    let (_, _, metrics) = get(net.cp_admin(), "localhost", "/metrics")
        .await
        .expect("metrics");
    let issued: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("minimesh_certificates_issued_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        issued >= 2 * 6,
        "only {issued} certificates issued in a minute"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissive_to_strict_under_load_loses_no_request_of_meshed_callers() {
    let mesh = Mesh::start(123, &[]).await;
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

/// Secure naming: of a Service's two endpoints, one runs a sidecar whose
/// certificate is valid in the mesh but of another service account than
/// its pod's (a workload answering on an address it should not). The
/// caller refuses that certificate: no request reaches the impostor, every
/// one is answered by the right replica, and the refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_presenting_another_identity_is_refused_and_its_share_goes_elsewhere() {
    const IMPOSTOR_TOKEN: &str = "impostor-token-0123456789";
    let net = Net::new(146);
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
    let net = Net::new(148);
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
    let cp = net
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
    assert!(cp.log_text().contains("absurd load report dropped"));
}

/// The issue's attack on LOAD_AWARE, measured as weights: three honest
/// sidecars report the three backends alike; then one workload opens six
/// report streams under six node ids and reports backend 1 a hundred times
/// slower. Its streams count as one reporter of four (its pod), so the
/// medians, and the weights, stay where the honest reports put them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_report_streams_of_one_workload_move_no_load_aware_weight() {
    use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
    use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest, Node};
    let net = Net::new(150);
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
