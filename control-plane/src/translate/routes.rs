//! The route model translated: a DestinationRule's subsets become clusters
//! of their own (the Service port's cluster, its endpoints narrowed to the
//! pods carrying the subset's labels), and each VirtualService's routes go
//! onto the ports of the Services it routes, with every backend resolved to
//! a cluster name. A route that only sets the timeout and retries of its
//! own Service is sent as that cluster's settings instead, understood by
//! every client (sidecars, Envoy, gRPC).

use minimesh_proto::v1::{self, string_match::Kind, Cluster, ClusterLoadAssignment, Route};

use super::Resources;
use crate::config::parse::ObjectKey;
use crate::config::route::{self, HttpRoute, RouteAction};
use crate::config::rule::Subset;
use crate::config::virtual_service::{ValidVirtualService, FROM_TOPOLOGY};
use crate::store::Store;

/// The name of a subset's cluster: the port's cluster's and the subset's.
pub fn subset_cluster_name(cluster: &str, subset: &str) -> String {
    format!("{cluster}|{subset}")
}

/// Adds the clusters of `subsets` of the Service port whose cluster is
/// `cluster`, with the endpoints (of `endpoints`) whose pods carry each
/// subset's labels; returns their names.
pub fn add_subset_clusters(
    out: &mut Resources,
    store: &Store,
    cluster: &Cluster,
    endpoints: &[v1::Endpoint],
    subsets: &[Subset],
) -> Vec<String> {
    let mut names = Vec::new();
    for s in subsets {
        let name = subset_cluster_name(&cluster.name, &s.name);
        let selected = endpoints
            .iter()
            .filter(|e| {
                let key = ObjectKey {
                    kind: "Pod",
                    namespace: cluster.namespace.clone(),
                    name: e.pod.clone(),
                };
                store.pods.get(&key).is_some_and(|p| {
                    s.labels
                        .iter()
                        .all(|(k, v)| p.metadata.labels.get(k) == Some(v))
                })
            })
            .cloned()
            .collect();
        out.endpoints.insert(
            name.clone(),
            ClusterLoadAssignment {
                cluster_name: name.clone(),
                endpoints: selected,
            },
        );
        out.clusters.insert(
            name.clone(),
            Cluster {
                name: name.clone(),
                ..cluster.clone()
            },
        );
        names.push(name);
    }
    names
}

/// Puts every applied VirtualService's routes onto the ports of the
/// Services it routes (those that exist).
pub fn apply_virtual_services(store: &Store, out: &mut Resources) {
    for (v, _) in store.virtual_services.values() {
        for service in &v.services {
            let key = format!("{}.{}", service.0, service.1);
            let Some(mut r) = out.routes.remove(&key) else {
                continue;
            };
            for pc in &mut r.ports {
                port_routes(v, service, pc, out);
            }
            out.routes.insert(key, r);
        }
    }
}

/// The routes of `v` that apply to the port `pc` of `service`: on the
/// port, or as its cluster's settings.
fn port_routes(
    v: &ValidVirtualService,
    service: &(String, String),
    pc: &mut v1::PortCluster,
    out: &mut Resources,
) {
    let port = pc.port;
    // A route applies to a port when one of its matches does (a match
    // without a port applies to every port).
    let here: Vec<HttpRoute> = v
        .routes
        .iter()
        .filter_map(|r| {
            if r.matches.is_empty() {
                return Some(r.clone());
            }
            let kept: Vec<_> = r
                .matches
                .iter()
                .filter(|m| m.port.is_none_or(|p| p == port))
                .cloned()
                .collect();
            (!kept.is_empty()).then(|| HttpRoute {
                matches: kept,
                ..r.clone()
            })
        })
        .collect();
    match here.as_slice() {
        [] => {}
        [only] if only.is_plain(service) => {
            let RouteAction::Forward(b) = &only.action else {
                return;
            };
            if b[0].port.is_none_or(|p| p == port) {
                if let Some(c) = out.clusters.get_mut(&pc.cluster) {
                    cluster_settings(c, only);
                }
            }
        }
        routes => {
            pc.http_routes = routes
                .iter()
                .map(|r| encode(r, service, port, out))
                .collect();
        }
    }
}

