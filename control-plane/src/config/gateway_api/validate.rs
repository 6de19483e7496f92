//! An HTTPRoute read into the route model: its parents, hostnames, and
//! one route per match in the Gateway API's precedence; or refused naming
//! the field.

use std::time::Duration;

use super::http_route::{
    HeaderModifier, HttpRoute, Match, NameValue, NamedMatch, PathModifier, Rule,
};
use super::{not_yet, Refusal};
use crate::config::gateway::is_host_name;
use crate::config::route::{
    self, Backend, HeaderMatch, HeaderOps, Redirect, Rewrite, RouteAction, RouteMatch,
};
use crate::config::virtual_service::check_regex;

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
