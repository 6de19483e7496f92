//! How a valid rule resolves to [`Resolved`]: each section of a traffic
//! policy checked and read in a step of its own, every default filled in.

use std::time::Duration;

use super::resolved::{Resolved, TlsMode};
use super::{
    is_zero_duration, parse_duration, parse_retry_on, validate_hash, ConnectionPool, FieldError,
    HealthCheck, LoadBalancer, Outlier, OutlierDetection, Policy, ResolvedHealthCheck, Retries,
    SimpleLb, TrafficPolicy, MAX_WEIGHT,
};

/// Resolves one traffic policy whose fields live under `at`
/// (`spec.trafficPolicy`, or a port's entry of `portLevelSettings`).
pub(crate) fn resolve(
    tp: &TrafficPolicy,
    at: &str,
    warnings: &mut Vec<String>,
) -> Result<Resolved, FieldError> {
    let mut resolved = Resolved::default();
    if let Some(od) = &tp.outlier_detection {
        let od_at = format!("{at}.outlierDetection");
        resolved.outlier = Some(outlier_detection(od, &od_at, warnings)?);
    }
    if let Some(hc) = &tp.health_check {
        resolved.health_check = Some(health_check(hc, &format!("{at}.healthCheck"))?);
    }
    if let Some(cp) = &tp.connection_pool {
        let cp_at = format!("{at}.connectionPool");
        connection_pool(cp, &cp_at, &mut resolved, warnings)?;
    }
    if let Some(tls) = &tp.tls {
        resolved.tls = tls_mode(tls, at, warnings)?;
    }
    for (set, field, why) in [
        (
            tp.tunnel.is_some(),
            "tunnel",
            "it applies to TCP routes; minimesh proxies HTTP",
        ),
        (
            tp.proxy_protocol.is_some(),
            "proxyProtocol",
            "minimesh does not send the PROXY protocol",
        ),
    ] {
        if set {
            warnings.push(format!("{at}.{field}: accepted but not enforced ({why})"));
        }
    }
    if let Some(t) = &tp.timeout {
        resolved.timeout =
            Some(parse_duration(t).map_err(|r| FieldError::new(format!("{at}.timeout"), r))?);
    }
    if let Some(r) = &tp.retries {
        retries(r, at, &mut resolved)?;
    }
    if let Some(lb) = &tp.load_balancer {
        let lb_at = format!("{at}.loadBalancer");
        load_balancer(lb, &lb_at, &mut resolved, warnings)?;
    }
    Ok(resolved)
}

/// `outlierDetection` (at `od_at`): ejection after consecutive errors,
/// Istio's deprecated `consecutiveErrors` read as Istio reads it.
fn outlier_detection(
    od: &OutlierDetection,
    od_at: &str,
    warnings: &mut Vec<String>,
) -> Result<Outlier, FieldError> {
    let dur = |v: &Option<String>, field: &str, default: Duration| match v {
        Some(t) => parse_duration(t).map_err(|r| FieldError::new(format!("{od_at}.{field}"), r)),
        None => Ok(default),
    };
    dur(&od.interval, "interval", Duration::from_secs(10))?;
    let base_ejection = dur(
        &od.base_ejection_time,
        "baseEjectionTime",
        Duration::from_secs(30),
    )?;
    for (v, field) in [
        (od.max_ejection_percent, "maxEjectionPercent"),
        (od.min_health_percent, "minHealthPercent"),
    ] {
        if v.is_some_and(|v| v > 100) {
            return Err(FieldError::new(
                format!("{od_at}.{field}"),
                format!("{} is more than 100", v.unwrap_or(0)),
            ));
        }
    }
    let (mut consecutive_5xx, mut consecutive_gateway) = (
        od.consecutive_5xx_errors.unwrap_or(5),
        od.consecutive_gateway_errors.unwrap_or(0),
    );
    if let Some(n) = od.consecutive_errors {
        if od.consecutive_5xx_errors.is_some() || od.consecutive_gateway_errors.is_some() {
            warnings.push(format!(
                "{od_at}.consecutiveErrors: deprecated, and ignored because consecutive5xxErrors or consecutiveGatewayErrors is set"
            ));
        } else {
            (consecutive_5xx, consecutive_gateway) = (0, n);
            warnings.push(format!(
                "{od_at}.consecutiveErrors: deprecated; read as consecutiveGatewayErrors: {n} with consecutive5xxErrors: 0, as Istio does"
            ));
        }
    }
    let split_local_origin = od.split_external_local_origin_errors.unwrap_or(false);
    if od.consecutive_local_origin_failures.is_some() && !split_local_origin {
        warnings.push(format!(
            "{od_at}.consecutiveLocalOriginFailures: has no effect without splitExternalLocalOriginErrors: true (local-origin failures count as 503/504 responses)"
        ));
    }
    Ok(Outlier {
        consecutive_5xx,
        consecutive_gateway,
        split_local_origin,
        consecutive_local_origin: od.consecutive_local_origin_failures.unwrap_or(5),
        base_ejection,
        max_ejection_percent: od.max_ejection_percent.unwrap_or(10),
        min_health_percent: od.min_health_percent.unwrap_or(0),
        ignore_503: false,
    })
}

