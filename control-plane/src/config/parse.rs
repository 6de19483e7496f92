//! YAML documents to typed, validated objects.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::authorization::{AuthorizationPolicy, AUTHZ_API_VERSIONS};
use super::gateway::{self as istio_gateway, Gateway, ValidGateway, GATEWAY_API_VERSIONS};
use super::gateway_api::{self, GATEWAY_API_VERSIONS as K8S_GATEWAY_API_VERSIONS};
use super::kube::{EndpointSlice, Service};
use super::rule::{self, DestinationRule, Resolved, RULE_API_VERSIONS};
use super::security::{PeerAuthentication, Pod, ROOT_NAMESPACE};
use super::virtual_service::{
    self, ValidVirtualService, VirtualService, VIRTUAL_SERVICE_API_VERSIONS,
};
use minimesh_proto::v1::MtlsMode;

/// Files larger than this are rejected before parsing: config files are
/// small, and this bounds what one bad file can make us allocate.
pub const MAX_FILE_BYTES: usize = 4 * 1024 * 1024;

/// Why a document (or a whole file) was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// `Kind namespace/name` of the object, when it could be read.
    pub object: Option<String>,
    /// Path of the offending field, when there is one.
    pub field: Option<String>,
    /// The reason.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(o) = &self.object {
            write!(f, ": {o}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": {field}")?;
        }
        write!(f, ": {}", self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// The API versions a PeerAuthentication is read in: Istio's, and
/// minimesh's group.
pub const PEER_AUTH_API_VERSIONS: [&str; 3] = [
    "security.istio.io/v1",
    "security.istio.io/v1beta1",
    "minimesh.io/v1alpha1",
];

/// The kind under which Istio's DestinationRules (`networking.istio.io`)
/// are keyed, apart from minimesh's; it sorts after minimesh's, so that
/// where both name one host, minimesh's own rule is the one applied.
pub const ISTIO_RULE_KIND: &str = "DestinationRule.networking.istio.io";

/// The kind under which Istio's VirtualServices are keyed, apart from
/// minimesh's (`minimesh.io`, keyed `VirtualService`): it sorts after
/// minimesh's, so that where both route one Service, minimesh's applies.
pub const ISTIO_VIRTUAL_SERVICE_KIND: &str = "VirtualService.networking.istio.io";

/// The kind under which Istio's AuthorizationPolicies are keyed, apart from
/// minimesh's (`AuthorizationPolicy`); every one of both applies.
pub const ISTIO_AUTHZ_KIND: &str = "AuthorizationPolicy.security.istio.io";

/// The API versions of minimesh's own VirtualService CRD.
pub const MESH_VIRTUAL_SERVICE_API_VERSIONS: [&str; 1] = ["minimesh.io/v1alpha1"];

/// Identity of an object: kind, namespace, name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectKey {
    /// `DestinationRule` (minimesh's), [`ISTIO_RULE_KIND`], `Service`,
    /// `EndpointSlice`, `PeerAuthentication`, `Pod`, `VirtualService`
    /// (minimesh's), [`ISTIO_VIRTUAL_SERVICE_KIND`], `Gateway` (Istio's),
    /// `HTTPRoute` or [`K8S_GATEWAY_KIND`].
    pub kind: &'static str,
    /// Namespace (`default` when unset).
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

/// A valid DestinationRule with its resolved settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRule {
    /// The rule as written.
    pub rule: DestinationRule,
    /// Settings resolved from it.
    pub resolved: Resolved,
    /// Fields accepted without effect yet.
    pub warnings: Vec<String>,
    /// Its subsets.
    pub subsets: Vec<rule::Subset>,
}

/// A valid object of one of the kinds minimesh reads.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    /// A DestinationRule.
    Rule(Arc<ValidRule>),
    /// A Service.
    Service(Arc<Service>),
    /// An EndpointSlice.
    Slice(Arc<EndpointSlice>),
    /// A PeerAuthentication, with the mode it sets.
    PeerAuth(Arc<PeerAuthentication>, MtlsMode),
    /// A Pod.
    Pod(Arc<Pod>),
    /// A VirtualService.
    VirtualService(Arc<ValidVirtualService>),
    /// Istio's Gateway.
    Gateway(Arc<ValidGateway>),
    /// The Gateway API's HTTPRoute.
    HttpRoute(Arc<gateway_api::ValidHttpRoute>),
    /// The Gateway API's Gateway: minimesh's class, or another's (None).
    K8sGateway(Option<Arc<gateway_api::ValidGateway>>),
    /// An AuthorizationPolicy, as the sidecars enforce it.
    Authorization(Arc<minimesh_proto::v1::Authorization>),
}

