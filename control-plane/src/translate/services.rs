//! One Service's translation: a cluster per TCP port, filled from the
//! settings its rule resolves to for that port (or the defaults), the
//! port's endpoints from its EndpointSlices (weights, health, meshed pods,
//! LOAD_AWARE's published weights), its subsets' clusters, its route, and
//! what the rule's status says of it.

use std::collections::{BTreeMap, BTreeSet};

use minimesh_proto::v1::{
    self, hash_key, Cluster, ClusterLoadAssignment, Endpoint, HashKey, HealthStatus, LbPolicy,
    PortCluster, Route, UpstreamProtocol,
};

use super::{
    cluster_name, export_to, port_kind, port_protocol, routes, security, standard_clients_note,
    Resources, RuleStatus, EXPORT_TO,
};
use crate::config::kube::{EndpointSlice, ServicePort, SliceEndpoint};
use crate::config::parse::{ObjectKey, ValidRule};
use crate::config::rule::{self, Policy};
use crate::store::Store;
/// What every Service's translation reads besides the Service itself.
pub(super) struct ServiceInputs<'a> {
    pub(super) store: &'a Store,
    pub(super) load_weights: &'a BTreeMap<String, BTreeMap<String, u32>>,
    /// The pods that run a sidecar.
    pub(super) meshed: security::Meshed<'a>,
}

impl ServiceInputs<'_> {
    /// One Service's clusters (one per TCP port, with their endpoints and
    /// subsets), its route, and what its rule's status says of it.
    pub(super) fn add(
        &self,
        out: &mut Resources,
        skey: &ObjectKey,
        svc: &crate::config::kube::Service,
        rule: Option<(&ObjectKey, &ValidRule)>,
        status: &mut BTreeMap<ObjectKey, RuleStatus>,
    ) {
        if let Some(value) = svc.metadata.annotations.get(EXPORT_TO) {
            if let Some(to) = export_to(value, &skey.namespace) {
                out.exported
                    .insert(format!("{}.{}", skey.name, skey.namespace), to);
            }
        }
        let slices: Vec<&EndpointSlice> = self
            .store
            .slices
            .iter()
            .filter(|(k, s)| k.namespace == skey.namespace && s.service_name() == Some(&skey.name))
            .map(|(_, s)| s.as_ref())
            .collect();
        let mut route = Route {
            service: skey.name.clone(),
            namespace: skey.namespace.clone(),
            ports: vec![],
            default_port: 0,
            cluster_ips: svc
                .spec
                .virtual_ips()
                .iter()
                .map(ToString::to_string)
                .collect(),
            ..Default::default()
        };
        let tcp_ports: Vec<_> = svc
            .spec
            .ports
            .iter()
            .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
            .collect();
        let no_rule = rule::Resolved::default();
        for port in &tcp_ports {
            let name = cluster_name(&skey.name, &skey.namespace, port.port);
            // The rule's settings for this port, or what a service with no
            // rule gets: every cluster is filled from one `Resolved`.
            let res = rule.map_or(&no_rule, |(_, r)| r.resolved.for_port(port.port));
            let mut cluster = cluster(&name, skey, port, res);
            if let Some((key, vr)) = rule {
                cluster.rule = format!("{}/{}", key.namespace, key.name);
                cluster.hash_key = vr.rule.spec.load_balancer(port.port).and_then(hash_key_of);
                applied(status, key, vr, &name);
            }
            let mut endpoints = endpoints_for(
                port.name.as_deref(),
                tcp_ports.len(),
                &slices,
                rule.and_then(|r| r.1.rule.spec.load_balancer(port.port))
                    .map_or(&[], |lb| lb.endpoint_weights.as_slice()),
            );
            security::mark_meshed(&mut endpoints, &self.meshed, res.tls);
            if cluster.policy == LbPolicy::LoadAware as i32 {
                let weights = self.load_weights.get(&name);
                for e in &mut endpoints {
                    e.weight = weights
                        .and_then(|w| w.get(&e.address))
                        .copied()
                        .unwrap_or(crate::load_aware::MEAN_WEIGHT as u32);
                }
            }
            if let Some((_, vr)) = rule.filter(|(_, r)| !r.subsets.is_empty()) {
                routes::add_subset_clusters(out, self.store, &cluster, &endpoints, &vr.subsets);
            }
            out.endpoints.insert(
                name.clone(),
                ClusterLoadAssignment {
                    cluster_name: name.clone(),
                    endpoints,
                },
            );
            route.ports.push(PortCluster {
                port: port.port.into(),
                cluster: name.clone(),
                protocol: port_kind(port) as i32,
                http_routes: vec![],
            });
            out.clusters.insert(name, cluster);
        }
        if let Some((key, vr)) = rule {
            note_unmatched_ports(status, key, vr, skey, &tcp_ports);
        }
        if route.ports.is_empty() {
            return;
        }
        route.default_port = route
            .ports
            .iter()
            .find(|p| p.port == 80)
            .unwrap_or(&route.ports[0])
            .port;
        out.routes
            .insert(format!("{}.{}", skey.name, skey.namespace), route);
    }
}

