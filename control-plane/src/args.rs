//! The `control-plane` binary's command line: every flag, its environment
//! variable and its default. `run` reads nothing else.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::{ca, config, webhook};

/// Command-line flags of the `control-plane` binary.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "control-plane",
    version,
    about = "minimesh control plane: watches rules and endpoints, pushes config to sidecars"
)]
pub struct Args {
    /// Where desired state comes from: `files` (a directory of YAML, watched) or
    /// `kubernetes` (the API server: in-cluster config, else KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "MINIMESH_SOURCE", default_value = "files", value_parser = ["files", "kubernetes"])]
    pub source: String,
    /// Kubernetes: name of the Lease that elects the replica writing rule status.
    #[arg(
        long,
        env = "MINIMESH_LEASE_NAME",
        default_value = "minimesh-control-plane"
    )]
    pub lease_name: String,
    /// Kubernetes: namespace of that Lease (the control plane's own; the Downward API sets POD_NAMESPACE).
    #[arg(long, env = "POD_NAMESPACE", default_value = "minimesh-system")]
    pub lease_namespace: String,
    /// Kubernetes: this replica's identity in the election (the Downward API sets POD_NAME).
    #[arg(long, env = "POD_NAME", default_value = "control-plane")]
    pub identity: String,
    /// Kubernetes: a lease not renewed for this long passes to another replica.
    #[arg(long, env = "MINIMESH_LEASE_DURATION", default_value = "15s", value_parser = duration)]
    pub lease_duration: Duration,
    /// Kubernetes: how often the leader renews and the others check the lease.
    #[arg(long, env = "MINIMESH_LEASE_RETRY", default_value = "2s", value_parser = duration)]
    pub lease_retry: Duration,
    /// Kubernetes: a leader that has not renewed the lease for this long (its
    /// requests failing or hanging) stops writing status; shorter than
    /// --lease-duration, longer than --lease-retry. Default: two thirds of
    /// --lease-duration (10s).
    #[arg(long, env = "MINIMESH_LEASE_RENEW_DEADLINE", value_parser = duration)]
    pub lease_renew_deadline: Option<Duration>,
    /// On SIGTERM, how long this replica stays up not ready first (`/readyz`
    /// 503) while it keeps serving admission webhooks, discovery and
    /// certificates, so that the API server and the sidecars stop sending it
    /// work before it stops (Istio's `terminationDrainDuration`): longer than
    /// the Service's endpoints take to drop a pod. Default: 5s with
    /// `--source kubernetes`, 0 (stop at once) with `files`.
    #[arg(long, env = "MINIMESH_TERMINATION_DRAIN", value_parser = minimesh_proto::duration::parse)]
    pub termination_drain: Option<Duration>,
    /// Kubernetes: watch rules, Services and EndpointSlices in these namespaces only
    /// (comma-separated), so that the control plane needs read access to no others.
    /// Unset: the whole cluster.
    #[arg(long, env = "MINIMESH_WATCH_NAMESPACES", value_delimiter = ',')]
    pub watch_namespaces: Option<Vec<String>>,
    /// Kubernetes: serve only the objects of namespaces whose labels match this
    /// selector (kubectl's -l syntax, e.g. `minimesh.io/discovery=enabled`), as
    /// Istio's discoverySelectors; a namespace that gains or loses a label comes
    /// into or leaves the mesh at once. Unset: every namespace watched.
    #[arg(long, env = "MINIMESH_NAMESPACE_SELECTOR")]
    pub namespace_selector: Option<String>,
    /// Kubernetes: where the other replicas reach this one's load-report service
    /// (the discovery port) when it leads, to pass on their sidecars' reports
    /// (LOAD_AWARE weights come from every report). Default: http://$POD_IP:<--xds-addr port>.
    #[arg(long, env = "MINIMESH_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// Kubernetes: the ConfigMap (in the control plane's namespace) where the leader
    /// publishes LOAD_AWARE weights and every other replica reads them.
    #[arg(
        long,
        env = "MINIMESH_LOAD_AWARE_CONFIGMAP",
        default_value = "minimesh-load-aware"
    )]
    pub load_aware_configmap: String,
    /// Files source: directory of YAML files (DestinationRule, Service, EndpointSlice; multi-document; watched).
    #[arg(long, env = "MINIMESH_CONFIG_DIR", default_value = "config")]
    pub config_dir: PathBuf,
    /// Files source: namespace of objects whose metadata names none (like kubectl's context namespace).
    #[arg(long, env = "MINIMESH_DEFAULT_NAMESPACE", default_value = "default")]
    pub default_namespace: String,
    /// Address of the discovery (gRPC) server.
    #[arg(long, env = "MINIMESH_XDS_ADDR", default_value = "127.0.0.1:15010")]
    pub xds_addr: SocketAddr,
    /// Address of the admin HTTP server (/healthz, /metrics, /debug/*).
    #[arg(long, env = "MINIMESH_ADMIN_ADDR", default_value = "127.0.0.1:15014")]
    pub admin_addr: SocketAddr,
    /// The mesh's certificate authority.
    #[command(flatten)]
    pub ca: ca::setup::CaArgs,
    /// Serve the admin port's `/debug/*` views (every rule, endpoint and
    /// proxy of the mesh) to every caller. Off, they answer loopback
    /// callers only (`kubectl port-forward`, `minimesh get` on the same
    /// host) and 403 anyone else; `/healthz`, `/readyz` and `/metrics`
    /// answer everyone.
    #[arg(long, env = "MINIMESH_ADMIN_DEBUG")]
    pub admin_debug: bool,
    /// Quiet window: changes are pushed once nothing changed for this long.
    #[arg(long, env = "MINIMESH_DEBOUNCE", default_value = "100ms", value_parser = duration)]
    pub debounce: Duration,
    /// Upper bound: changes are pushed at most this long after the first one, however busy.
    #[arg(long, env = "MINIMESH_DEBOUNCE_MAX", default_value = "1s", value_parser = duration)]
    pub debounce_max: Duration,
    /// Files source: how often the config directory is checked for changes.
    #[arg(long, env = "MINIMESH_POLL_INTERVAL", default_value = "50ms", value_parser = duration)]
    pub poll_interval: Duration,
    /// How often sidecars report load (served on the discovery address).
    #[arg(long, env = "MINIMESH_LOAD_REPORT_INTERVAL", default_value = "10s", value_parser = duration)]
    pub load_report_interval: Duration,
    /// Sliding window of the aggregated load view.
    #[arg(long, env = "MINIMESH_LOAD_WINDOW", default_value = "10s", value_parser = duration)]
    pub load_window: Duration,
    /// xDS v3 (Envoy, proxyless gRPC): send each cluster's policy alone, with no
    /// standard fallback, so that a client lacking it (gRPC has no RANDOM,
    /// MAGLEV or PEAK_EWMA) rejects the cluster, visibly in `minimesh get
    /// proxies`, and keeps its last good config. Off: such a client is sent the
    /// nearest policy it implements (see the README's policy mapping).
    #[arg(long, env = "MINIMESH_XDS_V3_EXACT_POLICIES")]
    pub xds_v3_exact_policies: bool,
    /// The validating admission webhook (Kubernetes).
    #[command(flatten)]
    pub webhook: webhook::WebhookArgs,
}

/// Parses a flag duration (`100ms`, `1s`, `2m`).
pub fn duration(s: &str) -> Result<Duration, String> {
    config::rule::parse_duration(s)
}
