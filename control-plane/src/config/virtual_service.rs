//! Istio's VirtualService, as far as minimesh routes it today: for one
//! Service of the mesh, the request timeout and the retries of its one HTTP
//! route to itself. That is the shape of Istio in Action's chapter 6
//! (`hosts: [simple-backend]`, one `http` route to `simple-backend` with a
//! `timeout` or `retries`), and it takes precedence over the timeout and
//! retries a DestinationRule sets for that Service, as in Istio, where
//! those are the VirtualService's alone.
//!
//! Everything else a VirtualService can say (request matches, weighted or
//! other destinations, subsets, header changes, rewrites, redirects,
//! faults, mirrors, CORS, delegation, Gateway binding, TCP and TLS routes,
//! `exportTo`) is refused, naming the field and saying it is not
//! implemented yet: nothing is ignored silently. The route model that will
//! take them grows from this one.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::kube::{resolve_host, ObjectMeta};
use minimesh_proto::retry_on::parse as parse_retry_on;

/// The API versions a VirtualService is read in (Istio's, as for
/// DestinationRules).
pub const VIRTUAL_SERVICE_API_VERSIONS: [&str; 3] = [
    "networking.istio.io/v1",
    "networking.istio.io/v1beta1",
    "networking.istio.io/v1alpha3",
];

/// The most retries a route may ask for (as a DestinationRule).
const MAX_ATTEMPTS: u32 = 10;

/// A VirtualService as written.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualService {
    /// `networking.istio.io/v1`, `v1beta1` or `v1alpha3`.
    pub api_version: String,
    /// `VirtualService`.
    pub kind: String,
    /// Name and namespace.
    pub metadata: ObjectMeta,
    /// The routes.
    pub spec: VirtualServiceSpec,
}

/// `spec`: every field of Istio's; those minimesh does not implement are
/// read only to be refused by name.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualServiceSpec {
    /// The Services whose traffic the routes apply to.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// `mesh` (the sidecars; the default) or Gateways.
    #[serde(default)]
    pub gateways: Vec<String>,
    /// HTTP routes.
    #[serde(default)]
    pub http: Vec<HttpRoute>,
    /// TCP routes (not implemented).
    #[serde(default)]
    pub tcp: Option<Value>,
    /// TLS routes (not implemented).
    #[serde(default)]
    pub tls: Option<Value>,
    /// Namespaces that see it (not implemented).
    #[serde(default)]
    pub export_to: Option<Value>,
}

/// `spec.http[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRoute {
    /// A name for logs.
    #[serde(default)]
    pub name: Option<String>,
    /// Request matches (not implemented).
    #[serde(default, rename = "match")]
    pub matches: Option<Value>,
    /// Where requests go.
    #[serde(default)]
    pub route: Vec<RouteDestination>,
    /// The time a request may take, e.g. `0.5s` (`0s`: none).
    #[serde(default)]
    pub timeout: Option<String>,
    /// Retries.
    #[serde(default)]
    pub retries: Option<HttpRetry>,
    /// Not implemented.
    #[serde(default)]
    pub redirect: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub direct_response: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub delegate: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub rewrite: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub fault: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub mirror: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub mirrors: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub mirror_percentage: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub mirror_percent: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub cors_policy: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub headers: Option<Value>,
}

/// `spec.http[].route[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteDestination {
    /// The Service (and port) requests go to.
    pub destination: Destination,
    /// Share of requests (one destination: 100, or unset).
    #[serde(default)]
    pub weight: Option<i64>,
    /// Not implemented.
    #[serde(default)]
    pub headers: Option<Value>,
}

/// `spec.http[].route[].destination`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Destination {
    /// A Service: `name`, `name.namespace`, `name.namespace.svc.cluster.local`.
    pub host: String,
    /// Not implemented.
    #[serde(default)]
    pub subset: Option<String>,
    /// The Service port, when the Service has more than one.
    #[serde(default)]
    pub port: Option<PortSelector>,
}

/// `destination.port`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortSelector {
    /// The port number.
    pub number: u32,
}

