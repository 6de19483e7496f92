//! `DestinationRule`: Istio's spec shape (so an Istio user's YAML works by
//! changing `apiVersion`, or as is in local mode) plus minimesh's documented
//! extension fields. Fields are typed and unknown ones rejected, so a typo is
//! an error that names the field rather than a setting that silently does
//! nothing.

use std::time::Duration;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::crd::{any_object, any_objects};

use super::kube::ObjectMeta;

/// API groups whose DestinationRule minimesh reads.
pub const RULE_API_VERSIONS: [&str; 4] = [
    "minimesh.io/v1alpha1",
    "networking.istio.io/v1",
    "networking.istio.io/v1beta1",
    "networking.istio.io/v1alpha3",
];

/// Largest ring Envoy builds (`maximum_ring_size` cap); the same here.
pub const MAX_RING_SIZE: u64 = 8 * 1024 * 1024;
/// Default `minimumRingSize`, as Envoy's.
pub const DEFAULT_RING_SIZE: u64 = 1024;
/// Default Maglev `tableSize`, as Envoy's.
pub const DEFAULT_MAGLEV_TABLE_SIZE: u64 = 65537;
/// Largest Maglev table accepted: a prime near 5M keeps the table (4 bytes an
/// entry) under 20 MiB whatever the input.
pub const MAX_MAGLEV_TABLE_SIZE: u64 = 5_000_011;
/// Largest static endpoint weight (Envoy caps weights at 128 per endpoint
/// for its EDF scheduler precision; we allow more, bounded).
pub const MAX_WEIGHT: u32 = 1_000_000;

/// Most `portLevelSettings` entries in a rule, as Istio's schema allows.
pub const MAX_PORT_LEVEL_SETTINGS: usize = 4096;

/// A DestinationRule document.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DestinationRule {
    /// `minimesh.io/v1alpha1` or one of Istio's `networking.istio.io` versions.
    pub api_version: String,
    /// Always `DestinationRule`.
    pub kind: String,
    /// Object metadata.
    pub metadata: ObjectMeta,
    /// The rule.
    pub spec: RuleSpec,
}

