//! The Gateway API's status of what minimesh serves: each HTTPRoute's
//! conditions per parent (`Accepted`, `ResolvedRefs`, with the spec's
//! reasons), and each Gateway of class `minimesh`'s own (`Accepted`,
//! `Programmed`, and per listener its attached routes), for the leader to
//! write and `minimesh get routes` to show.

use serde_json::{json, Value};

use super::{hosts_at, listeners_of};
use crate::config::gateway_api::{Parent, ValidGateway, ValidHttpRoute, GATEWAY_NAME_LABEL};
use crate::config::parse::{ObjectKey, K8S_GATEWAY_KIND};
use crate::config::route::RouteAction;
use crate::config::status::{DesiredRouteStatus, Wanted};
use crate::store::Store;

fn condition(kind: &str, ok: bool, reason: &str, message: String) -> Value {
    json!({"type": kind, "status": if ok { "True" } else { "False" }, "reason": reason, "message": message})
}

/// One parent's status: how `minimesh get routes` names it, the
/// `parentRef` as the Gateway API writes it, and the conditions.
pub struct ParentStatus {
    /// `Gateway default/web`, `Service default/web`.
    pub label: String,
    /// `{group, kind, namespace, name[, sectionName][, port]}`.
    pub parent_ref: Value,
    /// `Accepted` and `ResolvedRefs`.
    pub conditions: Vec<Value>,
}

/// An HTTPRoute's status for each of its parents, as the Gateway API's
/// `status.parents[]`: `Accepted` and `ResolvedRefs` with their reasons.
pub fn parents(store: &Store, key: &ObjectKey, r: &ValidHttpRoute) -> Vec<ParentStatus> {
    let mut missing = Vec::new();
    for (_, m) in &r.routes {
        if let RouteAction::Forward(backends) = &m.action {
            for b in backends {
                let skey = ObjectKey {
                    kind: "Service",
                    namespace: b.service.1.clone(),
                    name: b.service.0.clone(),
                };
                let name = format!("{}/{}", b.service.1, b.service.0);
                if !store.services.contains_key(&skey) && !missing.contains(&name) {
                    missing.push(name);
                }
            }
        }
    }
    let resolved = match missing.as_slice() {
        [] => condition(
            "ResolvedRefs",
            true,
            "ResolvedRefs",
            "every backend is a Service".into(),
        ),
        m => condition(
            "ResolvedRefs",
            false,
            "BackendNotFound",
            format!(
                "no Service {}: its share of requests is answered 503",
                m.join(", ")
            ),
        ),
    };
    let vs_for = |s: &(String, String)| {
        store
            .virtual_services
            .iter()
            .find(|(_, (v, _))| v.services.contains(s))
            .map(|(k, _)| format!("{}/{}", k.namespace, k.name))
    };
    r.parents
        .iter()
        .map(|p| {
            let (label, parent_ref, accepted) = match p {
                Parent::Service(s, port) => {
                    let skey = ObjectKey {
                        kind: "Service",
                        namespace: s.1.clone(),
                        name: s.0.clone(),
                    };
                    let accepted = if !store.services.contains_key(&skey) {
                        condition("Accepted", false, "NoMatchingParent", format!("no Service {}/{}", s.1, s.0))
                    } else if let Some(vs) = vs_for(s) {
                        condition(
                            "Accepted",
                            false,
                            "Conflicted",
                            format!("VirtualService {vs} routes Service {}/{}: it takes precedence, and this route is not applied to it", s.1, s.0),
                        )
                    } else {
                        condition("Accepted", true, "Accepted", "routes the Service's traffic from the mesh".into())
                    };
                    let mut parent_ref = json!({"group": "", "kind": "Service", "namespace": s.1, "name": s.0});
                    if let Some(port) = port {
                        parent_ref["port"] = json!(port);
                    }
                    (format!("Service {}/{}", s.1, s.0), parent_ref, accepted)
                }
                Parent::Gateway(gw, section, port) => {
                    let accepted = match listeners_of(store, gw, section.as_deref(), *port, &key.namespace) {
                        Err((reason, message)) => condition("Accepted", false, reason, message),
                        Ok(listeners) => {
                            let any = listeners.iter().any(|(_, h)| !hosts_at(r, h.as_deref()).is_empty());
                            if any {
                                condition("Accepted", true, "Accepted", "attached".into())
                            } else {
                                condition(
                                    "Accepted",
                                    false,
                                    "NoMatchingListenerHostname",
                                    "no listener takes any of its hostnames".into(),
                                )
                            }
                        }
                    };
                    let mut parent_ref = json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": gw.0, "name": gw.1});
                    if let Some(s) = section {
                        parent_ref["sectionName"] = json!(s);
                    }
                    if let Some(port) = port {
                        parent_ref["port"] = json!(port);
                    }
                    (format!("Gateway {}/{}", gw.0, gw.1), parent_ref, accepted)
                }
            };
            ParentStatus {
                label,
                parent_ref,
                conditions: vec![accepted, resolved.clone()],
            }
        })
        .collect()
}

