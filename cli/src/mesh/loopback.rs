//! The pods of the loopback mesh (`minimesh up` without `--capture`): each
//! pod's app (fake-service) and sidecar on the pod's own loopback address,
//! the app calling through the sidecar as its HTTP proxy (`HTTP_PROXY`).

use std::collections::BTreeMap;

use tokio::process::Command;

use super::{binary, identity, Mesh, Pod, OUTBOUND_PORT};

impl Mesh {
    /// Starts each pod's app and sidecar.
    pub(super) fn start_loopback_pods(
        &mut self,
        pods: &[(Pod, BTreeMap<String, String>)],
        xds: &str,
        ids: Option<&identity::Identities>,
        worker_threads: Option<usize>,
    ) -> anyhow::Result<()> {
        let sidecar = binary("sidecar")?;
        let app = binary("fake-service")?;
        let ns = self.state.namespace.clone();
        for (pod, env) in pods {
            let mut cmd = Command::new(&app);
            cmd.env("LISTEN_ADDR", pod.app().to_string())
                .env("NAME", &pod.service)
                .env("HTTP_PROXY", format!("http://{}:{OUTBOUND_PORT}", pod.ip));
            for (k, v) in env {
                cmd.env(k, v);
            }
            self.spawn(&format!("{}.app", pod.name), &mut cmd)?;
            self.spawn(
                &format!("{}.sidecar", pod.name),
                Command::new(&sidecar)
                    .args([
                        "--xds-addr",
                        xds,
                        "--workload",
                        &pod.name,
                        "--namespace",
                        &ns,
                    ])
                    .args(["--outbound", &format!("{}:{OUTBOUND_PORT}", pod.ip)])
                    .args(["--inbound", &format!("{}:{}", pod.ip, pod.port)])
                    .args(["--app", &pod.app().to_string()])
                    .args(["--labels", &pod.labels_arg()])
                    .args(["--admin", &pod.admin().to_string()])
                    .args(identity::sidecar_args(ids, &pod.name))
                    .args(
                        worker_threads
                            .map(|n| ["--worker-threads".to_string(), n.to_string()])
                            .into_iter()
                            .flatten(),
                    ),
            )?;
        }
        Ok(())
    }
}
