//! The ingress gateway of a local mesh: the sidecar binary in gateway mode
//! on the topology's `ingress.listen`, its hosts as routes, labelled as
//! Istio's ingress gateway (`istio=ingressgateway`) so that the Gateways
//! users apply bind theirs.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::process::Command;

use super::ready::wait_http;
use super::{binary, identity, Mesh};
use crate::topology::Ingress;

impl Mesh {
    /// Starts the gateway and waits until it is ready.
    pub(super) async fn start_gateway(
        &mut self,
        listen: SocketAddr,
        admin: SocketAddr,
        ing: &Ingress,
        xds: &str,
        ids: Option<&identity::Identities>,
    ) -> anyhow::Result<()> {
        let sidecar = binary("sidecar")?;
        let ns = self.state.namespace.clone();
        let mut cmd = Command::new(&sidecar);
        cmd.args([
            "--mode",
            "gateway",
            "--xds-addr",
            xds,
            "--workload",
            identity::GATEWAY,
            "--namespace",
            &ns,
        ])
        .args([
            "--outbound",
            &listen.to_string(),
            "--admin",
            &admin.to_string(),
        ])
        .args(identity::sidecar_args(ids, identity::GATEWAY))
        // Istio's ingress gateway's label: Gateways selecting it (as the
        // book's do) bind their hosts here, over the topology's own.
        .args(["--labels", "istio=ingressgateway"]);
        for (host, svc) in &ing.hosts {
            cmd.args(["--route", &format!("{host}={svc}.{ns}")]);
        }
        if let Some(d) = &ing.default_service {
            cmd.args(["--default-route", &format!("{d}.{ns}")]);
        }
        if let Some(z) = &ing.zone {
            cmd.args(["--zone", z]);
        }
        if ing.debug_headers {
            cmd.arg("--debug-headers");
        }
        self.spawn("ingress-gateway", &mut cmd)?;
        wait_http(&admin.to_string(), "/ready", Duration::from_secs(15), self).await?;
        Ok(())
    }
}