/// The kind of the Gateway API's Gateway among minimesh's object keys
/// (Istio's is `Gateway`).
pub const K8S_GATEWAY_KIND: &str = "Gateway.gateway.networking.k8s.io";

/// One document of a file, parsed.
#[derive(Clone, Debug)]
pub struct Document {
    /// The object's identity, when the document got far enough to have one.
    pub key: Option<ObjectKey>,
    /// The object, or why it was rejected.
    pub result: Result<Object, ConfigError>,
    /// The document as read (JSON data model), for tools that store it again.
    pub raw: serde_json::Value,
}

/// What reading a file produced: its documents, and notes (ignored kinds).
#[derive(Clone, Debug, Default)]
pub struct Parsed {
    /// Documents of the kinds minimesh reads.
    pub documents: Vec<Document>,
    /// Documents skipped on purpose (other kinds), one line each.
    pub ignored: Vec<String>,
}

/// Parses every YAML document of a file. Err means the file as a whole could
/// not be read (bad YAML, too large); a bad document inside a good file is an
/// `Err` result in its [`Document`].
/// `default_namespace` is the namespace of objects that name none (as
/// kubectl's context namespace).
pub fn parse_documents(
    file: &Path,
    text: &str,
    default_namespace: &str,
) -> Result<Parsed, ConfigError> {
    let whole = |reason: String| ConfigError {
        file: file.to_path_buf(),
        object: None,
        field: None,
        reason,
    };
    if text.len() > MAX_FILE_BYTES {
        return Err(whole(format!(
            "file is {} bytes, more than the {MAX_FILE_BYTES} minimesh reads",
            text.len()
        )));
    }
    // YAML 1.2 booleans only: `n` or `on` stay strings, as a name or label
    // value should. And a budget, so that anchors and aliases cannot expand
    // a small file into a large one ("billion laughs").
    let options = serde_saphyr::options! {
        strict_booleans: true,
        budget: serde_saphyr::budget! {
            max_total_scalar_bytes: MAX_FILE_BYTES,
            max_nodes: MAX_NODES,
            max_aliases: MAX_ALIASES,
            max_depth: MAX_DEPTH,
        },
    };
    let values: Vec<serde_json::Value> = serde_saphyr::from_multiple_with_options(text, options)
        .map_err(|e| whole(yaml_error(&e)))?;
    let mut parsed = Parsed::default();
    for (i, value) in values.into_iter().enumerate() {
        parse_value(file, i, value, default_namespace, &mut parsed, 0);
    }
    Ok(parsed)
}

/// Parses one object already decoded (from the Kubernetes API): the same
/// checks as a document of a file, with `origin` in place of the file name.
/// None for kinds minimesh does not read.
pub fn parse_object(
    origin: &Path,
    value: serde_json::Value,
    default_namespace: &str,
) -> Option<Document> {
    let mut parsed = Parsed::default();
    parse_value(origin, 0, value, default_namespace, &mut parsed, 1);
    parsed.documents.pop()
}

/// What a file's YAML expands to at most: strings (counting each alias
/// of one again), nodes, aliases and nesting. Config files come nowhere
/// near; these bound what a file made to expand can make us allocate.
const MAX_NODES: usize = 250_000;
const MAX_ALIASES: usize = 1_000;
const MAX_DEPTH: usize = 64;

