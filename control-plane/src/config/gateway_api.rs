//! The Kubernetes Gateway API (`gateway.networking.k8s.io/v1`): `HTTPRoute`
//! read into the route model, attached to a Service (mesh traffic, as
//! GAMMA defines) or to a `Gateway` (the ingress) of class `minimesh`.
//! What minimesh does not implement (mirrors, CORS, extension filters,
//! backend filters, other kinds of backends and parents) is refused,
//! naming the field.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::gateway::is_host_name;
use super::kube::ObjectMeta;
use super::route::{
    self, Backend, HeaderMatch, HeaderOps, Redirect, Rewrite, RouteAction, RouteMatch,
};
use super::virtual_service::check_regex;

/// The API versions read.
pub const GATEWAY_API_VERSIONS: [&str; 2] = [
    "gateway.networking.k8s.io/v1",
    "gateway.networking.k8s.io/v1beta1",
];

/// The GatewayClass whose Gateways minimesh's gateways serve.
pub const GATEWAY_CLASS: &str = "minimesh";

/// The label a gateway carries (`--labels`) to serve the Gateway API
/// Gateway of that name (in its namespace), as Istio's deployed gateways.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

/// `Gateway` (the Gateway API's).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gateway {
    /// `gateway.networking.k8s.io/v1`.
    pub api_version: String,
    /// `Gateway`.
    pub kind: String,
    /// Name, namespace.
    pub metadata: ObjectMeta,
    /// Its class and listeners.
    pub spec: GatewaySpec,
}

/// `Gateway.spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewaySpec {
    /// `minimesh` for minimesh's; others are another controller's.
    pub gateway_class_name: String,
    /// Its listeners.
    #[serde(default)]
    pub listeners: Vec<Listener>,
    /// Not implemented.
    #[serde(default)]
    pub addresses: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub infrastructure: Option<Value>,
}

/// `spec.listeners[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Listener {
    /// Its name (routes' `sectionName`).
    pub name: String,
    /// Hosts it takes: exact or `*.suffix`; none: any.
    #[serde(default)]
    pub hostname: Option<String>,
    /// The port.
    pub port: u32,
    /// `HTTP` (others refused).
    pub protocol: String,
    /// Not implemented.
    #[serde(default)]
    pub tls: Option<Value>,
    /// Which namespaces' routes may attach: `Same` (default) or `All`.
    #[serde(default)]
    pub allowed_routes: Option<AllowedRoutes>,
}

/// `allowedRoutes`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedRoutes {
    /// `from`.
    #[serde(default)]
    pub namespaces: Option<RouteNamespaces>,
    /// Not implemented (HTTPRoute only).
    #[serde(default)]
    pub kinds: Option<Value>,
}

/// `allowedRoutes.namespaces`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteNamespaces {
    /// `Same`, `All` (`Selector` refused).
    #[serde(default)]
    pub from: Option<String>,
    /// Not implemented.
    #[serde(default)]
    pub selector: Option<Value>,
}

/// A Gateway minimesh serves.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidGateway {
    /// Its listeners: (name, port, hostname pattern or None, all namespaces).
    pub listeners: Vec<(String, u32, Option<String>, bool)>,
}

/// Why an object is refused: the field and the reason.
pub type Refusal = (String, String);

fn not_yet(field: String, what: &str, kind: &str) -> Refusal {
    (
        field,
        format!("{what} is not implemented yet; this {kind} is not applied"),
    )
}

