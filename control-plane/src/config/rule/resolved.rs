//! What a valid rule resolves to: the settings sidecars are sent, with
//! every default filled in and port-level sections merged.

use std::collections::BTreeMap;
use std::time::Duration;

use super::{
    Outlier, Policy, ResolvedHealthCheck, DEFAULT_OUTLIER, DEFAULT_RETRY, DEFAULT_RETRY_ATTEMPTS,
    DEFAULT_RETRY_BUDGET_MIN_PER_SECOND, DEFAULT_RETRY_BUDGET_PERCENT,
};
/// How a cluster's sidecars dial its endpoints: Istio's
/// `trafficPolicy.tls.mode`, of which minimesh originates the mesh's own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// No `tls`: mutual TLS to the endpoints that run a sidecar (Istio's
    /// auto mTLS), plaintext to the others.
    #[default]
    Auto,
    /// `DISABLE`: plaintext to every endpoint, sidecar or not.
    Disable,
    /// `ISTIO_MUTUAL`: the mesh's mutual TLS to every endpoint.
    IstioMutual,
}

/// Settings the sidecar needs, resolved from a valid rule.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    /// The policy.
    pub policy: Policy,
    /// Ring size or table size for the hash policies.
    pub hash_table_size: u64,
    /// Connect timeout.
    pub connect_timeout: Option<Duration>,
    /// Request timeout.
    pub timeout: Option<Duration>,
    /// Retries after the first attempt.
    pub retry_attempts: u32,
    /// Slow-start window.
    pub warmup: Option<Duration>,
    /// Slow-start starting share, percent.
    pub warmup_min_percent: f64,
    /// Slow-start aggression.
    pub warmup_aggression: f64,
    /// Timeout of each attempt.
    pub per_try_timeout: Option<Duration>,
    /// Retry budget percent.
    pub retry_budget_percent: u32,
    /// Retry budget floor per second.
    pub retry_budget_min_per_second: u32,
    /// Outlier detection, when the rule sets it (else [`DEFAULT_OUTLIER`]
    /// is in force, see [`Resolved::outlier_in_force`]).
    pub outlier: Option<Outlier>,
    /// Bits of the wire `RetryOn` enum.
    pub retry_on: u32,
    /// The status codes retried under `retriable-status-codes`.
    pub retriable_status_codes: Vec<u32>,
    /// Active health checking, when configured.
    pub health_check: Option<ResolvedHealthCheck>,
    /// Requests in flight per sidecar at most over HTTP/1.1 (0 = unlimited):
    /// `tcp.maxConnections` plus `http.http1MaxPendingRequests`, and at
    /// most `http.http2MaxRequests`.
    pub max_requests: u32,
    /// Requests in flight per sidecar at most over HTTP/2
    /// (`http.http2MaxRequests`; 0 = unlimited).
    pub max_requests_h2: u32,
    /// `http.useClientProtocol`.
    pub use_client_protocol: bool,
    /// Streams per upstream HTTP/2 connection at most (0 = unlimited).
    pub max_concurrent_streams: u32,
    /// How sidecars dial the endpoints (`tls.mode`).
    pub tls: TlsMode,
    /// Idle upstream connection lifetime.
    pub idle_timeout: Option<Duration>,
    /// Requests per upstream connection (0 = unlimited).
    pub max_requests_per_connection: u32,
    /// Retries in flight per sidecar at most (0 = unlimited).
    pub max_retries: u32,
    /// Upstream connection lifetime at most.
    pub max_connection_duration: Option<Duration>,
    /// Zone failover (`localityLbSetting.enabled`, default on); it acts only
    /// with outlier detection or health checks, see [`Resolved::zone_failover`].
    pub locality_failover: bool,
    /// Settings of the ports named in `portLevelSettings`, each with the
    /// port's sections merged over the destination's (their own `ports` is
    /// empty).
    pub ports: BTreeMap<u16, Resolved>,
}

impl Resolved {
    /// True when sidecars prefer endpoints in their own zone: locality load
    /// balancing is not turned off and failures are detected (outlier
    /// detection or health checks), as Istio requires for failover.
    pub fn zone_failover(&self) -> bool {
        self.locality_failover && (self.outlier.is_some() || self.health_check.is_some())
    }

    /// The outlier detection sidecars enforce: the rule's, else the default.
    pub fn outlier_in_force(&self) -> &Outlier {
        self.outlier.as_ref().unwrap_or(&DEFAULT_OUTLIER)
    }

    /// The settings in force on `port`.
    pub fn for_port(&self, port: u16) -> &Resolved {
        self.ports.get(&port).unwrap_or(self)
    }
}

impl Default for Resolved {
    /// What a service with no rule gets.
    fn default() -> Self {
        Resolved {
            policy: Policy::LeastRequest,
            hash_table_size: 0,
            connect_timeout: None,
            timeout: None,
            retry_attempts: DEFAULT_RETRY_ATTEMPTS,
            warmup: None,
            warmup_min_percent: 10.0,
            warmup_aggression: 1.0,
            per_try_timeout: None,
            retry_budget_percent: DEFAULT_RETRY_BUDGET_PERCENT,
            retry_budget_min_per_second: DEFAULT_RETRY_BUDGET_MIN_PER_SECOND,
            outlier: None,
            max_requests: 0,
            max_requests_h2: 0,
            use_client_protocol: false,
            max_concurrent_streams: 0,
            tls: TlsMode::Auto,
            idle_timeout: None,
            max_requests_per_connection: 0,
            max_retries: 0,
            max_connection_duration: None,
            locality_failover: true,
            retry_on: DEFAULT_RETRY.bits,
            retriable_status_codes: DEFAULT_RETRY.codes.clone(),
            health_check: None,
            ports: BTreeMap::new(),
        }
    }
}