/// `healthCheck` (at `hc_at`): active checks of every endpoint, HTTP or
/// gRPC, with their interval, timeout and thresholds.
fn health_check(hc: &HealthCheck, hc_at: &str) -> Result<ResolvedHealthCheck, FieldError> {
    let dur = |v: &Option<String>, field: &str, default: Duration| match v {
        Some(t) => parse_duration(t).map_err(|r| FieldError::new(format!("{hc_at}.{field}"), r)),
        None => Ok(default),
    };
    let interval = dur(&hc.interval, "interval", Duration::from_secs(5))?;
    if interval < Duration::from_millis(100) {
        return Err(FieldError::new(
            format!("{hc_at}.interval"),
            "must be at least 100ms",
        ));
    }
    let timeout = dur(&hc.timeout, "timeout", Duration::from_secs(1))?;
    let path = hc.path.clone().unwrap_or_else(|| "/health".into());
    if !path.starts_with('/')
        || path.len() > 1024
        || path.parse::<http::uri::PathAndQuery>().is_err()
    {
        return Err(FieldError::new(
            format!("{hc_at}.path"),
            format!("{path:?} is not an absolute path"),
        ));
    }
    if let Some(svc) = &hc.grpc_service {
        if hc.path.is_some() {
            return Err(FieldError::new(
                format!("{hc_at}.grpcService"),
                "set either path (an HTTP check) or grpcService (a gRPC health check), not both",
            ));
        }
        if svc.len() > 1024 || svc.chars().any(|c| c.is_control()) {
            return Err(FieldError::new(
                format!("{hc_at}.grpcService"),
                "must be a service name of at most 1024 printable characters",
            ));
        }
    }
    let th = |v: Option<u32>, field: &str, default: u32| match v {
        Some(0) => Err(FieldError::new(
            format!("{hc_at}.{field}"),
            "must be at least 1",
        )),
        Some(n) if n > 100 => Err(FieldError::new(
            format!("{hc_at}.{field}"),
            format!("{n} is more than 100"),
        )),
        Some(n) => Ok(n),
        None => Ok(default),
    };
    Ok(ResolvedHealthCheck {
        path,
        grpc_service: hc.grpc_service.clone(),
        interval,
        timeout,
        healthy_threshold: th(hc.healthy_threshold, "healthyThreshold", 1)?,
        unhealthy_threshold: th(hc.unhealthy_threshold, "unhealthyThreshold", 2)?,
    })
}