/// A plain route's timeout and retries over its cluster's: they take the
/// place of the DestinationRule's (Istio's precedence: there they are the
/// VirtualService's alone); what it leaves unset stays.
fn cluster_settings(cluster: &mut Cluster, r: &HttpRoute) {
    if let Some(t) = r.timeout {
        cluster.timeout_ms = t.as_millis() as u64;
    }
    if let Some(x) = &r.retries {
        if let Some(a) = x.attempts {
            cluster.retry_attempts = a;
        }
        if let Some(t) = x.per_try_timeout {
            cluster.per_try_timeout_ms = t.as_millis() as u64;
        }
        if let Some((bits, codes)) = &x.retry_on {
            cluster.retry_on = *bits;
            cluster.retriable_status_codes = codes.clone();
        }
    }
}

/// The cluster a backend names: its Service's port (the one it names, the
/// port the request came to on the same Service, or its Service's only
/// port), and its subset's cluster when it names one. A backend that
/// resolves to no cluster is still named (its requests get 503 at the
/// sidecar, as Istio's "no cluster").
fn backend_cluster(
    b: &route::Backend,
    service: &(String, String),
    port: u32,
    out: &Resources,
) -> String {
    let ports: Vec<u32> = out
        .routes
        .get(&format!("{}.{}", b.service.0, b.service.1))
        .map(|r| r.ports.iter().map(|p| p.port).collect())
        .unwrap_or_default();
    let port = match b.port {
        Some(p) => p,
        None if b.service == *service => port,
        None => match ports.as_slice() {
            [only] => *only,
            _ => ports.iter().copied().find(|p| *p == 80).unwrap_or(port),
        },
    };
    let cluster = super::cluster_name(&b.service.0, &b.service.1, port as u16);
    match &b.subset {
        Some(s) => subset_cluster_name(&cluster, s),
        None => cluster,
    }
}

fn string_match(m: &route::StringMatch) -> v1::StringMatch {
    let kind = match m {
        route::StringMatch::Exact(s) => Kind::Exact(s.clone()),
        route::StringMatch::Prefix(s) => Kind::Prefix(s.clone()),
        route::StringMatch::PathPrefix(s) => Kind::PathPrefix(s.clone()),
        route::StringMatch::Regex(s) => Kind::Regex(s.clone()),
    };
    v1::StringMatch { kind: Some(kind) }
}

fn header_ops(h: &route::HeaderOps) -> Option<v1::HeaderOps> {
    let pairs = |l: &[(String, String)]| {
        l.iter()
            .map(|(name, value)| v1::HeaderValue {
                name: name.clone(),
                value: value.clone(),
            })
            .collect()
    };
    (!h.is_empty()).then(|| v1::HeaderOps {
        set: pairs(&h.set),
        add: pairs(&h.add),
        remove: h.remove.clone(),
    })
}

