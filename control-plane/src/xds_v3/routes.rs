//! Listeners and route configurations: how a client finds a service port's
//! cluster by the name it dials.
//!
//! gRPC's xDS resolver, given `xds:///<host>:<port>`, asks for the Listener
//! named `<host>:<port>` (gRFC A27); its API listener holds an HTTP
//! connection manager naming a RouteConfiguration (RDS over ADS), whose
//! virtual host for that authority routes to the cluster. minimesh serves a
//! listener for every name of a service port a Kubernetes client could dial
//! with its namespace spelled out — `svc.ns.svc.cluster.local:port`,
//! `svc.ns.svc:port` and `svc.ns:port`, and the same without `:port` for the
//! service's default port — all naming one RouteConfiguration per port
//! (named as the cluster). The bare `svc` is not served: it means a
//! different service in each client's namespace, and these resources are the
//! same for every client.
//!
//! [`OUTBOUND_ROUTE_CONFIG`] gathers every virtual host in one route
//! configuration, for Envoy's own listener (`deploy/envoy/`), which routes
//! by the request's authority as a sidecar does.

use envoy_types::pb::envoy::config::listener::v3::{ApiListener, Listener};
use envoy_types::pb::envoy::config::route::v3::{
    retry_policy::RetryBackOff, route, route_action, route_action::hash_policy, route_match,
    RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::{CodecType, RouteSpecifier},
    http_filter::ConfigType,
    HttpConnectionManager, HttpFilter, Rds,
};
use envoy_types::pb::google::protobuf::UInt32Value;
use minimesh_proto::v1::{self, hash_key::Key};
use minimesh_proto::xds_v3::OUTBOUND_ROUTE_CONFIG;

use super::clusters::ads;
use super::http_routes::FAULT_FILTER;
use super::{any, millis, Encoded};
use crate::translate::Resources;

/// Adds the listeners and route configurations of every service port in `r`.
pub fn encode(r: &Resources, out: &mut Encoded) {
    let mut outbound = RouteConfiguration {
        name: OUTBOUND_ROUTE_CONFIG.to_string(),
        ..Default::default()
    };
    for route in r.routes.values() {
        for pc in &route.ports {
            let Some(cluster) = r.clusters.get(&pc.cluster) else {
                continue;
            };
            let names = dial_names(route, pc.port);
            let routes = if pc.http_routes.is_empty() {
                vec![Route {
                    r#match: Some(RouteMatch {
                        path_specifier: Some(route_match::PathSpecifier::Prefix(String::new())),
                        ..Default::default()
                    }),
                    action: Some(route::Action::Route(action(cluster))),
                    ..Default::default()
                }]
            } else {
                super::http_routes::encode(&pc.http_routes, cluster)
            };
            let vhost = VirtualHost {
                name: pc.cluster.clone(),
                domains: names.clone(),
                routes,
                ..Default::default()
            };
            outbound.virtual_hosts.push(vhost.clone());
            out.routes.insert(
                pc.cluster.clone(),
                RouteConfiguration {
                    name: pc.cluster.clone(),
                    virtual_hosts: vec![vhost],
                    ..Default::default()
                },
            );
            for name in names {
                let l = listener(&name, &pc.cluster);
                out.listeners.insert(name, l);
            }
        }
    }
    out.routes
        .insert(OUTBOUND_ROUTE_CONFIG.to_string(), outbound);
}

/// The names a client may dial port `port` of `route`'s service by.
pub fn dial_names(route: &v1::Route, port: u32) -> Vec<String> {
    let (svc, ns) = (&route.service, &route.namespace);
    let hosts = [
        format!("{svc}.{ns}.svc.cluster.local"),
        format!("{svc}.{ns}.svc"),
        format!("{svc}.{ns}"),
    ];
    let mut names: Vec<String> = hosts.iter().map(|h| format!("{h}:{port}")).collect();
    if port == route.default_port {
        names.extend(hosts);
    }
    names
}