/// `spec` of a DestinationRule. On Kubernetes it is also the spec of the
/// `minimesh.io/v1alpha1` CRD (`crds/`), generated from these types.
// Each print column repeats `type_ = "string"`: that is the attribute's shape.
#[allow(clippy::duplicated_attributes)]
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema, CustomResource)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[kube(
    group = "minimesh.io",
    version = "v1alpha1",
    kind = "DestinationRule",
    root = "DestinationRuleResource",
    namespaced,
    shortname = "mdr",
    category = "minimesh",
    status = "super::crd::RuleStatusResource",
    doc = "Load-balancing policy for one service: Istio's DestinationRule spec plus minimesh's extensions.",
    printcolumn(name = "Host", type_ = "string", json_path = ".spec.host"),
    printcolumn(name = "Policy", type_ = "string", json_path = ".status.policy"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Warnings",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Warnings\")].status"
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        priority = 1,
        json_path = ".status.conditions[?(@.type==\"Warnings\")].message"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct RuleSpec {
    /// The service the rule applies to: `name`, `name.namespace`, or the FQDN
    /// `name.namespace.svc.cluster.local`. A short name is taken in the rule's
    /// namespace.
    pub host: String,
    /// Policies for traffic to the host.
    #[serde(default)]
    pub traffic_policy: Option<TrafficPolicy>,
    /// Istio subsets: named groups of endpoints by pod labels, for routes.
    #[serde(default)]
    #[schemars(schema_with = "any_objects")]
    pub subsets: Vec<serde_json::Value>,
    /// Istio's visibility: the namespaces whose callers may get this rule
    /// (`.` this one, `*` every one, `~` none, or namespace names); none
    /// listed is `*`. A caller's own namespace's rule comes first, then the
    /// service's namespace's, then the root namespace's.
    #[serde(default)]
    pub export_to: Vec<String>,
    /// Istio workload selector: accepted, not yet used (warning).
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub workload_selector: Option<serde_json::Value>,
}

/// `spec.trafficPolicy`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TrafficPolicy {
    /// How endpoints are picked.
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    /// Istio connection pool limits.
    #[serde(default)]
    pub connection_pool: Option<ConnectionPool>,
    /// Istio outlier detection (passive ejection of failing endpoints).
    /// Without it, minimesh ejects with the block's defaults (5 consecutive
    /// 5xx, 30 s); `consecutive5xxErrors: 0` turns that off.
    #[serde(default)]
    pub outlier_detection: Option<OutlierDetection>,
    /// Istio's client TLS settings: `mode` DISABLE or ISTIO_MUTUAL (docs/rules.md#tls).
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub tls: Option<serde_json::Value>,
    /// Istio per-port policies: for traffic to one port of the service, each
    /// of `loadBalancer`, `connectionPool`, `outlierDetection` and `tls` set
    /// here replaces the destination-level one as a whole (nothing inside it
    /// is inherited); the rest of the policy applies as is.
    #[serde(default)]
    #[schemars(length(max = 4096))]
    pub port_level_settings: Vec<PortTrafficPolicy>,
    /// Istio's tunnelling of TCP routes (accepted, not enforced: minimesh
    /// proxies HTTP; warning).
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub tunnel: Option<serde_json::Value>,
    /// Istio's upstream PROXY protocol (accepted, not sent; warning).
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub proxy_protocol: Option<serde_json::Value>,
    /// minimesh extension: active HTTP health checks.
    #[serde(default)]
    pub health_check: Option<HealthCheck>,
    /// minimesh extension: retries on connect failure.
    #[serde(default)]
    pub retries: Option<Retries>,
    /// minimesh extension: whole-request timeout, e.g. `10s` (default: none).
    #[serde(default)]
    pub timeout: Option<String>,
}

/// One entry of `spec.trafficPolicy.portLevelSettings` (Istio's
/// `PortTrafficPolicy`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortTrafficPolicy {
    /// The Service port (`spec.ports[].port`, not the target port) the
    /// settings apply to.
    #[serde(default)]
    pub port: Option<PortSelector>,
    /// How endpoints are picked on this port.
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    /// Connection pool limits on this port.
    #[serde(default)]
    pub connection_pool: Option<ConnectionPool>,
    /// Outlier detection on this port.
    #[serde(default)]
    pub outlier_detection: Option<OutlierDetection>,
    /// Istio's client TLS settings for this port (see the destination's).
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub tls: Option<serde_json::Value>,
}

/// `portLevelSettings[].port`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortSelector {
    /// Port number, 1 to 65535.
    #[schemars(range(min = 1, max = 65535))]
    pub number: u32,
}

impl RuleSpec {
    /// The load balancer in force on `port`: the port's own when
    /// `portLevelSettings` sets one, else the destination's.
    pub fn load_balancer(&self, port: u16) -> Option<&LoadBalancer> {
        let tp = self.traffic_policy.as_ref()?;
        tp.port_level_settings
            .iter()
            .find(|p| p.port.as_ref().is_some_and(|s| s.number == u32::from(port)))
            .and_then(|p| p.load_balancer.as_ref())
            .or(tp.load_balancer.as_ref())
    }
}

/// `spec.trafficPolicy.healthCheck` (minimesh extension).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheck {
    /// HTTP path probed with GET; 2xx is healthy (default `/health`).
    #[serde(default)]
    pub path: Option<String>,
    /// Probe with gRPC's health checking protocol instead
    /// (`grpc.health.v1.Health/Check` over HTTP/2), asking about this
    /// service (`""`: the server as a whole); SERVING is healthy.
    #[serde(default)]
    pub grpc_service: Option<String>,
    /// Time between probes (default 5s, at least 100ms).
    #[serde(default)]
    pub interval: Option<String>,
    /// Probe timeout (default 1s).
    #[serde(default)]
    pub timeout: Option<String>,
    /// Successes that make an unhealthy endpoint healthy (default 1).
    #[serde(default)]
    pub healthy_threshold: Option<u32>,
    /// Failures that make a healthy endpoint unhealthy (default 2).
    #[serde(default)]
    pub unhealthy_threshold: Option<u32>,
}

/// Health checking as resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ResolvedHealthCheck {
    /// Path.
    pub path: String,
    /// gRPC health checking of this service instead of `GET path`.
    pub grpc_service: Option<String>,
    /// Interval.
    pub interval: Duration,
    /// Timeout.
    pub timeout: Duration,
    /// Healthy threshold.
    pub healthy_threshold: u32,
    /// Unhealthy threshold.
    pub unhealthy_threshold: u32,
}

