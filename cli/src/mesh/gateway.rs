//! The ingress gateway of a local mesh: the sidecar binary in gateway mode
//! on the topology's `ingress.listen`, labelled as Istio's ingress gateway
//! (`istio=ingressgateway`), and the topology's `ingress.hosts` and
//! `defaultService` as what users would write for it: an Istio Gateway and
//! VirtualServices bound to it ([`ingress_objects`]), which the control
//! plane reads as it reads those users apply.

use std::net::SocketAddr;
use std::time::Duration;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minimesh_control_plane::config::virtual_service::FROM_TOPOLOGY;
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
        // Istio's ingress gateway's label: the Gateway made of the
        // topology's hosts selects it, and so do those users apply (the
        // book's), whose hosts take the place of the topology's.
        .args(["--labels", "istio=ingressgateway"]);
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

/// The Gateway `ingress` (port 80, every host of the topology's, `*` with
/// a `defaultService`) and one VirtualService per Service it routes to,
/// as YAML documents of the mesh namespace `ns`, labelled
/// [`FROM_TOPOLOGY`]: a host that an applied VirtualService routes at this
/// gateway too is the applied one's. None without hosts.
pub fn ingress_objects(ns: &str, ing: &Ingress) -> Option<String> {
    let mut by_service: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (host, svc) in &ing.hosts {
        by_service.entry(svc).or_default().push(host);
    }
    let mut hosts: Vec<&str> = ing.hosts.keys().map(String::as_str).collect();
    if ing.default_service.is_some() {
        hosts.push("*");
    }
    if hosts.is_empty() {
        return None;
    }
    let quoted = |hs: &[&str]| {
        hs.iter()
            .map(|h| format!("{h:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let meta = |name: &str| {
        format!("metadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{{FROM_TOPOLOGY}: ingress}}\n")
    };
    let mut y = format!(
        "# Written by minimesh up: the topology's ingress, as an Istio Gateway and\n# VirtualServices. Those you apply for the same hosts take their place.\napiVersion: networking.istio.io/v1\nkind: Gateway\n{}spec:\n  selector: {{istio: ingressgateway}}\n  servers:\n  - port: {{number: 80, name: http, protocol: HTTP}}\n    hosts: [{}]\n",
        meta("ingress"),
        quoted(&hosts)
    );
    let mut routes: Vec<(String, Vec<&str>, &str)> = by_service
        .into_iter()
        .map(|(svc, hs)| (format!("ingress-{svc}"), hs, svc))
        .collect();
    if let Some(d) = &ing.default_service {
        routes.push(("ingress-default".into(), vec!["*"], d));
    }
    for (name, hs, svc) in routes {
        let _ = write!(
            y,
            "---\napiVersion: networking.istio.io/v1\nkind: VirtualService\n{}spec:\n  hosts: [{}]\n  gateways: [ingress]\n  http:\n  - route:\n    - destination: {{host: {svc}}}\n",
            meta(&name),
            quoted(&hs)
        );
    }
    Some(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimesh_control_plane::config::parse::{parse_documents, Object};

    #[test]
    fn the_topologys_ingress_is_a_gateway_and_virtual_services_the_control_plane_accepts() {
        let ing: Ingress = serde_saphyr::from_str(
            "hosts: {simple-web.istioinaction.io: simple-web, web.example: simple-web, api.example: backend}\ndefaultService: simple-web\n",
        )
        .expect("ingress");
        let text = ingress_objects("istioinaction", &ing).expect("objects");
        let parsed =
            parse_documents(std::path::Path::new("ingress.yaml"), &text, "default").expect("YAML");
        let mut seen = Vec::new();
        for doc in parsed.documents {
            match doc.result.expect("accepted") {
                Object::Gateway(g) => {
                    let hosts: Vec<&str> = g.binds.iter().map(|(_, h)| h.host.as_str()).collect();
                    assert_eq!(
                        hosts,
                        [
                            "api.example",
                            "simple-web.istioinaction.io",
                            "web.example",
                            "*"
                        ]
                    );
                    seen.push("gateway".to_string());
                }
                Object::VirtualService(v) => {
                    assert_eq!(v.gateways, [("istioinaction".into(), "ingress".into())]);
                    seen.push(format!(
                        "{}: {}",
                        v.virtual_service.metadata.name,
                        v.gateway_hosts.join(" ")
                    ));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(
            seen,
            [
                "gateway",
                "ingress-backend: api.example",
                "ingress-simple-web: simple-web.istioinaction.io web.example",
                "ingress-default: *",
            ]
        );
        let none: Ingress = serde_saphyr::from_str("{}").expect("ingress");
        assert!(ingress_objects("default", &none).is_none());
    }
}