/// An API listener (a client-side listener with no socket, as gRPC uses)
/// whose routes come from RouteConfiguration `route_config` over ADS.
fn listener(name: &str, route_config: &str) -> Listener {
    let hcm = HttpConnectionManager {
        stat_prefix: "minimesh".to_string(),
        codec_type: CodecType::Auto as i32,
        route_specifier: Some(RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_config.to_string(),
        })),
        // The fault filter first, doing nothing but where a route's config
        // says (gRFC A33), then the router.
        http_filters: vec![
            HttpFilter {
                name: FAULT_FILTER.to_string(),
                config_type: Some(ConfigType::TypedConfig(any(&HttpFault::default()))),
                ..Default::default()
            },
            HttpFilter {
                name: "envoy.filters.http.router".to_string(),
                config_type: Some(ConfigType::TypedConfig(any(&Router::default()))),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    Listener {
        name: name.to_string(),
        api_listener: Some(ApiListener {
            api_listener: Some(any(&hcm)),
        }),
        ..Default::default()
    }
}

/// The route to `c`: its hash policy, retries and timeouts.
pub(super) fn action(c: &v1::Cluster) -> RouteAction {
    RouteAction {
        cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(c.name.clone())),
        hash_policy: c
            .hash_key
            .as_ref()
            .and_then(|k| k.key.as_ref())
            .map(hash_policy_of)
            .into_iter()
            .collect(),
        retry_policy: retry_policy(c),
        // Envoy's route timeout defaults to 15 s; minimesh's to none.
        timeout: Some(millis(c.timeout_ms)),
        // gRPC reads the call's deadline from here (gRFC A31), not `timeout`.
        max_stream_duration: (c.timeout_ms > 0).then(|| route_action::MaxStreamDuration {
            max_stream_duration: Some(millis(c.timeout_ms)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn hash_policy_of(key: &Key) -> route_action::HashPolicy {
    let spec =
        match key {
            Key::Header(name) => hash_policy::PolicySpecifier::Header(hash_policy::Header {
                header_name: name.clone(),
                ..Default::default()
            }),
            Key::Cookie(c) => hash_policy::PolicySpecifier::Cookie(hash_policy::Cookie {
                name: c.name.clone(),
                path: c.path.clone(),
                ttl: (c.ttl_ms > 0).then(|| millis(c.ttl_ms)),
                ..Default::default()
            }),
            Key::SourceIp(_) => hash_policy::PolicySpecifier::ConnectionProperties(
                hash_policy::ConnectionProperties { source_ip: true },
            ),
            Key::QueryParameter(name) => {
                hash_policy::PolicySpecifier::QueryParameter(hash_policy::QueryParameter {
                    name: name.clone(),
                })
            }
        };
    route_action::HashPolicy {
        policy_specifier: Some(spec),
        terminal: false,
    }
}

/// minimesh's retry settings as Envoy's. The `retryOn` tokens are Envoy's
/// own names; gRPC acts on those that name gRPC statuses (`unavailable`,
/// `cancelled`) and ignores the rest (gRFC A44).
pub(super) fn retry_policy(c: &v1::Cluster) -> Option<RetryPolicy> {
    if c.retry_attempts == 0 || c.retry_on == 0 {
        return None;
    }
    let on: Vec<&str> = minimesh_proto::retry_on::TOKENS
        .iter()
        .filter(|(_, bit)| c.retry_on & (*bit as u32) != 0)
        .map(|(name, _)| *name)
        .collect();
    Some(RetryPolicy {
        retry_on: on.join(","),
        num_retries: Some(UInt32Value {
            value: c.retry_attempts,
        }),
        per_try_timeout: (c.per_try_timeout_ms > 0).then(|| millis(c.per_try_timeout_ms)),
        retriable_status_codes: c.retriable_status_codes.clone(),
        retry_back_off: Some(RetryBackOff {
            base_interval: Some(millis(25)),
            max_interval: Some(millis(250)),
        }),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_dialled_by_every_namespaced_name() {
        let route = v1::Route {
            service: "echo".into(),
            namespace: "default".into(),
            ports: vec![],
            default_port: 80,
            ..Default::default()
        };
        assert_eq!(
            dial_names(&route, 50051),
            [
                "echo.default.svc.cluster.local:50051",
                "echo.default.svc:50051",
                "echo.default:50051"
            ]
        );
        assert_eq!(dial_names(&route, 80).len(), 6);
    }
}
