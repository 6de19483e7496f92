//! A VirtualService read into the route model, or refused naming the first
//! field minimesh cannot apply and why.

use super::{HttpMatchRequest, HttpRoute, StringMatch, ValidVirtualService, VirtualService};
use crate::config::gateway::is_host_name;
use crate::config::kube::resolve_host;
use crate::config::route::{self, Backend, HeaderMatch, Rewrite, RouteAction, RouteMatch};

mod actions;
use actions::{fault, headers, redirect, retries};

/// The most retries a route may ask for (as a DestinationRule).
const MAX_ATTEMPTS: u32 = 10;
/// The most routes, matches, destinations or header changes one object may
/// have (as the sidecar accepts).
const MAX_PARTS: usize = 64;
/// The compiled size a regular expression may take (as the sidecar).
const REGEX_SIZE_LIMIT: usize = 1 << 16;

/// Why a VirtualService is refused: the field and the reason.
pub type Refusal = (String, String);

fn not_yet(field: String, what: &str) -> Refusal {
    (
        field,
        format!("{what} is not implemented yet; this VirtualService is not applied"),
    )
}

/// Checks `vs` (of `namespace`) and reads its routes, or names the first
/// field minimesh does not implement or cannot accept.
pub fn validate(vs: VirtualService, namespace: &str) -> Result<ValidVirtualService, Refusal> {
    let spec = &vs.spec;
    if spec.tcp.is_some() {
        return Err(not_yet("spec.tcp".into(), "routing TCP"));
    }
    if spec.tls.is_some() {
        return Err(not_yet("spec.tls".into(), "routing TLS"));
    }
    if spec.export_to.is_some() {
        return Err(not_yet(
            "spec.exportTo".into(),
            "limiting which namespaces see a VirtualService",
        ));
    }
    // No gateways: the sidecars (`mesh`) only; otherwise those named.
    let mut mesh = spec.gateways.is_empty();
    let mut gateways = Vec::new();
    for (i, g) in spec.gateways.iter().enumerate() {
        if g == "mesh" {
            mesh = true;
            continue;
        }
        let (ns, name) = g.split_once('/').unwrap_or((namespace, g));
        if !is_host_name(name, false) || !is_host_name(ns, false) || name.contains('.') {
            return Err((
                format!("spec.gateways[{i}]"),
                format!("{g:?} is not a Gateway name (`name`, `namespace/name` or `mesh`)"),
            ));
        }
        gateways.push((ns.to_string(), name.to_string()));
    }
    if spec.hosts.is_empty() {
        return Err(("spec.hosts".into(), "names no host".into()));
    }
    let mut services = Vec::new();
    let mut gateway_hosts = Vec::new();
    for (i, h) in spec.hosts.iter().enumerate() {
        // `*` alone, at Gateways only: any host their servers bind that no
        // other VirtualService routes (the gateway's catch-all).
        if h == "*" && !mesh && !gateways.is_empty() {
            gateway_hosts.push(h.clone());
            continue;
        }
        if h.contains('*') {
            return Err(not_yet(
                format!("spec.hosts[{i}]"),
                "a wildcard host (other than `*` alone, at Gateways only)",
            ));
        }
        if !gateways.is_empty() {
            if !is_host_name(h, false) {
                return Err((
                    format!("spec.hosts[{i}]"),
                    format!("{h:?} is not a host name"),
                ));
            }
            gateway_hosts.push(h.to_ascii_lowercase());
        }
        if !mesh {
            continue;
        }
        match resolve_host(h, namespace) {
            Some(s) if !services.contains(&s) => services.push(s),
            Some(_) => {}
            // A gateway's host only.
            None if !gateways.is_empty() => {}
            None => {
                return Err(not_yet(
                    format!("spec.hosts[{i}]"),
                    &format!("{h:?} is not a Service name (name, name.namespace or name.namespace.svc.cluster.local); routing other hosts from the sidecars"),
                ))
            }
        }
    }
    if spec.http.is_empty() {
        return Err(("spec.http".into(), "has no route".into()));
    }
    if spec.http.len() > MAX_PARTS {
        return Err((
            "spec.http".into(),
            format!("{} routes, more than {MAX_PARTS}", spec.http.len()),
        ));
    }
    let name = format!("VirtualService/{namespace}/{}", vs.metadata.name);
    let routes = spec
        .http
        .iter()
        .enumerate()
        .map(|(i, r)| http_route(r, &format!("spec.http[{i}]"), &name, i, namespace))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ValidVirtualService {
        virtual_service: vs,
        services,
        gateways,
        gateway_hosts,
        routes,
    })
}

