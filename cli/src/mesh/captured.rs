//! The pods of `minimesh up --capture`: each in its own network namespace
//! (`pod_network.rs`), its capture rules written by `sidecar init-capture`
//! (the init step Kubernetes runs), its app started unchanged (listening on
//! `0.0.0.0:8080`, no proxy settings) and its sidecar in the group the
//! rules exclude.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use anyhow::{anyhow, bail, Context};
use tokio::process::Command;

use super::{binary, identity, pod_network, CaptureState, Mesh, Pod, APP_PORT, OUTBOUND_PORT};

impl Mesh {
    /// Makes each pod's namespace and starts its processes.
    pub(super) fn start_captured_pods(
        &mut self,
        capture: CaptureState,
        pods: &[(Pod, BTreeMap<String, String>)],
        xds: &str,
        ids: &Option<identity::Identities>,
        worker_threads: Option<usize>,
    ) -> anyhow::Result<()> {
        let sidecar = binary("sidecar")?;
        let app = binary("fake-service")?;
        let ns = self.state.namespace.clone();
        let services: Vec<(String, Ipv4Addr)> = capture
            .service_ips
            .iter()
            .map(|(n, ip)| (n.clone(), *ip))
            .collect();
        let hosts = pod_network::hosts_file(&ns, &services);
        for (i, (pod, env)) in pods.iter().enumerate() {
            let net = self
                .pod_network
                .as_mut()
                .ok_or_else(|| anyhow!("capture mode without a pod network"))?;
            let netns = net.add_pod(&pod.name, i as u8 + 1, &hosts)?;
            // The init step, as the pod's init container: the same code.
            let annotations = pod
                .annotations
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()));
            let settings = minimesh_proto::capture::CaptureSettings::from_annotations(annotations)
                .map_err(|e| anyhow!("{}: {e}", pod.name))?;
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", &netns])
                .arg(&sidecar)
                .arg("init-capture")
                .args(settings.init_args())
                .output()
                .context("running sidecar init-capture")?;
            if !out.status.success() {
                bail!(
                    "{}: sidecar init-capture failed: {}",
                    pod.name,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &netns]);
            match self.commands.get(&pod.deployment) {
                Some(command) => cmd.args(command),
                None => cmd.arg(&app),
            };
            cmd.env("LISTEN_ADDR", format!("0.0.0.0:{APP_PORT}"))
                .env("POD_NAME", &pod.name)
                .env("NAME", &pod.service);
            for (k, v) in env {
                cmd.env(k, v);
            }
            self.spawn(&format!("{}.app", pod.name), &mut cmd)?;
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", &netns])
                .arg(&sidecar)
                .args([
                    "--xds-addr",
                    xds,
                    "--workload",
                    &pod.name,
                    "--namespace",
                    &ns,
                ])
                .arg("--capture")
                .args(["--outbound", &format!("127.0.0.1:{OUTBOUND_PORT}")])
                .args([
                    "--inbound-capture",
                    &format!("0.0.0.0:{}", minimesh_proto::capture::INBOUND_CAPTURE_PORT),
                ])
                .args(["--admin", &pod.admin().to_string()])
                .args(["--labels", &pod.labels_arg()])
                .args(identity::sidecar_args(ids.as_ref(), &pod.name))
                .args(
                    worker_threads
                        .map(|n| ["--worker-threads".to_string(), n.to_string()])
                        .into_iter()
                        .flatten(),
                );
            self.spawn_as(
                &format!("{}.sidecar", pod.name),
                &mut cmd,
                Some(minimesh_proto::capture::PROXY_GID),
            )?;
        }
        Ok(())
    }
}
