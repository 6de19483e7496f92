//! `spec.trafficPolicy.loadBalancer`: the policies, consistent hashing,
//! locality, warm-up and static endpoint weights, as written.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::config::crd::any_objects;

/// `spec.trafficPolicy.loadBalancer`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancer {
    /// A standard policy.
    #[serde(default)]
    pub simple: Option<SimpleLb>,
    /// Consistent hashing (ring hash or Maglev).
    #[serde(default)]
    pub consistent_hash: Option<ConsistentHash>,
    /// Istio locality load balancing: with outlier detection or health
    /// checks on, a sidecar that knows its zone sends to endpoints of its
    /// zone and fails over to the others as they fail (`enabled: false`
    /// turns that off).
    #[serde(default)]
    pub locality_lb_setting: Option<LocalityLbSetting>,
    /// Istio slow start, e.g. `60s`.
    #[serde(default)]
    pub warmup_duration_secs: Option<String>,
    /// Istio slow start (newer form).
    #[serde(default)]
    pub warmup: Option<Warmup>,
    /// minimesh extension: static endpoint weights, first match wins,
    /// unmatched endpoints weigh 1.
    #[serde(default)]
    pub endpoint_weights: Vec<EndpointWeight>,
}

/// `loadBalancer.localityLbSetting` (Istio's `LocalityLoadBalancerSetting`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalityLbSetting {
    /// Zone failover on or off (default on, as Istio's mesh default).
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Traffic shares between localities: accepted, not enforced (warning).
    #[serde(default)]
    #[schemars(schema_with = "any_objects")]
    pub distribute: Vec<serde_json::Value>,
    /// Region failover pairs: accepted, not enforced (warning).
    #[serde(default)]
    #[schemars(schema_with = "any_objects")]
    pub failover: Vec<serde_json::Value>,
    /// Label-ordered failover: accepted, not enforced (warning).
    #[serde(default)]
    pub failover_priority: Vec<String>,
}

/// `loadBalancer.simple` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[allow(clippy::upper_case_acronyms)]
pub enum SimpleLb {
    /// Istio: let the proxy choose (minimesh: LEAST_REQUEST).
    #[serde(rename = "UNSPECIFIED")]
    Unspecified,
    /// Weighted round robin with smooth interleaving.
    #[serde(rename = "ROUND_ROBIN")]
    RoundRobin,
    /// Weighted random.
    #[serde(rename = "RANDOM")]
    Random,
    /// Power of two choices on active requests.
    #[serde(rename = "LEAST_REQUEST")]
    LeastRequest,
    /// Alias of LEAST_REQUEST, as in Istio.
    #[serde(rename = "LEAST_CONN")]
    LeastConn,
    /// Istio's PASSTHROUGH: rejected, minimesh always balances.
    #[serde(rename = "PASSTHROUGH")]
    Passthrough,
    /// minimesh extension: P2C on peak EWMA latency × load.
    #[serde(rename = "PEAK_EWMA")]
    PeakEwma,
    /// minimesh extension: weights from the control plane's load view.
    #[serde(rename = "LOAD_AWARE")]
    LoadAware,
}

/// `loadBalancer.consistentHash`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConsistentHash {
    /// Hash on this request header.
    #[serde(default)]
    pub http_header_name: Option<String>,
    /// Hash on this cookie (set when absent).
    #[serde(default)]
    pub http_cookie: Option<HttpCookie>,
    /// Hash on the caller's address.
    #[serde(default)]
    pub use_source_ip: Option<bool>,
    /// Hash on this query parameter.
    #[serde(default)]
    pub http_query_parameter_name: Option<String>,
    /// Ring hash.
    #[serde(default)]
    pub ring_hash: Option<RingHash>,
    /// Maglev.
    #[serde(default)]
    pub maglev: Option<Maglev>,
    /// Deprecated Istio form of `ringHash.minimumRingSize`.
    #[serde(default)]
    pub minimum_ring_size: Option<u64>,
}

/// `consistentHash.httpCookie`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpCookie {
    /// Cookie name.
    pub name: String,
    /// Cookie path.
    #[serde(default)]
    pub path: Option<String>,
    /// Lifetime, e.g. `3600s`.
    #[serde(default)]
    pub ttl: Option<String>,
}

/// `consistentHash.ringHash`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RingHash {
    /// Minimum number of ring entries (default 1024, at most 8M).
    #[serde(default)]
    pub minimum_ring_size: Option<u64>,
}

/// `consistentHash.maglev`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Maglev {
    /// Lookup table size, a prime (default 65537).
    #[serde(default)]
    pub table_size: Option<u64>,
}

/// `loadBalancer.warmup`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Warmup {
    /// Slow-start window, e.g. `60s`.
    pub duration: String,
    /// Starting share in percent (Envoy's min_weight_percent).
    #[serde(default)]
    pub minimum_percent: Option<f64>,
    /// Aggression (Envoy's slow-start aggression).
    #[serde(default)]
    pub aggression: Option<f64>,
}

/// One entry of `loadBalancer.endpointWeights`: a selector and a weight.
/// Exactly one of `pod`, `address` or `labels` selects.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointWeight {
    /// Pod name; a trailing `*` matches a prefix (`simple-backend-1-*`).
    #[serde(default)]
    pub pod: Option<String>,
    /// Endpoint IP address.
    #[serde(default)]
    pub address: Option<String>,
    /// Labels of the EndpointSlice holding the endpoint.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Relative weight, 1 to 1,000,000.
    pub weight: u32,
}
