//! Validation of a rule: what serde cannot check (value ranges, mutually
//! exclusive fields, supported combinations), with errors that name the
//! field, and warnings for fields accepted without effect.

use std::collections::BTreeMap;
use std::time::Duration;

use super::resolve;

use super::{
    ConsistentHash, LoadBalancer, Policy, PortSelector, Resolved, RuleSpec, TrafficPolicy,
    DEFAULT_MAGLEV_TABLE_SIZE, DEFAULT_RING_SIZE, MAX_MAGLEV_TABLE_SIZE, MAX_PORT_LEVEL_SETTINGS,
    MAX_RING_SIZE,
};

/// A field-level validation failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field, e.g. `spec.trafficPolicy.loadBalancer.simple`.
    pub field: String,
    /// Why it is rejected.
    pub reason: String,
}

impl FieldError {
    pub(crate) fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Default retry budget: retries at most 20% of requests…
pub const DEFAULT_RETRY_BUDGET_PERCENT: u32 = 20;
/// …plus 10 a second, so that a quiet service can still retry.
pub const DEFAULT_RETRY_BUDGET_MIN_PER_SECOND: u32 = 10;

/// Default retries on connect failure, as Istio's mesh default.
pub const DEFAULT_RETRY_ATTEMPTS: u32 = 2;

/// Checks what serde cannot: value ranges, mutually exclusive fields and
/// supported combinations. Returns the resolved settings and warnings for
/// fields that are accepted but have no effect yet.
pub fn validate(spec: &RuleSpec) -> Result<(Resolved, Vec<String>), FieldError> {
    let mut warnings = Vec::new();
    if spec.host.trim().is_empty() {
        return Err(FieldError::new("spec.host", "must name a service"));
    }
    if spec.host.contains('*') {
        return Err(FieldError::new(
            "spec.host",
            "wildcard hosts are not supported; name one service",
        ));
    }
    for (i, e) in spec.export_to.iter().enumerate() {
        let label = !e.is_empty()
            && e.len() <= 63
            && e.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !e.starts_with('-')
            && !e.ends_with('-');
        if !(label || matches!(e.as_str(), "*" | "." | "~")) {
            return Err(FieldError::new(
                format!("spec.exportTo[{i}]"),
                format!("{e:?} is not a namespace name, \".\" (this namespace), \"*\" (every namespace) or \"~\" (none)"),
            ));
        }
    }
    if spec.workload_selector.is_some() {
        warnings.push(
            "spec.workloadSelector: accepted but not used yet; the rule applies to every caller"
                .to_string(),
        );
    }
    let Some(tp) = &spec.traffic_policy else {
        return Ok((Resolved::default(), warnings));
    };
    const TP: &str = "spec.trafficPolicy";
    let mut resolved = resolve::resolve(tp, TP, &mut warnings)?;
    warn_idle_failover(tp.load_balancer.as_ref(), &resolved, TP, &mut warnings);
    if tp.port_level_settings.len() > MAX_PORT_LEVEL_SETTINGS {
        return Err(FieldError::new(
            format!("{TP}.portLevelSettings"),
            format!(
                "{} entries; at most {MAX_PORT_LEVEL_SETTINGS}",
                tp.port_level_settings.len()
            ),
        ));
    }
    let mut ports = BTreeMap::new();
    for (i, p) in tp.port_level_settings.iter().enumerate() {
        let at = format!("{TP}.portLevelSettings[{i}]");
        let Some(PortSelector { number }) = p.port else {
            return Err(FieldError::new(
                format!("{at}.port"),
                "must name the Service port: port: {number: N}",
            ));
        };
        let port = match u16::try_from(number) {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(FieldError::new(
                    format!("{at}.port.number"),
                    format!("{number} is out of range 1..=65535"),
                ))
            }
        };
        // The port's own sections are checked alone, so that errors and
        // warnings name them at `at`; no check spans two sections.
        let own = TrafficPolicy {
            load_balancer: p.load_balancer.clone(),
            connection_pool: p.connection_pool.clone(),
            outlier_detection: p.outlier_detection.clone(),
            tls: p.tls.clone(),
            ..TrafficPolicy::default()
        };
        resolve::resolve(&own, &at, &mut warnings)?;
        // Each section the port sets replaces the destination's whole.
        let merged = TrafficPolicy {
            load_balancer: own.load_balancer.or_else(|| tp.load_balancer.clone()),
            connection_pool: own.connection_pool.or_else(|| tp.connection_pool.clone()),
            outlier_detection: own
                .outlier_detection
                .or_else(|| tp.outlier_detection.clone()),
            tls: own.tls.or_else(|| tp.tls.clone()),
            port_level_settings: vec![],
            ..tp.clone()
        };
        let port_resolved = resolve::resolve(&merged, &at, &mut Vec::new())?;
        warn_idle_failover(p.load_balancer.as_ref(), &port_resolved, &at, &mut warnings);
        if ports.insert(port, port_resolved).is_some() {
            return Err(FieldError::new(
                format!("{at}.port.number"),
                format!("port {port} is set by an earlier entry too"),
            ));
        }
    }
    resolved.ports = ports;
    Ok((resolved, warnings))
}