/// The parser's error as a reason: its first line, or for a file that
/// expands beyond the budget, which limit and why.
fn yaml_error(e: &serde_saphyr::Error) -> String {
    use serde_saphyr::budget::BudgetBreach;
    let mut inner = e;
    while let serde_saphyr::Error::AliasError { error, .. }
    | serde_saphyr::Error::WithSnippet { error, .. } = inner
    {
        inner = error;
    }
    let serde_saphyr::Error::Budget { breach, .. } = inner else {
        return format!("invalid YAML: {}", first_line(&e.to_string()));
    };
    let what = match breach {
        BudgetBreach::ScalarBytes { .. } => {
            format!("more than {} MiB of strings", MAX_FILE_BYTES >> 20)
        }
        BudgetBreach::Nodes { .. } => format!("more than {MAX_NODES} nodes"),
        BudgetBreach::Aliases { .. } => format!("more than {MAX_ALIASES} aliases"),
        BudgetBreach::Depth { .. } => format!("nesting deeper than {MAX_DEPTH}"),
        other => format!("beyond the parser's limits ({other:?})"),
    };
    let at = e
        .location()
        .map(|l| format!(" by line {}", l.line()))
        .unwrap_or_default();
    format!(
        "the YAML expands to {what}{at} (an alias counts each time it is used); \
         minimesh reads no more"
    )
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).trim().to_string()
}