/// `spec.trafficPolicy.outlierDetection`, Istio's fields and defaults.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OutlierDetection {
    /// Consecutive 5xx responses that eject an endpoint (default 5; 0 = off).
    #[serde(default, rename = "consecutive5xxErrors")]
    pub consecutive_5xx_errors: Option<u32>,
    /// Consecutive 502/503/504 (and local-origin failures, unless split) that eject (default off).
    #[serde(default)]
    pub consecutive_gateway_errors: Option<u32>,
    /// Istio's analysis interval (default 10s); consecutive-error detection acts at once.
    #[serde(default)]
    pub interval: Option<String>,
    /// Ejection time, multiplied by the number of times ejected (default 30s).
    #[serde(default)]
    pub base_ejection_time: Option<String>,
    /// Most endpoints ejected at once, percent (default 10; at least one is always allowed).
    #[serde(default)]
    pub max_ejection_percent: Option<u32>,
    /// Panic threshold: below this percent of available endpoints, ejections are ignored (default 0).
    #[serde(default)]
    pub min_health_percent: Option<u32>,
    /// Istio's deprecated form: read as `consecutiveGatewayErrors` with
    /// `consecutive5xxErrors: 0`, as Istio does, unless either is set.
    #[serde(default)]
    pub consecutive_errors: Option<u32>,
    /// Count local-origin failures (refused or failed connections, resets,
    /// timeouts) apart, against `consecutiveLocalOriginFailures`, instead of
    /// as 503/504 responses (default false).
    #[serde(default)]
    pub split_external_local_origin_errors: Option<bool>,
    /// With `splitExternalLocalOriginErrors`: consecutive local-origin
    /// failures that eject (default 5; 0 = off).
    #[serde(default)]
    pub consecutive_local_origin_failures: Option<u32>,
}

/// Outlier detection as resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outlier {
    /// Consecutive 5xx to eject (0 = off).
    pub consecutive_5xx: u32,
    /// Consecutive gateway errors to eject (0 = off).
    pub consecutive_gateway: u32,
    /// Local-origin failures count apart (else as 503/504 responses).
    pub split_local_origin: bool,
    /// Consecutive local-origin failures to eject, when split (0 = off).
    pub consecutive_local_origin: u32,
    /// Base ejection time.
    pub base_ejection: Duration,
    /// Max ejected percent.
    pub max_ejection_percent: u32,
    /// Panic threshold percent.
    pub min_health_percent: u32,
    /// The endpoint's own 503 responses neither count nor reset (the
    /// default's; a rule's outlier detection counts them, as Istio's).
    pub ignore_503: bool,
}

/// Outlier detection in force where no rule sets `outlierDetection`:
/// Istio's defaults for the fields of that block (5 consecutive 5xx eject an
/// endpoint for 30 s, 10% of endpoints at most and always one), except that
/// an endpoint's own 503 responses do not count. Istio ejects nothing
/// without the block; minimesh does, because without it a replica that fails
/// every request at once draws more requests under LEAST_REQUEST, not fewer
/// (it never has any in flight). 503s are left out because they say
/// "overloaded": ejecting an overloaded endpoint for 30 s moves its load onto
/// the others (in the capacity-ramp bench, weighted round robin went from
/// 3% to 44% failed when they counted). A rule with `outlierDetection:
/// {consecutive5xxErrors: 0}` turns it off.
pub const DEFAULT_OUTLIER: Outlier = Outlier {
    consecutive_5xx: 5,
    consecutive_gateway: 0,
    split_local_origin: false,
    consecutive_local_origin: 5,
    base_ejection: Duration::from_secs(30),
    max_ejection_percent: 10,
    min_health_percent: 0,
    ignore_503: true,
};

/// `spec.trafficPolicy.connectionPool` (Istio).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ConnectionPool {
    /// TCP settings.
    #[serde(default)]
    pub tcp: Option<TcpPool>,
    /// HTTP settings.
    #[serde(default)]
    pub http: Option<HttpPool>,
}