/// Warns when `localityLbSetting.enabled: true` can have no effect.
pub(crate) fn warn_idle_failover(
    lb: Option<&LoadBalancer>,
    resolved: &Resolved,
    at: &str,
    warnings: &mut Vec<String>,
) {
    let enabled = lb
        .and_then(|lb| lb.locality_lb_setting.as_ref())
        .and_then(|l| l.enabled);
    if enabled == Some(true) && !resolved.zone_failover() {
        warnings.push(format!(
            "{at}.loadBalancer.localityLbSetting.enabled: no effect without outlierDetection or healthCheck, as in Istio: failover needs failures detected"
        ));
    }
}

pub(crate) fn validate_hash(
    ch: &ConsistentHash,
    lb_at: &str,
    resolved: &mut Resolved,
) -> Result<(), FieldError> {
    let ch_at = format!("{lb_at}.consistentHash");
    let keys = ch.http_header_name.is_some() as u8
        + ch.http_cookie.is_some() as u8
        + ch.use_source_ip.unwrap_or(false) as u8
        + ch.http_query_parameter_name.is_some() as u8;
    if keys != 1 {
        return Err(FieldError::new(
            &ch_at,
            "set exactly one hash key: httpHeaderName, httpCookie, useSourceIp or httpQueryParameterName",
        ));
    }
    if let Some(c) = &ch.http_cookie {
        if c.name.is_empty() {
            return Err(FieldError::new(
                format!("{ch_at}.httpCookie.name"),
                "must not be empty",
            ));
        }
        // Istio: a zero TTL makes a session cookie.
        if let Some(ttl) = c.ttl.as_deref().filter(|t| !is_zero_duration(t)) {
            parse_duration(ttl)
                .map_err(|r| FieldError::new(format!("{ch_at}.httpCookie.ttl"), r))?;
        }
    }
    match (&ch.ring_hash, &ch.maglev) {
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                &ch_at,
                "set either ringHash or maglev, not both",
            ))
        }
        (None, Some(m)) => {
            let size = m.table_size.unwrap_or(DEFAULT_MAGLEV_TABLE_SIZE);
            if size > MAX_MAGLEV_TABLE_SIZE || !is_prime(size) {
                return Err(FieldError::new(
                    format!("{ch_at}.maglev.tableSize"),
                    format!("{size} must be a prime no larger than {MAX_MAGLEV_TABLE_SIZE}"),
                ));
            }
            resolved.policy = Policy::Maglev;
            resolved.hash_table_size = size;
        }
        (ring, None) => {
            let (field, size) = match (
                ring.as_ref().and_then(|r| r.minimum_ring_size),
                ch.minimum_ring_size,
            ) {
                (Some(s), _) => ("ringHash.minimumRingSize", s),
                (None, Some(s)) => ("minimumRingSize", s),
                (None, None) => ("ringHash.minimumRingSize", DEFAULT_RING_SIZE),
            };
            if size == 0 || size > MAX_RING_SIZE {
                return Err(FieldError::new(
                    format!("{ch_at}.{field}"),
                    format!("{size} is out of range 1..={MAX_RING_SIZE}"),
                ));
            }
            resolved.policy = Policy::RingHash;
            resolved.hash_table_size = size;
        }
    }
    Ok(())
}

/// `0s`, `0ms`, `0m` or `0h`: where Istio gives a zero duration a meaning.
pub(crate) fn is_zero_duration(t: &str) -> bool {
    matches!(t.trim(), "0s" | "0ms" | "0m" | "0h")
}

pub(crate) fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// Retry conditions when a rule names none ([`minimesh_proto::retry_on`]).
pub use minimesh_proto::retry_on::DEFAULT as DEFAULT_RETRY_ON;

/// [`DEFAULT_RETRY_ON`], parsed once.
pub static DEFAULT_RETRY: std::sync::LazyLock<minimesh_proto::retry_on::Parsed> =
    std::sync::LazyLock::new(|| parse_retry_on(DEFAULT_RETRY_ON).unwrap_or_default());

/// Parses Istio's comma-separated `retryOn` ([`minimesh_proto::retry_on`]).
pub use minimesh_proto::retry_on::parse as parse_retry_on;

/// Parses a rule's duration: minimesh's one grammar, more than zero
/// ([`minimesh_proto::duration`]).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    minimesh_proto::duration::parse_positive(s)
}
