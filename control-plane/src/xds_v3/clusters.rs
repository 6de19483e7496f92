//! A minimesh cluster as Envoy's `Cluster`: EDS over ADS, the policy as a
//! `load_balancing_policy` list, outlier detection, circuit breakers and
//! load reporting to this control plane.
//!
//! The policy is written as Envoy's typed `load_balancing_policy` (gRFC
//! A52), not the older `lb_policy` enum, because a list lets each client
//! take the first entry it implements: Envoy implements every policy below;
//! gRPC implements round robin, ring hash, least request (where the
//! language has it) and `wrr_locality`, and skips the rest. So:
//!
//! | minimesh | Envoy takes | gRPC takes |
//! |---|---|---|
//! | ROUND_ROBIN, LOAD_AWARE | RoundRobin | WrrLocality(RoundRobin) |
//! | RANDOM | Random | WrrLocality(RoundRobin) |
//! | LEAST_REQUEST, PEAK_EWMA | LeastRequest (2 choices) | WrrLocality(LeastRequest, else RoundRobin) |
//! | RING_HASH | RingHash (xxHash) | RingHash |
//! | MAGLEV | Maglev | RingHash |
//!
//! `WrrLocality` comes first because it is what makes gRPC weigh endpoints:
//! gRPC's round robin and least request ignore endpoint weights and weigh
//! localities instead, so [`super::endpoints`] puts the endpoints of a
//! weighted cluster each in a locality of its own, weighted as the
//! endpoint. Envoy does not implement `WrrLocality`, skips it, and weighs the
//! endpoints themselves. PEAK_EWMA has no standard equivalent; LEAST_REQUEST
//! is the nearest (it too prefers the endpoint with less outstanding work),
//! and the rule's status says so.

use envoy_types::pb::envoy::config::cluster::v3::{
    circuit_breakers::Thresholds, cluster, load_balancing_policy, CircuitBreakers, Cluster,
    LoadBalancingPolicy, OutlierDetection,
};
use envoy_types::pb::envoy::config::core::v3::RuntimeDouble;
use envoy_types::pb::envoy::config::core::v3::{
    config_source::ConfigSourceSpecifier, AggregatedConfigSource, ApiVersion, ConfigSource,
    SelfConfigSource, TypedExtensionConfig,
};
use envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3::SlowStartConfig;
use envoy_types::pb::envoy::extensions::load_balancing_policies::{
    least_request::v3::LeastRequest,
    maglev::v3::Maglev,
    random::v3::Random,
    ring_hash::v3::{ring_hash::HashFunction, RingHash},
    round_robin::v3::RoundRobin,
    wrr_locality::v3::WrrLocality,
};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{Any, UInt32Value, UInt64Value};
use minimesh_proto::v1::{self, LbPolicy};

use super::{any, millis};

/// Envoy's largest ring (its default `maximum_ring_size`). gRPC caps rings
/// at 4,096 entries unless its application says otherwise.
const MAX_RING_SIZE: u64 = 8 << 20;

/// Ring entries per unit of endpoint weight when the rule sets none (as the
/// sidecar's ring).
const RING_POINTS_PER_WEIGHT: u64 = 1024;

