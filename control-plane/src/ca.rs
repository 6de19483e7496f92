//! The mesh's certificate authority. The control plane holds a root (read
//! from `--ca-dir`, generated there at first start) and signs each
//! sidecar's certificate signing request with the identity its token proves
//! (`spiffe://<trust domain>/ns/<namespace>/sa/<service account>`), never
//! the names the request asks for.

use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};

pub mod auth;
pub mod metrics;
pub mod service;
pub mod setup;
pub mod streams;
pub mod token_review;

/// Who a workload is, as its credentials prove.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    /// Its namespace.
    pub namespace: String,
    /// Its service account.
    pub service_account: String,
    /// The pod its token is bound to (a projected token's, on Kubernetes;
    /// the tokens file's `pod`), when it says: the one workload that may
    /// report load and take config with it.
    pub pod: Option<String>,
}

impl Identity {
    /// The same service account (whichever pod).
    pub fn same_account(&self, other: &Identity) -> bool {
        self.namespace == other.namespace && self.service_account == other.service_account
    }

    /// Whose voice a load report with this identity is: the pod's when the
    /// token is bound to one, else the service account's (all its
    /// workloads speak as one).
    pub fn reporter(&self) -> String {
        match &self.pod {
            Some(pod) => format!("{pod}.{}", self.namespace),
            None => format!("sa/{}.{}", self.service_account, self.namespace),
        }
    }

    /// Its SPIFFE ID in `trust_domain`.
    pub fn spiffe_id(&self, trust_domain: &str) -> String {
        format!(
            "spiffe://{trust_domain}/ns/{}/sa/{}",
            self.namespace, self.service_account
        )
    }
}

/// The root's file names in `--ca-dir`.
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
/// The root key's.
pub const ROOT_KEY_FILE: &str = "root-key.pem";

/// A signed certificate.
#[derive(Debug)]
pub struct Issued {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its SPIFFE ID.
    pub spiffe_id: String,
    /// When it expires.
    pub not_after: SystemTime,
}

/// The certificate authority.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    root_pem: String,
    /// The SPIFFE trust domain (`--trust-domain`).
    pub trust_domain: String,
    /// How long a workload certificate lasts (`--workload-cert-ttl`).
    pub ttl: Duration,
}

impl Ca {
    /// The root in `dir`, generated there (key mode 0600) when it holds
    /// none.
    pub fn load_or_create(dir: &Path, trust_domain: &str, ttl: Duration) -> anyhow::Result<Ca> {
        let (cert, key) = (dir.join(ROOT_CERT_FILE), dir.join(ROOT_KEY_FILE));
        if !cert.exists() && !key.exists() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("--ca-dir: creating {}", dir.display()))?;
            let (root_pem, key_pem) = generate_root(trust_domain)?;
            write_private(&key, &key_pem)?;
            std::fs::write(&cert, &root_pem)
                .with_context(|| format!("--ca-dir: writing {}", cert.display()))?;
            tracing::info!(dir = %dir.display(), trust_domain, "generated the mesh's root certificate");
        }
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("--ca-dir: reading {}", p.display()))
        };
        let (root_pem, key_pem) = (read(&cert)?, read(&key)?);
        Ca::from_pem(&root_pem, &key_pem, trust_domain, ttl)
            .with_context(|| format!("--ca-dir {}", dir.display()))
    }

    /// The CA of a root certificate and its key, PEM.
    pub fn from_pem(
        root_pem: &str,
        key_pem: &str,
        trust_domain: &str,
        ttl: Duration,
    ) -> anyhow::Result<Ca> {
        let key = KeyPair::from_pem(key_pem).context(ROOT_KEY_FILE)?;
        let issuer = Issuer::from_ca_cert_pem(root_pem, key).context(ROOT_CERT_FILE)?;
        Ok(Ca {
            issuer,
            root_pem: root_pem.to_string(),
            trust_domain: trust_domain.to_string(),
            ttl,
        })
    }

    /// The root certificate, PEM.
    pub fn root_pem(&self) -> &str {
        &self.root_pem
    }

    /// Signs the key of `csr_pem` for `who`; Err says why the request is
    /// unusable (its signature, its encoding).
    pub fn issue(&self, csr_pem: &str, who: &Identity) -> Result<Issued, String> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| format!("csr_pem: not a valid certificate signing request: {e}"))?;
        let spiffe_id = who.spiffe_id(&self.trust_domain);
        let now = SystemTime::now();
        let not_after = now + self.ttl;
        let params = self.workload_params(&spiffe_id, &[], now)?;
        let signed = CertificateSigningRequestParams {
            params,
            public_key: csr.public_key,
        }
        .signed_by(&self.issuer)
        .map_err(|e| format!("signing: {e}"))?;
        Ok(Issued {
            cert_pem: signed.pem(),
            spiffe_id,
            not_after,
        })
    }
}

