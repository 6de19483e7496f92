//! `minimesh apply -f FILE`: validates rule files (DestinationRules and
//! PeerAuthentications) exactly as the control plane will, and only then
//! puts each object into the running mesh's config directory (one file per
//! object, replaced on re-apply, like `kubectl apply`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use minimesh_control_plane::config::gateway_api::Parent;
use minimesh_control_plane::config::parse::ObjectKey;
use minimesh_control_plane::config::{parse_documents, Object};

use crate::mesh::{wait_converged, write_atomic, MeshState};

/// `minimesh apply` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ApplyArgs {
    /// Rule file(s) (DestinationRule, PeerAuthentication; multi-document YAML).
    #[arg(short = 'f', long = "filename", required = true)]
    pub files: Vec<PathBuf>,
    /// Only validate; change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// A validated rule and where it goes.
pub struct Validated {
    /// Its identity.
    pub key: ObjectKey,
    /// Its resolved policy; a PeerAuthentication's mode; the Service a
    /// VirtualService routes (`name.namespace`).
    pub policy: String,
    /// The policy of each port with its own (`portLevelSettings`).
    pub port_policies: Vec<(u16, &'static str)>,
    /// The document, to store.
    pub raw: serde_json::Value,
    /// Caveats.
    pub warnings: Vec<String>,
    /// A VirtualService's route as users read it (`: timeout 500ms`).
    pub route: String,
}

/// Istio's VirtualService or minimesh's.
fn is_virtual_service(kind: &str) -> bool {
    kind == "VirtualService"
        || kind == minimesh_control_plane::config::parse::ISTIO_VIRTUAL_SERVICE_KIND
}

impl Validated {
    /// The kind as kubectl prints it (`destinationrule`).
    pub fn kind(&self) -> &'static str {
        match self.key.kind {
            "PeerAuthentication" => "peerauthentication",
            "AuthorizationPolicy" | minimesh_control_plane::config::parse::ISTIO_AUTHZ_KIND => {
                "authorizationpolicy"
            }
            k if is_virtual_service(k) => "virtualservice",
            "Gateway" => "gateway",
            "HTTPRoute" => "httproute",
            minimesh_control_plane::config::parse::K8S_GATEWAY_KIND => {
                "gateway.gateway.networking.k8s.io"
            }
            _ => "destinationrule",
        }
    }

    /// The policy as users read it: `ROUND_ROBIN`, then each port's own;
    /// a PeerAuthentication's mode (`mtls STRICT`).
    pub fn describe(&self) -> String {
        if self.key.kind == "PeerAuthentication" {
            return format!("mtls {}", self.policy);
        }
        if self.kind() == "authorizationpolicy" {
            return self.policy.clone();
        }
        if is_virtual_service(self.key.kind) {
            return format!("routes {}{}", self.policy, self.route);
        }
        if self.key.kind == "Gateway" {
            return format!("serves {}", self.policy);
        }
        if self.key.kind == "HTTPRoute" {
            return format!("attaches to {}{}", self.policy, self.route);
        }
        if self.key.kind == minimesh_control_plane::config::parse::K8S_GATEWAY_KIND {
            return self.policy.clone();
        }
        let mut s = self.policy.to_string();
        for (port, policy) in &self.port_policies {
            s += &format!(", port {port}: {policy}");
        }
        s
    }
}

/// Validates every rule of a file; all errors at once, each naming file, object, field and reason.
pub fn validate_file(path: &Path, namespace: &str) -> anyhow::Result<Vec<Validated>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    validate_text(path, &text, namespace)
}