/// `connectionPool.tcp`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TcpPool {
    /// Connections to the service at most, per sidecar.
    #[serde(default)]
    pub max_connections: Option<u32>,
    /// TCP connect timeout (default: the sidecar's `--connect-timeout`, 1s).
    #[serde(default)]
    pub connect_timeout: Option<String>,
    /// TCP keepalive (accepted, not enforced).
    #[serde(default)]
    #[schemars(schema_with = "any_object")]
    pub tcp_keepalive: Option<serde_json::Value>,
    /// Upstream connections older than this are closed once their request
    /// is done, and never reused (default: no limit).
    #[serde(default)]
    pub max_connection_duration: Option<String>,
    /// Istio's idle timeout of proxied TCP streams (accepted, not enforced:
    /// minimesh proxies HTTP, where `http.idleTimeout` applies).
    #[serde(default)]
    pub idle_timeout: Option<String>,
}

/// `connectionPool.http`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpPool {
    /// Requests waiting for a connection at most.
    #[serde(default, rename = "http1MaxPendingRequests")]
    pub http1_max_pending_requests: Option<u32>,
    /// Requests in flight at most.
    #[serde(default, rename = "http2MaxRequests")]
    pub http2_max_requests: Option<u32>,
    /// Requests one upstream connection carries before it is closed (0 or unset: unlimited; 1: no keep-alive).
    #[serde(default)]
    pub max_requests_per_connection: Option<u32>,
    /// Retries in flight to the service at most, per sidecar (unset: unlimited).
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// Idle upstream connections are closed after this (default 1h).
    #[serde(default)]
    pub idle_timeout: Option<String>,
    /// `DEFAULT` or `DO_NOT_UPGRADE` (HTTP/1.1 ports stay HTTP/1.1);
    /// `UPGRADE` is accepted with a warning: declare the Service port's
    /// protocol instead.
    #[serde(default)]
    pub h2_upgrade_policy: Option<String>,
    /// Speak to the endpoints in the HTTP version the request arrived in,
    /// whatever the Service port declares.
    #[serde(default)]
    pub use_client_protocol: Option<bool>,
    /// Requests one upstream HTTP/2 connection carries at once at most
    /// (default unlimited); more open another connection.
    #[serde(default)]
    pub max_concurrent_streams: Option<u32>,
}

/// `spec.trafficPolicy.retries` (minimesh extension).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Retries {
    /// Retries after the first attempt (default 2, at most 10).
    #[serde(default)]
    pub attempts: Option<u32>,
    /// When to retry, Istio's comma-separated tokens and status codes
    /// (default `connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes,503,reset`:
    /// Istio's, plus `reset`).
    #[serde(default)]
    pub retry_on: Option<String>,
    /// Timeout of each attempt, e.g. `1s` (default: none).
    #[serde(default)]
    pub per_try_timeout: Option<String>,
    /// Retry budget: retries at most this percent of requests (default 20).
    #[serde(default)]
    pub budget_percent: Option<u32>,
    /// Retry budget: plus this many retries a second (default 10).
    #[serde(default)]
    pub min_retries_per_second: Option<u32>,
}

/// The policy a valid rule resolves to (one type with the sidecar's).
pub use minimesh_proto::Policy;

mod load_balancer;
mod resolve;
mod resolved;
mod subsets;
mod validate;

pub use load_balancer::*;