/// An HTTPRoute as `/debug/config` lists it: its routes and each parent's
/// conditions.
pub fn status(store: &Store, key: &ObjectKey, r: &ValidHttpRoute) -> Value {
    let parents: Vec<Value> = parents(store, key, r)
        .into_iter()
        .map(|p| json!({"parentRef": p.label, "controllerName": "minimesh.io/gateway-controller", "conditions": p.conditions}))
        .collect();
    json!({
        "namespace": key.namespace,
        "name": key.name,
        "hostnames": r.hostnames,
        "routes": r.routes.iter().map(|(_, m)| crate::config::route::view(m)).collect::<Vec<_>>(),
        "parents": parents,
    })
}

/// What the status writer writes: for every HTTPRoute minimesh's
/// `status.parents` entries; for every Gateway of class `minimesh` its
/// conditions and listeners ([`gateway`]), and for one it refused,
/// `Accepted` and `Programmed` False with the field and the reason.
pub fn desired(store: &Store) -> DesiredRouteStatus {
    let mut out: DesiredRouteStatus = store
        .http_routes
        .iter()
        .map(|(k, r)| {
            let entries = parents(store, k, r)
                .into_iter()
                .map(|p| json!({"parentRef": p.parent_ref, "conditions": p.conditions}))
                .collect();
            (k.clone(), Wanted::Parents(entries))
        })
        .collect();
    for (k, g) in &store.k8s_gateways {
        if let Some(g) = g {
            out.insert(k.clone(), Wanted::Gateway(gateway(store, k, g)));
        }
    }
    for (k, e) in store
        .rejected
        .iter()
        .filter(|(k, _)| k.kind == K8S_GATEWAY_KIND)
    {
        let message = match &e.field {
            Some(f) => format!("{f}: {}", e.reason),
            None => e.reason.clone(),
        };
        out.insert(
            k.clone(),
            Wanted::Gateway(json!({
                "conditions": [
                    condition("Accepted", false, "Invalid", message.clone()),
                    condition("Programmed", false, "Invalid", message),
                ],
                "listeners": [],
            })),
        );
    }
    out
}

/// A Gateway of class `minimesh`'s status: `Accepted` and `Programmed`
/// (its routes are sent to the gateways labelled with its name), and each
/// listener's routes attached (HTTPRoutes a parentRef of which names the
/// Gateway, the listener's section or port if set, from a namespace it
/// allows, with a hostname it takes).
pub fn gateway(store: &Store, key: &ObjectKey, g: &ValidGateway) -> Value {
    let gw = (key.namespace.clone(), key.name.clone());
    let listeners: Vec<Value> = g
        .listeners
        .iter()
        .map(|(name, port, hostname, all)| {
            let attached = store
                .http_routes
                .iter()
                .filter(|(rk, r)| {
                    (*all || rk.namespace == gw.0)
                        && !hosts_at(r, hostname.as_deref()).is_empty()
                        && r.parents.iter().any(|p| match p {
                            Parent::Gateway(pg, section, pport) => {
                                *pg == gw
                                    && section.as_deref().is_none_or(|s| s == name)
                                    && pport.is_none_or(|p| p == *port)
                            }
                            Parent::Service(..) => false,
                        })
                })
                .count();
            json!({
                "name": name,
                "supportedKinds": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}],
                "attachedRoutes": attached,
                "conditions": [
                    condition("Accepted", true, "Accepted", "an HTTP listener minimesh serves".into()),
                    condition("ResolvedRefs", true, "ResolvedRefs", "nothing to resolve".into()),
                    condition("Programmed", true, "Programmed", format!("its routes are sent to the gateways labelled {GATEWAY_NAME_LABEL}={}", gw.1)),
                ],
            })
        })
        .collect();
    json!({
        "conditions": [
            condition("Accepted", true, "Accepted", "class minimesh: every listener accepted".into()),
            condition("Programmed", true, "Programmed", format!("its routes are sent to the gateways labelled {GATEWAY_NAME_LABEL}={}", gw.1)),
        ],
        "listeners": listeners,
    })
}