/// `connectionPool` (at `cp_at`): the limits on requests in flight, the
/// upstream connections' timeouts and lifetimes; fields accepted without
/// effect are warned of.
fn connection_pool(
    cp: &ConnectionPool,
    cp_at: &str,
    resolved: &mut Resolved,
    warnings: &mut Vec<String>,
) -> Result<(), FieldError> {
    let conns = cp.tcp.as_ref().and_then(|t| t.max_connections);
    let pending = cp.http.as_ref().and_then(|h| h.http1_max_pending_requests);
    let h2 = cp.http.as_ref().and_then(|h| h.http2_max_requests);
    for (v, field) in [
        (conns, "tcp.maxConnections"),
        (pending, "http.http1MaxPendingRequests"),
        (h2, "http.http2MaxRequests"),
    ] {
        if v == Some(0) {
            return Err(FieldError::new(
                format!("{cp_at}.{field}"),
                "must be at least 1",
            ));
        }
    }
    // Upstream HTTP/1.1 connections carry one request each: requests in
    // flight are at most maxConnections plus the pending queue, and at
    // most http2MaxRequests. HTTP/2 connections multiplex, so there only
    // http2MaxRequests bounds them, as in Envoy.
    let limit = match (conns, pending) {
        (Some(c), Some(p)) => Some(c.saturating_add(p)),
        (Some(c), None) => Some(c.saturating_add(1024)),
        (None, Some(p)) => Some(p.saturating_add(1024)),
        (None, None) => None,
    };
    resolved.max_requests = match (limit, h2) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => 0,
    };
    resolved.max_requests_h2 = h2.unwrap_or(0);
    let dur = |v: Option<&String>, field: &str| {
        v.map(|t| parse_duration(t).map_err(|r| FieldError::new(format!("{cp_at}.{field}"), r)))
            .transpose()
    };
    resolved.connect_timeout = dur(
        cp.tcp.as_ref().and_then(|t| t.connect_timeout.as_ref()),
        "tcp.connectTimeout",
    )?;
    resolved.idle_timeout = dur(
        cp.http.as_ref().and_then(|h| h.idle_timeout.as_ref()),
        "http.idleTimeout",
    )?;
    resolved.max_connection_duration = dur(
        cp.tcp
            .as_ref()
            .and_then(|t| t.max_connection_duration.as_ref()),
        "tcp.maxConnectionDuration",
    )?;
    if let Some(t) = cp.tcp.as_ref().and_then(|t| t.idle_timeout.as_ref()) {
        // Istio allows 0s (no timeout) here; only the shape is checked.
        if !is_zero_duration(t) {
            dur(Some(t), "tcp.idleTimeout")?;
        }
        warnings.push(format!(
            "{cp_at}.tcp.idleTimeout: accepted but not enforced (it applies to proxied TCP streams; minimesh proxies HTTP, where http.idleTimeout closes idle upstream connections)"
        ));
    }
    if let Some(h) = &cp.http {
        resolved.max_requests_per_connection = h.max_requests_per_connection.unwrap_or(0);
        if h.max_retries == Some(0) {
            return Err(FieldError::new(
                format!("{cp_at}.http.maxRetries"),
                "must be at least 1 (to turn retries off, set retries.attempts: 0)",
            ));
        }
        resolved.max_retries = h.max_retries.unwrap_or(0);
    }
    if let Some(h) = &cp.http {
        resolved.use_client_protocol = h.use_client_protocol.unwrap_or(false);
        if h.max_concurrent_streams == Some(0) {
            return Err(FieldError::new(
                format!("{cp_at}.http.maxConcurrentStreams"),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        resolved.max_concurrent_streams = h.max_concurrent_streams.unwrap_or(0);
        match h.h2_upgrade_policy.as_deref() {
            None | Some("DEFAULT") | Some("DO_NOT_UPGRADE") => {}
            Some("UPGRADE") => warnings.push(format!(
                "{cp_at}.http.h2UpgradePolicy: UPGRADE is accepted but not enforced (requests to HTTP/1.1 ports stay HTTP/1.1, which every app behind them speaks); to speak HTTP/2 to a service, declare its port: appProtocol: http2 or grpc, or a port name starting with http2- or grpc-"
            )),
            Some(other) => {
                return Err(FieldError::new(
                    format!("{cp_at}.http.h2UpgradePolicy"),
                    format!("{other:?} is not one of DEFAULT, DO_NOT_UPGRADE, UPGRADE"),
                ))
            }
        }
    }
    if cp.tcp.as_ref().is_some_and(|t| t.tcp_keepalive.is_some()) {
        warnings.push(format!(
            "{cp_at}.tcp.tcpKeepalive: accepted but not enforced (minimesh does not set TCP keepalive on upstream connections)"
        ));
    }
    Ok(())
}

/// `retries` (under `at`): attempts, what is retried, each attempt's
/// timeout, the retry budget.
fn retries(r: &Retries, at: &str, resolved: &mut Resolved) -> Result<(), FieldError> {
    if let Some(a) = r.attempts {
        if a > 10 {
            return Err(FieldError::new(
                format!("{at}.retries.attempts"),
                format!("{a} is more than the maximum of 10"),
            ));
        }
        resolved.retry_attempts = a;
    }
    if let Some(on) = &r.retry_on {
        let parsed = parse_retry_on(on)
            .map_err(|reason| FieldError::new(format!("{at}.retries.retryOn"), reason))?;
        resolved.retry_on = parsed.bits;
        resolved.retriable_status_codes = parsed.codes;
    }
    if let Some(t) = &r.per_try_timeout {
        resolved.per_try_timeout = Some(
            parse_duration(t)
                .map_err(|r| FieldError::new(format!("{at}.retries.perTryTimeout"), r))?,
        );
    }
    if let Some(p) = r.budget_percent {
        if p > 100 {
            return Err(FieldError::new(
                format!("{at}.retries.budgetPercent"),
                format!("{p} is more than 100"),
            ));
        }
        resolved.retry_budget_percent = p;
    }
    if let Some(m) = r.min_retries_per_second {
        if m > 100_000 {
            return Err(FieldError::new(
                format!("{at}.retries.minRetriesPerSecond"),
                format!("{m} is more than 100000"),
            ));
        }
        resolved.retry_budget_min_per_second = m;
    }
    Ok(())
}

/// `loadBalancer` (at `lb_at`): the policy (simple or consistent hash),
/// locality failover, warmup, endpoint weights.
fn load_balancer(
    lb: &LoadBalancer,
    lb_at: &str,
    resolved: &mut Resolved,
    warnings: &mut Vec<String>,
) -> Result<(), FieldError> {
    if let Some(l) = &lb.locality_lb_setting {
        resolved.locality_failover = l.enabled.unwrap_or(true);
        for (set, field) in [
            (!l.distribute.is_empty(), "distribute"),
            (!l.failover.is_empty(), "failover"),
            (!l.failover_priority.is_empty(), "failoverPriority"),
        ] {
            if set {
                warnings.push(format!(
                    "{lb_at}.localityLbSetting.{field}: accepted but not enforced; minimesh fails over from the caller's zone to the other zones (see enabled)"
                ));
            }
        }
    }
    match (&lb.simple, &lb.consistent_hash) {
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                lb_at,
                "set either simple or consistentHash, not both",
            ))
        }
        (Some(simple), None) => {
            resolved.policy = match simple {
                SimpleLb::Unspecified | SimpleLb::LeastRequest | SimpleLb::LeastConn => {
                    Policy::LeastRequest
                }
                SimpleLb::RoundRobin => Policy::RoundRobin,
                SimpleLb::Random => Policy::Random,
                SimpleLb::PeakEwma => Policy::PeakEwma,
                SimpleLb::LoadAware => Policy::LoadAware,
                SimpleLb::Passthrough => {
                    return Err(FieldError::new(
                        format!("{lb_at}.simple"),
                        "PASSTHROUGH is not supported: minimesh always balances over the service's endpoints",
                    ))
                }
            };
        }
        (None, Some(ch)) => {
            validate_hash(ch, lb_at, resolved)?;
        }
        (None, None) => {}
    }
    let warmup = match (&lb.warmup_duration_secs, &lb.warmup) {
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                lb_at,
                "set either warmupDurationSecs or warmup, not both",
            ))
        }
        (Some(d), None) => Some((format!("{lb_at}.warmupDurationSecs"), d)),
        (None, Some(w)) => Some((format!("{lb_at}.warmup.duration"), &w.duration)),
        (None, None) => None,
    };
    if let Some((field, d)) = warmup {
        let d = parse_duration(d).map_err(|r| FieldError::new(field.clone(), r))?;
        if !matches!(resolved.policy, Policy::RoundRobin | Policy::LeastRequest) {
            return Err(FieldError::new(
                field,
                "warmup applies to ROUND_ROBIN and LEAST_REQUEST only",
            ));
        }
        resolved.warmup = Some(d);
        if let Some(w) = &lb.warmup {
            if let Some(p) = w.minimum_percent {
                if !(0.0..=100.0).contains(&p) {
                    return Err(FieldError::new(
                        format!("{lb_at}.warmup.minimumPercent"),
                        format!("{p} is not between 0 and 100"),
                    ));
                }
                resolved.warmup_min_percent = p;
            }
            if let Some(a) = w.aggression {
                if !(a.is_finite() && a > 0.0 && a <= 100.0) {
                    return Err(FieldError::new(
                        format!("{lb_at}.warmup.aggression"),
                        format!("{a} must be above 0 and at most 100"),
                    ));
                }
                resolved.warmup_aggression = a;
            }
        }
    }
    for (i, w) in lb.endpoint_weights.iter().enumerate() {
        let field = format!("{lb_at}.endpointWeights[{i}]");
        let selectors =
            w.pod.is_some() as u8 + w.address.is_some() as u8 + (!w.labels.is_empty()) as u8;
        if selectors != 1 {
            return Err(FieldError::new(
                field,
                "set exactly one of pod, address or labels",
            ));
        }
        if w.weight == 0 || w.weight > MAX_WEIGHT {
            return Err(FieldError::new(
                format!("{field}.weight"),
                format!("{} is out of range 1..={MAX_WEIGHT}", w.weight),
            ));
        }
        if let Some(a) = &w.address {
            if a.parse::<std::net::IpAddr>().is_err() {
                return Err(FieldError::new(
                    format!("{field}.address"),
                    format!("{a:?} is not an IP address"),
                ));
            }
        }
    }
    if !lb.endpoint_weights.is_empty() && resolved.policy == Policy::LoadAware {
        return Err(FieldError::new(
            format!("{lb_at}.endpointWeights"),
            "LOAD_AWARE computes weights itself; remove endpointWeights or pick another policy",
        ));
    }
    Ok(())
}