pub use resolved::{Resolved, TlsMode};
pub use subsets::{subsets, Subset};
pub use validate::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primes() {
        assert!(is_prime(65537));
        assert!(!is_prime(65536));
        assert!(is_prime(MAX_MAGLEV_TABLE_SIZE));
    }

    #[test]
    fn policy_defaults_to_least_request() {
        let spec = RuleSpec {
            host: "a".into(),
            ..Default::default()
        };
        assert_eq!(
            validate(&spec).map(|r| r.0.policy),
            Ok(Policy::LeastRequest)
        );
    }

    fn with_policy(yaml: &str) -> Result<(Resolved, Vec<String>), FieldError> {
        let tp: TrafficPolicy = serde_json::from_value(
            serde_saphyr::from_str::<serde_json::Value>(yaml).expect("yaml"),
        )
        .expect("shape");
        validate(&RuleSpec {
            host: "a".into(),
            traffic_policy: Some(tp),
            ..Default::default()
        })
    }

    #[test]
    fn outlier_detection_is_on_by_default_and_a_rule_can_turn_it_off() {
        // No rule, or a rule without the block: Istio's defaults for it.
        let none = Resolved::default();
        let (bare, _) = with_policy("{loadBalancer: {simple: ROUND_ROBIN}}").expect("valid");
        for r in [&none, &bare] {
            let od = r.outlier_in_force();
            assert_eq!(
                (
                    od.consecutive_5xx,
                    od.consecutive_gateway,
                    od.base_ejection,
                    od.max_ejection_percent
                ),
                (5, 0, Duration::from_secs(30), 10)
            );
            // The default does not turn zone failover on; a rule's block does.
            assert!(!r.zone_failover());
        }
        let (off, _) = with_policy("{outlierDetection: {consecutive5xxErrors: 0}}").expect("valid");
        assert!(none.outlier_in_force().ignore_503 && bare.outlier_in_force().ignore_503);
        let od = off.outlier_in_force();
        assert_eq!((od.consecutive_5xx, od.consecutive_gateway), (0, 0));
        // A rule's own block counts 503s, as Istio's does.
        assert!(!od.ignore_503);
        assert!(off.zone_failover());
    }

    #[test]
    fn port_level_sections_replace_the_destinations_whole_and_nothing_else() {
        let (r, warnings) = with_policy(
            "{loadBalancer: {simple: ROUND_ROBIN, warmupDurationSecs: 30s},
              connectionPool: {http: {maxRetries: 3}},
              retries: {attempts: 4},
              portLevelSettings: [
                {port: {number: 9000}, loadBalancer: {consistentHash: {httpHeaderName: x-user, maglev: {}}}},
                {port: {number: 9001}, connectionPool: {tcp: {connectTimeout: 250ms}}, tls: {mode: DISABLE}}]}",
        )
        .expect("valid");
        assert_eq!(
            (r.policy, r.warmup),
            (Policy::RoundRobin, Some(Duration::from_secs(30)))
        );
        // Port 9000: its own load balancer, without the destination's warmup;
        // the destination's pool and retries.
        let p = r.for_port(9000);
        assert_eq!(
            (p.policy, p.warmup, p.hash_table_size),
            (Policy::Maglev, None, 65537)
        );
        assert_eq!((p.max_retries, p.retry_attempts), (3, 4));
        // Port 9001: its own pool, whose maxRetries is not inherited.
        let p = r.for_port(9001);
        assert_eq!(p.policy, Policy::RoundRobin);
        assert_eq!(
            (p.connect_timeout, p.max_retries),
            (Some(Duration::from_millis(250)), 0)
        );
        assert_eq!(r.for_port(80), &r);
        // Port 9001 is dialed in plaintext, the others by automatic mTLS.
        assert_eq!((p.tls, r.tls), (TlsMode::Disable, TlsMode::Auto));
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    /// Every field of Istio's DestinationRule (networking.istio.io/v1) in
    /// one rule: an Istio user's YAML is accepted as is, each field either
    /// read or reported.
    #[test]
    fn every_istio_field_is_accepted() {
        let spec: RuleSpec = serde_json::from_value(
            serde_saphyr::from_str::<serde_json::Value>(
                r#"
host: reviews.prod.svc.cluster.local
exportTo: ["*"]
workloadSelector: {matchLabels: {app: reviews}}
trafficPolicy:
  loadBalancer:
    simple: LEAST_REQUEST
    localityLbSetting:
      enabled: true
      distribute: [{from: "us-west/zone1/*", to: {"us-west/zone1/*": 80, "us-west/zone2/*": 20}}]
    warmup: {duration: 60s, minimumPercent: 10, aggression: 1.5}
  connectionPool:
    tcp:
      maxConnections: 100
      connectTimeout: 30ms
      tcpKeepalive: {probes: 3, time: 7200s, interval: 75s}
      maxConnectionDuration: 10m
      idleTimeout: 1h
    http:
      http1MaxPendingRequests: 64
      http2MaxRequests: 1000
      maxRequestsPerConnection: 10
      maxRetries: 3
      idleTimeout: 30s
      h2UpgradePolicy: DO_NOT_UPGRADE
      useClientProtocol: false
      maxConcurrentStreams: 100
  outlierDetection:
    splitExternalLocalOriginErrors: false
    consecutiveLocalOriginFailures: 5
    consecutiveGatewayErrors: 3
    consecutive5xxErrors: 7
    interval: 5m
    baseEjectionTime: 15m
    maxEjectionPercent: 50
    minHealthPercent: 0
  tls:
    mode: MUTUAL
    clientCertificate: /etc/certs/cert.pem
    privateKey: /etc/certs/key.pem
    caCertificates: /etc/certs/ca.pem
    credentialName: reviews-creds
    subjectAltNames: [reviews.example.com]
    sni: reviews.example.com
    insecureSkipVerify: false
    caCrl: /etc/certs/crl.pem
  portLevelSettings:
  - port: {number: 9080}
    loadBalancer:
      consistentHash:
        httpCookie: {name: user, path: /, ttl: 0s}
        ringHash: {minimumRingSize: 2048}
    connectionPool: {tcp: {maxConnections: 10}}
    outlierDetection: {consecutive5xxErrors: 2}
    tls: {mode: ISTIO_MUTUAL}
  tunnel: {protocol: CONNECT, targetHost: egress.example.com, targetPort: 8443}
  proxyProtocol: {version: V2}
subsets:
- name: v1
  labels: {version: v1}
  trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}
"#,
            )
            .expect("yaml"),
        )
        .expect("every Istio field has a place");
        let (r, warnings) = validate(&spec).expect("valid");
        assert_eq!(r.policy, Policy::LeastRequest);
        assert_eq!(r.for_port(9080).policy, Policy::RingHash);
        assert_eq!(r.for_port(9080).tls, TlsMode::IstioMutual);
        let fields: Vec<&str> = warnings
            .iter()
            .map(|w| w.split(':').next().unwrap_or(""))
            .collect();
        assert_eq!(
            fields,
            [
                "spec.workloadSelector",
                "spec.trafficPolicy.outlierDetection.consecutiveLocalOriginFailures",
                "spec.trafficPolicy.connectionPool.tcp.idleTimeout",
                "spec.trafficPolicy.connectionPool.tcp.tcpKeepalive",
                "spec.trafficPolicy.tls",
                "spec.trafficPolicy.tls.mode",
                "spec.trafficPolicy.tunnel",
                "spec.trafficPolicy.proxyProtocol",
                "spec.trafficPolicy.loadBalancer.localityLbSetting.distribute",
            ],
            "{warnings:#?}"
        );
    }

    #[test]
    fn zone_failover_follows_istio_locality_settings() {
        let on = |yaml: &str| {
            let (r, w) = with_policy(yaml).expect("valid");
            (r.zone_failover(), w)
        };
        // Istio's default: on, but only where failures are detected.
        assert_eq!(on("{}"), (false, vec![]));
        assert_eq!(on("{outlierDetection: {}}"), (true, vec![]));
        assert_eq!(on("{healthCheck: {}}"), (true, vec![]));
        assert_eq!(
            on("{outlierDetection: {}, loadBalancer: {localityLbSetting: {enabled: false}}}"),
            (false, vec![])
        );
        assert_eq!(
            on("{loadBalancer: {localityLbSetting: {enabled: true}}}"),
            (false, vec!["spec.trafficPolicy.loadBalancer.localityLbSetting.enabled: no effect without outlierDetection or healthCheck, as in Istio: failover needs failures detected".to_string()])
        );
        let (r, w) = with_policy(
            "{outlierDetection: {}, portLevelSettings: [{port: {number: 81}, loadBalancer: {localityLbSetting: {enabled: false, failoverPriority: [topology.kubernetes.io/zone]}}}]}",
        )
        .expect("valid");
        assert!(r.zone_failover() && !r.for_port(81).zone_failover());
        assert_eq!(w, vec!["spec.trafficPolicy.portLevelSettings[0].loadBalancer.localityLbSetting.failoverPriority: accepted but not enforced; minimesh fails over from the caller's zone to the other zones (see enabled)".to_string()]);
    }

    #[test]
    fn export_to_takes_istio_values_and_refuses_others() {
        let check = |export_to: &[&str]| {
            validate(&RuleSpec {
                host: "a".into(),
                export_to: export_to.iter().map(|e| e.to_string()).collect(),
                ..Default::default()
            })
            .map(|(_, w)| w)
        };
        for ok in [&["*"][..], &["."], &["~"], &[".", "team-b"]] {
            assert_eq!(check(ok), Ok(vec![]), "{ok:?}");
        }
        let e = check(&[".", "Team_B"]).unwrap_err();
        assert_eq!(e.field, "spec.exportTo[1]");
        assert_eq!(
            e.reason,
            "\"Team_B\" is not a namespace name, \".\" (this namespace), \"*\" (every namespace) or \"~\" (none)"
        );
    }

    #[test]
    fn port_level_errors_name_the_entry() {
        let err = |yaml: &str| with_policy(yaml).map(|_| ()).unwrap_err();
        assert_eq!(
            err("{portLevelSettings: [{port: {number: 80}}, {port: {number: 81}, loadBalancer: {simple: PASSTHROUGH}}]}").field,
            "spec.trafficPolicy.portLevelSettings[1].loadBalancer.simple"
        );
        assert_eq!(
            err("{portLevelSettings: [{port: {number: 80}, loadBalancer: {consistentHash: {maglev: {tableSize: 100}, useSourceIp: true}}}]}").field,
            "spec.trafficPolicy.portLevelSettings[0].loadBalancer.consistentHash.maglev.tableSize"
        );
        assert_eq!(
            err("{portLevelSettings: [{loadBalancer: {simple: RANDOM}}]}"),
            FieldError::new(
                "spec.trafficPolicy.portLevelSettings[0].port",
                "must name the Service port: port: {number: N}"
            )
        );
        assert_eq!(
            err("{portLevelSettings: [{port: {number: 70000}}]}"),
            FieldError::new(
                "spec.trafficPolicy.portLevelSettings[0].port.number",
                "70000 is out of range 1..=65535"
            )
        );
        assert_eq!(
            err("{portLevelSettings: [{port: {number: 80}}, {port: {number: 80}, loadBalancer: {simple: RANDOM}}]}"),
            FieldError::new(
                "spec.trafficPolicy.portLevelSettings[1].port.number",
                "port 80 is set by an earlier entry too"
            )
        );
        let many: Vec<String> = (1..=4097)
            .map(|n| format!("{{port: {{number: {n}}}}}"))
            .collect();
        assert_eq!(
            err(&format!("{{portLevelSettings: [{}]}}", many.join(", "))),
            FieldError::new(
                "spec.trafficPolicy.portLevelSettings",
                "4097 entries; at most 4096"
            )
        );
    }

    #[test]
    fn istio_connection_lifetime_and_outlier_fields_are_read_or_reported() {
        let (r, warnings) = with_policy(
            "{connectionPool: {tcp: {maxConnectionDuration: 30s, idleTimeout: 0s}},
              outlierDetection: {consecutiveErrors: 3, consecutiveLocalOriginFailures: 2}}",
        )
        .expect("valid");
        assert_eq!(r.max_connection_duration, Some(Duration::from_secs(30)));
        let od = r.outlier.expect("outlier detection");
        assert_eq!((od.consecutive_5xx, od.consecutive_gateway), (0, 3));
        assert_eq!(
            warnings,
            vec![
                "spec.trafficPolicy.outlierDetection.consecutiveErrors: deprecated; read as consecutiveGatewayErrors: 3 with consecutive5xxErrors: 0, as Istio does".to_string(),
                "spec.trafficPolicy.outlierDetection.consecutiveLocalOriginFailures: has no effect without splitExternalLocalOriginErrors: true (local-origin failures count as 503/504 responses)".to_string(),
                "spec.trafficPolicy.connectionPool.tcp.idleTimeout: accepted but not enforced (it applies to proxied TCP streams; minimesh proxies HTTP, where http.idleTimeout closes idle upstream connections)".to_string(),
            ]
        );
        // Local-origin failures apart: their own threshold, 5 by default.
        let (r, w) = with_policy(
            "{outlierDetection: {splitExternalLocalOriginErrors: true, consecutiveLocalOriginFailures: 2}}",
        )
        .expect("valid");
        let od = r.outlier.expect("outlier detection");
        assert_eq!(
            (
                od.split_local_origin,
                od.consecutive_local_origin,
                od.consecutive_5xx
            ),
            (true, 2, 5)
        );
        assert_eq!(w, Vec::<String>::new());
        let (r, _) = with_policy("{outlierDetection: {splitExternalLocalOriginErrors: true}}")
            .expect("valid");
        assert_eq!(r.outlier.expect("od").consecutive_local_origin, 5);
        // The current fields win over the deprecated one.
        let (r, _) =
            with_policy("{outlierDetection: {consecutiveErrors: 3, consecutive5xxErrors: 7}}")
                .expect("valid");
        let od = r.outlier.expect("outlier detection");
        assert_eq!((od.consecutive_5xx, od.consecutive_gateway), (7, 0));
        assert_eq!(
            with_policy("{connectionPool: {tcp: {maxConnectionDuration: 0s}}}")
                .map(|_| ())
                .map_err(|e| e.field),
            Err("spec.trafficPolicy.connectionPool.tcp.maxConnectionDuration".to_string())
        );
    }

    #[test]
    fn health_check_is_http_or_grpc() {
        let hc = |yaml: &str| {
            with_traffic_policy(&format!("{{healthCheck: {yaml}}}"))
                .map(|(r, _)| r.health_check.expect("resolved"))
        };
        let http = hc("{}").expect("valid");
        assert_eq!((http.path.as_str(), http.grpc_service), ("/health", None));
        let grpc = hc("{grpcService: \"\"}").expect("valid");
        assert_eq!(grpc.grpc_service.as_deref(), Some(""));
        assert_eq!(
            hc("{grpcService: mesh.Echo, path: /health}").map(|_| ()),
            Err(FieldError::new(
                "spec.trafficPolicy.healthCheck.grpcService",
                "set either path (an HTTP check) or grpcService (a gRPC health check), not both"
            ))
        );
    }

    /// Validates a rule whose `trafficPolicy` is `yaml`.
    fn with_traffic_policy(yaml: &str) -> Result<(Resolved, Vec<String>), FieldError> {
        let tp: TrafficPolicy = serde_json::from_value(
            serde_saphyr::from_str::<serde_json::Value>(yaml).expect("yaml"),
        )
        .expect("shape");
        validate(&RuleSpec {
            host: "a".into(),
            traffic_policy: Some(tp),
            ..Default::default()
        })
    }

    fn with_pool(yaml: &str) -> Result<(Resolved, Vec<String>), FieldError> {
        with_traffic_policy(&format!("{{connectionPool: {yaml}}}"))
    }

    #[test]
    fn connection_pool_fields_resolve_or_name_the_field() {
        let (r, warnings) = with_pool(
            "{tcp: {connectTimeout: 250ms}, http: {idleTimeout: 30s, maxRequestsPerConnection: 7, maxRetries: 3}}",
        )
        .expect("valid");
        assert_eq!(r.connect_timeout, Some(Duration::from_millis(250)));
        assert_eq!(r.idle_timeout, Some(Duration::from_secs(30)));
        assert_eq!((r.max_requests_per_connection, r.max_retries), (7, 3));
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            with_pool("{http: {idleTimeout: \"5\"}}").map(|_| ()),
            Err(FieldError::new(
                "spec.trafficPolicy.connectionPool.http.idleTimeout",
                "\"5\" needs a unit (ms, s, m or h)"
            ))
        );
        assert_eq!(
            with_pool("{http: {maxRetries: 0}}")
                .map(|_| ())
                .map_err(|e| e.field),
            Err("spec.trafficPolicy.connectionPool.http.maxRetries".to_string())
        );
        let (r, warnings) = with_pool(
            "{http: {maxConcurrentStreams: 10, useClientProtocol: true, http2MaxRequests: 50, h2UpgradePolicy: DO_NOT_UPGRADE}}",
        )
        .expect("valid");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(r.max_concurrent_streams, 10);
        assert!(r.use_client_protocol);
        assert_eq!((r.max_requests, r.max_requests_h2), (50, 50));
        let (r, _) = with_pool("{tcp: {maxConnections: 4}}").expect("valid");
        assert_eq!((r.max_requests, r.max_requests_h2), (1028, 0));
        assert_eq!(
            with_pool("{http: {maxConcurrentStreams: 0}}").map(|_| ()),
            Err(FieldError::new(
                "spec.trafficPolicy.connectionPool.http.maxConcurrentStreams",
                "must be at least 1 (leave it out for no limit)"
            ))
        );
        assert_eq!(
            with_pool("{http: {h2UpgradePolicy: ALWAYS}}").map(|_| ()),
            Err(FieldError::new(
                "spec.trafficPolicy.connectionPool.http.h2UpgradePolicy",
                "\"ALWAYS\" is not one of DEFAULT, DO_NOT_UPGRADE, UPGRADE"
            ))
        );
        let (_, warnings) = with_pool("{http: {h2UpgradePolicy: UPGRADE}}").expect("valid");
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with("spec.trafficPolicy.connectionPool.http.h2UpgradePolicy: UPGRADE is accepted but not enforced")
                && warnings[0].contains("appProtocol: http2 or grpc"),
            "{warnings:?}"
        );
    }
}
