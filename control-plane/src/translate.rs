//! Translation: a pure function from the desired state ([`Store`]) to the
//! resources sidecars consume, plus the status of every rule.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use minimesh_proto::v1::{
    self, Cluster, ClusterLoadAssignment, PortProtocol, Route, UpstreamProtocol,
};

use crate::config::kube::ServicePort;
use crate::config::parse::ObjectKey;
use crate::config::security::ROOT_NAMESPACE;
pub use crate::config::status::RuleStatus;
use crate::store::Store;

mod gateway_api;
mod routes;
mod scope;
mod security;
mod services;

pub use gateway_api::{desired as http_route_desired_status, status as http_route_status};
pub use routes::{subset_cluster_name, warnings as route_warnings};
pub use scope::view as rule_scope;
use services::ServiceInputs;

/// Everything sidecars are sent, by resource name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resources {
    /// Clusters by name.
    pub clusters: BTreeMap<String, Cluster>,
    /// Endpoint assignments by cluster name.
    pub endpoints: BTreeMap<String, ClusterLoadAssignment>,
    /// Routes by `service.namespace`.
    pub routes: BTreeMap<String, Route>,
    /// The namespaces whose proxies may see a service (`service.namespace`),
    /// from its `networking.istio.io/exportTo` annotation; a service not
    /// listed is seen by every proxy.
    pub exported: BTreeMap<String, Arc<[String]>>,
    /// PeerAuthentications by namespace (each seen by its namespace's
    /// proxies only, the mesh-wide one by every proxy).
    pub peer_auth: BTreeMap<String, v1::PeerAuthentication>,
    /// AuthorizationPolicies by `kind/namespace/name` (each seen by its
    /// namespace's proxies only, mesh-wide ones by every proxy).
    pub authz: BTreeMap<String, v1::Authorization>,
    /// What the proxies of some namespaces get instead, by namespace: the
    /// whole set as their DestinationRules make it (a rule of their own,
    /// or one exported to them alone). Empty in a view itself.
    pub scoped: BTreeMap<String, Resources>,
}

/// The Service annotation that limits which namespaces see it, as Istio's.
pub const EXPORT_TO: &str = "networking.istio.io/exportTo";

/// The namespaces a Service of `namespace` annotated `exportTo: value` is
/// visible to: `.` is its own, `*` every one (None), `~` none.
pub fn export_to(value: &str, namespace: &str) -> Option<Arc<[String]>> {
    let mut out = Vec::new();
    for v in value.split(',').map(str::trim).filter(|v| !v.is_empty()) {
        match v {
            "*" => return None,
            "." => out.push(namespace.to_string()),
            "~" => {}
            ns => out.push(ns.to_string()),
        }
    }
    out.sort();
    out.dedup();
    Some(out.into())
}

/// The service (`service.namespace`) a resource is about, from its name:
/// `svc.ns.svc.cluster.local:port`, `svc.ns.svc:port`, `svc.ns:port`, `svc.ns`,
/// and a subset's cluster, `svc.ns.svc.cluster.local:port|subset`.
pub fn service_of(resource: &str) -> Option<&str> {
    // A subset's cluster: `<port's cluster>|<subset>`.
    let resource = resource.split_once('|').map_or(resource, |(c, _)| c);
    let host = match resource.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => resource,
    };
    let host = host
        .strip_suffix(".svc.cluster.local")
        .or_else(|| host.strip_suffix(".svc"))
        .unwrap_or(host);
    (host.split('.').count() == 2).then_some(host)
}

/// What a rule's status says of a policy that standard clients (Envoy,
/// proxyless gRPC) do not all implement as named: the mapping
/// [`crate::xds_v3::clusters`] encodes (its table), said here, below the
/// encodings, because translation writes the rule's status.
pub fn standard_clients_note(policy: minimesh_proto::Policy) -> Option<&'static str> {
    use minimesh_proto::Policy;
    match policy {
        Policy::PeakEwma => Some(
            "xDS v3 clients (Envoy, proxyless gRPC) have no PEAK_EWMA: they are sent LEAST_REQUEST, the nearest standard policy (gRPC's C core, which lacks it, balances round robin)",
        ),
        Policy::LeastRequest => None,
        Policy::Random => Some("proxyless gRPC has no RANDOM: gRPC clients balance this service round robin (Envoy: RANDOM)"),
        Policy::Maglev => Some("proxyless gRPC has no MAGLEV: gRPC clients use a ring hash on the same hash key (Envoy: MAGLEV)"),
        _ => None,
    }
}