fn parse_value(
    file: &Path,
    index: usize,
    value: serde_json::Value,
    default_ns: &str,
    out: &mut Parsed,
    depth: u8,
) {
    if value.is_null() {
        return;
    }
    let err = |object: Option<String>, field: Option<String>, reason: String| ConfigError {
        file: file.to_path_buf(),
        object,
        field,
        reason,
    };
    let Some(map) = value.as_object() else {
        out.documents.push(Document {
            key: None,
            result: Err(err(
                None,
                None,
                format!(
                    "document {} is not a mapping with apiVersion and kind",
                    index + 1
                ),
            )),
            raw: value,
        });
        return;
    };
    let api_version = map.get("apiVersion").and_then(|v| v.as_str()).unwrap_or("");
    let kind = map.get("kind").and_then(|v| v.as_str()).unwrap_or("");
    let meta = map.get("metadata");
    let name = meta
        .and_then(|m| m.get("name"))
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    let namespace = meta
        .and_then(|m| m.get("namespace"))
        .and_then(|v| v.as_str())
        .filter(|s| !s.is_empty())
        .unwrap_or(default_ns)
        .to_string();
    let (kind_static, expected): (&'static str, &[&str]) = match kind {
        // Istio's rules and minimesh's are different objects: a same-named
        // pair (the migration path: copy Istio's, change its apiVersion)
        // must not be taken for one.
        "DestinationRule" if api_version.starts_with("networking.istio.io/") => {
            (ISTIO_RULE_KIND, &RULE_API_VERSIONS)
        }
        "DestinationRule" => ("DestinationRule", &RULE_API_VERSIONS),
        "Service" => ("Service", &["v1"]),
        "EndpointSlice" => ("EndpointSlice", &["discovery.k8s.io/v1"]),
        "PeerAuthentication" => ("PeerAuthentication", &PEER_AUTH_API_VERSIONS),
        "AuthorizationPolicy" if api_version.starts_with("security.istio.io/") => {
            (ISTIO_AUTHZ_KIND, &AUTHZ_API_VERSIONS)
        }
        "AuthorizationPolicy" => ("AuthorizationPolicy", &AUTHZ_API_VERSIONS),
        "Pod" => ("Pod", &["v1"]),
        "VirtualService" if api_version.starts_with("minimesh.io/") => {
            ("VirtualService", &MESH_VIRTUAL_SERVICE_API_VERSIONS)
        }
        "VirtualService" => (ISTIO_VIRTUAL_SERVICE_KIND, &VIRTUAL_SERVICE_API_VERSIONS),
        // Istio's; the Gateway API's (gateway.networking.k8s.io) is not read yet.
        "Gateway" if api_version.starts_with("networking.istio.io/") => {
            ("Gateway", &GATEWAY_API_VERSIONS)
        }
        "Gateway" if api_version.starts_with("gateway.networking.k8s.io/") => {
            (K8S_GATEWAY_KIND, &K8S_GATEWAY_API_VERSIONS)
        }
        "HTTPRoute" => ("HTTPRoute", &K8S_GATEWAY_API_VERSIONS),
        "List" if api_version == "v1" && depth == 0 => {
            if let Some(items) = map.get("items").and_then(|i| i.as_array()) {
                for item in items.clone() {
                    parse_value(file, index, item, default_ns, out, depth + 1);
                }
            }
            return;
        }
        "" => {
            out.documents.push(Document {
                key: None,
                result: Err(err(
                    None,
                    Some("kind".into()),
                    format!("document {} has no kind", index + 1),
                )),
                raw: value.clone(),
            });
            return;
        }
        other => {
            out.ignored.push(format!(
                "{}: {other} {namespace}/{name} ({api_version}): not a kind minimesh reads (DestinationRule, VirtualService, Gateway, HTTPRoute, Service, EndpointSlice, PeerAuthentication, AuthorizationPolicy, Pod); ignored",
                file.display()
            ));
            return;
        }
    };
    // Named as written (`DestinationRule`, not the key of Istio's).
    let object = format!("{kind} {namespace}/{name}");
    let key = ObjectKey {
        kind: kind_static,
        namespace,
        name: name.clone(),
    };
    if !expected.contains(&api_version) {
        out.documents.push(Document {
            key: Some(key),
            result: Err(err(
                Some(object),
                Some("apiVersion".into()),
                format!(
                    "{api_version:?} is not a supported version of {kind_static} (expected {})",
                    expected.join(", ")
                ),
            )),
            raw: value.clone(),
        });
        return;
    }
    if name.is_empty() {
        out.documents.push(Document {
            key: None,
            result: Err(err(
                Some(object),
                Some("metadata.name".into()),
                "is required".into(),
            )),
            raw: value.clone(),
        });
        return;
    }
    let raw = value.clone();
    let result = match kind_static {
        "DestinationRule" | ISTIO_RULE_KIND => typed::<DestinationRule>(value).and_then(|r| {
            let (resolved, warnings) =
                rule::validate(&r.spec).map_err(|e| (Some(e.field), e.reason))?;
            let subsets = rule::subsets(&r.spec.subsets).map_err(|e| (Some(e.field), e.reason))?;
            Ok(Object::Rule(Arc::new(ValidRule {
                rule: r,
                resolved,
                warnings,
                subsets,
            })))
        }),
        "Service" => typed::<Service>(value).map(|s| Object::Service(Arc::new(s))),
        "AuthorizationPolicy" | ISTIO_AUTHZ_KIND => {
            typed::<AuthorizationPolicy>(value).and_then(|p| {
                let policy = p
                    .validate(&key.namespace, ROOT_NAMESPACE)
                    .map_err(|(field, reason)| (Some(field), reason))?;
                Ok(Object::Authorization(Arc::new(policy)))
            })
        }
        "PeerAuthentication" => typed::<PeerAuthentication>(value).and_then(|p| {
            let mode = p.mode().map_err(|(field, reason)| (Some(field), reason))?;
            Ok(Object::PeerAuth(Arc::new(p), mode))
        }),
        "Pod" => typed::<Pod>(value).map(|p| Object::Pod(Arc::new(p))),
        "VirtualService" | ISTIO_VIRTUAL_SERVICE_KIND => {
            typed::<VirtualService>(value).and_then(|v| {
                let valid = virtual_service::validate(v, &key.namespace)
                    .map_err(|(field, reason)| (Some(field), reason))?;
                Ok(Object::VirtualService(Arc::new(valid)))
            })
        }
        K8S_GATEWAY_KIND => typed::<gateway_api::Gateway>(value).and_then(|g| {
            let valid = gateway_api::validate_gateway(&g)
                .map_err(|(field, reason)| (Some(field), reason))?;
            Ok(Object::K8sGateway(valid.map(Arc::new)))
        }),
        "HTTPRoute" => typed::<gateway_api::HttpRoute>(value).and_then(|r| {
            let valid = gateway_api::validate_route(&r, &key.namespace)
                .map_err(|(field, reason)| (Some(field), reason))?;
            Ok(Object::HttpRoute(Arc::new(valid)))
        }),
        "Gateway" => typed::<Gateway>(value).and_then(|g| {
            let valid = istio_gateway::validate(g, &key.namespace)
                .map_err(|(field, reason)| (Some(field), reason))?;
            Ok(Object::Gateway(Arc::new(valid)))
        }),
        _ => typed::<EndpointSlice>(value)
            .and_then(validate_slice)
            .map(|s| Object::Slice(Arc::new(s))),
    };
    out.documents.push(Document {
        key: Some(key),
        result: result.map_err(|(field, reason)| err(Some(object), field, reason)),
        raw,
    });
}