impl Ca {
    /// A serving certificate for the control plane's own discovery port,
    /// naming `names` (DNS names or IP addresses), valid a year: its
    /// certificate and key, PEM.
    pub fn serving(&self, names: &[String]) -> anyhow::Result<(String, String)> {
        let now = SystemTime::now();
        let mut params = CertificateParams::new(names.to_vec())?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "minimesh control plane");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.not_before = (now - Duration::from_secs(60)).into();
        params.not_after = (now + Duration::from_secs(365 * 86_400)).into();
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

impl Ca {
    /// A workload certificate's settings: the SPIFFE ID (and `names`, DNS
    /// names or addresses) as its names, server and client use, valid from
    /// a minute before `now` (clocks a little behind) for the lifetime.
    fn workload_params(
        &self,
        spiffe_id: &str,
        names: &[String],
        now: SystemTime,
    ) -> Result<CertificateParams, String> {
        let mut params = CertificateParams::new(names.to_vec()).map_err(|e| e.to_string())?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "minimesh");
        let uri = spiffe_id
            .to_string()
            .try_into()
            .map_err(|e| format!("identity {spiffe_id:?}: {e}"))?;
        params.subject_alt_names.push(SanType::URI(uri));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.not_before = (now - Duration::from_secs(60)).into();
        params.not_after = (now + self.ttl).into();
        params.use_authority_key_identifier_extension = true;
        Ok(params)
    }

    /// A key and a certificate for `who` that also names `names` (DNS names
    /// or IP addresses), both PEM: for a process that stands in for a
    /// workload without asking over the network (the overhead bench's nginx
    /// pair, which verifies its peer by address).
    pub fn issue_with_key(
        &self,
        who: &Identity,
        names: &[String],
    ) -> anyhow::Result<(String, String)> {
        let spiffe_id = who.spiffe_id(&self.trust_domain);
        let params = self
            .workload_params(&spiffe_id, names, SystemTime::now())
            .map_err(anyhow::Error::msg)?;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// The names the control plane's discovery certificate carries: its
/// Service's (in the namespace it runs in), `localhost`, and the address
/// it listens on when that is one address, and the pod's address (where
/// the other replicas pass the leader their load reports).
pub fn serving_names(
    xds: std::net::SocketAddr,
    namespace: &str,
    pod_ip: Option<&str>,
) -> Vec<String> {
    let svc = "minimesh-control-plane";
    let mut names = vec![
        svc.to_string(),
        format!("{svc}.{namespace}"),
        format!("{svc}.{namespace}.svc"),
        format!("{svc}.{namespace}.svc.cluster.local"),
        "localhost".to_string(),
    ];
    if !xds.ip().is_unspecified() {
        names.push(xds.ip().to_string());
    }
    names.extend(
        pod_ip
            .filter(|ip| *ip != xds.ip().to_string())
            .map(str::to_string),
    );
    names
}

/// A new root for `trust_domain`, valid ten years: its certificate and key, PEM.
pub fn generate_root(trust_domain: &str) -> anyhow::Result<(String, String)> {
    let now = SystemTime::now();
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::OrganizationName, "minimesh");
    ca.distinguished_name.push(
        DnType::CommonName,
        format!("minimesh root CA ({trust_domain})"),
    );
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = (now - Duration::from_secs(60)).into();
    ca.not_after = (now + Duration::from_secs(10 * 365 * 86_400)).into();
    let key = KeyPair::generate()?;
    let cert = ca.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("--ca-dir: creating {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("--ca-dir: writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> Ca {
        let (root, key) = generate_root("cluster.local").expect("root");
        Ca::from_pem(&root, &key, "cluster.local", Duration::from_secs(3600)).expect("ca")
    }

    #[test]
    fn the_certificate_names_the_proven_identity_not_the_requested_one() {
        let ca = ca();
        let key = KeyPair::generate().expect("key");
        // The request asks for someone else's identity.
        let mut asks = CertificateParams::default();
        asks.subject_alt_names = vec![SanType::URI(
            "spiffe://cluster.local/ns/kube-system/sa/admin"
                .to_string()
                .try_into()
                .expect("uri"),
        )];
        let csr = asks
            .serialize_request(&key)
            .expect("csr")
            .pem()
            .expect("pem");
        let who = Identity {
            pod: None,
            namespace: "default".into(),
            service_account: "web".into(),
        };
        let issued = ca.issue(&csr, &who).expect("issued");
        assert_eq!(issued.spiffe_id, "spiffe://cluster.local/ns/default/sa/web");
        let der = rustls::pki_types::pem::PemObject::from_pem_slice(issued.cert_pem.as_bytes())
            .map(|c: rustls::pki_types::CertificateDer<'static>| c)
            .expect("pem");
        let text = String::from_utf8_lossy(&der);
        assert!(text.contains("spiffe://cluster.local/ns/default/sa/web"));
        assert!(!text.contains("kube-system"));
    }

    #[test]
    fn a_request_that_is_not_a_csr_is_refused_with_the_field() {
        let who = Identity {
            pod: None,
            namespace: "default".into(),
            service_account: "web".into(),
        };
        let e = ca().issue(
            "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
            &who,
        );
        assert!(e.is_err_and(|e| e.starts_with("csr_pem: not a valid certificate signing request")));
    }
}