/// The cluster of one service port, from the settings resolved for it.
fn cluster(name: &str, skey: &ObjectKey, port: &ServicePort, res: &rule::Resolved) -> Cluster {
    let ms = |d: Option<std::time::Duration>| d.map_or(0, |d| d.as_millis() as u64);
    let upstream_protocol = if res.use_client_protocol {
        UpstreamProtocol::Client
    } else {
        port_protocol(port)
    };
    Cluster {
        name: name.to_string(),
        service: skey.name.clone(),
        namespace: skey.namespace.clone(),
        port: port.port.into(),
        policy: res.policy.to_wire() as i32,
        connect_timeout_ms: ms(res.connect_timeout),
        timeout_ms: ms(res.timeout),
        retry_attempts: res.retry_attempts,
        per_try_timeout_ms: ms(res.per_try_timeout),
        retry_budget_percent: res.retry_budget_percent,
        retry_budget_min_per_second: res.retry_budget_min_per_second,
        upstream_protocol: upstream_protocol as i32,
        max_concurrent_streams: res.max_concurrent_streams,
        idle_timeout_ms: ms(res.idle_timeout),
        zone_failover: res.zone_failover(),
        max_connection_duration_ms: ms(res.max_connection_duration),
        max_requests_per_connection: res.max_requests_per_connection,
        max_retries: res.max_retries,
        retry_on: res.retry_on,
        retriable_status_codes: res.retriable_status_codes.clone(),
        health_check: res.health_check.as_ref().map(|h| v1::HealthCheck {
            path: h.path.clone(),
            grpc: h.grpc_service.is_some(),
            grpc_service: h.grpc_service.clone().unwrap_or_default(),
            interval_ms: h.interval.as_millis() as u64,
            timeout_ms: h.timeout.as_millis() as u64,
            healthy_threshold: h.healthy_threshold,
            unhealthy_threshold: h.unhealthy_threshold,
        }),
        outlier_detection: Some(outlier_detection(res.outlier_in_force())),
        warmup_ms: ms(res.warmup),
        warmup_min_percent: res.warmup_min_percent,
        warmup_aggression: res.warmup_aggression,
        max_requests: if upstream_protocol == UpstreamProtocol::Http2 {
            res.max_requests_h2
        } else {
            res.max_requests
        },
        minimum_ring_size: match res.policy {
            Policy::RingHash => res.hash_table_size,
            _ => 0,
        },
        table_size: match res.policy {
            Policy::Maglev => res.hash_table_size,
            _ => 0,
        },
        ..Default::default()
    }
}

/// Records that the rule `key` applies to cluster `name` (accepted, with
/// what standard clients do with its policy).
fn applied(
    status: &mut BTreeMap<ObjectKey, RuleStatus>,
    key: &ObjectKey,
    vr: &ValidRule,
    name: &str,
) {
    status
        .entry(key.clone())
        .or_insert_with(|| RuleStatus {
            accepted: true,
            reason: "Accepted".into(),
            message: standard_clients_note(vr.resolved.policy)
                .unwrap_or_default()
                .to_string(),
            policy: Some(vr.resolved.policy.as_str()),
            clusters: vec![],
            warnings: vec![],
        })
        .clusters
        .push(name.to_string());
}

/// Says in the rule's status which of its `portLevelSettings` name no port
/// of the service (settings that apply to no traffic).
fn note_unmatched_ports(
    status: &mut BTreeMap<ObjectKey, RuleStatus>,
    key: &ObjectKey,
    vr: &ValidRule,
    skey: &ObjectKey,
    tcp_ports: &[&ServicePort],
) {
    let unmatched: Vec<String> = vr
        .resolved
        .ports
        .keys()
        .filter(|n| !tcp_ports.iter().any(|p| p.port == **n))
        .map(u16::to_string)
        .collect();
    // (Once: every view that applies the rule comes here.)
    let st = status.get_mut(key).filter(|st| {
        !st.message
            .starts_with("spec.trafficPolicy.portLevelSettings")
    });
    if let (false, Some(st)) = (unmatched.is_empty(), st) {
        let ports: Vec<String> = tcp_ports.iter().map(|p| p.port.to_string()).collect();
        let note = std::mem::take(&mut st.message);
        st.message = format!(
            "spec.trafficPolicy.portLevelSettings: service {}.{} has no port {} (its ports: {}); those settings apply to no traffic",
            skey.name,
            skey.namespace,
            unmatched.join(", "),
            ports.join(", ")
        );
        if !note.is_empty() {
            st.message = format!("{}; {note}", st.message);
        }
    }
}

