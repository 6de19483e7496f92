//! The local topology file (`kind: LocalMesh`): which services, deployments
//! and replicas `minimesh up` starts, with each deployment's fake-service
//! environment, the ingress and the rules applied at start.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Deserialize;

/// A topology document.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Topology {
    /// `minimesh.io/v1alpha1`.
    pub api_version: String,
    /// `LocalMesh`.
    pub kind: String,
    /// Name of the mesh.
    pub metadata: Metadata,
    /// The mesh.
    pub spec: Spec,
}

/// Topology metadata.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// Name of the mesh (or of a bench scenario, which shares this header).
    pub name: String,
}

/// `spec` of a topology.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    /// Namespace of every service (and of rules that name none).
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Pods get addresses .1, .2, … of this /24 (every 127.x.y.z is loopback
    /// on Linux); the control plane .254, the ingress admin .253.
    #[serde(default = "default_network")]
    pub network: Ipv4Addr,
    /// The ingress gateway.
    #[serde(default)]
    pub ingress: Option<Ingress>,
    /// Services and their deployments.
    pub services: Vec<ServiceDef>,
    /// Rule files applied at start, relative to the topology file.
    #[serde(default)]
    pub rules: Vec<PathBuf>,
    /// Mutual TLS between sidecars (and the gateway), with the control
    /// plane as the CA (its root under `<home>/ca`). On by default, as
    /// Istio and Linkerd; `false` runs the mesh in plaintext (for
    /// comparing the two).
    #[serde(default = "yes")]
    pub mtls: bool,
}

fn default_namespace() -> String {
    "default".into()
}

fn default_network() -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 1, 0)
}

/// The ingress gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Ingress {
    /// Public listener.
    #[serde(default = "default_ingress")]
    pub listen: SocketAddr,
    /// Host name -> service (in the mesh namespace).
    #[serde(default)]
    pub hosts: BTreeMap<String, String>,
    /// Service for any other host.
    #[serde(default)]
    pub default_service: Option<String>,
    /// The gateway's zone, for zone failover (`localityLbSetting`); none by
    /// default, so the gateway spreads over every zone.
    #[serde(default)]
    pub zone: Option<String>,
    /// Pass the mesh headers (`x-minimesh-endpoint`: which pod answered)
    /// and detailed error reasons to the ingress's clients (the gateway's
    /// `--debug-headers`). On by default: the local mesh listens on
    /// loopback for its developer, who wants to see where requests went.
    #[serde(default = "yes")]
    pub debug_headers: bool,
}

fn yes() -> bool {
    true
}

fn default_ingress() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 30000))
}

/// A service: a Kubernetes Service and the deployments behind it.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceDef {
    /// Service name.
    pub name: String,
    /// Service port.
    #[serde(default = "default_port")]
    pub port: u16,
    /// Pod port (where each pod's inbound listener takes traffic).
    #[serde(default = "default_target_port")]
    pub target_port: u16,
    /// The port's `appProtocol` (`grpc`, `http2`, `tcp`, ...), as a
    /// Service's: it says how sidecars speak to the pods and proxy a
    /// captured connection (docs/capture.md). Unset: the port is named
    /// `http`.
    #[serde(default)]
    pub app_protocol: Option<String>,
    /// Deployments selected by the service.
    pub deployments: Vec<Deployment>,
}

fn default_port() -> u16 {
    80
}

fn default_target_port() -> u16 {
    9090
}

/// A deployment: replicas of fake-service with one environment.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Deployment {
    /// Deployment name; pods are `<name>-0`, `<name>-1`, …
    pub name: String,
    /// Number of pods.
    #[serde(default = "one")]
    pub replicas: u32,
    /// fake-service environment (MESSAGE, TIMING_50_PERCENTILE, UPSTREAM_URIS, …).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// With `minimesh up --capture`: the app's command in place of
    /// fake-service (any program, unchanged: it gets `LISTEN_ADDR`,
    /// `POD_NAME` and `env`, and must listen on port 8080). Not expanded
    /// by a shell; start one (`[sh, -c, ...]`) to use variables.
    #[serde(default)]
    pub command: Vec<String>,
    /// Zone of its pods, written into the EndpointSlice as a cluster's
    /// endpoint controller writes its node's zone (default `local`). The
    /// pods' sidecars take it as their own zone, for zone failover.
    #[serde(default = "local_zone")]
    pub zone: String,
    /// Its pods' annotations. With `minimesh up --capture`, Istio's
    /// `traffic.sidecar.istio.io/*` (or `traffic.minimesh.io/*`) capture
    /// annotations set each pod's capture rules, as the injector reads
    /// them on Kubernetes (docs/capture.md).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Its pods' labels besides `app` (the service's name), e.g.
    /// `version: v1`: what a DestinationRule's subsets select
    /// (docs/routes.md). Written into the pods' Pod objects (with mutual
    /// TLS, the default).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn local_zone() -> String {
    "local".to_string()
}

fn one() -> u32 {
    1
}

/// Most pods a topology may have: addresses .1 to .250 of its /24.
pub const MAX_PODS: usize = 250;

impl Topology {
    /// Reads and checks a topology file.
    pub fn load(path: &Path) -> anyhow::Result<Topology> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let t: Topology = serde_saphyr::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if t.kind != "LocalMesh" {
            bail!("{}: kind: {:?} is not LocalMesh", path.display(), t.kind);
        }
        let pods: usize = t
            .spec
            .services
            .iter()
            .flat_map(|s| &s.deployments)
            .map(|d| d.replicas as usize)
            .sum();
        let zones = t
            .spec
            .services
            .iter()
            .flat_map(|s| s.deployments.iter().map(move |d| (s, d)))
            .map(|(s, d)| {
                (
                    format!("spec.services[{}].deployments[{}].zone", s.name, d.name),
                    &d.zone,
                )
            })
            .chain(
                t.spec
                    .ingress
                    .iter()
                    .filter_map(|i| i.zone.as_ref())
                    .map(|z| ("spec.ingress.zone".to_string(), z)),
            );
        for (field, zone) in zones {
            let ok = !zone.is_empty()
                && zone.len() <= 63
                && zone
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_./".contains(&b));
            if !ok {
                bail!(
                    "{}: {field}: {zone:?} is not a zone name (1 to 63 letters, digits, '-', '_', '.', '/')",
                    path.display()
                );
            }
        }
        for s in &t.spec.services {
            for d in &s.deployments {
                let annotations = d.annotations.iter().map(|(k, v)| (k.as_str(), v.as_str()));
                if let Err(e) =
                    minimesh_proto::capture::CaptureSettings::from_annotations(annotations)
                {
                    bail!(
                        "{}: spec.services[{}].deployments[{}].annotations: {e}",
                        path.display(),
                        s.name,
                        d.name
                    );
                }
            }
        }
        if pods > MAX_PODS {
            bail!(
                "{}: spec.services: {pods} pods, more than the {MAX_PODS} one /24 network holds",
                path.display()
            );
        }
        Ok(t)
    }
}
