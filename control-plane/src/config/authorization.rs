//! `AuthorizationPolicy`: Istio's spec (`security.istio.io/v1`, `v1beta1`)
//! and minimesh's CRD of the same types (`minimesh.io/v1alpha1`), read
//! into the policy the inbound sidecars enforce ([`v1::Authorization`]):
//! who may call (principals and namespaces from mutual TLS) what (methods,
//! paths, ports), ALLOW or DENY. What minimesh does not implement
//! (`CUSTOM` and `AUDIT`, `when` conditions, request principals, IP
//! blocks, hosts, `targetRef`) is refused naming the field: a policy that
//! silently allowed more than it says would be worse than none.

use std::collections::BTreeMap;

use kube::CustomResource;
use minimesh_proto::v1::{self, AuthzAction};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::crd::any_value;
use super::kube::ObjectMeta;

/// The API versions an AuthorizationPolicy is read in.
pub const AUTHZ_API_VERSIONS: [&str; 3] = [
    "minimesh.io/v1alpha1",
    "security.istio.io/v1",
    "security.istio.io/v1beta1",
];

/// Most rules of a policy, and most values of one list: a policy is
/// evaluated on every inbound request.
pub const MAX_AUTHZ_ITEMS: usize = 256;

/// An AuthorizationPolicy as written.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizationPolicy {
    /// Object metadata.
    pub metadata: ObjectMeta,
    /// The policy (`{}`: allow nothing).
    #[serde(default)]
    pub spec: AuthorizationPolicySpec,
}

/// `spec`: Istio's fields; those minimesh does not implement are read only
/// to be refused by name. On Kubernetes it is also the spec of the
/// `minimesh.io/v1alpha1` CRD (`crds/`), generated from these types.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema, CustomResource)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[kube(
    group = "minimesh.io",
    version = "v1alpha1",
    kind = "AuthorizationPolicy",
    root = "AuthorizationPolicyResource",
    namespaced,
    shortname = "mauthz",
    category = "minimesh",
    doc = "Who may call the workloads it selects, and what: Istio's AuthorizationPolicy, enforced by their inbound sidecars (docs/security.md).",
    printcolumn(name = "Action", type_ = "string", json_path = ".spec.action")
)]
pub struct AuthorizationPolicySpec {
    /// The workloads it applies to, by their pods' labels (`matchLabels`);
    /// none: every workload of its namespace (of the mesh, in
    /// `minimesh-system`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<WorkloadSelector>,
    /// `ALLOW` (the default) or `DENY`. `CUSTOM` and `AUDIT` are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// A request matches the policy when it matches any rule. No rules:
    /// an ALLOW policy allows nothing, a DENY policy denies nothing.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub provider: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub target_ref: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub target_refs: Option<Value>,
}

/// `selector`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkloadSelector {
    /// Every label, with its value.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// `rules[]`: some `from` and some `to` must match (none: any).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    /// Callers.
    #[serde(default)]
    pub from: Vec<From>,
    /// Requests.
    #[serde(default)]
    pub to: Vec<To>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub when: Option<Value>,
}

/// `rules[].from[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct From {
    /// The caller.
    #[serde(default)]
    pub source: Source,
}

/// `rules[].to[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct To {
    /// The request.
    #[serde(default)]
    pub operation: Operation,
}

/// `from[].source`: every field set must match.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Source {
    /// The caller's identity from mutual TLS, `<trust domain>/ns/<ns>/sa/<sa>`;
    /// exact, `prefix*`, `*suffix` or `*` (any authenticated caller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principals: Option<Vec<String>>,
    /// Identities that must not call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_principals: Option<Vec<String>>,
    /// The caller's namespace (its identity's); wildcards as principals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<Vec<String>>,
    /// Namespaces that must not call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_namespaces: Option<Vec<String>>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub request_principals: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub not_request_principals: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub ip_blocks: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub not_ip_blocks: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub remote_ip_blocks: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub not_remote_ip_blocks: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub service_accounts: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub not_service_accounts: Option<Value>,
}

