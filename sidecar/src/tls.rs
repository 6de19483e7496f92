//! Mutual TLS between sidecars. Each sidecar holds a certificate from the
//! mesh's CA naming its SPIFFE ID (the `identity` module gets and renews it);
//! it presents it on every connection to another sidecar's inbound listener
//! and requires one from every TLS client of its own. A peer's certificate
//! must chain to the mesh's root (`--ca-root`) and name a SPIFFE ID of the
//! trust domain. Certificates are checked once per connection: a rotation
//! changes the next connection's, never a request's.
//!
//! The inbound listener's mode comes from the PeerAuthentication of the
//! sidecar's namespace (else the mesh's): PERMISSIVE serves TLS and
//! plaintext alike (told apart by the first byte), STRICT closes plaintext
//! connections unanswered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use minimesh_proto::v1::MtlsMode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio::net::TcpStream;

pub mod fuzz;
mod io;
pub use io::Io;

/// The mesh's TLS settings and this sidecar's current certificate.
pub struct Mesh {
    /// The SPIFFE trust domain peers' IDs must be in.
    pub trust_domain: String,
    identity: Arc<ArcSwapOption<CertifiedKey>>,
    spiffe_id: ArcSwapOption<String>,
    client_h1: Arc<ClientConfig>,
    client_h2: Arc<ClientConfig>,
    client_tcp: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

/// This sidecar's mutual TLS: its identity (with `--ca-root`) and the
/// inbound mode the control plane sets. One value per sidecar, passed to the
/// listeners, the discovery client and the admin server: two sidecars in one
/// process keep theirs apart.
pub struct Tls {
    mesh: Option<Arc<Mesh>>,
    /// The inbound mode in force (a [`MtlsMode`] as u8); PERMISSIVE until
    /// the control plane says otherwise.
    mode: AtomicU8,
    /// True while STRICT: what plaintext inbound connections watch, to close
    /// (gracefully) when the mode becomes STRICT.
    strict: tokio::sync::watch::Sender<bool>,
}

impl Tls {
    /// A sidecar's TLS: with `mesh`, it dials and serves mutual TLS.
    pub fn new(mesh: Option<Arc<Mesh>>) -> Arc<Tls> {
        Arc::new(Tls {
            mesh,
            mode: AtomicU8::new(MtlsMode::MtlsPermissive as u8),
            strict: tokio::sync::watch::Sender::new(false),
        })
    }

    /// The mesh's TLS, with `--ca-root`.
    pub fn mesh(&self) -> Option<&Arc<Mesh>> {
        self.mesh.as_ref()
    }

    /// Resolves once the inbound mode is STRICT.
    pub async fn became_strict(&self) {
        let mut rx = self.strict.subscribe();
        let _ = rx.wait_for(|strict| *strict).await;
    }

    /// Sets the inbound listener's mode: STRICT, or PERMISSIVE for anything else.
    pub fn set_inbound_mode(&self, mode: MtlsMode) {
        let mode = match mode {
            MtlsMode::MtlsStrict => MtlsMode::MtlsStrict,
            _ => MtlsMode::MtlsPermissive,
        };
        let old = self.mode.swap(mode as u8, Ordering::Relaxed);
        self.strict.send_if_modified(|strict| {
            let now = mode == MtlsMode::MtlsStrict;
            std::mem::replace(strict, now) != now
        });
        if old != mode as u8 {
            tracing::info!(mode = mode.as_str_name(), "inbound mutual TLS mode");
            if mode == MtlsMode::MtlsStrict && self.mesh.is_none() {
                tracing::warn!("STRICT mutual TLS is in force but this sidecar has no --ca-root: every inbound connection is refused");
            }
        }
    }

    /// The inbound listener's mode now.
    pub fn strict(&self) -> bool {
        self.mode.load(Ordering::Relaxed) == MtlsMode::MtlsStrict as u8
    }

