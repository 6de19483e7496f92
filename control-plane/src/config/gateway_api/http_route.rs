//! The Gateway API's `HTTPRoute`, as written.

use serde::Deserialize;
use serde_json::Value;

use crate::config::kube::ObjectMeta;

/// `HTTPRoute`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRoute {
    /// `gateway.networking.k8s.io/v1`.
    pub api_version: String,
    /// `HTTPRoute`.
    pub kind: String,
    /// Name, namespace, creation time.
    pub metadata: ObjectMeta,
    /// Its parents and rules.
    pub spec: HttpRouteSpec,
}

/// `HTTPRoute.spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRouteSpec {
    /// Where it attaches: Gateways, or Services (mesh).
    #[serde(default)]
    pub parent_refs: Vec<ParentRef>,
    /// The hosts it routes at a Gateway.
    #[serde(default)]
    pub hostnames: Vec<String>,
    /// The rules.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// `parentRefs[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentRef {
    /// `gateway.networking.k8s.io` (default) or `""` for a Service.
    #[serde(default)]
    pub group: Option<String>,
    /// `Gateway` (default) or `Service`.
    #[serde(default)]
    pub kind: Option<String>,
    /// The parent's name.
    pub name: String,
    /// Its namespace (default: the route's).
    #[serde(default)]
    pub namespace: Option<String>,
    /// A Gateway's listener.
    #[serde(default)]
    pub section_name: Option<String>,
    /// A port of the parent.
    #[serde(default)]
    pub port: Option<u32>,
}

/// `rules[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    /// A name for status and logs.
    #[serde(default)]
    pub name: Option<String>,
    /// Any of these (none: every request, `PathPrefix /`).
    #[serde(default)]
    pub matches: Vec<Match>,
    /// Request and response changes.
    #[serde(default)]
    pub filters: Vec<Filter>,
    /// Where requests go, by weight.
    #[serde(default)]
    pub backend_refs: Vec<BackendRef>,
    /// `request`, `backendRequest`.
    #[serde(default)]
    pub timeouts: Option<Timeouts>,
    /// Not implemented.
    #[serde(default)]
    pub retry: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub session_persistence: Option<Value>,
}

/// `matches[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    /// `type` (`PathPrefix` default, `Exact`, `RegularExpression`), `value`.
    #[serde(default)]
    pub path: Option<TypedValue>,
    /// `type` (`Exact` default, `RegularExpression`), `name`, `value`.
    #[serde(default)]
    pub headers: Vec<NamedMatch>,
    /// As headers.
    #[serde(default)]
    pub query_params: Vec<NamedMatch>,
    /// The method.
    #[serde(default)]
    pub method: Option<String>,
}

/// A path match.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypedValue {
    /// Its type.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Its value.
    #[serde(default)]
    pub value: Option<String>,
}

/// A header or query match.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedMatch {
    /// Its type.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The name.
    pub name: String,
    /// The value.
    pub value: String,
}

/// `filters[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Filter {
    /// `RequestHeaderModifier`, `ResponseHeaderModifier`, `URLRewrite`,
    /// `RequestRedirect` (others refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// Its settings.
    #[serde(default)]
    pub request_header_modifier: Option<HeaderModifier>,
    /// Its settings.
    #[serde(default)]
    pub response_header_modifier: Option<HeaderModifier>,
    /// Its settings.
    #[serde(default)]
    pub url_rewrite: Option<UrlRewrite>,
    /// Its settings.
    #[serde(default)]
    pub request_redirect: Option<RequestRedirect>,
    /// Not implemented.
    #[serde(default)]
    pub request_mirror: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub extension_ref: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub cors: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub external_auth: Option<Value>,
}

/// `set`, `add`, `remove`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderModifier {
    /// Replace.
    #[serde(default)]
    pub set: Vec<NameValue>,
    /// Append.
    #[serde(default)]
    pub add: Vec<NameValue>,
    /// Remove.
    #[serde(default)]
    pub remove: Vec<String>,
}

/// A header.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NameValue {
    /// Name.
    pub name: String,
    /// Value.
    pub value: String,
}

/// `urlRewrite`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UrlRewrite {
    /// The Host sent upstream.
    #[serde(default)]
    pub hostname: Option<String>,
    /// The path sent upstream.
    #[serde(default)]
    pub path: Option<PathModifier>,
}

/// `path` of a rewrite or redirect.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PathModifier {
    /// `ReplaceFullPath` or `ReplacePrefixMatch`.
    #[serde(rename = "type")]
    pub kind: String,
    /// For `ReplaceFullPath`.
    #[serde(default)]
    pub replace_full_path: Option<String>,
    /// For `ReplacePrefixMatch`.
    #[serde(default)]
    pub replace_prefix_match: Option<String>,
}

/// `requestRedirect`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestRedirect {
    /// `http` or `https`.
    #[serde(default)]
    pub scheme: Option<String>,
    /// The host.
    #[serde(default)]
    pub hostname: Option<String>,
    /// The path.
    #[serde(default)]
    pub path: Option<PathModifier>,
    /// The port.
    #[serde(default)]
    pub port: Option<u32>,
    /// 301 (default) or 302 (303, 307, 308 too).
    #[serde(default)]
    pub status_code: Option<u32>,
}

/// `backendRefs[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendRef {
    /// `""` (default).
    #[serde(default)]
    pub group: Option<String>,
    /// `Service` (default).
    #[serde(default)]
    pub kind: Option<String>,
    /// The Service.
    pub name: String,
    /// Its namespace (default: the route's).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Its port (required for a Service).
    #[serde(default)]
    pub port: Option<u32>,
    /// Share (default 1).
    #[serde(default)]
    pub weight: Option<u32>,
    /// Not implemented.
    #[serde(default)]
    pub filters: Option<Value>,
}

/// `timeouts`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Timeouts {
    /// The whole request.
    #[serde(default)]
    pub request: Option<String>,
    /// Each attempt.
    #[serde(default)]
    pub backend_request: Option<String>,
}