/// The name of the cluster for one service port.
pub fn cluster_name(service: &str, namespace: &str, port: u16) -> String {
    format!("{service}.{namespace}.svc.cluster.local:{port}")
}

/// The HTTP version sidecars speak to a Service port's endpoints, chosen as
/// Istio chooses a port's protocol: its `appProtocol`, else its name's
/// `<protocol>[-<suffix>]` prefix. gRPC and HTTP/2 ports get HTTP/2 (with
/// prior knowledge, as gRPC servers expect); every other port HTTP/1.1.
pub fn port_protocol(port: &ServicePort) -> UpstreamProtocol {
    let h2 = match (&port.app_protocol, &port.name) {
        (Some(app), _) => ["grpc", "grpc-web", "http2", "kubernetes.io/h2c"]
            .iter()
            .any(|p| app.eq_ignore_ascii_case(p)),
        (None, Some(name)) => {
            let proto = name.split('-').next().unwrap_or_default();
            proto.eq_ignore_ascii_case("grpc") || proto.eq_ignore_ascii_case("http2")
        }
        (None, None) => false,
    };
    if h2 {
        UpstreamProtocol::Http2
    } else {
        UpstreamProtocol::Http1
    }
}

/// How a sidecar proxies a captured connection to a Service port, by
/// Istio's protocol selection: the port's `appProtocol`, else its name's
/// `<protocol>[-<suffix>]` prefix. HTTP of every version (and gRPC) is
/// balanced per request; the protocols Istio treats as opaque TCP per
/// connection; anything else is detected from the client's first bytes.
pub fn port_kind(port: &ServicePort) -> PortProtocol {
    let declared = match (&port.app_protocol, &port.name) {
        (Some(app), _) => app.as_str(),
        (None, Some(name)) => name.split('-').next().unwrap_or_default(),
        (None, None) => "",
    };
    const HTTP: [&str; 7] = [
        "http",
        "http2",
        "grpc",
        "grpc-web",
        "kubernetes.io/h2c",
        "kubernetes.io/ws",
        "h2c",
    ];
    const TCP: [&str; 7] = [
        "tcp",
        "tls",
        "https",
        "mongo",
        "mysql",
        "redis",
        "kubernetes.io/wss",
    ];
    if HTTP.iter().any(|p| declared.eq_ignore_ascii_case(p)) {
        PortProtocol::Http
    } else if TCP.iter().any(|p| declared.eq_ignore_ascii_case(p)) {
        PortProtocol::Tcp
    } else {
        PortProtocol::Detect
    }
}

pub use crate::config::kube::resolve_host;

/// Translates the store. Which rule a caller gets for a service is Istio's
/// lookup ([`scope`]): its own namespace's, else the service's namespace's,
/// else the root namespace's, each as its `exportTo` allows. What callers
/// of most namespaces get is the default view; a namespace whose callers
/// get other rules has its own view in [`Resources::scoped`].
///
/// `load_weights` holds the LOAD_AWARE weights by cluster and endpoint
/// address; endpoints without one get the mean weight.
pub fn translate(
    store: &Store,
    load_weights: &BTreeMap<String, BTreeMap<String, u32>>,
) -> (Resources, BTreeMap<ObjectKey, RuleStatus>) {
    let mut status = BTreeMap::new();
    let mut overridden: BTreeMap<ObjectKey, Vec<String>> = BTreeMap::new();
    let scope = scope::Scope::of(store, &mut status, &mut overridden);
    let default_rules = scope.rules_for(None);
    let mut out = build(store, load_weights, &default_rules, &mut status);
    for ns in scope.namespaces() {
        let rules = scope.rules_for(Some(ns));
        if rules != default_rules {
            let view = build(store, load_weights, &rules, &mut status);
            out.scoped.insert(ns.to_string(), view);
        }
    }
    let services: BTreeSet<(String, String)> = store
        .services
        .keys()
        .map(|k| (k.name.clone(), k.namespace.clone()))
        .collect();
    // A rule that won its namespace's place: in force where some view
    // applies it (its clusters say where), waiting for its service, or
    // shadowed everywhere.
    for (target, key, rule) in scope.winners() {
        let policy = Some(rule.resolved.policy.as_str());
        if !services.contains(target) {
            status.insert(
                key.clone(),
                RuleStatus {
                    accepted: true,
                    reason: "NoService".into(),
                    message: format!(
                        "no Service {}/{} yet; the rule applies once it exists",
                        target.1, target.0
                    ),
                    policy,
                    clusters: vec![],
                    warnings: vec![],
                },
            );
            continue;
        }
        let Some(st) = status.get_mut(key) else {
            status.insert(
                key.clone(),
                RuleStatus {
                    accepted: false,
                    reason: "Conflict".into(),
                    message: format!(
                        "spec.host: no caller gets this rule for service {}.{}: spec.exportTo shows it to no namespace, or each that may see it gets another first (the caller's namespace's, then the service's, then {ROOT_NAMESPACE}'s); this rule is not applied",
                        target.0, target.1
                    ),
                    policy,
                    clusters: vec![],
                    warnings: vec![],
                },
            );
            continue;
        };
        st.clusters.sort();
        st.clusters.dedup();
        if key.namespace != target.1 && key.namespace != ROOT_NAMESPACE {
            let note = format!(
                "applies to callers in namespace {} only (Istio's lookup: the caller's namespace, then the service's, then {ROOT_NAMESPACE})",
                key.namespace
            );
            st.message = match st.message.is_empty() {
                true => note,
                false => format!("{note}; {}", st.message),
            };
        }
    }
    for (key, warnings) in overridden {
        if let Some(s) = status.get_mut(&key) {
            s.warnings.extend(warnings);
        }
    }
    (out, status)
}

