//! The Gateway API's HTTPRoutes translated: those attached to a Service go
//! onto its ports (mesh traffic, as GAMMA defines), those attached to a
//! Gateway of class `minimesh` onto the hosts its listeners take, each
//! host's matches across every route in the Gateway API's precedence. And
//! each route's status per parent, as the spec's conditions.

use std::collections::BTreeMap;

use minimesh_proto::v1::{self, Route};

use super::routes::{encode, gateway_route_key};
use super::Resources;
use crate::config::gateway_api::{Parent, Precedence, ValidHttpRoute, GATEWAY_NAME_LABEL};
use crate::config::parse::{ObjectKey, K8S_GATEWAY_KIND};
use crate::config::route::HttpRoute;
use crate::store::Store;

mod status;
pub use status::{desired, status};

/// Whether a listener's hostname (None: any) takes `host`.
fn listener_takes(listener: Option<&str>, host: &str) -> bool {
    match listener {
        None => true,
        Some(l) => match l.strip_prefix('*') {
            Some(suffix) => host.ends_with(suffix) && host.len() > suffix.len(),
            None => l == host,
        },
    }
}

/// The hosts a route takes at a listener: its hostnames the listener
/// takes, or the listener's hostname (`*`: any) when the route names none.
pub(super) fn hosts_at(r: &ValidHttpRoute, listener: Option<&str>) -> Vec<String> {
    if r.hostnames.is_empty() {
        return vec![listener.unwrap_or("*").to_string()];
    }
    r.hostnames
        .iter()
        .filter(|h| listener_takes(listener, h))
        .cloned()
        .collect()
}

/// A listener a route attaches to: its port and hostname.
pub(super) type Listening = (u32, Option<String>);

/// The listeners of the Gateway a parent names that the route in
/// `namespace` attaches to: (port, hostname).
pub(super) fn listeners_of(
    store: &Store,
    gw: &(String, String),
    section: Option<&str>,
    port: Option<u32>,
    namespace: &str,
) -> Result<Vec<Listening>, (&'static str, String)> {
    let key = ObjectKey {
        kind: K8S_GATEWAY_KIND,
        namespace: gw.0.clone(),
        name: gw.1.clone(),
    };
    let Some(Some(g)) = store.k8s_gateways.get(&key) else {
        return Err((
            "NoMatchingParent",
            format!("no Gateway {}/{} of class minimesh", gw.0, gw.1),
        ));
    };
    let out: Vec<_> = g
        .listeners
        .iter()
        .filter(|(name, p, _, _)| section.is_none_or(|s| s == name) && port.is_none_or(|q| q == *p))
        .filter(|(_, _, _, all)| *all || namespace == gw.0)
        .map(|(_, p, h, _)| (*p, h.clone()))
        .collect();
    if out.is_empty() {
        return Err((
            "NotAllowedByListeners",
            format!(
                "no listener of Gateway {}/{} takes routes of namespace {namespace} there",
                gw.0, gw.1
            ),
        ));
    }
    Ok(out)
}

type Ranked = Vec<(Precedence, HttpRoute)>;

/// Puts every HTTPRoute's routes onto the Services and Gateway hosts it
/// attaches to. A Service a VirtualService routes keeps the VirtualService's
/// routes (its HTTPRoutes' status says so).
pub fn apply(store: &Store, out: &mut Resources) {
    let vs_services: Vec<&(String, String)> = store
        .virtual_services
        .values()
        .flat_map(|(v, _)| &v.services)
        .collect();
    // Mesh: Service (and port, None for every one) -> ranked routes.
    let mut mesh: BTreeMap<((String, String), Option<u32>), Ranked> = BTreeMap::new();
    // Gateways: (gateway, port, host) -> ranked routes.
    let mut hosts: BTreeMap<((String, String), u32, String), Ranked> = BTreeMap::new();
    for (key, r) in &store.http_routes {
        for p in &r.parents {
            match p {
                Parent::Service(s, port) => {
                    if vs_services.contains(&s) {
                        continue;
                    }
                    mesh.entry((s.clone(), *port))
                        .or_default()
                        .extend(r.routes.iter().cloned());
                }
                Parent::Gateway(gw, section, port) => {
                    let Ok(listeners) =
                        listeners_of(store, gw, section.as_deref(), *port, &key.namespace)
                    else {
                        continue;
                    };
                    for (lport, lhost) in listeners {
                        for h in hosts_at(r, lhost.as_deref()) {
                            hosts
                                .entry((gw.clone(), lport, h))
                                .or_default()
                                .extend(r.routes.iter().cloned());
                        }
                    }
                }
            }
        }
    }
    for ((service, port), mut ranked) in mesh {
        ranked.sort_by(|a, b| a.0.cmp(&b.0));
        let key = format!("{}.{}", service.0, service.1);
        let Some(mut route) = out.routes.remove(&key) else {
            continue;
        };
        for pc in route
            .ports
            .iter_mut()
            .filter(|pc| port.is_none_or(|p| p == pc.port))
        {
            let p = pc.port;
            pc.http_routes = ranked
                .iter()
                .map(|(_, r)| encode(r, &service, p, out))
                .collect();
        }
        out.routes.insert(key, route);
    }
    let none = (String::new(), String::new());
    for ((gw, port, host), mut ranked) in hosts {
        ranked.sort_by(|a, b| a.0.cmp(&b.0));
        let id = (format!("gateway.networking.k8s.io:{}", gw.0), gw.1.clone());
        let http_routes = ranked
            .iter()
            .map(|(_, r)| encode(r, &none, port, out))
            .collect();
        out.routes.insert(
            gateway_route_key(&id, &host),
            Route {
                service: host,
                namespace: gw.0.clone(),
                ports: vec![v1::PortCluster {
                    port,
                    cluster: String::new(),
                    protocol: v1::PortProtocol::Http as i32,
                    http_routes,
                }],
                default_port: port,
                cluster_ips: vec![],
                gateway: format!("gateway.networking.k8s.io/{}/{}", gw.0, gw.1),
                gateway_selector: [(GATEWAY_NAME_LABEL.to_string(), gw.1.clone())].into(),
            },
        );
    }
}