type FieldResult<T> = Result<T, (Option<String>, String)>;

fn typed<T: DeserializeOwned>(value: serde_json::Value) -> FieldResult<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let field = (path != ".").then_some(path);
        (field, e.into_inner().to_string())
    })
}

fn validate_slice(s: EndpointSlice) -> FieldResult<EndpointSlice> {
    if s.service_name().is_none() {
        return Err((
            Some(format!(
                "metadata.labels[{:?}]",
                super::kube::SERVICE_NAME_LABEL
            )),
            "is required: it names the Service the slice belongs to".into(),
        ));
    }
    for (i, ep) in s.endpoints.iter().enumerate() {
        for (j, a) in ep.addresses.iter().enumerate() {
            if a.parse::<std::net::IpAddr>().is_err() {
                return Err((
                    Some(format!("endpoints[{i}].addresses[{j}]")),
                    format!("{a:?} is not an IP address"),
                ));
            }
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Result<Object, ConfigError> {
        let mut p = parse_documents(Path::new("r.yaml"), text, "default").expect("file parses");
        assert_eq!(p.documents.len(), 1);
        p.documents.remove(0).result
    }

    #[test]
    fn yaml_that_expands_past_the_budget_is_refused_with_the_limit() {
        let head = "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: x}\nspec: {host: b}\n";
        // Nine levels of nine aliases: 387 million nodes from 600 bytes.
        let mut laughs = String::from(head);
        laughs.push_str("l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
        for i in 1..9 {
            let p = i - 1;
            let row = vec![format!("*l{p}"); 9].join(", ");
            laughs.push_str(&format!("l{i}: &l{i} [{row}]\n"));
        }
        let e = parse_documents(Path::new("r.yaml"), &laughs, "default").unwrap_err();
        assert_eq!(
            e.to_string(),
            "r.yaml: the YAML expands to more than 250000 nodes by line 10 \
             (an alias counts each time it is used); minimesh reads no more"
        );
        // One 512 KiB string, aliased 9 times: 5 MiB of strings from a
        // file well under the size limit.
        let big = format!(
            "{head}s: &s {}\nt: [{}]\n",
            "x".repeat(512 << 10),
            ["*s"; 9].join(", ")
        );
        let e = parse_documents(Path::new("r.yaml"), &big, "default").unwrap_err();
        assert!(
            e.reason
                .starts_with("the YAML expands to more than 4 MiB of strings by line"),
            "{}",
            e.reason
        );
        // Aliases themselves are fine within the budget.
        let fine = format!("{head}a: &a [1, 2]\nb: [*a, *a]\n");
        assert!(parse_documents(Path::new("r.yaml"), &fine, "default").is_ok());
    }

    #[test]
    fn bad_policy_names_field_and_reason() {
        let e = one(
            "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: x}\nspec:\n  host: b\n  trafficPolicy:\n    loadBalancer:\n      simple: ROUND_ROBBIN\n",
        )
        .unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("spec.trafficPolicy.loadBalancer.simple")
        );
        assert!(
            e.reason.contains("unknown variant `ROUND_ROBBIN`"),
            "{}",
            e.reason
        );
        assert_eq!(e.object.as_deref(), Some("DestinationRule default/x"));
    }

    #[test]
    fn unknown_field_is_rejected() {
        let e = one(
            "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: x, namespace: n}\nspec:\n  host: b\n  trafficPolicy:\n    loadBalancr: {}\n",
        )
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.trafficPolicy.loadBalancr"));
        assert!(e.reason.contains("unknown field"), "{}", e.reason);
    }

    #[test]
    fn other_kinds_are_ignored_and_bad_yaml_is_a_file_error() {
        let p = parse_documents(
            Path::new("d.yaml"),
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n",
            "default",
        )
        .expect("parses");
        assert!(p.documents.is_empty());
        assert_eq!(p.ignored.len(), 1);
        let e = parse_documents(Path::new("d.yaml"), "a: [1, 2\n", "default").unwrap_err();
        assert!(e.reason.starts_with("invalid YAML"), "{}", e.reason);
        eprintln!("{e}");
    }
}