    /// An inbound connection as the mode allows it: TLS (its client
    /// authenticated), plaintext (PERMISSIVE), or None (refused: STRICT and
    /// plaintext, a failed handshake, or nothing sent within `within`).
    pub async fn accept_inbound(
        &self,
        tcp: TcpStream,
        peer: SocketAddr,
        within: Duration,
    ) -> Option<Io> {
        let sorted = async {
            let mut first = [0u8; 1];
            let n = tcp.peek(&mut first).await.ok()?;
            match (n, first[0], &self.mesh) {
                (1, TLS_HANDSHAKE, Some(m)) => match m.accept(tcp).await {
                    Ok(io) => Some(io),
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "inbound TLS handshake failed");
                        None
                    }
                },
                _ if self.strict() => {
                    tracing::debug!(%peer, "plaintext connection refused (STRICT mutual TLS)");
                    None
                }
                _ => Some(Io::Plain(tcp)),
            }
        };
        tokio::time::timeout(within, sorted).await.ok().flatten()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Mesh {
    /// The mesh of the root certificates in `roots_pem`, for `trust_domain`.
    pub fn new(roots_pem: &str, trust_domain: &str) -> anyhow::Result<Mesh> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
            roots.add(cert?)?;
        }
        anyhow::ensure!(!roots.is_empty(), "no certificate in the root file");
        let roots = Arc::new(roots);
        let identity: Arc<ArcSwapOption<CertifiedKey>> = Arc::default();
        let resolver = Arc::new(Current(identity.clone()));
        let verifier = Arc::new(MeshVerifier {
            roots: roots.clone(),
            trust_domain: trust_domain.to_string(),
            provider: provider(),
        });
        let client = |alpn: &[u8]| -> anyhow::Result<Arc<ClientConfig>> {
            let mut c = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&rustls::version::TLS13])?
                .dangerous()
                .with_custom_certificate_verifier(verifier.clone())
                .with_client_cert_resolver(resolver.clone());
            c.alpn_protocols = vec![alpn.to_vec()];
            Ok(Arc::new(c))
        };
        let clients =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider()).build()?;
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(clients)
            .with_cert_resolver(resolver.clone());
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), ALPN_TCP.to_vec()];
        Ok(Mesh {
            trust_domain: trust_domain.to_string(),
            client_h1: client(b"http/1.1")?,
            client_h2: client(b"h2")?,
            client_tcp: client(ALPN_TCP)?,
            server: Arc::new(server),
            identity,
            spiffe_id: ArcSwapOption::empty(),
        })
    }

    /// Takes `key` (with its chain) as this sidecar's certificate for the
    /// connections made and accepted from now on.
    pub fn set_identity(&self, key: CertifiedKey, spiffe_id: String) {
        self.identity.store(Some(Arc::new(key)));
        self.spiffe_id.store(Some(Arc::new(spiffe_id)));
    }

    /// This sidecar's SPIFFE ID, once it has a certificate.
    pub fn spiffe_id(&self) -> Option<Arc<String>> {
        self.spiffe_id.load_full()
    }

    /// A TLS connection to another sidecar's inbound listener at `addr`,
    /// for what `alpn` names, whose certificate names an identity `peer`
    /// expects (secure naming): another is a failed connect, counted on
    /// `peer` and logged once for it; nothing was sent.
    pub async fn connect(
        &self,
        tcp: TcpStream,
        addr: SocketAddr,
        alpn: Alpn,
        peer: &Peer,
    ) -> std::io::Result<Io> {
        let config = match alpn {
            Alpn::Http1 => &self.client_h1,
            Alpn::Http2 => &self.client_h2,
            Alpn::Tcp => &self.client_tcp,
        };
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let stream = connector
            .connect(ServerName::IpAddress(addr.ip().into()), tcp)
            .await?;
        let io = Io::Client(Box::new(stream));
        let presented = io.peer_identity();
        if presented
            .as_deref()
            .is_some_and(|id| peer.accepts(id, &self.trust_domain))
        {
            return Ok(io);
        }
        peer.refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if !peer.logged.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                endpoint = %addr,
                expected = ?peer.accounts,
                presented = presented.as_deref().unwrap_or("none"),
                "secure naming: the endpoint's certificate names an identity its pod does not have; connection refused (logged once per endpoint, counted in minimesh_endpoint_identity_refused)"
            );
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "secure naming: {addr} presented {}, not one of {:?}",
                presented.as_deref().unwrap_or("no identity"),
                peer.accounts
            ),
        ))
    }

    /// The server side of a TLS connection a client opened.
    pub async fn accept(&self, tcp: TcpStream) -> std::io::Result<Io> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        Ok(Io::Server(Box::new(acceptor.accept(tcp).await?)))
    }
}

