//! Acting as a workload of a mesh with mutual TLS: its tokens, a
//! certificate from the mesh's CA or from another, TLS to a sidecar's
//! inbound port, discovery and load-report streams under a token, and paced
//! load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

/// Token of the backend's sidecar (service account `backend`).
pub(crate) const BACKEND_TOKEN: &str = "backend-token-0123456789";

/// Token of the caller's sidecar (service account `web`).
pub(crate) const WEB_TOKEN: &str = "web-token-0123456789abcd";

/// A certificate and its key.
pub(crate) struct Identity {
    pub(crate) chain: Vec<CertificateDer<'static>>,
    pub(crate) key: PrivatePkcs8KeyDer<'static>,
}

/// A certificate for the same SPIFFE ID from a CA the mesh does not trust.
pub(crate) fn foreign_identity() -> Identity {
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
pub(crate) struct Anything(Arc<rustls::crypto::CryptoProvider>);

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
pub(crate) async fn tls_get(
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
pub(crate) fn spiffe_id(cert: &[u8]) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert).ok()?;
    let san = x509.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    })
}

/// A plaintext GET straight to `addr`: the status, or why there was none.
pub(crate) async fn plain_get(addr: std::net::SocketAddr) -> Result<u16, String> {
    let (status, _, _) = get(addr, "backend", "/").await.map_err(|e| e.to_string())?;
    Ok(status)
}

/// A TLS connection to the control plane's discovery port, trusting the
/// mesh's root.
pub(crate) async fn channel(net: &Net) -> tonic::transport::Channel {
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
pub(crate) async fn plaintext_discovery(net: &Net) -> String {
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

pub(crate) fn with_token<T>(req: &mut tonic::Request<T>, token: Option<&str>) {
    if let Some(t) = token {
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {t}").parse().expect("value"),
        );
    }
}

/// Opens a discovery stream as a proxy of `namespace` and reads its first
/// response.
pub(crate) async fn discovery(
    net: &Net,
    token: Option<&str>,
    namespace: &str,
) -> Result<(), tonic::Status> {
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
pub(crate) async fn load_reports(net: &Net, token: Option<&str>) -> Result<(), tonic::Status> {
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
pub(crate) async fn paced(
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