/// Checks a Gateway of class `minimesh` (`Ok(None)`: another class's).
pub fn validate_gateway(g: &Gateway) -> Result<Option<ValidGateway>, Refusal> {
    if g.spec.gateway_class_name != GATEWAY_CLASS {
        return Ok(None);
    }
    let k = "Gateway";
    if g.spec.addresses.is_some() {
        return Err(not_yet("spec.addresses".into(), "requesting addresses", k));
    }
    if g.spec.infrastructure.is_some() {
        return Err(not_yet(
            "spec.infrastructure".into(),
            "infrastructure settings",
            k,
        ));
    }
    let mut listeners = Vec::new();
    for (i, l) in g.spec.listeners.iter().enumerate() {
        let at = format!("spec.listeners[{i}]");
        if l.protocol != "HTTP" {
            return Err(not_yet(
                format!("{at}.protocol"),
                &format!("serving {}", l.protocol),
                k,
            ));
        }
        if l.tls.is_some() {
            return Err(not_yet(format!("{at}.tls"), "TLS at the gateway", k));
        }
        if l.port == 0 || l.port > 65535 {
            return Err((format!("{at}.port"), format!("{} is not a port", l.port)));
        }
        if let Some(h) = l.hostname.as_deref().filter(|h| !is_host_name(h, true)) {
            return Err((
                format!("{at}.hostname"),
                format!("{h:?} is not a host name or *.suffix"),
            ));
        }
        let all = match l
            .allowed_routes
            .as_ref()
            .and_then(|a| a.namespaces.as_ref())
        {
            None => false,
            Some(n) if n.selector.is_some() => {
                return Err(not_yet(
                    format!("{at}.allowedRoutes.namespaces.selector"),
                    "selecting namespaces by label",
                    k,
                ))
            }
            Some(n) => match n.from.as_deref() {
                None | Some("Same") => false,
                Some("All") => true,
                Some(other) => {
                    return Err(not_yet(
                        format!("{at}.allowedRoutes.namespaces.from"),
                        &format!("allowing routes from {other:?}"),
                        k,
                    ))
                }
            },
        };
        listeners.push((
            l.name.clone(),
            l.port,
            l.hostname.as_ref().map(|h| h.to_ascii_lowercase()),
            all,
        ));
    }
    Ok(Some(ValidGateway { listeners }))
}

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

/// Where a route attaches.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Parent {
    /// A Service's traffic from the sidecars (name, namespace), one port or all.
    Service((String, String), Option<u32>),
    /// A Gateway (namespace, name) of the Gateway API, one listener or all.
    Gateway((String, String), Option<String>, Option<u32>),
}

/// An HTTPRoute minimesh applies.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidHttpRoute {
    /// Its parents.
    pub parents: Vec<Parent>,
    /// Its hostnames (lower case).
    pub hostnames: Vec<String>,
    /// Its routes, one per match, with the Gateway API's precedence key.
    pub routes: Vec<(Precedence, route::HttpRoute)>,
    /// `metadata.creationTimestamp`.
    pub created: String,
}

/// The Gateway API's order between matches: exact paths, then longer
/// prefixes, then those with a method, more headers, more query
/// parameters; then older routes, then by namespace/name, then in order.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Precedence {
    path_kind: u8,
    longer_prefix: std::cmp::Reverse<usize>,
    no_method: bool,
    more_headers: std::cmp::Reverse<usize>,
    more_query: std::cmp::Reverse<usize>,
    /// Then: creation time, `namespace/name`, rule index, match index.
    pub tie: (String, String, usize, usize),
}

fn duration(s: &str, at: &str) -> Result<Duration, Refusal> {
    // The Gateway API's duration: `1h`, `10s`, `500ms`, combinations.
    minimesh_proto::duration::parse(s).map_err(|e| (at.into(), e))
}