/// The resources of one view: every service with the rule `rule_for`
/// gives it; the rules applied record their clusters in `status`.
fn build(
    store: &Store,
    load_weights: &BTreeMap<String, BTreeMap<String, u32>>,
    rule_for: &scope::RuleFor<'_>,
    status: &mut BTreeMap<ObjectKey, RuleStatus>,
) -> Resources {
    let mut out = Resources {
        peer_auth: security::peer_authentications(store),
        authz: store
            .authorizations
            .iter()
            .map(|(k, a)| {
                (
                    format!("{}/{}/{}", k.kind, k.namespace, k.name),
                    (**a).clone(),
                )
            })
            .collect(),
        ..Resources::default()
    };
    let service = ServiceInputs {
        store,
        load_weights,
        meshed: security::meshed_ips(store),
    };
    for (skey, svc) in &store.services {
        let rule = rule_for
            .get(&(skey.name.clone(), skey.namespace.clone()))
            .copied();
        service.add(&mut out, skey, svc, rule, status);
    }
    routes::apply_virtual_services(store, &mut out);
    routes::apply_gateways(store, &mut out);
    gateway_api::apply(store, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse::ISTIO_RULE_KIND;
    use minimesh_proto::v1::LbPolicy;

    fn store(yaml: &str) -> Store {
        let file = std::path::Path::new("test.yaml");
        let parsed = crate::config::parse::parse_documents(file, yaml, "default").expect("parses");
        let mut store = Store::default();
        for d in parsed.documents {
            let (Some(key), Ok(object)) = (d.key, d.result) else {
                panic!("a document was rejected");
            };
            store.insert(key, object, &file.to_path_buf());
        }
        store
    }

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: backend}\nspec: {ports: [{name: http, port: 80}, {name: grpc, port: 9000}]}\n";

    /// A rule for backend.default in `ns`, with `policy` and `exportTo`.
    fn rule(ns: &str, name: &str, policy: &str, export_to: &str) -> String {
        format!("---\napiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  host: backend.default.svc.cluster.local\n  exportTo: {export_to}\n  trafficPolicy: {{loadBalancer: {{simple: {policy}}}}}\n")
    }

    fn istio_key(namespace: &str, name: &str) -> ObjectKey {
        ObjectKey {
            kind: ISTIO_RULE_KIND,
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The policy of backend's port 80 as callers of `view` get it.
    fn policy_in(r: &Resources, view: Option<&str>) -> i32 {
        let name = "backend.default.svc.cluster.local:80";
        let c = view
            .and_then(|ns| r.scoped.get(ns))
            .map_or(&r.clusters[name], |v| &v.clusters[name]);
        c.policy
    }

    #[test]
    fn rules_are_looked_up_as_istio_does_callers_then_services_then_root() {
        let (rr, random, least) = (
            LbPolicy::RoundRobin as i32,
            LbPolicy::Random as i32,
            LbPolicy::LeastRequest as i32,
        );
        // A third namespace's rule: its own callers only.
        let s = store(&format!(
            "{SERVICE}{}",
            rule("aaa", "steal", "RANDOM", "[]")
        ));
        let (r, status) = translate(&s, &BTreeMap::new());
        assert_eq!(
            (policy_in(&r, None), policy_in(&r, Some("aaa"))),
            (least, random)
        );
        let st = &status[&istio_key("aaa", "steal")];
        assert!(st.accepted, "{st:?}");
        assert!(
            st.message
                .starts_with("applies to callers in namespace aaa only"),
            "{st:?}"
        );
        // The root's for everyone else; the service's own first.
        let s = store(&format!(
            "{SERVICE}{}{}{}",
            rule("aaa", "steal", "RANDOM", "[]"),
            rule("minimesh-system", "mesh", "ROUND_ROBIN", "[]"),
            rule("default", "own", "LEAST_REQUEST", "['.']"),
        ));
        let (r, status) = translate(&s, &BTreeMap::new());
        // `own` is for its namespace's callers only: the others get the root's.
        assert_eq!(policy_in(&r, None), rr);
        assert_eq!(policy_in(&r, Some("default")), least);
        assert_eq!(policy_in(&r, Some("aaa")), random);
        assert!(r.scoped.contains_key("default") && r.scoped.contains_key("aaa"));
        assert!(
            !r.scoped.contains_key("minimesh-system"),
            "the root's callers see the default"
        );
        assert!(status.values().all(|s| s.accepted), "{status:?}");
        // Exported to every namespace, `own` shadows the root's everywhere
        // but in the root namespace, whose callers' own rule comes first.
        let s = store(&format!(
            "{SERVICE}{}{}",
            rule("minimesh-system", "mesh", "ROUND_ROBIN", "['*']"),
            rule("default", "own", "RANDOM", "[]"),
        ));
        let (r, _) = translate(&s, &BTreeMap::new());
        assert_eq!(policy_in(&r, None), random);
        assert_eq!(policy_in(&r, Some("minimesh-system")), rr);
        assert_eq!(r.scoped.keys().collect::<Vec<_>>(), ["minimesh-system"]);
        // Exported to none, a rule is nobody's: not applied, and says so.
        let s = store(&format!(
            "{SERVICE}{}",
            rule("default", "own", "RANDOM", "['~']")
        ));
        let (r, status) = translate(&s, &BTreeMap::new());
        assert_eq!((policy_in(&r, None), r.scoped.len()), (least, 0));
        let own = &status[&istio_key("default", "own")];
        assert_eq!(
            (own.accepted, own.reason.as_str()),
            (false, "Conflict"),
            "{own:?}"
        );
        // Named namespaces: bbb gets the service's rule, others none.
        let s = store(&format!(
            "{SERVICE}{}",
            rule("default", "own", "RANDOM", "[bbb]")
        ));
        let (r, _) = translate(&s, &BTreeMap::new());
        assert_eq!(policy_in(&r, None), least);
        assert_eq!(policy_in(&r, Some("bbb")), random);
        assert_eq!(
            policy_in(&r, Some("default")),
            least,
            "not exported to its own namespace"
        );
        // What `minimesh get rules` shows of it.
        assert_eq!(
            rule_scope(&s),
            vec![
                serde_json::json!({"service": "backend.default", "callers": [
                    {"namespace": "*", "rule": null},
                    {"namespace": "bbb", "rule": "default/own"},
                ]})
            ]
        );
    }

    #[test]
    fn a_service_with_no_rule_gets_what_a_rule_that_sets_nothing_gets() {
        let none = store(SERVICE);
        let empty = store(&format!(
            "{SERVICE}---\napiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: backend}}\nspec: {{host: backend, trafficPolicy: {{}}}}\n"
        ));
        let (none, _) = translate(&none, &BTreeMap::new());
        let (empty, status) = translate(&empty, &BTreeMap::new());
        assert_eq!(none.clusters.len(), 2);
        for (name, cluster) in &none.clusters {
            let mut ruled = empty.clusters[name].clone();
            assert_eq!(ruled.rule, "default/backend");
            ruled.rule.clear();
            assert_eq!(cluster, &ruled, "{name}");
        }
        // What both are: LEAST_REQUEST, two retries on connect failure within
        // a 20% budget, outlier detection on, the port's protocol.
        let c = &none.clusters["backend.default.svc.cluster.local:80"];
        assert_eq!(c.policy, LbPolicy::LeastRequest as i32);
        assert_eq!((c.retry_attempts, c.retry_budget_percent), (2, 20));
        assert_eq!(
            c.outlier_detection.as_ref().map(|o| o.consecutive_5xx),
            Some(5)
        );
        assert_eq!(c.upstream_protocol, UpstreamProtocol::Http1 as i32);
        let c = &none.clusters["backend.default.svc.cluster.local:9000"];
        assert_eq!(c.upstream_protocol, UpstreamProtocol::Http2 as i32);
        assert!(status.values().all(|s| s.accepted));
    }

    #[test]
    fn an_istio_rule_of_the_same_name_is_kept_apart_and_the_minimesh_one_applies() {
        let rule = |api: &str, name: &str, policy: &str| {
            format!("---\napiVersion: {api}\nkind: DestinationRule\nmetadata: {{name: {name}}}\nspec: {{host: backend, trafficPolicy: {{loadBalancer: {{simple: {policy}}}}}}}\n")
        };
        // In either order, and even when Istio's sorts first by name.
        for (istio_name, yaml_first_istio) in [("backend", true), ("a-backend", false)] {
            let istio = rule("networking.istio.io/v1", istio_name, "RANDOM");
            let ours = rule("minimesh.io/v1alpha1", "backend", "ROUND_ROBIN");
            let yaml = if yaml_first_istio {
                format!("{SERVICE}{istio}{ours}")
            } else {
                format!("{SERVICE}{ours}{istio}")
            };
            let s = store(&yaml);
            assert_eq!(s.rules.len(), 2, "two objects, not one");
            let (out, status) = translate(&s, &BTreeMap::new());
            let c = &out.clusters["backend.default.svc.cluster.local:80"];
            assert_eq!(c.policy, LbPolicy::RoundRobin as i32);
            let key = |kind, name: &str| ObjectKey {
                kind,
                namespace: "default".into(),
                name: name.into(),
            };
            let theirs = &status[&key(ISTIO_RULE_KIND, istio_name)];
            assert_eq!(
                (theirs.accepted, theirs.reason.as_str()),
                (false, "Conflict")
            );
            let ours = &status[&key("DestinationRule", "backend")];
            assert!(ours.accepted);
            assert_eq!(
                ours.warnings,
                [format!("Istio's DestinationRule default/{istio_name} (networking.istio.io) also names service backend.default; this rule is applied and that one is ignored")]
            );
        }
    }

    #[test]
    fn export_to_reads_istios_values_and_resource_names_map_to_services() {
        let to = |v: &str| export_to(v, "shop").map(|t| t.to_vec());
        assert_eq!(to("*"), None);
        assert_eq!(to("."), Some(vec!["shop".to_string()]));
        assert_eq!(to("~"), Some(vec![]));
        assert_eq!(
            to("b, ., a"),
            Some(vec!["a".into(), "b".into(), "shop".into()])
        );
        assert_eq!(to("a,*"), None);
        for name in [
            "web.shop.svc.cluster.local:80",
            "web.shop.svc:8080",
            "web.shop:80",
            "web.shop",
        ] {
            assert_eq!(service_of(name), Some("web.shop"), "{name}");
        }
        assert_eq!(service_of("minimesh-outbound"), None);
    }

    #[test]
    fn an_applied_gateway_host_takes_the_place_of_the_topologys_own() {
        let web = "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {ports: [{name: http, port: 80}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: canary}\nspec: {ports: [{name: http, port: 80}]}\n";
        let gateway = |name: &str, labels: &str| {
            format!("---\napiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata: {{name: {name}{labels}}}\nspec:\n  selector: {{istio: ingressgateway}}\n  servers: [{{port: {{number: 80, name: http, protocol: HTTP}}, hosts: [web.example]}}]\n---\napiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {{name: {name}{labels}}}\nspec:\n  hosts: [web.example]\n  gateways: [{name}]\n  http: [{{route: [{{destination: {{host: {}}}}}]}}]\n", if labels.is_empty() { "canary" } else { "web" })
        };
        // `a-ingress` sorts first: order is not what decides.
        let made = gateway(
            "a-ingress",
            ", labels: {minimesh.io/from-topology: ingress}",
        );
        let backend = |s: &Store| {
            let (res, _) = translate(s, &BTreeMap::new());
            let hosts: Vec<(String, String)> = res
                .routes
                .iter()
                .filter(|(_, r)| r.service == "web.example")
                .map(|(k, r)| {
                    (
                        k.clone(),
                        r.ports[0].http_routes[0].clusters[0].cluster.clone(),
                    )
                })
                .collect();
            hosts
        };
        let alone = store(&format!("{web}{made}"));
        assert_eq!(
            backend(&alone),
            [(
                "default/a-ingress|web.example".to_string(),
                "web.default.svc.cluster.local:80".to_string()
            )]
        );
        let both = store(&format!("{web}{made}{}", gateway("book", "")));
        assert_eq!(
            backend(&both),
            [(
                "default/book|web.example".to_string(),
                "canary.default.svc.cluster.local:80".to_string()
            )]
        );
    }

    #[test]
    fn hosts_resolve() {
        assert_eq!(resolve_host("b", "ns"), Some(("b".into(), "ns".into())));
        assert_eq!(
            resolve_host("b.x.svc.cluster.local", "ns"),
            Some(("b".into(), "x".into()))
        );
        assert_eq!(resolve_host("b.x.example.com", "ns"), None);
    }

    /// Port 80 named `name` with `appProtocol` `app`.
    fn port(name: Option<&str>, app: Option<&str>) -> ServicePort {
        ServicePort {
            name: name.map(str::to_string),
            port: 80,
            target_port: None,
            protocol: None,
            app_protocol: app.map(str::to_string),
        }
    }

    #[test]
    fn port_protocol_follows_app_protocol_then_the_name() {
        let h2 = UpstreamProtocol::Http2;
        let h1 = UpstreamProtocol::Http1;
        for (name, app, want) in [
            (None, None, h1),
            (Some("http"), None, h1),
            (Some("grpc"), None, h2),
            (Some("grpc-api"), None, h2),
            (Some("GRPC-web"), None, h2),
            (Some("http2-web"), None, h2),
            (Some("http2x"), None, h1),
            (Some("web"), Some("grpc"), h2),
            (Some("web"), Some("kubernetes.io/h2c"), h2),
            (Some("web"), Some("HTTP2"), h2),
            // appProtocol wins over the name, as in Istio.
            (Some("grpc"), Some("http"), h1),
            (None, Some("kubernetes.io/ws"), h1),
        ] {
            assert_eq!(port_protocol(&port(name, app)), want, "{name:?} {app:?}");
        }
    }

    #[test]
    fn captured_ports_are_http_tcp_or_detected_as_istio_selects_them() {
        let (http, tcp, detect) = (PortProtocol::Http, PortProtocol::Tcp, PortProtocol::Detect);
        for (name, app, want) in [
            (None, None, detect),
            (Some("web"), None, detect),
            (Some("http"), None, http),
            (Some("http-web"), None, http),
            (Some("HTTP2"), None, http),
            (Some("grpc-api"), None, http),
            (Some("tcp-db"), None, tcp),
            (Some("tls"), None, tcp),
            (Some("https"), None, tcp),
            (Some("mysql"), None, tcp),
            (Some("httpx"), None, detect),
            (Some("web"), Some("kubernetes.io/h2c"), http),
            // appProtocol wins over the name.
            (Some("http"), Some("tcp"), tcp),
            (Some("tcp"), Some("grpc"), http),
            (Some("http"), Some("custom"), detect),
        ] {
            assert_eq!(port_kind(&port(name, app)), want, "{name:?} {app:?}");
        }
    }

    #[test]
    fn routes_carry_the_services_cluster_ips() {
        let spec: crate::config::kube::ServiceSpec = serde_json::from_value(serde_json::json!({
            "clusterIP": "198.19.0.10",
            "clusterIPs": ["198.19.0.10", "fd00::10"],
            "ports": [{"port": 80}]
        }))
        .expect("spec");
        let ips: Vec<String> = spec.virtual_ips().iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["198.19.0.10", "fd00::10"]);
        let headless: crate::config::kube::ServiceSpec =
            serde_json::from_value(serde_json::json!({"clusterIP": "None"})).expect("spec");
        assert!(headless.virtual_ips().is_empty());
    }
}