/// `to[].operation`: every field set must match.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Operation {
    /// HTTP methods (`GET`); wildcards as principals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub methods: Option<Vec<String>>,
    /// Methods that must not be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_methods: Option<Vec<String>>,
    /// Request paths without the query: exact, `/prefix*`, `*suffix`, `*`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paths: Option<Vec<String>>,
    /// Paths that must not be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_paths: Option<Vec<String>>,
    /// The workload's (the app's) ports, as strings (`"8080"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<String>>,
    /// Ports that must not be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ports: Option<Vec<String>>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub hosts: Option<Value>,
    /// Not implemented (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub not_hosts: Option<Value>,
}

/// Why a policy is refused: the field and the reason.
pub type Refusal = (String, String);

fn not_yet(field: String, what: &str) -> Refusal {
    (
        field,
        format!("{what} is not implemented yet; this AuthorizationPolicy is not applied"),
    )
}

/// A value list checked: no empty value, `*` only at one end, bounded.
fn values(list: &Option<Vec<String>>, at: &str) -> Result<Vec<String>, Refusal> {
    let Some(list) = list else {
        return Ok(Vec::new());
    };
    if list.is_empty() {
        return Err((
            at.to_string(),
            "is empty: leave it out to match any value".into(),
        ));
    }
    if list.len() > MAX_AUTHZ_ITEMS {
        return Err((
            at.to_string(),
            format!("more than {MAX_AUTHZ_ITEMS} values"),
        ));
    }
    for (i, v) in list.iter().enumerate() {
        let inner = v.strip_prefix('*').unwrap_or(v);
        let inner = inner.strip_suffix('*').unwrap_or(inner);
        if v.is_empty()
            || (v.len() > 1 && inner.contains('*'))
            || (v.len() > 1 && v.starts_with('*') && v.ends_with('*'))
        {
            return Err((
                format!("{at}[{i}]"),
                format!("{v:?}: a value is exact, \"prefix*\", \"*suffix\" or \"*\""),
            ));
        }
    }
    Ok(list.clone())
}

fn ports(list: &Option<Vec<String>>, at: &str) -> Result<Vec<u32>, Refusal> {
    values(list, at)?
        .iter()
        .enumerate()
        .map(|(i, p)| match p.parse::<u16>() {
            Ok(n) if n > 0 => Ok(u32::from(n)),
            _ => Err((
                format!("{at}[{i}]"),
                format!("{p:?} is not a port (1-65535)"),
            )),
        })
        .collect()
}

fn source(s: &Source, at: &str) -> Result<v1::AuthzSource, Refusal> {
    let refused = [
        (
            "requestPrincipals",
            s.request_principals.is_some(),
            "matching request principals (JWT)",
        ),
        (
            "notRequestPrincipals",
            s.not_request_principals.is_some(),
            "matching request principals (JWT)",
        ),
        ("ipBlocks", s.ip_blocks.is_some(), "matching IP blocks"),
        (
            "notIpBlocks",
            s.not_ip_blocks.is_some(),
            "matching IP blocks",
        ),
        (
            "remoteIpBlocks",
            s.remote_ip_blocks.is_some(),
            "matching IP blocks",
        ),
        (
            "notRemoteIpBlocks",
            s.not_remote_ip_blocks.is_some(),
            "matching IP blocks",
        ),
        (
            "serviceAccounts",
            s.service_accounts.is_some(),
            "matching service accounts (use principals)",
        ),
        (
            "notServiceAccounts",
            s.not_service_accounts.is_some(),
            "matching service accounts (use notPrincipals)",
        ),
    ];
    if let Some((field, _, what)) = refused.iter().find(|(_, set, _)| *set) {
        return Err(not_yet(format!("{at}.{field}"), what));
    }
    Ok(v1::AuthzSource {
        principals: values(&s.principals, &format!("{at}.principals"))?,
        not_principals: values(&s.not_principals, &format!("{at}.notPrincipals"))?,
        namespaces: values(&s.namespaces, &format!("{at}.namespaces"))?,
        not_namespaces: values(&s.not_namespaces, &format!("{at}.notNamespaces"))?,
    })
}