/// A route on the wire, for port `port` of `service`.
pub(super) fn encode(
    r: &HttpRoute,
    service: &(String, String),
    port: u32,
    out: &Resources,
) -> v1::HttpRoute {
    let mut wire = v1::HttpRoute {
        name: r.name.clone(),
        matches: r
            .matches
            .iter()
            .map(|m| v1::RouteMatch {
                path: m.path.as_ref().map(string_match),
                headers: m
                    .headers
                    .iter()
                    .map(|h| v1::HeaderMatch {
                        name: h.name.clone(),
                        value: h.value.as_ref().map(string_match),
                        invert: h.invert,
                    })
                    .collect(),
                method: m.method.clone().unwrap_or_default(),
                query: m
                    .query
                    .iter()
                    .map(|(name, v)| v1::QueryMatch {
                        name: name.clone(),
                        value: v.as_ref().map(string_match),
                    })
                    .collect(),
            })
            .collect(),
        timeout_ms: r.timeout.map(|t| t.as_millis() as u64),
        retry: r.retries.as_ref().map(|x| v1::RouteRetry {
            attempts: x.attempts.unwrap_or(0),
            per_try_timeout_ms: x.per_try_timeout.map_or(0, |t| t.as_millis() as u64),
            retry_on: x.retry_on.as_ref().map(|(bits, _)| *bits),
            retriable_status_codes: x
                .retry_on
                .as_ref()
                .map(|(_, c)| c.clone())
                .unwrap_or_default(),
        }),
        request_headers: header_ops(&r.request_headers),
        response_headers: header_ops(&r.response_headers),
        rewrite: r.rewrite.as_ref().map(|rw| v1::Rewrite {
            prefix: rw.prefix.clone().unwrap_or_default(),
            path: rw.path.clone().unwrap_or_default(),
            authority: rw.authority.clone().unwrap_or_default(),
        }),
        fault: r.fault.as_ref().map(|f| v1::Fault {
            delay_percent: f.delay.map_or(0.0, |d| d.0),
            delay_ms: f.delay.map_or(0, |d| d.1.as_millis() as u64),
            abort_percent: f.abort.map_or(0.0, |a| a.0),
            abort_status: f.abort.map_or(0, |a| u32::from(a.1)),
        }),
        ..Default::default()
    };
    // A route's retries that leave `attempts` unset keep the cluster's.
    if let (Some(x), Some(w)) = (&r.retries, &mut wire.retry) {
        if x.attempts.is_none() {
            let own = super::cluster_name(&service.0, &service.1, port as u16);
            w.attempts = out.clusters.get(&own).map_or(0, |c| c.retry_attempts);
        }
    }
    match &r.action {
        RouteAction::Forward(backends) => {
            wire.clusters = backends
                .iter()
                .map(|b| v1::WeightedCluster {
                    cluster: backend_cluster(b, service, port, out),
                    weight: b.weight,
                    request_headers: header_ops(&b.request_headers),
                    response_headers: header_ops(&b.response_headers),
                })
                .collect();
        }
        RouteAction::Redirect(rd) => {
            wire.redirect = Some(v1::Redirect {
                scheme: rd.scheme.clone().unwrap_or_default(),
                host: rd.host.clone().unwrap_or_default(),
                port: rd.port.unwrap_or(0),
                path: rd.path.clone().unwrap_or_default(),
                prefix: rd.prefix.clone().unwrap_or_default(),
                status: u32::from(rd.status),
            })
        }
        RouteAction::Direct(s) => wire.direct_status = u32::from(*s),
    }
    wire
}

/// The key of a Gateway's host among the routes (never a Service's:
/// `service.namespace` has no `|`).
pub fn gateway_route_key(gateway: &(String, String), host: &str) -> String {
    format!("{}/{}|{host}", gateway.0, gateway.1)
}

/// Puts every host a Gateway binds and a VirtualService bound to it routes
/// into the routes, as the gateways that Gateway selects serve them.
/// A host bound at the same gateways (Gateways with one selector) by more
/// than one VirtualService goes to the first: those applied before those
/// `minimesh up` made of a topology's `ingress.hosts` ([`FROM_TOPOLOGY`]),
/// so that the book's Gateway takes the place of the topology's own host.
pub fn apply_gateways(store: &Store, out: &mut Resources) {
    let none = (String::new(), String::new());
    let made = |v: &ValidVirtualService| made_of_topology(v);
    let applied = store.virtual_services.iter().filter(|(_, (v, _))| !made(v));
    let generated = store.virtual_services.iter().filter(|(_, (v, _))| made(v));
    for (vkey, (v, _)) in applied.chain(generated) {
        for gw in &v.gateways {
            let key = ObjectKey {
                kind: "Gateway",
                namespace: gw.0.clone(),
                name: gw.1.clone(),
            };
            let Some(g) = store.gateways.get(&key) else {
                continue;
            };
            for host in &v.gateway_hosts {
                let Some((port, _)) = g
                    .binds
                    .iter()
                    .find(|(_, p)| p.allows(&vkey.namespace, host))
                else {
                    continue;
                };
                let rkey = gateway_route_key(gw, host);
                if out.routes.contains_key(&rkey) {
                    continue; // the first VirtualService in order has it (the store refused others)
                }
                let selector: std::collections::HashMap<String, String> =
                    g.selector.clone().into_iter().collect();
                let taken = out.routes.values().any(|r| {
                    !r.gateway.is_empty() && r.service == *host && r.gateway_selector == selector
                });
                if taken && made(v) {
                    continue;
                }
                let here: Vec<HttpRoute> = v
                    .routes
                    .iter()
                    .filter(|r| {
                        r.matches.is_empty()
                            || r.matches.iter().any(|m| m.port.is_none_or(|p| p == *port))
                    })
                    .cloned()
                    .collect();
                let http_routes = here.iter().map(|r| encode(r, &none, *port, out)).collect();
                out.routes.insert(
                    rkey,
                    Route {
                        service: host.clone(),
                        namespace: gw.0.clone(),
                        ports: vec![v1::PortCluster {
                            port: *port,
                            cluster: String::new(),
                            protocol: v1::PortProtocol::Http as i32,
                            http_routes,
                        }],
                        default_port: *port,
                        cluster_ips: vec![],
                        gateway: format!("{}/{}", gw.0, gw.1),
                        gateway_selector: selector,
                    },
                );
            }
        }
    }
}