/// Checks `r` (of `namespace`) and reads its routes.
pub fn validate_route(r: &HttpRoute, namespace: &str) -> Result<ValidHttpRoute, Refusal> {
    let k = "HTTPRoute";
    if r.spec.parent_refs.is_empty() {
        return Err((
            "spec.parentRefs".into(),
            "names no parent (a Gateway, or a Service for mesh traffic)".into(),
        ));
    }
    let mut parents = Vec::new();
    for (i, p) in r.spec.parent_refs.iter().enumerate() {
        let at = format!("spec.parentRefs[{i}]");
        let ns = p.namespace.clone().unwrap_or_else(|| namespace.to_string());
        let group = p.group.as_deref().unwrap_or("gateway.networking.k8s.io");
        match (group, p.kind.as_deref().unwrap_or("Gateway")) {
            ("", "Service") | ("core", "Service") => {
                if p.section_name.is_some() {
                    return Err(not_yet(
                        format!("{at}.sectionName"),
                        "a Service parent's sectionName",
                        k,
                    ));
                }
                parents.push(Parent::Service((p.name.clone(), ns), p.port))
            }
            ("gateway.networking.k8s.io", "Gateway") => parents.push(Parent::Gateway(
                (ns, p.name.clone()),
                p.section_name.clone(),
                p.port,
            )),
            (g, kind) => {
                return Err(not_yet(
                    format!("{at}.kind"),
                    &format!("attaching to a {kind} of group {g:?}"),
                    k,
                ))
            }
        }
    }
    let mut hostnames = Vec::new();
    for (i, h) in r.spec.hostnames.iter().enumerate() {
        if !is_host_name(h, true) {
            return Err((
                format!("spec.hostnames[{i}]"),
                format!("{h:?} is not a host name or *.suffix"),
            ));
        }
        if h.starts_with("*.") {
            return Err(not_yet(
                format!("spec.hostnames[{i}]"),
                "a wildcard hostname",
                k,
            ));
        }
        hostnames.push(h.to_ascii_lowercase());
    }
    let who = format!("{namespace}/{}", r.metadata.name);
    let created = r.metadata.creation_timestamp.clone().unwrap_or_default();
    let mut routes = Vec::new();
    for (ri, rule) in r.spec.rules.iter().enumerate() {
        let at = format!("spec.rules[{ri}]");
        if rule.retry.is_some() {
            return Err(not_yet(format!("{at}.retry"), "a rule's retry", k));
        }
        if rule.session_persistence.is_some() {
            return Err(not_yet(
                format!("{at}.sessionPersistence"),
                "session persistence",
                k,
            ));
        }
        let base = rule_route(rule, &at, namespace)?;
        let label = rule.name.clone().unwrap_or_else(|| ri.to_string());
        let matches = if rule.matches.is_empty() {
            vec![Match::default()]
        } else {
            rule.matches.clone()
        };
        for (mi, m) in matches.iter().enumerate() {
            let (model, prec) = route_match(m, &format!("{at}.matches[{mi}]"))?;
            let mut one = base.clone();
            one.name = format!("HTTPRoute/{who}/{label}");
            // A prefix rewrite replaces what this match's prefix matched.
            one.matches = vec![model];
            routes.push((
                Precedence {
                    tie: (created.clone(), who.clone(), ri, mi),
                    ..prec
                },
                one,
            ));
        }
    }
    routes.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(ValidHttpRoute {
        parents,
        hostnames,
        routes,
        created,
    })
}