fn operation(o: &Operation, at: &str) -> Result<v1::AuthzOperation, Refusal> {
    if o.hosts.is_some() || o.not_hosts.is_some() {
        let field = if o.hosts.is_some() {
            "hosts"
        } else {
            "notHosts"
        };
        return Err(not_yet(format!("{at}.{field}"), "matching hosts"));
    }
    let methods = |l: &Option<Vec<String>>, f: &str| {
        let v = values(l, &format!("{at}.{f}"))?;
        Ok::<_, Refusal>(v.into_iter().map(|m| m.to_ascii_uppercase()).collect())
    };
    Ok(v1::AuthzOperation {
        methods: methods(&o.methods, "methods")?,
        not_methods: methods(&o.not_methods, "notMethods")?,
        paths: values(&o.paths, &format!("{at}.paths"))?,
        not_paths: values(&o.not_paths, &format!("{at}.notPaths"))?,
        ports: ports(&o.ports, &format!("{at}.ports"))?,
        not_ports: ports(&o.not_ports, &format!("{at}.notPorts"))?,
    })
}

impl AuthorizationPolicy {
    /// The policy the sidecars enforce, or the field and reason it is
    /// refused for. `root` is the control plane's root namespace (its
    /// policies apply mesh-wide).
    pub fn validate(&self, namespace: &str, root: &str) -> Result<v1::Authorization, Refusal> {
        let spec = &self.spec;
        for (field, set) in [
            ("provider", spec.provider.is_some()),
            ("targetRef", spec.target_ref.is_some()),
            ("targetRefs", spec.target_refs.is_some()),
        ] {
            if set {
                return Err(not_yet(format!("spec.{field}"), "this field"));
            }
        }
        let action = match spec.action.as_deref().unwrap_or("ALLOW") {
            "ALLOW" => AuthzAction::AuthzAllow,
            "DENY" => AuthzAction::AuthzDeny,
            a @ ("CUSTOM" | "AUDIT") => {
                return Err(not_yet("spec.action".into(), &format!("action {a}")))
            }
            other => {
                return Err((
                    "spec.action".into(),
                    format!("{other:?} is not one of ALLOW, DENY"),
                ))
            }
        };
        if spec.rules.len() > MAX_AUTHZ_ITEMS {
            return Err((
                "spec.rules".into(),
                format!("more than {MAX_AUTHZ_ITEMS} rules"),
            ));
        }
        let mut rules = Vec::new();
        for (i, r) in spec.rules.iter().enumerate() {
            let at = format!("spec.rules[{i}]");
            if r.when.is_some() {
                return Err(not_yet(format!("{at}.when"), "conditions (when)"));
            }
            let from = r
                .from
                .iter()
                .enumerate()
                .map(|(j, f)| source(&f.source, &format!("{at}.from[{j}].source")))
                .collect::<Result<Vec<_>, _>>()?;
            let to =
                r.to.iter()
                    .enumerate()
                    .map(|(j, t)| operation(&t.operation, &format!("{at}.to[{j}].operation")))
                    .collect::<Result<Vec<_>, _>>()?;
            rules.push(v1::AuthzRule { from, to });
        }
        Ok(v1::Authorization {
            namespace: namespace.to_string(),
            name: self.metadata.name.clone(),
            mesh_wide: namespace == root,
            selector: spec
                .selector
                .as_ref()
                .map(|s| s.match_labels.clone().into_iter().collect())
                .unwrap_or_default(),
            action: action as i32,
            rules,
        })
    }
}