/// `spec.http[].retries`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRetry {
    /// Retries after the first attempt (0: none; at most 10).
    #[serde(default)]
    pub attempts: Option<u32>,
    /// Time of each attempt, e.g. `1s`.
    #[serde(default)]
    pub per_try_timeout: Option<String>,
    /// When to retry: Istio's comma-separated conditions and status codes.
    #[serde(default)]
    pub retry_on: Option<String>,
    /// Not implemented.
    #[serde(default)]
    pub retry_remote_localities: Option<Value>,
}

/// A VirtualService minimesh applies: what its route sets for the Service.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidVirtualService {
    /// The object as written.
    pub virtual_service: VirtualService,
    /// The Service it routes: (name, namespace).
    pub service: (String, String),
    /// The one Service port it applies to, or every port.
    pub port: Option<u32>,
    /// The route's request timeout (`Some(ZERO)`: none).
    pub timeout: Option<Duration>,
    /// The route's retries, when it sets them.
    pub retries: Option<RouteRetries>,
}

/// Retries as a route sets them; what it leaves unset stays as the
/// DestinationRule (or the default) has it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteRetries {
    /// Retries after the first attempt.
    pub attempts: Option<u32>,
    /// Time of each attempt.
    pub per_try_timeout: Option<Duration>,
    /// `retryOn` bits and the status codes it names.
    pub retry_on: Option<(u32, Vec<u32>)>,
}

/// Why a VirtualService is refused: the field and the reason.
type Refusal = (String, String);

fn not_yet(field: String, what: &str) -> Refusal {
    (
        field,
        format!("{what} is not implemented yet; this VirtualService is not applied"),
    )
}

/// Checks `vs` (of `namespace`) and resolves what it sets, or names the
/// first field minimesh does not implement or cannot accept.
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
    for (i, g) in spec.gateways.iter().enumerate() {
        if g != "mesh" {
            return Err(not_yet(
                format!("spec.gateways[{i}]"),
                &format!("binding a VirtualService to Gateway {g:?} (only `mesh`, the sidecars)"),
            ));
        }
    }
    if spec.hosts.is_empty() {
        return Err(("spec.hosts".into(), "names no host".into()));
    }
    let mut service = None;
    for (i, h) in spec.hosts.iter().enumerate() {
        let Some(s) = resolve_host(h, namespace).filter(|_| !h.contains('*')) else {
            return Err(not_yet(
                format!("spec.hosts[{i}]"),
                &format!("{h:?} is not a Service name (name, name.namespace or name.namespace.svc.cluster.local); routing other hosts, which needs a Gateway,"),
            ));
        };
        match &service {
            None => service = Some(s),
            Some(first) if *first == s => {}
            Some(first) => {
                return Err(not_yet(
                    format!("spec.hosts[{i}]"),
                    &format!(
                        "routing two Services ({}.{} and {}.{}) in one VirtualService",
                        first.0, first.1, s.0, s.1
                    ),
                ))
            }
        }
    }
    let service = service.unwrap_or_default();
    let route = match spec.http.as_slice() {
        [] => return Err(("spec.http".into(), "has no route".into())),
        [one] => one,
        [_, ..] => {
            return Err(not_yet(
                "spec.http[1]".into(),
                "more than one HTTP route (requests matched to routes)",
            ))
        }
    };
    let at = "spec.http[0]";
    let refused = [
        ("match", route.matches.is_some(), "matching requests"),
        ("redirect", route.redirect.is_some(), "redirecting"),
        (
            "directResponse",
            route.direct_response.is_some(),
            "answering directly",
        ),
        ("delegate", route.delegate.is_some(), "delegating routes"),
        ("rewrite", route.rewrite.is_some(), "rewriting requests"),
        ("fault", route.fault.is_some(), "injecting faults"),
        ("mirror", route.mirror.is_some(), "mirroring"),
        ("mirrors", route.mirrors.is_some(), "mirroring"),
        (
            "mirrorPercentage",
            route.mirror_percentage.is_some(),
            "mirroring",
        ),
        ("mirrorPercent", route.mirror_percent.is_some(), "mirroring"),
        ("corsPolicy", route.cors_policy.is_some(), "CORS"),
        ("headers", route.headers.is_some(), "changing headers"),
    ];
    if let Some((field, _, what)) = refused.iter().find(|(_, set, _)| *set) {
        return Err(not_yet(format!("{at}.{field}"), what));
    }
    let dest = match route.route.as_slice() {
        [] => return Err((format!("{at}.route"), "names no destination".into())),
        [one] => one,
        [_, ..] => {
            return Err(not_yet(
                format!("{at}.route[1]"),
                "splitting requests between destinations",
            ))
        }
    };
    let at = format!("{at}.route[0]");
    if dest.weight.is_some_and(|w| w != 100) {
        return Err(not_yet(
            format!("{at}.weight"),
            "a weight other than 100 (splitting requests)",
        ));
    }
    if dest.headers.is_some() {
        return Err(not_yet(format!("{at}.headers"), "changing headers"));
    }
    if dest.destination.subset.is_some() {
        return Err(not_yet(
            format!("{at}.destination.subset"),
            "routing to a subset",
        ));
    }
    match resolve_host(&dest.destination.host, namespace) {
        Some(d) if d == service => {}
        _ => {
            return Err(not_yet(
                format!("{at}.destination.host"),
                &format!(
                    "routing {}.{} to another host ({:?})",
                    service.0, service.1, dest.destination.host
                ),
            ))
        }
    }
    let port = match &dest.destination.port {
        Some(p) if p.number == 0 || p.number > 65535 => {
            return Err((
                format!("{at}.destination.port.number"),
                format!("{} is not a port", p.number),
            ))
        }
        p => p.as_ref().map(|p| p.number),
    };
    let timeout = match &route.timeout {
        None => None,
        Some(t) => Some(
            minimesh_proto::duration::parse(t).map_err(|r| ("spec.http[0].timeout".into(), r))?,
        ),
    };
    let retries = match &route.retries {
        None => None,
        Some(r) => Some(retries(r)?),
    };
    Ok(ValidVirtualService {
        virtual_service: vs,
        service,
        port,
        timeout,
        retries,
    })
}

