//! `minimesh delete -f FILE` and `minimesh delete KIND NAME... [-n NS]`:
//! removes from the running mesh what `minimesh apply` put there, as
//! `kubectl delete` does, and waits until every proxy has the config
//! without it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use minimesh_control_plane::config::parse::{
    ISTIO_AUTHZ_KIND, ISTIO_RULE_KIND, ISTIO_VIRTUAL_SERVICE_KIND, K8S_GATEWAY_KIND,
};
use minimesh_control_plane::config::parse_documents;

use crate::mesh::{wait_converged, MeshState};

/// `minimesh delete` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DeleteArgs {
    /// Delete the objects these files name (kind, namespace and name; the
    /// rest of each object is not read).
    #[arg(short = 'f', long = "filename", conflicts_with_all = ["kind", "names"])]
    pub files: Vec<PathBuf>,
    /// The kind: `destinationrule` (`dr`), `virtualservice` (`vs`),
    /// `gateway` (`gw`, Istio's), `httproute`,
    /// `gateway.gateway.networking.k8s.io` or `peerauthentication` (`pa`).
    #[arg(required_unless_present = "files")]
    pub kind: Option<String>,
    /// The names of the objects of that kind.
    #[arg(required_unless_present = "files")]
    pub names: Vec<String>,
    /// Their namespace (default: the mesh's, or each file object's own).
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Succeed when an object is not in the mesh (as kubectl's flag).
    #[arg(long)]
    pub ignore_not_found: bool,
}

/// The kind as `apply` names its files, from what users type.
fn kind_of(typed: &str) -> Option<&'static str> {
    Some(match typed.to_ascii_lowercase().as_str() {
        "destinationrule" | "destinationrules" | "dr" => "destinationrule",
        "virtualservice" | "virtualservices" | "vs" => "virtualservice",
        "gateway" | "gateways" | "gw" => "gateway",
        "peerauthentication" | "peerauthentications" | "pa" => "peerauthentication",
        "authorizationpolicy" | "authorizationpolicies" | "ap" => "authorizationpolicy",
        "httproute" | "httproutes" => "httproute",
        "gateway.gateway.networking.k8s.io" | "gateways.gateway.networking.k8s.io" => {
            "gateway.gateway.networking.k8s.io"
        }
        _ => return None,
    })
}

/// The kind of a parsed object, as `apply` names its files.
fn kind_of_object(kind: &str) -> Option<&'static str> {
    Some(match kind {
        "DestinationRule" => "destinationrule",
        k if k == ISTIO_RULE_KIND => "destinationrule",
        "VirtualService" => "virtualservice",
        k if k == ISTIO_VIRTUAL_SERVICE_KIND => "virtualservice",
        "Gateway" => "gateway",
        "PeerAuthentication" => "peerauthentication",
        "AuthorizationPolicy" => "authorizationpolicy",
        k if k == ISTIO_AUTHZ_KIND => "authorizationpolicy",
        "HTTPRoute" => "httproute",
        k if k == K8S_GATEWAY_KIND => "gateway.gateway.networking.k8s.io",
        _ => return None,
    })
}

/// `minimesh delete`.
pub async fn run(home: PathBuf, args: DeleteArgs) -> anyhow::Result<()> {
    let state = MeshState::load(&home)?;
    let mut targets: Vec<(&'static str, String, String)> = Vec::new();
    for f in &args.files {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("{}: cannot read", f.display()))?;
        let ns = args.namespace.as_deref().unwrap_or(&state.namespace);
        let parsed = parse_documents(f, &text, ns).map_err(|e| anyhow!("{e}"))?;
        for doc in parsed.documents {
            let Some(key) = doc.key else { continue };
            let Some(kind) = kind_of_object(key.kind) else {
                bail!(
                    "{}: {key}: minimesh delete takes DestinationRules, VirtualServices, Gateways, HTTPRoutes, PeerAuthentications and AuthorizationPolicies; a local mesh's Services, EndpointSlices and Pods are minimesh up's",
                    f.display()
                );
            };
            targets.push((kind, key.namespace, key.name));
        }
    }
    if let Some(typed) = &args.kind {
        let kind = kind_of(typed).ok_or_else(|| {
            anyhow!("{typed:?} is not a kind minimesh delete takes (destinationrule, virtualservice, gateway, httproute, gateway.gateway.networking.k8s.io, peerauthentication, authorizationpolicy)")
        })?;
        let ns = args.namespace.clone().unwrap_or(state.namespace.clone());
        for n in &args.names {
            targets.push((kind, ns.clone(), n.clone()));
        }
    }
    if targets.is_empty() {
        bail!("nothing to delete: no object in the files");
    }
    let dir = state.config_dir.join("rules");
    let mut missing = Vec::new();
    let mut deleted = Vec::new();
    for (kind, ns, name) in &targets {
        let file = dir.join(format!("{kind}.{ns}.{name}.yaml"));
        match std::fs::remove_file(&file) {
            Ok(()) => deleted.push(format!("{kind} {ns}/{name} deleted")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                missing.push(format!("{kind} {ns}/{name} not found"))
            }
            Err(e) => return Err(e).with_context(|| format!("removing {}", file.display())),
        }
    }
    if !deleted.is_empty() {
        wait_converged(&state, Duration::from_secs(10)).await?;
    }
    for d in &deleted {
        println!("{d}");
    }
    if !missing.is_empty() && !args.ignore_not_found {
        bail!("{}", missing.join("\n"));
    }
    Ok(())
}