/// What a caller expects of an endpoint that runs a sidecar: a server
/// certificate naming one of its pod's identities (secure naming), and the
/// count of those refused. Shared by the endpoint's connections.
#[derive(Default)]
pub struct Peer {
    /// `namespace/service account` pairs; empty: any of the trust domain.
    accounts: Vec<String>,
    /// The caller's mesh TLS, which dials the endpoint (none: plaintext).
    mesh: Option<Arc<Mesh>>,
    refused: std::sync::atomic::AtomicU64,
    logged: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("accounts", &self.accounts)
            .field("mtls", &self.mesh.is_some())
            .field("refused", &self.refused())
            .finish()
    }
}

impl Peer {
    /// Expects one of `accounts` (`namespace/service account`; none: any).
    pub fn new(accounts: Vec<String>) -> Peer {
        Peer {
            accounts,
            ..Peer::default()
        }
    }

    /// The same, dialed with `mesh` (a sidecar's own mesh TLS).
    pub fn dialed_with(accounts: Vec<String>, mesh: Arc<Mesh>) -> Peer {
        Peer {
            accounts,
            mesh: Some(mesh),
            ..Peer::default()
        }
    }

    /// The identities expected.
    pub fn accounts(&self) -> &[String] {
        &self.accounts
    }

    /// Certificates refused for naming another identity.
    pub fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True when `id` (a SPIFFE ID) is one this endpoint may present:
    /// `spiffe://<trust_domain>/ns/<ns>/sa/<sa>` of an expected pair.
    pub fn accepts(&self, id: &str, trust_domain: &str) -> bool {
        if !in_domain(id, trust_domain) {
            return false;
        }
        if self.accounts.is_empty() {
            return true;
        }
        let path = &id["spiffe://".len() + trust_domain.len()..];
        let Some((ns, sa)) = path.strip_prefix("/ns/").and_then(|p| p.split_once("/sa/")) else {
            return false;
        };
        self.accounts
            .iter()
            .any(|a| a.split_once('/') == Some((ns, sa)))
    }
}

/// Connects to `addr` within `timeout`: over mutual TLS when the endpoint
/// runs a sidecar (`peer`: what its certificate must name) and this one has
/// the mesh's TLS, else plaintext. A failed handshake, or a certificate of
/// another identity, is a failed connect: the request was not sent. Out of
/// time is an error of kind `TimedOut`.
pub async fn connect(
    addr: SocketAddr,
    timeout: Duration,
    peer: Option<&Peer>,
    h2: bool,
) -> std::io::Result<Io> {
    let alpn = if h2 { Alpn::Http2 } else { Alpn::Http1 };
    dial(addr, timeout, peer, alpn).await
}

/// What a mutual TLS connection to another sidecar carries, told by ALPN so
/// that its inbound side knows without reading: HTTP/1.1, HTTP/2, or an
/// opaque byte stream (a captured connection to a TCP port).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alpn {
    /// `http/1.1`.
    Http1,
    /// `h2`.
    Http2,
    /// [`ALPN_TCP`].
    Tcp,
}