/// Outlier detection on the wire.
fn outlier_detection(o: &rule::Outlier) -> v1::OutlierDetection {
    v1::OutlierDetection {
        consecutive_5xx: o.consecutive_5xx,
        consecutive_gateway_errors: o.consecutive_gateway,
        split_local_origin: o.split_local_origin,
        consecutive_local_origin: o.consecutive_local_origin,
        base_ejection_ms: o.base_ejection.as_millis() as u64,
        max_ejection_percent: o.max_ejection_percent,
        min_health_percent: o.min_health_percent,
        ignore_503: o.ignore_503,
    }
}

fn hash_key_of(lb: &rule::LoadBalancer) -> Option<HashKey> {
    let ch = lb.consistent_hash.as_ref()?;
    let key = if let Some(h) = &ch.http_header_name {
        hash_key::Key::Header(h.to_ascii_lowercase())
    } else if let Some(c) = &ch.http_cookie {
        hash_key::Key::Cookie(v1::HttpCookie {
            name: c.name.clone(),
            path: c.path.clone().unwrap_or_default(),
            ttl_ms: c
                .ttl
                .as_deref()
                .and_then(|t| rule::parse_duration(t).ok())
                .map_or(0, |d| d.as_millis() as u64),
        })
    } else if let Some(q) = &ch.http_query_parameter_name {
        hash_key::Key::QueryParameter(q.clone())
    } else {
        hash_key::Key::SourceIp(true)
    };
    Some(HashKey { key: Some(key) })
}

/// Endpoints of one service port: from the slice port of the same name (or
/// the slice's only port when the service has one port), ready endpoints
/// healthy, serving-and-terminating ones draining, the rest unhealthy.
fn endpoints_for(
    port_name: Option<&str>,
    service_ports: usize,
    slices: &[&EndpointSlice],
    weights: &[rule::EndpointWeight],
) -> Vec<Endpoint> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for slice in slices {
        let port = slice
            .ports
            .iter()
            .find(|p| p.name.as_deref().unwrap_or("") == port_name.unwrap_or(""))
            .or_else(|| (service_ports == 1 && slice.ports.len() == 1).then(|| &slice.ports[0]))
            .and_then(|p| p.port);
        let Some(port) = port else { continue };
        for ep in &slice.endpoints {
            let Some(ip) = ep.addresses.first() else {
                continue;
            };
            let address = if ip.contains(':') {
                format!("[{ip}]:{port}")
            } else {
                format!("{ip}:{port}")
            };
            if !seen.insert(address.clone()) {
                continue;
            }
            let pod = ep
                .target_ref
                .as_ref()
                .map(|t| t.name.clone())
                .unwrap_or_default();
            let weight = weights
                .iter()
                .find(|w| weight_matches(w, ip, &pod, slice))
                .map_or(1, |w| w.weight);
            out.push(Endpoint {
                address,
                weight,
                health: health(ep) as i32,
                zone: ep.zone.clone().unwrap_or_default(),
                pod,
                mtls: false,
                service_accounts: vec![],
            });
        }
    }
    out
}

fn weight_matches(w: &rule::EndpointWeight, ip: &str, pod: &str, slice: &EndpointSlice) -> bool {
    if let Some(p) = &w.pod {
        return match p.strip_suffix('*') {
            Some(prefix) => pod.starts_with(prefix),
            None => pod == p,
        };
    }
    if let Some(a) = &w.address {
        return a == ip;
    }
    !w.labels.is_empty()
        && w.labels
            .iter()
            .all(|(k, v)| slice.metadata.labels.get(k) == Some(v))
}

fn health(ep: &SliceEndpoint) -> HealthStatus {
    let c = &ep.conditions;
    if c.ready.unwrap_or(true) && !c.terminating.unwrap_or(false) {
        HealthStatus::Healthy
    } else if c.serving.unwrap_or(c.ready.unwrap_or(true)) {
        HealthStatus::Draining
    } else {
        HealthStatus::Unhealthy
    }
}
