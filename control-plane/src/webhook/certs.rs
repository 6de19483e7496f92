//! The webhook's certificate: generated once per cluster and shared by every
//! replica through a Secret (the first replica to start creates it; a
//! replica that loses the race reads the winner's), and its CA kept in the
//! `caBundle` of the webhook configurations, as Istio and Linkerd do. With
//! `--webhook-tls-dir` (cert-manager's Secret mounted) none of this runs.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::ByteString;
use kube::api::{Api, PostParams};
use kube::Client;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tracing::{info, warn};

/// A serving certificate and key, and the CA that signed it (PEM).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tls {
    /// The serving certificate.
    pub cert: String,
    /// Its private key.
    pub key: String,
    /// The CA certificate clients trust it by (the `caBundle`).
    pub ca: String,
}

/// The DNS names the API server dials the webhook Service by.
pub fn names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
        format!("{service}.{namespace}"),
        service.to_string(),
    ]
}

/// Generates a CA and a serving certificate for `names`, valid from the
/// start of this year for ten years.
pub fn generate(names: &[String]) -> anyhow::Result<Tls> {
    let year = 1970
        + (std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
            / 31_556_952) as i32;
    let (from, until) = (
        rcgen::date_time_ymd(year, 1, 1),
        rcgen::date_time_ymd(year + 10, 1, 1),
    );
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "minimesh webhook CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    (ca.not_before, ca.not_after) = (from, until);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let mut leaf = CertificateParams::new(names.to_vec())?;
    leaf.distinguished_name.push(DnType::CommonName, &names[0]);
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    (leaf.not_before, leaf.not_after) = (from, until);
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &Issuer::new(ca, ca_key))?;
    Ok(Tls {
        cert: leaf_cert.pem(),
        key: leaf_key.serialize_pem(),
        ca: ca_cert.pem(),
    })
}

/// Reads `tls.crt` and `tls.key` (and `ca.crt` when present) from a
/// directory, as cert-manager writes a Certificate's Secret.
pub fn from_dir(dir: &Path) -> anyhow::Result<Tls> {
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .with_context(|| format!("--webhook-tls-dir: reading {}", dir.join(f).display()))
    };
    Ok(Tls {
        cert: read("tls.crt")?,
        key: read("tls.key")?,
        ca: read("ca.crt").unwrap_or_default(),
    })
}

/// The certificate in Secret `namespace/name`, made and stored there when
/// there is none yet. Every replica ends with the same one.
pub async fn shared(
    client: &Client,
    namespace: &str,
    name: &str,
    names: &[String],
) -> anyhow::Result<Tls> {
    let data = crate::source::kubernetes::secret::shared(
        client,
        namespace,
        name,
        &["tls.crt", "tls.key", "ca.crt"],
        "kubernetes.io/tls",
        "webhook certificate",
        || {
            let tls = generate(names)?;
            Ok(BTreeMap::from([
                ("tls.crt".to_string(), tls.cert),
                ("tls.key".to_string(), tls.key),
                ("ca.crt".to_string(), tls.ca),
            ]))
        },
    )
    .await?;
    let text = |k: &str| data.get(k).cloned().unwrap_or_default();
    Ok(Tls {
        cert: text("tls.crt"),
        key: text("tls.key"),
        ca: text("ca.crt"),
    })
}

/// A webhook configuration kind: validating or mutating.
pub trait Hooks:
    kube::Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + serde::Serialize
{
    /// The client config of each of its webhooks.
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig>;
}

impl Hooks for ValidatingWebhookConfiguration {
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig> {
        self.webhooks
            .iter_mut()
            .flatten()
            .map(|h| &mut h.client_config)
            .collect()
    }
}

impl Hooks for MutatingWebhookConfiguration {
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig> {
        self.webhooks
            .iter_mut()
            .flatten()
            .map(|h| &mut h.client_config)
            .collect()
    }
}

/// Sets `caBundle` on every webhook of the configuration `name` that calls
/// `service` in `namespace`. Ok(false) when the configuration does not exist.
pub async fn patch_ca_bundle<K: Hooks>(
    client: &Client,
    name: &str,
    service: &str,
    namespace: &str,
    ca: &str,
) -> anyhow::Result<bool> {
    let api: Api<K> = Api::all(client.clone());
    // Read, change, replace at the version read; on a conflict read again.
    for _ in 0..5 {
        let Some(mut config) = api.get_opt(name).await? else {
            return Ok(false);
        };
        let mut changed = false;
        let bundle = Some(ByteString(ca.as_bytes().to_vec()));
        for hook in config.client_configs() {
            let ours = hook
                .service
                .as_ref()
                .is_some_and(|s| s.name == service && s.namespace == namespace);
            if ours && hook.ca_bundle != bundle {
                hook.ca_bundle = bundle.clone();
                changed = true;
            }
        }
        if !changed {
            return Ok(true);
        }
        match api.replace(name, &PostParams::default(), &config).await {
            Ok(_) => {
                info!(configuration = name, "webhook CA bundle set");
                return Ok(true);
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(anyhow!("kept conflicting with other writers"))
}

/// Keeps the CA bundle set on the validating configuration `validating`
/// and the mutating one `mutating`: every `every` (a configuration applied
/// later, or re-applied without it, gets it back). `said_missing` carries
/// over from the first pass, made before the control plane serves.
pub async fn keep_ca_bundle(
    client: Client,
    [validating, mutating]: [String; 2],
    service: String,
    namespace: String,
    ca: String,
    every: Duration,
    mut said_missing: [bool; 2],
) {
    loop {
        tokio::time::sleep(every).await;
        ensure_ca_bundle(
            &client,
            [&validating, &mutating],
            &service,
            &namespace,
            &ca,
            &mut said_missing,
        )
        .await;
    }
}

/// One pass: sets the bundle on both configurations, saying once (per
/// absence) that one is missing.
pub async fn ensure_ca_bundle(
    client: &Client,
    [validating, mutating]: [&String; 2],
    service: &str,
    namespace: &str,
    ca: &str,
    said_missing: &mut [bool; 2],
) {
    let results = [
        patch_ca_bundle::<ValidatingWebhookConfiguration>(
            client, validating, service, namespace, ca,
        )
        .await,
        patch_ca_bundle::<MutatingWebhookConfiguration>(client, mutating, service, namespace, ca)
            .await,
    ];
    let what = [
        (
            "ValidatingWebhookConfiguration",
            validating,
            "rules are not validated at admission",
        ),
        (
            "MutatingWebhookConfiguration",
            mutating,
            "no sidecar is injected",
        ),
    ];
    for (i, result) in results.into_iter().enumerate() {
        let (kind, name, effect) = what[i];
        match result {
            Ok(true) => said_missing[i] = false,
            Ok(false) if !said_missing[i] => {
                said_missing[i] = true;
                warn!(configuration = %name, "{kind} not found: {effect} until it is applied");
            }
            Ok(false) => {}
            Err(e) => {
                warn!(configuration = %name, error = %format!("{e:#}"), "setting the webhook CA bundle failed; will retry")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generated_certificate_names_the_service_and_chains_to_the_ca() {
        let names = names("minimesh-control-plane", "minimesh-system");
        assert_eq!(names[0], "minimesh-control-plane.minimesh-system.svc");
        let tls = generate(&names).expect("generate");
        assert!(tls.cert.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(tls.ca.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(tls.key.starts_with("-----BEGIN PRIVATE KEY-----"));
        assert_ne!(tls.cert, tls.ca);
        // A server config takes the pair (key matches certificate).
        super::super::server::server_config(&tls).expect("usable pair");
    }
}