/// How the admin API's `/debug/config` lists a policy in force.
pub fn view(key: &super::parse::ObjectKey, a: &v1::Authorization) -> Value {
    let list = |v: &[String]| v.to_vec();
    serde_json::json!({
        "kind": key.kind,
        "namespace": a.namespace,
        "name": a.name,
        "meshWide": a.mesh_wide,
        "selector": a.selector.iter().collect::<BTreeMap<_, _>>(),
        "action": if a.action == AuthzAction::AuthzDeny as i32 { "DENY" } else { "ALLOW" },
        "rules": a.rules.iter().map(|r| serde_json::json!({
            "from": r.from.iter().map(|s| serde_json::json!({
                "principals": list(&s.principals), "notPrincipals": list(&s.not_principals),
                "namespaces": list(&s.namespaces), "notNamespaces": list(&s.not_namespaces),
            })).collect::<Vec<_>>(),
            "to": r.to.iter().map(|o| serde_json::json!({
                "methods": list(&o.methods), "notMethods": list(&o.not_methods),
                "paths": list(&o.paths), "notPaths": list(&o.not_paths),
                "ports": o.ports, "notPorts": o.not_ports,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(spec: &str) -> Result<v1::Authorization, Refusal> {
        let p: AuthorizationPolicy =
            serde_saphyr::from_str(&format!("metadata: {{name: p}}\nspec: {spec}")).expect("YAML");
        p.validate("istioinaction", "minimesh-system")
    }

    #[test]
    fn istios_fields_read_into_the_policy() {
        let p = policy("{selector: {matchLabels: {app: simple-backend}}, action: ALLOW, rules: [{from: [{source: {principals: [\"cluster.local/ns/istioinaction/sa/simple-web\"]}}], to: [{operation: {methods: [get], paths: [\"/api/*\"], ports: [\"8080\"]}}]}]}").expect("valid");
        assert_eq!(p.action, AuthzAction::AuthzAllow as i32);
        assert_eq!(
            p.selector.get("app").map(String::as_str),
            Some("simple-backend")
        );
        assert!(!p.mesh_wide);
        let op = &p.rules[0].to[0];
        assert_eq!(op.methods, ["GET"]);
        assert_eq!(op.ports, [8080]);
        assert_eq!(
            p.rules[0].from[0].principals,
            ["cluster.local/ns/istioinaction/sa/simple-web"]
        );
        // `{}`: ALLOW with no rule (allow nothing).
        let p = policy("{}").expect("valid");
        assert!(p.rules.is_empty() && p.action == AuthzAction::AuthzAllow as i32);
    }

    #[test]
    fn what_is_not_implemented_or_wrong_is_refused_by_field() {
        let cases = [
            ("{action: CUSTOM, provider: {name: ext}}", "spec.provider"),
            ("{action: AUDIT}", "spec.action"),
            ("{action: deny}", "spec.action"),
            (
                "{rules: [{when: [{key: \"request.headers[x]\", values: [a]}]}]}",
                "spec.rules[0].when",
            ),
            (
                "{rules: [{from: [{source: {ipBlocks: [1.2.3.4]}}]}]}",
                "spec.rules[0].from[0].source.ipBlocks",
            ),
            (
                "{rules: [{from: [{source: {requestPrincipals: [\"*\"]}}]}]}",
                "spec.rules[0].from[0].source.requestPrincipals",
            ),
            (
                "{rules: [{to: [{operation: {hosts: [a.example]}}]}]}",
                "spec.rules[0].to[0].operation.hosts",
            ),
            (
                "{rules: [{to: [{operation: {ports: [http]}}]}]}",
                "spec.rules[0].to[0].operation.ports[0]",
            ),
            (
                "{rules: [{to: [{operation: {paths: [\"/a*b\"]}}]}]}",
                "spec.rules[0].to[0].operation.paths[0]",
            ),
            (
                "{rules: [{to: [{operation: {paths: []}}]}]}",
                "spec.rules[0].to[0].operation.paths",
            ),
        ];
        for (spec, field) in cases {
            let e = policy(spec).expect_err(spec);
            assert_eq!(e.0, field, "{spec}: {e:?}");
        }
        assert_eq!(
            policy("{action: CUSTOM}").expect_err("custom").1,
            "action CUSTOM is not implemented yet; this AuthorizationPolicy is not applied"
        );
    }
}