/// Validates the rules of `text`; errors name `path` as the file.
pub fn validate_text(path: &Path, text: &str, namespace: &str) -> anyhow::Result<Vec<Validated>> {
    let parsed = parse_documents(path, text, namespace).map_err(|e| anyhow!("{e}"))?;
    let mut errors = Vec::new();
    let mut out = Vec::new();
    for doc in parsed.documents {
        match (doc.result, doc.key) {
            (Err(e), _) => errors.push(e.to_string()),
            (Ok(Object::Rule(r)), Some(key)) => out.push(Validated {
                key,
                policy: r.resolved.policy.as_str().to_string(),
                port_policies: r
                    .resolved
                    .ports
                    .iter()
                    .map(|(port, p)| (*port, p.policy.as_str()))
                    .collect(),
                raw: doc.raw,
                warnings: r.warnings.clone(),
                route: String::new(),
            }),
            (Ok(Object::PeerAuth(_, mode)), Some(key)) => out.push(Validated {
                key,
                policy: match mode {
                    minimesh_proto::v1::MtlsMode::MtlsStrict => "STRICT",
                    minimesh_proto::v1::MtlsMode::MtlsPermissive => "PERMISSIVE",
                    minimesh_proto::v1::MtlsMode::Unset => "UNSET",
                }
                .to_string(),
                port_policies: vec![],
                raw: doc.raw,
                warnings: vec![],
                route: String::new(),
            }),
            (Ok(Object::HttpRoute(r)), Some(key)) => out.push(Validated {
                key,
                policy: r
                    .parents
                    .iter()
                    .map(|p| match p {
                        Parent::Service(s, _) => format!("Service {}/{}", s.1, s.0),
                        Parent::Gateway(g, _, _) => format!("Gateway {}/{}", g.0, g.1),
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                port_policies: vec![],
                raw: doc.raw,
                warnings: vec![],
                route: format!(": {} routes", r.routes.len()),
            }),
            (Ok(Object::K8sGateway(g)), Some(key)) => out.push(Validated {
                key,
                policy: match g {
                    Some(g) => format!(
                        "serves {}",
                        g.listeners
                            .iter()
                            .map(|(name, port, host, _)| {
                                format!("{name} {}:{port}", host.as_deref().unwrap_or("*"))
                            })
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    None => "another class's Gateway: not served by minimesh".to_string(),
                },
                port_policies: vec![],
                raw: doc.raw,
                warnings: vec![],
                route: String::new(),
            }),
            (Ok(Object::Gateway(g)), Some(key)) => out.push(Validated {
                key,
                policy: g
                    .binds
                    .iter()
                    .map(|(port, h)| format!("{}:{port}", h.host))
                    .collect::<Vec<_>>()
                    .join(", "),
                port_policies: vec![],
                raw: doc.raw,
                warnings: vec![],
                route: String::new(),
            }),
            (Ok(Object::VirtualService(v)), Some(key)) => out.push(Validated {
                key,
                policy: v
                    .services
                    .iter()
                    .map(|s| format!("{}.{}", s.0, s.1))
                    .chain(v.gateway_hosts.iter().map(|h| {
                        let gws: Vec<String> =
                            v.gateways.iter().map(|g| format!("{}/{}", g.0, g.1)).collect();
                        format!("{h} at {}", gws.join(", "))
                    }))
                    .collect::<Vec<_>>()
                    .join(", "),
                port_policies: vec![],
                raw: doc.raw,
                warnings: vec![],
                route: route_summary(&v),
            }),
            (Ok(Object::Authorization(a)), Some(key)) => out.push(Validated {
                key,
                policy: format!(
                    "{} {} rule{}{}",
                    if a.action == minimesh_proto::v1::AuthzAction::AuthzDeny as i32 {
                        "DENY"
                    } else {
                        "ALLOW"
                    },
                    a.rules.len(),
                    if a.rules.len() == 1 { "" } else { "s" },
                    match (a.mesh_wide, a.selector.is_empty()) {
                        (true, _) => " (mesh-wide)".to_string(),
                        (false, true) => String::new(),
                        (false, false) => {
                            let mut s: Vec<String> =
                                a.selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
                            s.sort();
                            format!(" for {}", s.join(","))
                        }
                    }
                ),
                port_policies: vec![],
                raw: doc.raw,
                warnings: vec![],
                route: String::new(),
            }),
            (Ok(_), Some(key)) => errors.push(format!(
                "{}: {key}: minimesh apply takes DestinationRules, VirtualServices, Gateways, HTTPRoutes, PeerAuthentications and AuthorizationPolicies; a local mesh's Services, EndpointSlices and Pods are written by minimesh up",
                path.display()
            )),
            (Ok(_), None) => {}
        }
    }
    if !errors.is_empty() {
        bail!("{}", errors.join("\n"));
    }
    if out.is_empty() {
        bail!(
            "{}: no DestinationRule, VirtualService, Gateway, HTTPRoute, PeerAuthentication or AuthorizationPolicy in the file",
            path.display()
        );
    }
    Ok(out)
}

/// What a VirtualService's routes do, as `minimesh apply` prints it: one
/// route's timeout and retries, or how many routes.
fn route_summary(
    v: &minimesh_control_plane::config::virtual_service::ValidVirtualService,
) -> String {
    use minimesh_control_plane::config::route::RouteAction;
    let mut parts = Vec::new();
    match v.routes.as_slice() {
        [r] if v.services.iter().any(|s| r.is_plain(s)) => {
            if let RouteAction::Forward(b) = &r.action {
                if let Some(p) = b[0].port {
                    parts.push(format!("port {p}"));
                }
            }
            if let Some(t) = r.timeout {
                parts.push(format!("timeout {t:?}"));
            }
            if let Some(x) = &r.retries {
                if let Some(a) = x.attempts {
                    parts.push(format!("{a} retries"));
                }
                if let Some(t) = x.per_try_timeout {
                    parts.push(format!("per try {t:?}"));
                }
            }
        }
        routes => parts.push(match routes.len() {
            1 => "1 route".to_string(),
            n => format!("{n} routes"),
        }),
    }
    match parts.is_empty() {
        true => String::new(),
        false => format!(": {}", parts.join(", ")),
    }
}

/// Validates and stores a file's rules into the mesh's config directory.
pub fn apply_file(state: &MeshState, path: &Path) -> anyhow::Result<Vec<Validated>> {
    let rules = validate_file(path, &state.namespace)?;
    for r in &rules {
        let mut raw = r.raw.clone();
        raw["metadata"]["namespace"] = serde_json::json!(r.key.namespace);
        let file = state.config_dir.join("rules").join(format!(
            "{}.{}.{}.yaml",
            r.kind(),
            r.key.namespace,
            r.key.name
        ));
        let text = serde_json::to_string_pretty(&raw)?;
        write_atomic(&file, &format!("{text}\n"))?;
    }
    Ok(rules)
}

/// `minimesh apply`.
pub async fn run(home: PathBuf, args: ApplyArgs) -> anyhow::Result<()> {
    if args.dry_run {
        for f in &args.files {
            for r in validate_file(f, "default")? {
                println!(
                    "{} {}/{} valid: {} (dry run)",
                    r.kind(),
                    r.key.namespace,
                    r.key.name,
                    r.describe()
                );
            }
        }
        return Ok(());
    }
    // Validate everything before touching the mesh: all or nothing.
    for f in &args.files {
        validate_file(f, "default")?;
    }
    let state = MeshState::load(&home)?;
    let mut applied = Vec::new();
    for f in &args.files {
        applied.extend(apply_file(&state, f)?);
    }
    for r in &applied {
        wait_rule(&state, &r.key, &r.policy).await?;
        println!(
            "{} {}/{} applied: {}",
            r.kind(),
            r.key.namespace,
            r.key.name,
            r.describe()
        );
        for w in &r.warnings {
            println!("  warning: {w}");
        }
    }
    wait_converged(&state, Duration::from_secs(10)).await?;
    Ok(())
}

/// Waits until the control plane reports the rule with this policy, and
/// fails with its reason when it is not accepted.
pub async fn wait_rule(state: &MeshState, key: &ObjectKey, policy: &str) -> anyhow::Result<()> {
    let (list, field) = match key.kind {
        // In force once the control plane lists it (every proxy's ACK of it
        // is `wait_converged`'s to wait for).
        "PeerAuthentication" => ("peerAuthentications", Some("mode")),
        "AuthorizationPolicy" | minimesh_control_plane::config::parse::ISTIO_AUTHZ_KIND => {
            ("authorizationPolicies", None)
        }
        // Listed: applied (what it routes is `describe`'s).
        k if is_virtual_service(k) => ("virtualServices", None),
        "Gateway" => ("gateways", None),
        "HTTPRoute" => ("httpRoutes", None),
        minimesh_control_plane::config::parse::K8S_GATEWAY_KIND => return Ok(()),
        _ => ("rules", Some("policy")),
    };
    let admin = state.control_plane_admin.to_string();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let config = crate::http::get_json(&admin, "/debug/config").await?;
        let found = config[list].as_array().and_then(|rules| {
            rules
                .iter()
                .find(|r| {
                    r["namespace"] == key.namespace.as_str()
                        && r["name"] == key.name.as_str()
                        && field.is_none_or(|f| r[f] == policy)
                })
                .cloned()
        });
        if let Some(rule) = found {
            if rule["accepted"] == true || key.kind != "DestinationRule" {
                return Ok(());
            }
            bail!(
                "{key} not applied: {}: {}",
                rule["reason"].as_str().unwrap_or(""),
                rule["message"].as_str().unwrap_or("")
            );
        }
        if tokio::time::Instant::now() > deadline {
            let errors = config["errors"].to_string();
            bail!("the control plane did not pick up {key} within 10s; its errors: {errors}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_virtual_service_is_applied_and_described_by_what_its_route_sets() {
        let text = "apiVersion: networking.istio.io/v1alpha3\nkind: VirtualService\nmetadata: {name: simple-backend-vs}\nspec:\n  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n    timeout: 0.5s\n    retries: {attempts: 2}\n";
        let v = validate_text(Path::new("vs.yaml"), text, "istioinaction").expect("valid");
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].kind(), "virtualservice");
        assert_eq!(
            v[0].describe(),
            "routes simple-backend.istioinaction: timeout 500ms, 2 retries"
        );
        let refused = text.replace("    timeout: 0.5s\n", "    mirror: {host: simple-web}\n");
        let Err(e) = validate_text(Path::new("vs.yaml"), &refused, "istioinaction") else {
            panic!("refused");
        };
        assert_eq!(
            e.to_string(),
            "vs.yaml: VirtualService istioinaction/simple-backend-vs: spec.http[0].mirror: mirroring is not implemented yet; this VirtualService is not applied"
        );
    }

    #[test]
    fn an_httproute_and_its_gateway_are_applied_and_described() {
        let text = "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: gw}\nspec:\n  gatewayClassName: minimesh\n  listeners: [{name: http, port: 80, protocol: HTTP, hostname: web.example.com}]\n---\napiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: web}\nspec:\n  parentRefs: [{name: gw}, {group: \"\", kind: Service, name: web}]\n  rules:\n  - matches: [{path: {value: /a}}, {path: {value: /b}}]\n    backendRefs: [{name: web, port: 80}]\n";
        let v = validate_text(Path::new("routes.yaml"), text, "default").expect("valid");
        let described: Vec<(String, String)> = v
            .iter()
            .map(|r| (r.kind().to_string(), r.describe()))
            .collect();
        assert_eq!(
            described,
            [
                (
                    "gateway.gateway.networking.k8s.io".to_string(),
                    "serves http web.example.com:80".to_string()
                ),
                (
                    "httproute".to_string(),
                    "attaches to Gateway default/gw, Service default/web: 2 routes".to_string()
                ),
            ]
        );
    }
}
