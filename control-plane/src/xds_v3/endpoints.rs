//! A cluster's endpoints as Envoy's `ClusterLoadAssignment`, laid out in
//! localities so that both Envoy and gRPC weigh them as minimesh does.
//!
//! Envoy weighs endpoints by their own weight (it ignores locality weights
//! unless a cluster asks for locality-weighted balancing, which minimesh
//! never does). gRPC's round robin and least request ignore endpoint
//! weights: gRPC picks a locality by its weight, then an endpoint within it
//! (gRFC A27, A52), and its ring hash weighs an endpoint by its weight times
//! its locality's (A42). So:
//!
//! - **Equal weights** (the common case): one locality per zone, weighted by
//!   the sum of its endpoints' weights; within it gRPC's round robin is exact.
//! - **Unequal weights, or LOAD_AWARE** (whose weights move every second): each
//!   endpoint is a locality of its own (`sub_zone` = its address), weighted as
//!   the endpoint. gRPC then picks endpoints in proportion to their weights,
//!   and, since gRPC reports load per locality, its load reports name each
//!   endpoint ([`super::lrs`] reads the address back from `sub_zone`).
//! - **RING_HASH and MAGLEV**: one locality per zone, weight 1, so that gRPC's
//!   ring weighs each endpoint by its own weight.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address::PortSpecifier, Address, Locality, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint::HostIdentifier, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::google::protobuf::UInt32Value;
use minimesh_proto::v1::{self, LbPolicy};

/// How the endpoints of a cluster are grouped into localities.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Layout {
    /// One locality per zone, weighted by its endpoints' total weight.
    PerZone,
    /// One locality per zone, weight 1 (consistent hashing).
    PerZoneUnweighted,
    /// One locality per endpoint, weighted as the endpoint.
    PerEndpoint,
}

/// The layout for cluster `c` with endpoints `eps` (see the module doc).
pub fn layout(c: &v1::Cluster, eps: &[v1::Endpoint]) -> Layout {
    match LbPolicy::try_from(c.policy).unwrap_or(LbPolicy::RoundRobin) {
        LbPolicy::RingHash | LbPolicy::Maglev => Layout::PerZoneUnweighted,
        LbPolicy::LoadAware => Layout::PerEndpoint,
        _ if eps.windows(2).any(|w| w[0].weight != w[1].weight) => Layout::PerEndpoint,
        _ => Layout::PerZone,
    }
}

/// The endpoints of cluster `c` (none when `cla` is absent).
pub fn assignment(
    c: &v1::Cluster,
    cla: Option<&v1::ClusterLoadAssignment>,
) -> ClusterLoadAssignment {
    let eps = cla.map_or(&[][..], |a| a.endpoints.as_slice());
    let layout = layout(c, eps);
    let mut localities: BTreeMap<(&str, &str), LocalityLbEndpoints> = BTreeMap::new();
    for e in eps {
        let Some(socket) = socket_address(&e.address) else {
            continue;
        };
        let weight = e.weight.max(1);
        let sub_zone = if layout == Layout::PerEndpoint {
            e.address.as_str()
        } else {
            ""
        };
        let l = localities
            .entry((e.zone.as_str(), sub_zone))
            .or_insert_with(|| LocalityLbEndpoints {
                locality: Some(Locality {
                    zone: e.zone.clone(),
                    sub_zone: sub_zone.to_string(),
                    ..Default::default()
                }),
                load_balancing_weight: Some(UInt32Value { value: 0 }),
                ..Default::default()
            });
        if let Some(w) = l.load_balancing_weight.as_mut() {
            w.value = match layout {
                Layout::PerZoneUnweighted => 1,
                _ => w.value.saturating_add(weight),
            };
        }
        l.lb_endpoints.push(LbEndpoint {
            host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(socket)),
                }),
                hostname: e.pod.clone(),
                ..Default::default()
            })),
            // The numbers of minimesh's HealthStatus are Envoy's.
            health_status: e.health,
            load_balancing_weight: Some(UInt32Value { value: weight }),
            ..Default::default()
        });
    }
    ClusterLoadAssignment {
        cluster_name: c.name.clone(),
        endpoints: localities.into_values().collect(),
        ..Default::default()
    }
}

/// `ip:port` or `[ip6]:port` as a socket address.
pub fn socket_address(addr: &str) -> Option<SocketAddress> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port: u16 = port.parse().ok()?;
    Some(SocketAddress {
        address: host.to_string(),
        port_specifier: Some(PortSpecifier::PortValue(port.into())),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(addr: &str, weight: u32, zone: &str) -> v1::Endpoint {
        v1::Endpoint {
            address: addr.into(),
            weight,
            health: v1::HealthStatus::Healthy as i32,
            zone: zone.into(),
            pod: String::new(),
            mtls: false,
            service_accounts: vec![],
        }
    }

    fn cluster(policy: LbPolicy) -> v1::Cluster {
        v1::Cluster {
            name: "b.default.svc.cluster.local:80".into(),
            policy: policy as i32,
            ..Default::default()
        }
    }

    /// (zone, sub_zone, locality weight, endpoint weights) per locality.
    fn shape(c: &v1::Cluster, eps: Vec<v1::Endpoint>) -> Vec<(String, String, u32, Vec<u32>)> {
        let cla = v1::ClusterLoadAssignment {
            cluster_name: c.name.clone(),
            endpoints: eps,
        };
        assignment(c, Some(&cla))
            .endpoints
            .into_iter()
            .map(|l| {
                let loc = l.locality.unwrap_or_default();
                (
                    loc.zone,
                    loc.sub_zone,
                    l.load_balancing_weight.map_or(0, |w| w.value),
                    l.lb_endpoints
                        .iter()
                        .map(|e| e.load_balancing_weight.as_ref().map_or(0, |w| w.value))
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn equal_weights_share_one_locality_per_zone() {
        let got = shape(
            &cluster(LbPolicy::RoundRobin),
            vec![
                ep("10.0.0.1:80", 1, "a"),
                ep("10.0.0.2:80", 1, "a"),
                ep("10.0.0.3:80", 1, "b"),
            ],
        );
        assert_eq!(
            got,
            vec![
                ("a".into(), "".into(), 2, vec![1, 1]),
                ("b".into(), "".into(), 1, vec![1]),
            ]
        );
    }

    #[test]
    fn unequal_weights_give_each_endpoint_its_locality() {
        let got = shape(
            &cluster(LbPolicy::RoundRobin),
            vec![
                ep("10.0.0.1:80", 2, ""),
                ep("10.0.0.2:80", 1, ""),
                ep("[::1]:80", 1, ""),
            ],
        );
        assert_eq!(
            got,
            vec![
                ("".into(), "10.0.0.1:80".into(), 2, vec![2]),
                ("".into(), "10.0.0.2:80".into(), 1, vec![1]),
                ("".into(), "[::1]:80".into(), 1, vec![1]),
            ]
        );
    }

    #[test]
    fn hashing_weighs_endpoints_not_localities() {
        let got = shape(
            &cluster(LbPolicy::RingHash),
            vec![ep("10.0.0.1:80", 3, "a"), ep("10.0.0.2:80", 1, "a")],
        );
        assert_eq!(got, vec![("a".into(), "".into(), 1, vec![3, 1])]);
    }

    #[test]
    fn addresses_parse_for_v4_and_v6() {
        let v6 = socket_address("[fd00::1]:8080").expect("parses");
        assert_eq!(v6.address, "fd00::1");
        assert_eq!(v6.port_specifier, Some(PortSpecifier::PortValue(8080)));
        assert!(socket_address("no-port").is_none());
    }
}