/// The mode of a `tls` block (Istio's default, with none given: DISABLE).
fn tls_mode(
    tls: &serde_json::Value,
    at: &str,
    warnings: &mut Vec<String>,
) -> Result<TlsMode, FieldError> {
    let mode = match tls.get("mode") {
        None => "DISABLE",
        Some(serde_json::Value::String(m)) => m.as_str(),
        Some(other) => {
            return Err(FieldError::new(
                format!("{at}.tls.mode"),
                format!("{other} is not a string"),
            ))
        }
    };
    let others = tls
        .as_object()
        .is_some_and(|o| o.keys().any(|k| k != "mode"));
    if others {
        warnings.push(format!(
            "{at}.tls: only mode is read; the other fields are accepted but not enforced (certificates are the mesh's own)"
        ));
    }
    Ok(match mode {
        "DISABLE" => TlsMode::Disable,
        "ISTIO_MUTUAL" => TlsMode::IstioMutual,
        "SIMPLE" | "MUTUAL" => {
            warnings.push(format!(
                "{at}.tls.mode: {mode} is accepted but not enforced (minimesh originates only the mesh's own mutual TLS, ISTIO_MUTUAL; endpoints that run a sidecar still get it)"
            ));
            TlsMode::Auto
        }
        other => {
            return Err(FieldError::new(
                format!("{at}.tls.mode"),
                format!("{other:?} is not one of DISABLE, SIMPLE, MUTUAL, ISTIO_MUTUAL"),
            ))
        }
    })
}
