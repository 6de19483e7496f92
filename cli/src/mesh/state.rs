//! What a running local mesh is: its pods, where its processes listen, and
//! (`--capture`) its pods' network namespaces and Service IPs, as
//! `<home>/mesh.json` holds them for `minimesh get`, `apply` and `kill`.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use serde::{Deserialize, Serialize};

use super::{APP_PORT, SIDECAR_ADMIN_PORT};

/// One pod of the running mesh.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pod {
    /// Pod name (`<deployment>-<i>`).
    pub name: String,
    /// Service it belongs to.
    pub service: String,
    /// Deployment it belongs to.
    pub deployment: String,
    /// Pod address.
    pub ip: Ipv4Addr,
    /// Inbound (endpoint) port.
    pub port: u16,
    /// Zone (the EndpointSlice endpoint's `zone`).
    #[serde(default)]
    pub zone: String,
    /// The pod's annotations (its deployment's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// The pod's labels besides `app` (its deployment's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl Pod {
    /// The app's address.
    pub fn app(&self) -> SocketAddr {
        SocketAddr::from((self.ip, APP_PORT))
    }
    /// The sidecar's admin address.
    pub fn admin(&self) -> SocketAddr {
        SocketAddr::from((self.ip, SIDECAR_ADMIN_PORT))
    }

    /// Its labels as its sidecar's `--labels` (what AuthorizationPolicy
    /// selectors match): `app=<service>` and its deployment's.
    pub fn labels_arg(&self) -> String {
        std::iter::once(format!("app={}", self.service))
            .chain(
                self.labels
                    .iter()
                    .filter(|(k, _)| *k != "app")
                    .map(|(k, v)| format!("{k}={v}")),
            )
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// What `minimesh apply` and `minimesh get` need to find a running mesh;
/// written to `<home>/mesh.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MeshState {
    /// Mesh name.
    pub name: String,
    /// Namespace of its services.
    pub namespace: String,
    /// Directory the control plane watches.
    pub config_dir: PathBuf,
    /// Control-plane admin address.
    pub control_plane_admin: SocketAddr,
    /// Control-plane discovery address.
    pub control_plane_xds: SocketAddr,
    /// Ingress listener.
    pub ingress: Option<SocketAddr>,
    /// Ingress admin address.
    pub ingress_admin: Option<SocketAddr>,
    /// Pods.
    pub pods: Vec<Pod>,
    /// Process id of `minimesh up`.
    pub pid: u32,
    /// Process ids by process name (`control-plane`, `ingress-gateway`,
    /// `<pod>.app`, `<pod>.sidecar`), as last started.
    #[serde(default)]
    pub pids: BTreeMap<String, u32>,
    /// How long after a process exits `minimesh up` starts it again, in
    /// milliseconds (None: never).
    #[serde(default)]
    pub restart_after_ms: Option<u64>,
    /// With `--capture`: each pod's network namespace, and each Service's
    /// virtual IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<CaptureState>,
}

/// Where a capture-mode mesh's pods and Services are.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaptureState {
    /// The pod network's index (its bridge is `mmbr<index>`).
    pub network: u8,
    /// Network namespace by pod name.
    pub namespaces: BTreeMap<String, String>,
    /// Virtual IP by Service name.
    pub service_ips: BTreeMap<String, Ipv4Addr>,
}

impl MeshState {
    /// Reads `<home>/mesh.json`.
    pub fn load(home: &Path) -> anyhow::Result<MeshState> {
        let path = home.join("mesh.json");
        let text = std::fs::read_to_string(&path).map_err(|_| {
            anyhow!("no running mesh found ({} is missing): start one with `minimesh up`, or point --home at its directory", path.display())
        })?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a mesh state file", path.display()))
    }

    /// Number of discovery clients (sidecars and the ingress).
    pub fn proxies(&self) -> usize {
        self.pods.len() + usize::from(self.ingress.is_some())
    }
}
