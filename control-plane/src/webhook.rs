//! The admission webhooks. Validating, for minimesh.io DestinationRules: the
//! API server asks it before storing a rule, and a rule `minimesh apply`
//! would refuse is refused by `kubectl apply` too, with the field and the
//! reason (`review.rs`). Mutating, for Pods: sidecar injection
//! (`inject.rs`). HTTPS (`server.rs`) with a certificate generated once per
//! cluster and shared through a Secret, its CA patched into the webhook
//! configurations (`certs.rs`); or cert-manager's.

pub mod certs;
pub mod inject;
pub mod metrics;
pub mod review;
pub mod server;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use metrics::VerdictLabel;

/// Flags of the admission webhook.
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookArgs {
    /// Kubernetes: address of the validating admission webhook (HTTPS, `POST /validate`). Unset: no webhook.
    #[arg(long = "webhook-addr", env = "MINIMESH_WEBHOOK_ADDR")]
    pub addr: Option<SocketAddr>,
    /// Kubernetes: the Service the API server calls the webhook through (its names go in the certificate).
    #[arg(
        long = "webhook-service",
        env = "MINIMESH_WEBHOOK_SERVICE",
        default_value = "minimesh-control-plane"
    )]
    pub service: String,
    /// Kubernetes: the ValidatingWebhookConfiguration whose caBundle the control plane keeps set.
    #[arg(
        long = "webhook-configuration",
        env = "MINIMESH_WEBHOOK_CONFIGURATION",
        default_value = "minimesh-validator"
    )]
    pub configuration: String,
    /// Kubernetes: the Secret (in the control plane's namespace) that holds the generated certificate, one for every replica.
    #[arg(
        long = "webhook-secret",
        env = "MINIMESH_WEBHOOK_SECRET",
        default_value = "minimesh-webhook-tls"
    )]
    pub secret: String,
    /// A directory holding tls.crt and tls.key (cert-manager's Certificate
    /// Secret, mounted): served as is, and no Secret or caBundle is written
    /// (cert-manager's CA injector sets it).
    #[arg(long = "webhook-tls-dir", env = "MINIMESH_WEBHOOK_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Kubernetes: the MutatingWebhookConfiguration (sidecar injection) whose caBundle the control plane keeps set.
    #[arg(
        long = "injector-configuration",
        env = "MINIMESH_INJECTOR_CONFIGURATION",
        default_value = "minimesh-injector"
    )]
    pub injector_configuration: String,
    /// Sidecar injection: the image of the injected sidecar (the one the control plane runs).
    #[arg(
        long = "sidecar-image",
        env = "MINIMESH_SIDECAR_IMAGE",
        default_value = "minimesh:dev"
    )]
    pub sidecar_image: String,
    /// Sidecar injection: the image of the capture init container
    /// (`minimesh-init`: the sidecar binary with nftables; `deploy/Dockerfile`'s
    /// `init` target).
    #[arg(
        long = "init-image",
        env = "MINIMESH_INIT_IMAGE",
        default_value = "minimesh-init:dev"
    )]
    pub init_image: String,
    /// Sidecar injection: the discovery address injected sidecars dial.
    /// Default: http://<--webhook-service>.<namespace>.svc:15010 (https://
    /// with a CA).
    #[arg(long = "sidecar-xds-addr", env = "MINIMESH_SIDECAR_XDS_ADDR")]
    pub sidecar_xds_addr: Option<String>,
}

/// Starts the webhook when `--webhook-addr` is set: binds (so that a taken
/// port fails the start), gets the certificate, and serves in the
/// background; `client` (Kubernetes) shares the certificate and keeps the
/// CA bundle set and writes Events (as `instance`, this replica).
/// `namespace` is the control plane's own.
pub async fn start(
    args: &WebhookArgs,
    client: Option<kube::Client>,
    instance: &str,
    namespace: &str,
    identity: Option<inject::Identity>,
    reviews: Family<VerdictLabel, Counter>,
) -> anyhow::Result<()> {
    let Some(addr) = args.addr else {
        return Ok(());
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding webhook address {addr}"))?;
    let events = client.clone().map(|client| {
        kube::runtime::events::Recorder::new(
            client,
            kube::runtime::events::Reporter {
                controller: "minimesh-control-plane".into(),
                instance: Some(instance.to_string()),
            },
        )
    });
    let tls = match (&args.tls_dir, client) {
        (Some(dir), _) => certs::from_dir(dir)?,
        (None, Some(client)) => {
            let names = certs::names(&args.service, namespace);
            let tls = certs::shared(&client, namespace, &args.secret, &names).await?;
            let mut said_missing = [false, false];
            certs::ensure_ca_bundle(
                &client,
                [&args.configuration, &args.injector_configuration],
                &args.service,
                namespace,
                &tls.ca,
                &mut said_missing,
            )
            .await;
            tokio::spawn(certs::keep_ca_bundle(
                client,
                [args.configuration.clone(), args.injector_configuration.clone()],
                args.service.clone(),
                namespace.to_string(),
                tls.ca.clone(),
                Duration::from_secs(30),
                said_missing,
            ));
            tls
        }
        (None, None) => anyhow::bail!(
            "--webhook-addr needs --source kubernetes (to share its certificate through a Secret) or --webhook-tls-dir"
        ),
    };
    let config = server::server_config(&tls)?;
    // With the CA, discovery is TLS (its certificate names the Service).
    let scheme = if identity.is_some() { "https" } else { "http" };
    let template = inject::Template {
        image: args.sidecar_image.clone(),
        init_image: args.init_image.clone(),
        xds_addr: args
            .sidecar_xds_addr
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{}.{namespace}.svc:15010", args.service)),
        identity,
    };
    tokio::spawn(server::serve(
        listener,
        config,
        std::sync::Arc::new(template),
        reviews,
        events,
    ));
    Ok(())
}