fn route_match(m: &Match, at: &str) -> Result<(RouteMatch, Precedence), Refusal> {
    let (path, path_kind, len) = match &m.path {
        None => (route::StringMatch::PathPrefix("/".into()), 1, 1),
        Some(p) => {
            let value = p.value.clone().unwrap_or_else(|| "/".into());
            if !value.starts_with('/') && p.kind.as_deref() != Some("RegularExpression") {
                return Err((
                    format!("{at}.path.value"),
                    format!("{value:?} does not start with /"),
                ));
            }
            match p.kind.as_deref().unwrap_or("PathPrefix") {
                "PathPrefix" => {
                    let n = value.trim_end_matches('/').len().max(1);
                    (route::StringMatch::PathPrefix(value), 1, n)
                }
                "Exact" => (route::StringMatch::Exact(value), 0, 0),
                "RegularExpression" => {
                    check_regex(&value, &format!("{at}.path.value"))?;
                    (route::StringMatch::Regex(value), 2, 0)
                }
                t => {
                    return Err((
                        format!("{at}.path.type"),
                        format!("{t:?} is not PathPrefix, Exact or RegularExpression"),
                    ))
                }
            }
        }
    };
    let named = |list: &[NamedMatch],
                 what: &str,
                 headers: bool|
     -> Result<Vec<(String, route::StringMatch)>, Refusal> {
        let mut out = Vec::new();
        for (i, h) in list.iter().enumerate() {
            let f = format!("{at}.{what}[{i}]");
            if headers && http::HeaderName::from_bytes(h.name.as_bytes()).is_err() {
                return Err((
                    format!("{f}.name"),
                    format!("{:?} is not a header name", h.name),
                ));
            }
            let v = match h.kind.as_deref().unwrap_or("Exact") {
                "Exact" => route::StringMatch::Exact(h.value.clone()),
                "RegularExpression" => {
                    check_regex(&h.value, &format!("{f}.value"))?;
                    route::StringMatch::Regex(h.value.clone())
                }
                t => {
                    return Err((
                        format!("{f}.type"),
                        format!("{t:?} is not Exact or RegularExpression"),
                    ))
                }
            };
            let name = if headers {
                h.name.to_ascii_lowercase()
            } else {
                h.name.clone()
            };
            out.push((name, v));
        }
        Ok(out)
    };
    let headers = named(&m.headers, "headers", true)?;
    let query = named(&m.query_params, "queryParams", false)?;
    if let Some(me) = m
        .method
        .as_deref()
        .filter(|me| http::Method::from_bytes(me.as_bytes()).is_err())
    {
        return Err((format!("{at}.method"), format!("{me:?} is not a method")));
    }
    let prec = Precedence {
        path_kind,
        longer_prefix: std::cmp::Reverse(len),
        no_method: m.method.is_none(),
        more_headers: std::cmp::Reverse(headers.len()),
        more_query: std::cmp::Reverse(query.len()),
        tie: Default::default(),
    };
    Ok((
        RouteMatch {
            path: Some(path),
            headers: headers
                .into_iter()
                .map(|(name, v)| HeaderMatch {
                    name,
                    value: Some(v),
                    invert: false,
                })
                .collect(),
            method: m.method.clone(),
            query: query.into_iter().map(|(n, v)| (n, Some(v))).collect(),
            port: None,
        },
        prec,
    ))
}

fn header_modifier(m: Option<&HeaderModifier>, at: &str) -> Result<HeaderOps, Refusal> {
    let Some(m) = m else {
        return Err((at.into(), "is required by the filter's type".into()));
    };
    let pairs = |l: &[NameValue], what: &str| -> Result<Vec<(String, String)>, Refusal> {
        l.iter()
            .enumerate()
            .map(|(i, h)| {
                let f = format!("{at}.{what}[{i}]");
                if http::HeaderName::from_bytes(h.name.as_bytes()).is_err()
                    || h.name.eq_ignore_ascii_case("host")
                {
                    return Err((
                        format!("{f}.name"),
                        format!("{:?} cannot be set here", h.name),
                    ));
                }
                if http::HeaderValue::from_str(&h.value).is_err() {
                    return Err((
                        format!("{f}.value"),
                        format!("{:?} is not a header value", h.value),
                    ));
                }
                Ok((h.name.to_ascii_lowercase(), h.value.clone()))
            })
            .collect()
    };
    Ok(HeaderOps {
        set: pairs(&m.set, "set")?,
        add: pairs(&m.add, "add")?,
        remove: m.remove.iter().map(|n| n.to_ascii_lowercase()).collect(),
    })
}