/// The cluster `c`, whose endpoints are `cla`, as Envoy's; `exact`: its
/// policy with no fallback.
pub fn cluster(c: &v1::Cluster, cla: Option<&v1::ClusterLoadAssignment>, exact: bool) -> Cluster {
    Cluster {
        name: c.name.clone(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::EdsClusterConfig {
            eds_config: Some(ads()),
            service_name: c.name.clone(),
        }),
        connect_timeout: (c.connect_timeout_ms > 0).then(|| millis(c.connect_timeout_ms)),
        load_balancing_policy: Some(policy(c, ring_size(c, cla), exact)),
        outlier_detection: c.outlier_detection.as_ref().map(outlier_detection),
        // Below this share of healthy endpoints, ejections are ignored.
        common_lb_config: c
            .outlier_detection
            .as_ref()
            .map(|o| cluster::CommonLbConfig {
                healthy_panic_threshold: Some(Percent {
                    value: f64::from(o.min_health_percent),
                }),
                ..Default::default()
            }),
        circuit_breakers: circuit_breakers(c),
        // Every client reports its load, as every sidecar does: it is what
        // `minimesh top` shows and what LOAD_AWARE's weights come from.
        // gRPC reads this; Envoy reports from its bootstrap's
        // `cluster_manager.load_stats_config` (deploy/envoy/bootstrap.yaml).
        lrs_server: Some(ConfigSource {
            resource_api_version: ApiVersion::V3 as i32,
            config_source_specifier: Some(ConfigSourceSpecifier::Self_(SelfConfigSource {
                transport_api_version: ApiVersion::V3 as i32,
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Resources found on the ADS stream the client is on.
pub(crate) fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        ..Default::default()
    }
}

/// The policy list of `c` (see the module's table); with `exact`, only
/// the policy the rule names, so that a client lacking it rejects the
/// cluster instead of balancing another way. PEAK_EWMA, which no standard
/// client implements, is then named as minimesh's own (a `TypedStruct` for
/// `minimesh.v1.PeakEwma`, as gRFC A52 names custom policies).
pub fn policy(c: &v1::Cluster, ring_size: u64, exact: bool) -> LoadBalancingPolicy {
    let slow_start = (c.warmup_ms > 0).then(|| SlowStartConfig {
        slow_start_window: Some(millis(c.warmup_ms)),
        aggression: Some(RuntimeDouble {
            default_value: if c.warmup_aggression > 0.0 {
                c.warmup_aggression
            } else {
                1.0
            },
            // Envoy requires a key; none is set, so the default holds.
            runtime_key: "minimesh.slow_start.aggression".to_string(),
        }),
        min_weight_percent: (c.warmup_min_percent > 0.0).then_some(Percent {
            value: c.warmup_min_percent,
        }),
    });
    let round_robin = RoundRobin {
        slow_start_config: slow_start.clone(),
        ..Default::default()
    };
    let least_request = LeastRequest {
        choice_count: Some(UInt32Value { value: 2 }),
        slow_start_config: slow_start,
        ..Default::default()
    };
    let ring_hash = RingHash {
        hash_function: HashFunction::XxHash as i32,
        minimum_ring_size: Some(UInt64Value { value: ring_size }),
        maximum_ring_size: Some(UInt64Value {
            value: MAX_RING_SIZE.max(ring_size),
        }),
        ..Default::default()
    };
    let mut policies = match LbPolicy::try_from(c.policy).unwrap_or(LbPolicy::RoundRobin) {
        LbPolicy::PeakEwma if exact => {
            vec![typed_struct("type.googleapis.com/minimesh.v1.PeakEwma")]
        }
        LbPolicy::LeastRequest if exact => vec![
            any(&wrr_locality(vec![any(&least_request)])),
            any(&least_request),
        ],
        LbPolicy::RingHash => vec![any(&ring_hash)],
        LbPolicy::Maglev => vec![
            any(&Maglev {
                table_size: (c.table_size > 0).then_some(UInt64Value {
                    value: c.table_size,
                }),
                ..Default::default()
            }),
            any(&ring_hash),
        ],
        LbPolicy::LeastRequest | LbPolicy::PeakEwma => vec![
            any(&wrr_locality(vec![any(&least_request), any(&round_robin)])),
            any(&least_request),
        ],
        LbPolicy::Random => vec![
            any(&Random::default()),
            any(&wrr_locality(vec![any(&round_robin)])),
        ],
        LbPolicy::RoundRobin | LbPolicy::LoadAware | LbPolicy::Unspecified => vec![
            any(&wrr_locality(vec![any(&round_robin)])),
            any(&round_robin),
        ],
    };
    if exact {
        // The first entry is what the rule names (for round robin and least
        // request, as gRPC needs it; Envoy takes the second, the same policy).
        let keep = match LbPolicy::try_from(c.policy) {
            Ok(LbPolicy::Maglev | LbPolicy::Random) => 1,
            _ => policies.len(),
        };
        policies.truncate(keep);
    }
    list(policies)
}

/// An `xds.type.v3.TypedStruct` naming a custom policy `type_url`, with an
/// empty config (field 1: the type URL; field 2, the config, left out).
fn typed_struct(type_url: &str) -> Any {
    let mut value = vec![0x0a, type_url.len() as u8];
    value.extend_from_slice(type_url.as_bytes());
    Any {
        type_url: "type.googleapis.com/xds.type.v3.TypedStruct".to_string(),
        value,
    }
}

/// The `minimum_ring_size` that gives every endpoint the same number of
/// ring entries per unit of weight whatever the other endpoints, as the
/// sidecar's ring does, so that removing an endpoint moves only the keys it
/// owned. Envoy and gRPC spread the ring's size over the endpoints instead
/// (each gets `scale · w / Σw` entries, with `scale = ⌈m · M⌉ / m` for the
/// smallest normalised weight `m` and minimum size `M`); `M = k · Σw − 1`
/// makes that `k · w` exactly (the −1 keeps the ceiling from rounding up by
/// one on a float error). The Cluster changes with its endpoints' total
/// weight. Past gRPC's cap of 4,096 entries the ring is scaled down and
/// keys may move between the remaining endpoints, as in Envoy's own rings.
fn ring_size(c: &v1::Cluster, cla: Option<&v1::ClusterLoadAssignment>) -> u64 {
    let per_weight = match c.minimum_ring_size {
        0 => RING_POINTS_PER_WEIGHT,
        n => n,
    };
    let total: u64 = cla
        .map(|a| a.endpoints.iter().map(|e| u64::from(e.weight.max(1))).sum())
        .unwrap_or(0);
    per_weight
        .saturating_mul(total.max(1))
        .saturating_sub(1)
        .clamp(1, MAX_RING_SIZE)
}

fn wrr_locality(children: Vec<Any>) -> WrrLocality {
    WrrLocality {
        endpoint_picking_policy: Some(list(children)),
    }
}

fn list(policies: Vec<Any>) -> LoadBalancingPolicy {
    LoadBalancingPolicy {
        policies: policies
            .into_iter()
            .map(|p| load_balancing_policy::Policy {
                typed_extension_config: Some(TypedExtensionConfig {
                    name: extension_name(&p.type_url),
                    typed_config: Some(p),
                }),
            })
            .collect(),
    }
}

/// `envoy.load_balancing_policies.<name>`, as Envoy names its extensions.
fn extension_name(type_url: &str) -> String {
    let name = type_url
        .strip_prefix("type.googleapis.com/envoy.extensions.load_balancing_policies.")
        .and_then(|s| s.split('.').next())
        .unwrap_or("custom");
    format!("envoy.load_balancing_policies.{name}")
}

/// Istio's outlier detection as Envoy's. Success-rate ejection, on in
/// Envoy by default, is turned off as Istio does: minimesh's rules ask for
/// consecutive errors only. gRPC implements only the success-rate and
/// failure-percentage detectors (gRFC A50), so for gRPC clients this
/// enables nothing; the rule reference says so.
fn outlier_detection(o: &v1::OutlierDetection) -> OutlierDetection {
    let u32v = |v: u32| Some(UInt32Value { value: v });
    OutlierDetection {
        consecutive_5xx: u32v(o.consecutive_5xx),
        enforcing_consecutive_5xx: u32v(if o.consecutive_5xx > 0 { 100 } else { 0 }),
        consecutive_gateway_failure: u32v(o.consecutive_gateway_errors),
        enforcing_consecutive_gateway_failure: u32v(if o.consecutive_gateway_errors > 0 {
            100
        } else {
            0
        }),
        split_external_local_origin_errors: o.split_local_origin,
        consecutive_local_origin_failure: u32v(o.consecutive_local_origin),
        enforcing_consecutive_local_origin_failure: u32v(if o.consecutive_local_origin > 0 {
            100
        } else {
            0
        }),
        enforcing_success_rate: u32v(0),
        enforcing_local_origin_success_rate: u32v(0),
        base_ejection_time: Some(millis(o.base_ejection_ms)),
        max_ejection_percent: u32v(o.max_ejection_percent),
        ..Default::default()
    }
}

/// Envoy's defaults are 1,024 of everything; minimesh's limits where set.
fn circuit_breakers(c: &v1::Cluster) -> Option<CircuitBreakers> {
    if c.max_requests == 0 && c.max_retries == 0 {
        return None;
    }
    let limit = |v: u32| (v > 0).then_some(UInt32Value { value: v });
    Some(CircuitBreakers {
        thresholds: vec![Thresholds {
            max_requests: limit(c.max_requests),
            max_retries: limit(c.max_retries),
            ..Default::default()
        }],
        ..Default::default()
    })
}
