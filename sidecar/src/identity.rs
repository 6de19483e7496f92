//! This sidecar's certificate: a key generated here, a certificate signing
//! request sent to the control plane's CA with the workload's token, and the
//! certificate it answers put in force ([`crate::tls::Mesh::set_identity`]).
//! Renewed (with a new key) at half its lifetime, retried with backoff on
//! failure while the current one still serves.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use minimesh_proto::v1::certificate_service_client::CertificateServiceClient;
use minimesh_proto::v1::IssueRequest;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use tonic::metadata::{Ascii, MetadataValue};
use tracing::{info, warn};

use crate::tls::Mesh;

/// Gets and renews the certificate.
pub struct Renewer {
    /// The control plane (its CA serves on the discovery port).
    pub channel: tonic::transport::Channel,
    /// The workload's token (`--token-file`), read at each renewal: the
    /// kubelet rotates a projected token in place.
    pub token_file: PathBuf,
    /// Where the certificate goes.
    pub mesh: Arc<Mesh>,
}

const FIRST_RETRY: Duration = Duration::from_millis(200);
const MAX_RETRY: Duration = Duration::from_secs(30);

impl Renewer {
    /// Runs forever.
    pub async fn run(self) {
        let mut retry = FIRST_RETRY;
        loop {
            match self.renew().await {
                Ok(not_after) => {
                    retry = FIRST_RETRY;
                    tokio::time::sleep(renew_in(not_after, SystemTime::now())).await;
                }
                Err(e) => {
                    warn!(error = %format!("{e:#}"), retry_in = ?retry, "cannot get a workload certificate; the current one (if any) stays");
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(MAX_RETRY);
                }
            }
        }
    }

    /// One certificate: requested, checked and put in force; its expiry.
    async fn renew(&self) -> anyhow::Result<SystemTime> {
        let key = rcgen::KeyPair::generate().context("generating a key")?;
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)
            .and_then(|c| c.pem())
            .context("building the signing request")?;
        let mut req = tonic::Request::new(IssueRequest { csr_pem: csr });
        req.metadata_mut()
            .insert("authorization", bearer(&self.token_file)?);
        let resp = CertificateServiceClient::new(self.channel.clone())
            .issue(req)
            .await
            .context("the control plane's CA")?
            .into_inner();
        let chain = resp
            .cert_chain_pem
            .iter()
            .map(|pem| CertificateDer::from_pem_slice(pem.as_bytes()))
            .collect::<Result<Vec<_>, _>>()
            .context("the certificate chain")?;
        anyhow::ensure!(!chain.is_empty(), "the CA answered no certificate");
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = rustls::crypto::ring::default_provider();
        let certified = CertifiedKey::from_der(chain, der, &provider).context("the certificate")?;
        self.mesh.set_identity(certified, resp.spiffe_id.clone());
        let not_after = UNIX_EPOCH + Duration::from_secs(resp.not_after_unix.max(0) as u64);
        info!(
            spiffe_id = resp.spiffe_id,
            not_after = resp.not_after_unix,
            "workload certificate in force"
        );
        Ok(not_after)
    }
}

/// `Bearer <token>` of the token in `token_file`, read now (the kubelet
/// rotates a projected token in place).
pub fn bearer(token_file: &Path) -> anyhow::Result<MetadataValue<Ascii>> {
    let token = std::fs::read_to_string(token_file)
        .with_context(|| format!("--token-file: reading {}", token_file.display()))?;
    format!("Bearer {}", token.trim())
        .parse()
        .with_context(|| format!("--token-file {}: not a header value", token_file.display()))
}

/// Adds the workload's token to a discovery or load-report call when its
/// file exists (no token file: the control plane asks for none).
pub fn authorize<T>(req: &mut tonic::Request<T>, token_file: &Path) {
    if !token_file.exists() {
        return;
    }
    match bearer(token_file) {
        Ok(v) => {
            req.metadata_mut().insert("authorization", v);
        }
        Err(e) => warn!(error = %format!("{e:#}"), "calling the control plane without a token"),
    }
}

/// How long until a certificate expiring at `not_after` is renewed: at half
/// its remaining life, at least a second from now.
fn renew_in(not_after: SystemTime, now: SystemTime) -> Duration {
    let left = not_after.duration_since(now).unwrap_or_default();
    (left / 2).max(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_comes_at_half_the_remaining_life() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let day = Duration::from_secs(86_400);
        assert_eq!(renew_in(now + day, now), day / 2);
        assert_eq!(
            renew_in(now + Duration::from_secs(20), now),
            Duration::from_secs(10)
        );
        assert_eq!(renew_in(now, now), Duration::from_secs(1));
    }
}