fn rule_route(rule: &Rule, at: &str, namespace: &str) -> Result<route::HttpRoute, Refusal> {
    let k = "HTTPRoute";
    let mut out = route::HttpRoute::default();
    let mut redirect = None;
    for (i, f) in rule.filters.iter().enumerate() {
        let fa = format!("{at}.filters[{i}]");
        match f.kind.as_str() {
            "RequestHeaderModifier" => {
                out.request_headers = header_modifier(
                    f.request_header_modifier.as_ref(),
                    &format!("{fa}.requestHeaderModifier"),
                )?
            }
            "ResponseHeaderModifier" => {
                out.response_headers = header_modifier(
                    f.response_header_modifier.as_ref(),
                    &format!("{fa}.responseHeaderModifier"),
                )?
            }
            "URLRewrite" => {
                let Some(u) = &f.url_rewrite else {
                    return Err((
                        format!("{fa}.urlRewrite"),
                        "is required by the filter's type".into(),
                    ));
                };
                let (prefix, path) =
                    path_modifier(u.path.as_ref(), &format!("{fa}.urlRewrite.path"))?;
                out.rewrite = Some(Rewrite {
                    prefix,
                    path,
                    authority: u.hostname.clone(),
                });
            }
            "RequestRedirect" => {
                let Some(r) = &f.request_redirect else {
                    return Err((
                        format!("{fa}.requestRedirect"),
                        "is required by the filter's type".into(),
                    ));
                };
                let (prefix, path) =
                    path_modifier(r.path.as_ref(), &format!("{fa}.requestRedirect.path"))?;
                let status = match r.status_code.unwrap_or(302) {
                    s @ (301 | 302 | 303 | 307 | 308) => s as u16,
                    s => {
                        return Err((
                            format!("{fa}.requestRedirect.statusCode"),
                            format!("{s} is not 301, 302, 303, 307 or 308"),
                        ))
                    }
                };
                if let Some(s) = r
                    .scheme
                    .as_deref()
                    .filter(|s| !matches!(*s, "http" | "https"))
                {
                    return Err((
                        format!("{fa}.requestRedirect.scheme"),
                        format!("{s:?} is not http or https"),
                    ));
                }
                redirect = Some(Redirect {
                    scheme: r.scheme.clone(),
                    host: r.hostname.clone(),
                    port: r.port,
                    path,
                    prefix,
                    status,
                });
            }
            other => {
                return Err(not_yet(
                    format!("{fa}.type"),
                    &format!("the {other} filter"),
                    k,
                ))
            }
        }
    }
    if let Some(t) = &rule.timeouts {
        if let Some(r) = &t.request {
            out.timeout = Some(duration(r, &format!("{at}.timeouts.request"))?);
        }
        if let Some(b) = &t.backend_request {
            out.retries = Some(route::RouteRetries {
                attempts: None,
                per_try_timeout: Some(duration(b, &format!("{at}.timeouts.backendRequest"))?),
                retry_on: None,
            });
        }
    }
    out.action = match redirect {
        Some(r) => {
            if !rule.backend_refs.is_empty() {
                return Err((
                    format!("{at}.backendRefs"),
                    "a rule that redirects names no backend".into(),
                ));
            }
            RouteAction::Redirect(r)
        }
        None => {
            let mut backends = Vec::new();
            for (i, b) in rule.backend_refs.iter().enumerate() {
                let f = format!("{at}.backendRefs[{i}]");
                if b.filters.is_some() {
                    return Err(not_yet(
                        format!("{f}.filters"),
                        "a backend's own filters",
                        k,
                    ));
                }
                match (
                    b.group.as_deref().unwrap_or(""),
                    b.kind.as_deref().unwrap_or("Service"),
                ) {
                    ("" | "core", "Service") => {}
                    (g, kind) => {
                        return Err(not_yet(
                            format!("{f}.kind"),
                            &format!("a backend of kind {kind} in group {g:?}"),
                            k,
                        ))
                    }
                }
                let Some(port) = b.port.filter(|p| (1..=65535).contains(p)) else {
                    return Err((
                        format!("{f}.port"),
                        "a Service backend needs its port".into(),
                    ));
                };
                backends.push(Backend {
                    service: (
                        b.name.clone(),
                        b.namespace.clone().unwrap_or_else(|| namespace.to_string()),
                    ),
                    port: Some(port),
                    subset: None,
                    weight: b.weight.unwrap_or(1),
                    ..Default::default()
                });
            }
            if backends.is_empty() {
                // No backend: every request answered 500, as the spec says.
                RouteAction::Direct(500)
            } else {
                RouteAction::Forward(backends)
            }
        }
    };
    Ok(out)
}