/// Whether `minimesh up` made it of a topology's `ingress.hosts`.
fn made_of_topology(v: &ValidVirtualService) -> bool {
    v.virtual_service
        .metadata
        .labels
        .contains_key(FROM_TOPOLOGY)
}

/// The hosts of a VirtualService made of a topology that an applied one
/// routes at the same gateways (Gateways with the same selector), each with
/// that one's key.
fn yielded<'a>(store: &'a Store, v: &ValidVirtualService) -> Vec<(&'a str, &'a ObjectKey)> {
    let selector = |gw: &(String, String)| {
        let key = ObjectKey {
            kind: "Gateway",
            namespace: gw.0.clone(),
            name: gw.1.clone(),
        };
        store.gateways.get(&key).map(|g| &g.selector)
    };
    let ours: Vec<_> = v.gateways.iter().filter_map(selector).collect();
    let mut out = Vec::new();
    for (okey, (o, _)) in &store.virtual_services {
        if made_of_topology(o)
            || !o
                .gateways
                .iter()
                .filter_map(selector)
                .any(|s| ours.contains(&s))
        {
            continue;
        }
        for h in &o.gateway_hosts {
            if v.gateway_hosts.contains(h) {
                out.push((h.as_str(), okey));
            }
        }
    }
    out
}

/// What keeps a VirtualService from doing all it says, for its status:
/// Gateways that do not exist or bind none of its hosts, destinations that
/// are no Service, subsets no rule of the Service defines.
pub fn warnings(store: &Store, vkey: &ObjectKey, v: &ValidVirtualService) -> Vec<String> {
    let mut out = Vec::new();
    for gw in &v.gateways {
        let key = ObjectKey {
            kind: "Gateway",
            namespace: gw.0.clone(),
            name: gw.1.clone(),
        };
        match store.gateways.get(&key) {
            None => out.push(format!(
                "spec.gateways: Gateway {}/{} does not exist; its hosts are not served until it does",
                gw.0, gw.1
            )),
            Some(g) => {
                for h in &v.gateway_hosts {
                    if !g.binds.iter().any(|(_, p)| p.allows(&vkey.namespace, h)) {
                        out.push(format!(
                            "spec.hosts: Gateway {}/{} binds no server to host {h} for namespace {}; it is not served there",
                            gw.0, gw.1, vkey.namespace
                        ));
                    }
                }
            }
        }
    }
    if made_of_topology(v) {
        for (h, other) in yielded(store, v) {
            out.push(format!(
                "spec.hosts: {h} is routed by VirtualService {}/{}, applied for the same gateways; this one takes it back when that one goes",
                other.namespace, other.name
            ));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for r in &v.routes {
        let RouteAction::Forward(backends) = &r.action else {
            continue;
        };
        for b in backends {
            if !seen.insert((b.service.clone(), b.subset.clone())) {
                continue;
            }
            let skey = ObjectKey {
                kind: "Service",
                namespace: b.service.1.clone(),
                name: b.service.0.clone(),
            };
            if !store.services.contains_key(&skey) {
                out.push(format!(
                    "destination {}.{} is not a Service (yet); its share of requests is answered 503",
                    b.service.0, b.service.1
                ));
                continue;
            }
            if let Some(subset) = &b.subset {
                let defined = store.rules.iter().any(|(k, (rule, _))| {
                    crate::config::kube::resolve_host(&rule.rule.spec.host, &k.namespace)
                        .is_some_and(|s| s == b.service)
                        && rule.subsets.iter().any(|s| &s.name == subset)
                });
                if !defined {
                    out.push(format!(
                        "destination {}.{} subset {subset}: no DestinationRule of that Service defines it; its share of requests is answered 503",
                        b.service.0, b.service.1
                    ));
                }
            }
        }
    }
    out
}
