//! `minimesh bench overhead --mtls`: the services and peers of the paths
//! over mutual TLS. The mesh runs on mutual TLS; `echo` is kept plaintext by
//! a rule's `tls: {mode: DISABLE}` (its rows are compared with the plaintext
//! peers), and `echo-mtls` is the same pod's sidecar over mutual TLS.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::bench::peers::{self, mtls::NginxPair};
use crate::mesh::{Mesh, Pod};

/// The mesh's topology: with `--mtls`, on mutual TLS (not with
/// `--baseline-sidecar`: an older build may not speak it).
pub(super) fn topology(args: &crate::bench::BenchArgs) -> anyhow::Result<String> {
    if !args.mtls {
        return Ok(super::TOPOLOGY.to_string());
    }
    if args.baseline_sidecar.is_some() {
        anyhow::bail!("--mtls and --baseline-sidecar: run them apart (an older build may not speak the mesh's mutual TLS)");
    }
    Ok(super::TOPOLOGY.replace("mtls: false", "mtls: true"))
}

/// Writes `echo-mtls` (the echo pod's inbound port) and the rule that keeps
/// `echo` plaintext, and waits for the rule.
pub(super) async fn services(mesh: &Mesh, out: &Path, pod: &Pod) -> anyhow::Result<()> {
    let ns = &mesh.state.namespace;
    let yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: echo-mtls, namespace: {ns}}}\nspec:\n  ports: [{{name: http, port: 80, targetPort: {port}}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: echo-mtls-local\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: echo-mtls}}\naddressType: IPv4\nports: [{{name: http, port: {port}}}]\nendpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: {name}, namespace: {ns}}}\n",
        port = pod.port,
        ip = pod.ip,
        name = pod.name,
    );
    let dir = &mesh.state.config_dir;
    crate::mesh::write_atomic(&dir.join("services").join("echo-mtls.yaml"), &yaml)?;
    let rule = out.join("echo-plaintext.yaml");
    std::fs::write(
        &rule,
        format!("apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: echo-plaintext, namespace: {ns}}}\nspec:\n  host: echo\n  trafficPolicy:\n    tls: {{mode: DISABLE}}\n"),
    )?;
    for r in crate::apply::apply_file(&mesh.state, &rule)? {
        crate::apply::wait_rule(&mesh.state, &r.key, &r.policy).await?;
    }
    Ok(())
}

/// nginx as a pair over mutual TLS with the mesh's certificates (`front` ->
/// `back` -> the pod's app), when nginx is installed: the processes to
/// measure, and the pair to stop.
pub(super) async fn nginx_pair(
    mesh: &Mesh,
    out: &Path,
    pod: &Pod,
    front: SocketAddr,
    back: SocketAddr,
) -> anyhow::Result<Option<(Vec<u32>, NginxPair)>> {
    let Some(binary) = peers::find(peers::Kind::Nginx.binary()) else {
        return Ok(None);
    };
    let ca = minimesh_control_plane::ca::Ca::load_or_create(
        &mesh.home.join("ca"),
        "cluster.local",
        Duration::from_secs(86_400),
    )?;
    let dir = out.join("nginx-mtls");
    let ns = &mesh.state.namespace;
    let pair =
        peers::mtls::start_nginx_pair(&binary, &dir, &ca, ns, front, back, pod.app()).await?;
    let pids = pair
        .front
        .pid()
        .into_iter()
        .chain(pair.back.pid())
        .collect();
    Ok(Some((pids, pair)))
}