/// A `path` modifier: (prefix replacement, full path).
fn path_modifier(
    p: Option<&PathModifier>,
    at: &str,
) -> Result<(Option<String>, Option<String>), Refusal> {
    let Some(p) = p else {
        return Ok((None, None));
    };
    match p.kind.as_str() {
        "ReplaceFullPath" => Ok((
            None,
            Some(p.replace_full_path.clone().unwrap_or_else(|| "/".into())),
        )),
        "ReplacePrefixMatch" => Ok((
            Some(p.replace_prefix_match.clone().unwrap_or_else(|| "/".into())),
            None,
        )),
        t => Err((
            format!("{at}.type"),
            format!("{t:?} is not ReplaceFullPath or ReplacePrefixMatch"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(spec: &str) -> Result<ValidHttpRoute, Refusal> {
        let text = format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: web, namespace: default}}\nspec:\n{spec}"
        );
        let r: HttpRoute = serde_saphyr::from_str(&text).expect("YAML");
        validate_route(&r, "default")
    }

    #[test]
    fn matches_are_ordered_as_the_gateway_api_says_not_as_written() {
        let r = route("  parentRefs: [{group: \"\", kind: Service, name: web, port: 80}]\n  rules:\n  - backendRefs: [{name: web-v1, port: 80}]\n  - matches: [{path: {type: PathPrefix, value: /api}}]\n    backendRefs: [{name: web-v2, port: 80, weight: 3}]\n  - matches: [{path: {type: Exact, value: /api/login}}, {headers: [{name: X-Canary, value: \"yes\"}]}]\n    backendRefs: [{name: web-v2, port: 80}]\n")
            .expect("valid");
        assert_eq!(
            r.parents,
            [Parent::Service(("web".into(), "default".into()), Some(80))]
        );
        let order: Vec<(String, Option<route::StringMatch>)> = r
            .routes
            .iter()
            .map(|(_, m)| (m.name.clone(), m.matches[0].path.clone()))
            .collect();
        assert_eq!(
            order,
            [
                (
                    "HTTPRoute/default/web/2".into(),
                    Some(route::StringMatch::Exact("/api/login".into()))
                ),
                (
                    "HTTPRoute/default/web/1".into(),
                    Some(route::StringMatch::PathPrefix("/api".into()))
                ),
                // `/` with a header before `/` without.
                (
                    "HTTPRoute/default/web/2".into(),
                    Some(route::StringMatch::PathPrefix("/".into()))
                ),
                (
                    "HTTPRoute/default/web/0".into(),
                    Some(route::StringMatch::PathPrefix("/".into()))
                ),
            ]
        );
        assert_eq!(r.routes[2].1.matches[0].headers[0].name, "x-canary");
    }

    #[test]
    fn filters_timeouts_and_refusals() {
        let r = route("  parentRefs: [{name: gw, sectionName: http}]\n  hostnames: [web.example.com]\n  rules:\n  - filters:\n    - {type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /}}}\n    - {type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: X-A, value: b}]}}\n    timeouts: {request: 500ms}\n    backendRefs: [{name: web, port: 80}]\n")
            .expect("valid");
        let (_, m) = &r.routes[0];
        assert_eq!(m.timeout, Some(Duration::from_millis(500)));
        assert_eq!(
            m.rewrite.as_ref().and_then(|w| w.prefix.as_deref()),
            Some("/")
        );
        assert_eq!(
            m.request_headers.set,
            [("x-a".to_string(), "b".to_string())]
        );
        assert_eq!(
            r.parents,
            [Parent::Gateway(
                ("default".into(), "gw".into()),
                Some("http".into()),
                None
            )]
        );
        let (f, e) = route("  parentRefs: [{name: gw}]\n  rules:\n  - filters: [{type: RequestMirror, requestMirror: {backendRef: {name: x, port: 80}}}]\n").unwrap_err();
        assert_eq!(
            (f.as_str(), e.as_str()),
            (
                "spec.rules[0].filters[0].type",
                "the RequestMirror filter is not implemented yet; this HTTPRoute is not applied"
            )
        );
        let (f, _) =
            route("  parentRefs: [{name: gw}]\n  rules:\n  - backendRefs: [{name: web}]\n")
                .unwrap_err();
        assert_eq!(f, "spec.rules[0].backendRefs[0].port");
    }
}
