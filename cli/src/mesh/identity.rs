//! The local mesh's identities, as a cluster would have them: the control
//! plane's CA under `<home>/ca` (its root generated there at the first
//! `minimesh up`, kept across runs), one token per workload (written as
//! `<home>/tokens/<workload>`, and all of them in `<home>/tokens.yaml` for
//! the control plane), and a `Pod` object per pod labelled as running a
//! sidecar, so that callers speak mutual TLS to it.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use super::{write_atomic, MeshState, Pod};

/// Where the mesh's identities live.
pub struct Identities {
    /// The CA's directory (`--ca-dir`).
    pub ca_dir: PathBuf,
    /// Every token (`--workload-tokens`).
    pub tokens_file: PathBuf,
    token_dir: PathBuf,
}

/// The gateway's workload name and service account.
pub const GATEWAY: &str = "ingress-gateway";

impl Identities {
    /// Writes a fresh token for every pod and the gateway, and the pods'
    /// `Pod` objects into the config directory.
    pub fn prepare(home: &Path, namespace: &str, state: &MeshState) -> anyhow::Result<Identities> {
        let pods = &state.pods;
        write_atomic(
            &state.config_dir.join("services").join("pods.yaml"),
            &pods_yaml(namespace, pods, state.capture.is_some()),
        )?;
        let ids = Identities {
            ca_dir: std::path::absolute(home.join("ca"))?,
            tokens_file: std::path::absolute(home.join("tokens.yaml"))?,
            token_dir: std::path::absolute(home.join("tokens"))?,
        };
        std::fs::create_dir_all(&ids.token_dir)
            .with_context(|| format!("creating {}", ids.token_dir.display()))?;
        let mut all = String::from("# Written by minimesh up: one token per workload, as a cluster's service-account tokens.\ntokens:\n");
        let workloads = pods
            .iter()
            .map(|p| (p.name.as_str(), p.service.as_str()))
            .chain([(GATEWAY, GATEWAY)]);
        for (workload, account) in workloads {
            let token = random_token()?;
            let _ = writeln!(
                all,
                "- token: {token}\n  namespace: {namespace}\n  serviceAccount: {account}\n  pod: {workload}"
            );
            write_private(&ids.token_file(workload), &token)?;
        }
        write_private(&ids.tokens_file, &all)?;
        Ok(ids)
    }

    /// The token file of `workload`.
    pub fn token_file(&self, workload: &str) -> PathBuf {
        self.token_dir.join(workload)
    }

    /// The mesh's root certificate (the control plane writes it).
    pub fn root(&self) -> PathBuf {
        self.ca_dir.join("root-cert.pem")
    }
}

/// A sidecar's flags for mutual TLS as `workload` (none without).
pub fn sidecar_args(ids: Option<&Identities>, workload: &str) -> Vec<OsString> {
    ids.iter()
        .flat_map(|i| {
            [
                OsString::from("--ca-root"),
                i.root().into(),
                "--token-file".into(),
                i.token_file(workload).into(),
            ]
        })
        .collect()
}

/// The control plane's flags for the CA (none without), with the
/// certificates' lifetime when one is given.
pub fn control_plane_args(ids: Option<&Identities>, ttl: Option<Duration>) -> Vec<OsString> {
    let Some(i) = ids else {
        return Vec::new();
    };
    let mut args: Vec<OsString> = vec![
        "--ca-dir".into(),
        i.ca_dir.clone().into(),
        "--workload-tokens".into(),
        i.tokens_file.clone().into(),
    ];
    if let Some(t) = ttl {
        args.push("--workload-cert-ttl".into());
        args.push(format!("{}ms", t.as_millis()).into());
    }
    args
}

/// The `Pod` objects of `pods`, each labelled as running a sidecar; with
/// `captured`, annotated as the injector annotates a pod whose connections
/// are captured (every port of it reaches its sidecar).
pub fn pods_yaml(namespace: &str, pods: &[Pod], captured: bool) -> String {
    let mut y = String::from("# Written by minimesh up: the pods, each with a sidecar.\n");
    let capture = if captured {
        "\n    minimesh.io/capture: enabled"
    } else {
        ""
    };
    for p in pods {
        let mut annotations = String::new();
        for (k, v) in p.annotations.iter().filter(|_| captured) {
            let _ = write!(
                annotations,
                "\n    {k}: {}",
                serde_json::Value::from(v.as_str())
            );
        }
        let mut labels = String::new();
        for (k, v) in p
            .labels
            .iter()
            .filter(|(k, _)| *k != "app" && *k != "minimesh.io/proxy")
        {
            let _ = write!(
                labels,
                "\n    {}: {}",
                serde_json::Value::from(k.as_str()),
                serde_json::Value::from(v.as_str())
            );
        }
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n  namespace: {namespace}\n  labels:\n    app: {}\n    minimesh.io/proxy: sidecar{labels}\n  annotations:\n    minimesh.io/inbound-port: \"{}\"{capture}{annotations}\nspec:\n  serviceAccountName: {}\nstatus:\n  podIP: \"{}\"\n",
            p.name, p.service, p.port, p.service, p.ip
        );
    }
    y
}

/// 32 hex digits from the system's random source.
fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `text` to `path`, readable by this user only.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    write_atomic(path, text)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("securing {}", path.display()))
}