/// The ALPN protocol of a mutual TLS connection that carries opaque TCP.
pub const ALPN_TCP: &[u8] = b"minimesh-tcp";

/// Connects to `addr` as [`connect`] does, for what `alpn` names.
pub async fn dial(
    addr: SocketAddr,
    timeout: Duration,
    peer: Option<&Peer>,
    alpn: Alpn,
) -> std::io::Result<Io> {
    let dial = async {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        match peer.and_then(|p| Some((p.mesh.as_ref()?, p))) {
            Some((m, peer)) => m.connect(tcp, addr, alpn, peer).await,
            None => Ok(Io::Plain(tcp)),
        }
    };
    match tokio::time::timeout(timeout, dial).await {
        Ok(dialed) => dialed,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// The first byte of every TLS connection (a handshake record).
const TLS_HANDSHAKE: u8 = 0x16;

/// Resolves to the current certificate, for both ends of a connection.
#[derive(Debug)]
struct Current(Arc<ArcSwapOption<CertifiedKey>>);

impl rustls::client::ResolvesClientCert for Current {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.0.load_full()
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl rustls::server::ResolvesServerCert for Current {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.load_full()
    }
}

/// Verifies a peer sidecar's certificate: it chains to the mesh's root and
/// names a SPIFFE ID of the trust domain. Endpoints are dialed by address,
/// so no host name is checked.
#[derive(Debug)]
struct MeshVerifier {
    roots: Arc<RootCertStore>,
    trust_domain: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for MeshVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match spiffe_id(end_entity) {
            Some(id) if in_domain(&id, &self.trust_domain) => Ok(ServerCertVerified::assertion()),
            other => Err(rustls::Error::General(format!(
                "the peer's certificate names no SPIFFE ID of trust domain {} ({other:?})",
                self.trust_domain
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// True when `id` is a SPIFFE ID of `trust_domain`.
fn in_domain(id: &str, trust_domain: &str) -> bool {
    id.strip_prefix("spiffe://")
        .and_then(|rest| rest.strip_prefix(trust_domain))
        .is_some_and(|path| path.starts_with('/'))
}

/// The SPIFFE ID (the `spiffe://` URI SAN) of a certificate.
pub fn spiffe_id(cert: &[u8]) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, x509) = X509Certificate::from_der(cert).ok()?;
    let san = x509.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(u) if u.starts_with("spiffe://") => Some(u.to_string()),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secure_naming_accepts_only_the_expected_service_accounts() {
        let p = Peer::new(vec!["default/backend".into()]);
        assert!(p.accepts(
            "spiffe://cluster.local/ns/default/sa/backend",
            "cluster.local"
        ));
        for other in [
            "spiffe://cluster.local/ns/default/sa/web",
            "spiffe://cluster.local/ns/other/sa/backend",
            "spiffe://other.domain/ns/default/sa/backend",
            "spiffe://cluster.local/ns/default/sa/backend/x",
            "spiffe://cluster.local/ns/default/sa/backendx",
        ] {
            assert!(!p.accepts(other, "cluster.local"), "{other}");
        }
        // Nothing known of the pod: any identity of the trust domain.
        let any = Peer::new(vec![]);
        assert!(any.accepts("spiffe://cluster.local/ns/a/sa/b", "cluster.local"));
        assert!(!any.accepts("spiffe://evil/ns/a/sa/b", "cluster.local"));
    }

    #[test]
    fn spiffe_ids_belong_to_their_trust_domain_only() {
        assert!(in_domain(
            "spiffe://cluster.local/ns/a/sa/b",
            "cluster.local"
        ));
        assert!(!in_domain(
            "spiffe://cluster.localx/ns/a/sa/b",
            "cluster.local"
        ));
        assert!(!in_domain("spiffe://other/ns/a/sa/b", "cluster.local"));
        assert!(!in_domain("https://cluster.local/ns/a", "cluster.local"));
    }
}