/// How the admin API's `/debug/config` lists an applied VirtualService
/// (`namespace/name`): its Service and what its route sets.
pub fn view(namespace: &str, name: &str, v: &ValidVirtualService) -> Value {
    serde_json::json!({
        "namespace": namespace,
        "name": name,
        "service": format!("{}.{}", v.service.0, v.service.1),
        "port": v.port,
        "timeout_ms": v.timeout.map(|t| t.as_millis() as u64),
        "retry_attempts": v.retries.as_ref().and_then(|r| r.attempts),
        "per_try_timeout_ms": v
            .retries
            .as_ref()
            .and_then(|r| r.per_try_timeout)
            .map(|t| t.as_millis() as u64),
    })
}

fn retries(r: &HttpRetry) -> Result<RouteRetries, Refusal> {
    let at = "spec.http[0].retries";
    if r.retry_remote_localities.is_some() {
        return Err(not_yet(
            format!("{at}.retryRemoteLocalities"),
            "choosing retry localities",
        ));
    }
    if let Some(a) = r.attempts.filter(|a| *a > MAX_ATTEMPTS) {
        return Err((
            format!("{at}.attempts"),
            format!("{a} is more than the maximum of {MAX_ATTEMPTS}"),
        ));
    }
    let per_try_timeout = match &r.per_try_timeout {
        None => None,
        Some(t) => Some(
            minimesh_proto::duration::parse_positive(t)
                .map_err(|e| (format!("{at}.perTryTimeout"), e))?,
        ),
    };
    let retry_on = match &r.retry_on {
        None => None,
        Some(on) => {
            let parsed = parse_retry_on(on).map_err(|e| (format!("{at}.retryOn"), e))?;
            Some((parsed.bits, parsed.codes))
        }
    };
    Ok(RouteRetries {
        attempts: r.attempts,
        per_try_timeout,
        retry_on,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vs(spec: &str) -> Result<ValidVirtualService, Refusal> {
        let text = format!(
            "apiVersion: networking.istio.io/v1alpha3\nkind: VirtualService\nmetadata: {{name: simple-backend-vs}}\nspec:\n{spec}"
        );
        let v: VirtualService = serde_saphyr::from_str(&text).expect("YAML");
        validate(v, "istioinaction")
    }

    #[test]
    fn the_books_timeout_and_retries_are_read() {
        let timeout = vs("  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n    timeout: 0.5s\n")
            .expect("valid");
        assert_eq!(
            timeout.service,
            ("simple-backend".to_string(), "istioinaction".to_string())
        );
        assert_eq!(timeout.timeout, Some(Duration::from_millis(500)));
        assert_eq!(timeout.retries, None);
        let retry = vs("  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n    retries: {attempts: 2, retryOn: 5xx}\n")
            .expect("valid");
        let r = retry.retries.expect("retries");
        assert_eq!(r.attempts, Some(2));
        assert_eq!(
            r.retry_on,
            Some((parse_retry_on("5xx").expect("5xx").bits, vec![]))
        );
        let off = vs("  hosts: [simple-backend.istioinaction.svc.cluster.local]\n  gateways: [mesh]\n  http:\n  - route:\n    - destination: {host: simple-backend, port: {number: 80}}\n      weight: 100\n    retries: {attempts: 0}\n")
            .expect("valid");
        assert_eq!(off.port, Some(80));
        assert_eq!(off.retries.and_then(|r| r.attempts), Some(0));
    }

    #[test]
    fn what_is_not_implemented_is_refused_by_field() {
        let route = "  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n";
        let cases = [
            (
                "  hosts: [simple-web.istioinaction.io]\n  gateways: [simple-web-gateway]\n  http:\n  - route:\n    - destination: {host: simple-web}\n",
                "spec.gateways[0]",
                "binding a VirtualService to Gateway \"simple-web-gateway\" (only `mesh`, the sidecars) is not implemented yet; this VirtualService is not applied",
            ),
            (
                &format!("{route}    match: [{{uri: {{prefix: /api}}}}]\n"),
                "spec.http[0].match",
                "matching requests is not implemented yet; this VirtualService is not applied",
            ),
            (
                "  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend, subset: v1}\n",
                "spec.http[0].route[0].destination.subset",
                "routing to a subset is not implemented yet; this VirtualService is not applied",
            ),
            (
                "  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-backend}\n      weight: 90\n    - destination: {host: simple-web}\n      weight: 10\n",
                "spec.http[0].route[1]",
                "splitting requests between destinations is not implemented yet; this VirtualService is not applied",
            ),
            (
                &format!("{route}    fault: {{abort: {{httpStatus: 500, percentage: {{value: 10}}}}}}\n"),
                "spec.http[0].fault",
                "injecting faults is not implemented yet; this VirtualService is not applied",
            ),
            (
                "  hosts: [simple-backend]\n  http:\n  - route:\n    - destination: {host: simple-web}\n",
                "spec.http[0].route[0].destination.host",
                "routing simple-backend.istioinaction to another host (\"simple-web\") is not implemented yet; this VirtualService is not applied",
            ),
            (
                &format!("{route}  tcp: []\n"),
                "spec.tcp",
                "routing TCP is not implemented yet; this VirtualService is not applied",
            ),
            (
                &format!("{route}    retries: {{attempts: 11}}\n"),
                "spec.http[0].retries.attempts",
                "11 is more than the maximum of 10",
            ),
        ];
        for (spec, field, reason) in cases {
            let (f, r) = vs(spec).unwrap_err();
            assert_eq!((f.as_str(), r.as_str()), (field, reason), "{spec}");
        }
        // A field Istio does not have either: serde's unknown field.
        let text = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: x}\nspec:\n  hosts: [a]\n  htp: []\n";
        assert!(serde_saphyr::from_str::<VirtualService>(text).is_err());
    }
}