fn http_route(
    r: &HttpRoute,
    at: &str,
    object: &str,
    index: usize,
    namespace: &str,
) -> Result<route::HttpRoute, Refusal> {
    let refused = [
        ("delegate", r.delegate.is_some(), "delegating routes"),
        ("mirror", r.mirror.is_some(), "mirroring"),
        ("mirrors", r.mirrors.is_some(), "mirroring"),
        (
            "mirrorPercentage",
            r.mirror_percentage.is_some(),
            "mirroring",
        ),
        ("mirrorPercent", r.mirror_percent.is_some(), "mirroring"),
        ("corsPolicy", r.cors_policy.is_some(), "CORS"),
    ];
    if let Some((field, _, what)) = refused.iter().find(|(_, set, _)| *set) {
        return Err(not_yet(format!("{at}.{field}"), what));
    }
    if r.matches.len() > MAX_PARTS {
        return Err((
            format!("{at}.match"),
            format!("more than {MAX_PARTS} matches"),
        ));
    }
    let matches = r
        .matches
        .iter()
        .enumerate()
        .map(|(j, m)| route_match(m, &format!("{at}.match[{j}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let answers = [
        ("redirect", r.redirect.is_some()),
        ("directResponse", r.direct_response.is_some()),
        ("route", !r.route.is_empty()),
    ];
    let set: Vec<&str> = answers.iter().filter(|a| a.1).map(|a| a.0).collect();
    let action = match set.as_slice() {
        [] => {
            return Err((
                format!("{at}.route"),
                "names no destination (nor redirect, nor directResponse)".into(),
            ))
        }
        [_, second, ..] => {
            return Err((
                format!("{at}.{second}"),
                format!(
                    "a route has one of route, redirect and directResponse, not {}",
                    set.join(" and ")
                ),
            ))
        }
        ["redirect"] => RouteAction::Redirect(redirect(r.redirect.as_ref().expect("set"), at)?),
        ["directResponse"] => {
            let d = r.direct_response.as_ref().expect("set");
            if d.body.is_some() {
                return Err(not_yet(
                    format!("{at}.directResponse.body"),
                    "a direct response's body",
                ));
            }
            if !(200..=599).contains(&d.status) {
                return Err((
                    format!("{at}.directResponse.status"),
                    format!("{} is not an HTTP status from 200 to 599", d.status),
                ));
            }
            RouteAction::Direct(d.status as u16)
        }
        _ => RouteAction::Forward(backends(r, at, namespace)?),
    };
    let (request_headers, response_headers) =
        headers(r.headers.as_ref(), &format!("{at}.headers"))?;
    let timeout = match &r.timeout {
        None => None,
        Some(t) => {
            Some(minimesh_proto::duration::parse(t).map_err(|e| (format!("{at}.timeout"), e))?)
        }
    };
    let retries = match &r.retries {
        None => None,
        Some(x) => Some(retries(x, &format!("{at}.retries"))?),
    };
    let rewrite = match &r.rewrite {
        None => None,
        Some(rw) => {
            if rw.uri_regex_rewrite.is_some() {
                return Err(not_yet(
                    format!("{at}.rewrite.uriRegexRewrite"),
                    "rewriting by regex",
                ));
            }
            if let Some(u) = rw.uri.as_deref().filter(|u| !u.starts_with('/')) {
                return Err((
                    format!("{at}.rewrite.uri"),
                    format!("{u:?} does not start with /"),
                ));
            }
            if let Some(a) = rw
                .authority
                .as_deref()
                .filter(|a| a.parse::<http::uri::Authority>().is_err() || a.is_empty())
            {
                return Err((
                    format!("{at}.rewrite.authority"),
                    format!("{a:?} is not a host"),
                ));
            }
            Some(Rewrite {
                prefix: rw.uri.clone(),
                path: None,
                authority: rw.authority.clone(),
            })
        }
    };
    let fault = match &r.fault {
        None => None,
        Some(f) => Some(fault(f, &format!("{at}.fault"))?),
    };
    Ok(route::HttpRoute {
        name: format!(
            "{object}/{}",
            r.name.clone().unwrap_or_else(|| index.to_string())
        ),
        matches,
        action,
        timeout,
        retries,
        request_headers,
        response_headers,
        rewrite,
        fault,
    })
}

fn route_match(m: &HttpMatchRequest, at: &str) -> Result<RouteMatch, Refusal> {
    let refused = [
        ("scheme", m.scheme.is_some(), "matching the scheme"),
        ("authority", m.authority.is_some(), "matching the authority"),
        (
            "sourceLabels",
            m.source_labels.is_some(),
            "matching the caller's labels",
        ),
        ("gateways", m.gateways.is_some(), "matching gateways"),
        (
            "ignoreUriCase",
            m.ignore_uri_case.is_some(),
            "matching paths ignoring case",
        ),
        (
            "sourceNamespace",
            m.source_namespace.is_some(),
            "matching the caller's namespace",
        ),
        (
            "statPrefix",
            m.stat_prefix.is_some(),
            "a match's statistics prefix",
        ),
    ];
    if let Some((field, _, what)) = refused.iter().find(|(_, set, _)| *set) {
        return Err(not_yet(format!("{at}.{field}"), what));
    }
    if m.headers.len() + m.without_headers.len() + m.query_params.len() > MAX_PARTS {
        return Err((
            at.into(),
            format!("more than {MAX_PARTS} header and query matches"),
        ));
    }
    let path = match &m.uri {
        None => None,
        Some(u) => Some(string_match(u, &format!("{at}.uri"))?.ok_or_else(|| {
            (
                format!("{at}.uri"),
                "sets none of exact, prefix and regex".to_string(),
            )
        })?),
    };
    let method = match &m.method {
        None => None,
        Some(StringMatch {
            exact: Some(e),
            prefix: None,
            regex: None,
        }) => {
            if http::Method::from_bytes(e.as_bytes()).is_err() {
                return Err((
                    format!("{at}.method.exact"),
                    format!("{e:?} is not a method"),
                ));
            }
            Some(e.clone())
        }
        Some(_) => {
            return Err(not_yet(
                format!("{at}.method"),
                "matching methods other than exactly",
            ))
        }
    };
    let mut headers = Vec::new();
    for (list, field, invert) in [
        (&m.headers, "headers", false),
        (&m.without_headers, "withoutHeaders", true),
    ] {
        for (name, v) in list {
            let f = format!("{at}.{field}.{name}");
            header_name(name, &f)?;
            if name.bytes().any(|b| b.is_ascii_uppercase()) {
                return Err((
                    f,
                    "header names are matched in lower case; write it so".into(),
                ));
            }
            headers.push(HeaderMatch {
                name: name.clone(),
                value: string_match(v, &f)?,
                invert,
            });
        }
    }
    let mut query = Vec::new();
    for (name, v) in &m.query_params {
        let f = format!("{at}.queryParams.{name}");
        if v.prefix.is_some() {
            return Err((
                format!("{f}.prefix"),
                "query parameters match by exact or regex only (as Istio)".into(),
            ));
        }
        query.push((name.clone(), string_match(v, &f)?));
    }
    if let Some(p) = m.port.filter(|p| *p == 0 || *p > 65535) {
        return Err((format!("{at}.port"), format!("{p} is not a port")));
    }
    Ok(RouteMatch {
        path,
        headers,
        method,
        query,
        port: m.port,
    })
}

/// One of exact, prefix, regex; none: None (presence).
fn string_match(m: &StringMatch, at: &str) -> Result<Option<route::StringMatch>, Refusal> {
    Ok(match (&m.exact, &m.prefix, &m.regex) {
        (None, None, None) => None,
        (Some(e), None, None) => Some(route::StringMatch::Exact(e.clone())),
        (None, Some(p), None) => Some(route::StringMatch::Prefix(p.clone())),
        (None, None, Some(r)) => {
            check_regex(r, &format!("{at}.regex"))?;
            Some(route::StringMatch::Regex(r.clone()))
        }
        _ => {
            return Err((
                at.into(),
                "sets more than one of exact, prefix and regex".into(),
            ))
        }
    })
}

/// Refuses a regular expression the sidecars would not compile.
pub fn check_regex(r: &str, at: &str) -> Result<(), Refusal> {
    regex::RegexBuilder::new(&format!("^(?:{r})$"))
        .size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map(drop)
        .map_err(|e| (at.into(), format!("{r:?} is not a regular expression minimesh accepts (RE2 syntax, bounded size): {e}")))
}

fn header_name(name: &str, at: &str) -> Result<(), Refusal> {
    if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
        return Err((at.into(), format!("{name:?} is not a header name")));
    }
    Ok(())
}

fn backends(r: &HttpRoute, at: &str, namespace: &str) -> Result<Vec<Backend>, Refusal> {
    if r.route.len() > MAX_PARTS {
        return Err((
            format!("{at}.route"),
            format!("more than {MAX_PARTS} destinations"),
        ));
    }
    let several = r.route.len() > 1;
    let mut out = Vec::new();
    for (k, d) in r.route.iter().enumerate() {
        let f = format!("{at}.route[{k}]");
        let host = &d.destination.host;
        let Some(service) = resolve_host(host, namespace).filter(|_| !host.contains('*')) else {
            return Err(not_yet(
                format!("{f}.destination.host"),
                &format!("routing to {host:?}, not a Service of the mesh (name, name.namespace or name.namespace.svc.cluster.local),"),
            ));
        };
        let weight = match d.weight {
            None if several => {
                return Err((
                    format!("{f}.weight"),
                    "each destination needs a weight when a route has more than one".into(),
                ))
            }
            None => 100,
            Some(w) if !(0..=i64::from(i32::MAX)).contains(&w) => {
                return Err((format!("{f}.weight"), format!("{w} is not a weight from 0")))
            }
            Some(w) => w as u32,
        };
        if let Some(s) = &d.destination.subset {
            if s.is_empty() || s.len() > 253 {
                return Err((
                    format!("{f}.destination.subset"),
                    "is not a subset name".into(),
                ));
            }
        }
        let port = match &d.destination.port {
            Some(p) if p.number == 0 || p.number > 65535 => {
                return Err((
                    format!("{f}.destination.port.number"),
                    format!("{} is not a port", p.number),
                ))
            }
            p => p.as_ref().map(|p| p.number),
        };
        let (request_headers, response_headers) =
            headers(d.headers.as_ref(), &format!("{f}.headers"))?;
        out.push(Backend {
            service,
            port,
            subset: d.destination.subset.clone(),
            weight,
            request_headers,
            response_headers,
        });
    }
    if several && out.iter().all(|b| b.weight == 0) {
        return Err((
            format!("{at}.route"),
            "every destination has weight 0".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{validate, Refusal};
    use crate::config::route::{RouteAction, StringMatch};
    use crate::config::virtual_service::{ValidVirtualService, VirtualService};
    use minimesh_proto::retry_on::parse as parse_retry_on;
    use std::time::Duration;

    fn vs(spec: &str) -> Result<ValidVirtualService, Refusal> {
        let text = format!(
            "apiVersion: networking.istio.io/v1alpha3\nkind: VirtualService\nmetadata: {{name: simple-backend-vs}}\nspec:\n{spec}"
        );
        let v: VirtualService = serde_saphyr::from_str(&text).expect("YAML");
        validate(v, "istioinaction")
    }

    fn backend() -> (String, String) {
        ("simple-backend".to_string(), "istioinaction".to_string())
    }

    #[test]
    fn the_books_timeout_and_retries_are_read() {
        let timeout = vs("  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n    timeout: 0.5s\n")
            .expect("valid");
        assert_eq!(timeout.services, [backend()]);
        let r = &timeout.routes[0];
        assert_eq!(r.timeout, Some(Duration::from_millis(500)));
        assert_eq!(r.retries, None);
        assert!(r.is_plain(&backend()));
        assert_eq!(r.name, "VirtualService/istioinaction/simple-backend-vs/0");
        let retry = vs("  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n    retries: {attempts: 2, retryOn: 5xx}\n")
            .expect("valid");
        let r = retry.routes[0].retries.clone().expect("retries");
        assert_eq!(r.attempts, Some(2));
        assert_eq!(
            r.retry_on,
            Some((parse_retry_on("5xx").expect("5xx").bits, vec![]))
        );
        let off = vs("  hosts: [simple-backend.istioinaction.svc.cluster.local]\n  gateways: [mesh]\n  http:\n  - route:\n    - destination: {host: simple-backend, port: {number: 80}}\n      weight: 100\n    retries: {attempts: 0}\n")
            .expect("valid");
        let RouteAction::Forward(b) = &off.routes[0].action else {
            panic!("forwards")
        };
        assert_eq!(b[0].port, Some(80));
        assert!(off.routes[0].is_plain(&backend()));
    }

    #[test]
    fn a_canary_split_and_a_header_match_are_read_in_order() {
        let v = vs("  hosts: [simple-backend]\n  http:\n  - name: tester\n    match:\n    - headers: {x-canary: {exact: \"yes\"}}\n      uri: {prefix: /api}\n    route:\n    - destination: {host: simple-backend, subset: v2}\n  - route:\n    - destination: {host: simple-backend, subset: v1}\n      weight: 90\n    - destination: {host: simple-backend, subset: v2}\n      weight: 10\n      headers: {response: {set: {x-version: v2}}}\n")
            .expect("valid");
        assert_eq!(v.routes.len(), 2);
        let first = &v.routes[0];
        assert_eq!(
            first.name,
            "VirtualService/istioinaction/simple-backend-vs/tester"
        );
        assert_eq!(
            first.matches[0].path,
            Some(StringMatch::Prefix("/api".into()))
        );
        assert_eq!(first.matches[0].headers[0].name, "x-canary");
        let RouteAction::Forward(split) = &v.routes[1].action else {
            panic!("forwards")
        };
        let weights: Vec<_> = split
            .iter()
            .map(|b| (b.subset.as_deref(), b.weight))
            .collect();
        assert_eq!(weights, [(Some("v1"), 90), (Some("v2"), 10)]);
        assert_eq!(
            split[1].response_headers.set,
            [("x-version".into(), "v2".into())]
        );
        assert!(!v.routes[1].is_plain(&backend()));
    }

    #[test]
    fn the_books_gateway_virtual_service_binds_its_host_to_the_gateway() {
        let v = vs("  hosts: [\"simple-web.istioinaction.io\"]\n  gateways: [simple-web-gateway]\n  http:\n  - route:\n    - destination: {host: simple-web}\n    retries: {attempts: 2}\n")
            .expect("valid");
        assert!(v.services.is_empty(), "not for the sidecars");
        assert_eq!(
            v.gateways,
            [(
                "istioinaction".to_string(),
                "simple-web-gateway".to_string()
            )]
        );
        assert_eq!(v.gateway_hosts, ["simple-web.istioinaction.io"]);
        let both = vs("  hosts: [simple-backend]\n  gateways: [mesh, other/gw]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n")
            .expect("valid");
        assert_eq!(both.services, [backend()]);
        assert_eq!(both.gateways, [("other".to_string(), "gw".to_string())]);
    }

    #[test]
    fn what_is_not_implemented_or_wrong_is_refused_by_field() {
        let route = "  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n";
        let cases = [
            (
                "  hosts: [simple-web.istioinaction.io]\n  http:\n  - route:\n    - destination: {host: simple-web}\n".to_string(),
                "spec.hosts[0]",
                "\"simple-web.istioinaction.io\" is not a Service name (name, name.namespace or name.namespace.svc.cluster.local); routing other hosts from the sidecars is not implemented yet",
            ),
            (
                "  hosts: [\"*.istioinaction.io\"]\n  gateways: [simple-web-gateway]\n  http:\n  - route:\n    - destination: {host: simple-web}\n".to_string(),
                "spec.hosts[0]",
                "a wildcard host (other than `*` alone, at Gateways only) is not implemented yet",
            ),
            (
                format!("{route}    match: [{{sourceLabels: {{app: web}}}}]\n"),
                "spec.http[0].match[0].sourceLabels",
                "matching the caller's labels is not implemented yet; this VirtualService is not applied",
            ),
            (
                format!("{route}    match: [{{uri: {{prefix: /a, exact: /b}}}}]\n"),
                "spec.http[0].match[0].uri",
                "sets more than one of exact, prefix and regex",
            ),
            (
                format!("{route}    match: [{{uri: {{regex: \"(\"}}}}]\n"),
                "spec.http[0].match[0].uri.regex",
                "",
            ),
            (
                "  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n    - destination: {host: simple-web}\n".to_string(),
                "spec.http[0].route[0].weight",
                "each destination needs a weight when a route has more than one",
            ),
            (
                format!("{route}    mirror: {{host: simple-web}}\n"),
                "spec.http[0].mirror",
                "mirroring is not implemented yet; this VirtualService is not applied",
            ),
            (
                format!("{route}    redirect: {{uri: /x}}\n"),
                "spec.http[0].route",
                "a route has one of route, redirect and directResponse, not redirect and route",
            ),
            (
                format!("{route}    fault: {{abort: {{grpcStatus: UNAVAILABLE}}}}\n"),
                "spec.http[0].fault.abort.grpcStatus",
                "aborting with a gRPC status is not implemented yet; this VirtualService is not applied",
            ),
            (
                format!("{route}    headers: {{request: {{set: {{host: evil}}}}}}\n"),
                "spec.http[0].headers.request.set.host",
                "\"host\" cannot be changed here (rewrite.authority sets the host)",
            ),
            (
                format!("{route}  tcp: []\n"),
                "spec.tcp",
                "routing TCP is not implemented yet; this VirtualService is not applied",
            ),
            (
                format!("{route}    retries: {{attempts: 11}}\n"),
                "spec.http[0].retries.attempts",
                "11 is more than the maximum of 10",
            ),
        ];
        for (spec, field, reason) in cases {
            let (f, r) = vs(&spec).unwrap_err();
            assert_eq!(f.as_str(), field, "{spec}");
            assert!(r.starts_with(reason), "{spec}: {r}");
        }
        // A field Istio does not have either: serde's unknown field.
        let text = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: x}\nspec:\n  hosts: [a]\n  htp: []\n";
        assert!(serde_saphyr::from_str::<VirtualService>(text).is_err());
    }
}
