//! Passive outlier detection: each attempt's outcome counts towards its
//! endpoint's consecutive-error thresholds, and an endpoint that crosses
//! one is ejected for a while, within the cluster's limits (Envoy's
//! semantics).

use std::sync::atomic::Ordering;

use http::StatusCode;
use tracing::info;

use crate::endpoint::EndpointState;
use crate::routing::ClusterHandle;

/// What an attempt came to, for outlier detection.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    /// The endpoint answered with this status.
    Status(StatusCode),
    /// A local-origin failure: no connection, or the connection or stream
    /// reset or closed before the response.
    Failed,
    /// A local-origin failure: no response within the per-try timeout.
    TimedOut,
}

/// Counts an attempt's outcome towards its endpoint's outlier detection and
/// ejects the endpoint when it crosses a consecutive-error threshold. As
/// Envoy does it: unless the rule splits them off, local-origin failures count
/// as the 503 (504 for a timeout) Envoy maps them to, towards both the 5xx
/// and the gateway-error thresholds; split, they count only towards
/// `consecutiveLocalOriginFailures`, which any response resets.
pub fn record(cluster: &ClusterHandle, ep: &EndpointState, outcome: Outcome) {
    let status = match outcome {
        Outcome::Status(s) => s,
        Outcome::Failed => StatusCode::SERVICE_UNAVAILABLE,
        Outcome::TimedOut => StatusCode::GATEWAY_TIMEOUT,
    };
    let local = !matches!(outcome, Outcome::Status(_));
    if !status.is_server_error() {
        for c in [
            &ep.consecutive_5xx,
            &ep.consecutive_gateway,
            &ep.consecutive_local,
        ] {
            if c.load(Ordering::Relaxed) != 0 {
                c.store(0, Ordering::Relaxed);
            }
        }
        return;
    }
    let Some(od) = &cluster.outlier else { return };
    if od.ignore_503 && !local && status == StatusCode::SERVICE_UNAVAILABLE {
        // The default detector leaves overload alone: a 503 neither counts
        // nor resets (see ignore_503).
        return;
    }
    let tripped = if local && od.split_local_origin {
        let cl = ep.consecutive_local.fetch_add(1, Ordering::Relaxed) + 1;
        od.consecutive_local_origin > 0 && cl >= od.consecutive_local_origin
    } else {
        if !local && od.split_local_origin {
            // The endpoint answered: its connection works.
            ep.consecutive_local.store(0, Ordering::Relaxed);
        }
        let c5 = ep.consecutive_5xx.fetch_add(1, Ordering::Relaxed) + 1;
        let cg = if matches!(status.as_u16(), 502..=504) {
            ep.consecutive_gateway.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            ep.consecutive_gateway.store(0, Ordering::Relaxed);
            0
        };
        (od.consecutive_5xx > 0 && c5 >= od.consecutive_5xx)
            || (od.consecutive_gateway_errors > 0 && cg >= od.consecutive_gateway_errors)
    };
    if !tripped || ep.is_ejected() {
        return;
    }
    let eps = cluster.balancer.endpoints();
    let n = eps.len();
    let ejected = eps.iter().filter(|e| e.is_ejected()).count();
    // As Envoy: at least one endpoint may always be ejected.
    let max = (n * od.max_ejection_percent as usize / 100).max(1);
    let available_after = (n - ejected - 1) * 100 / n.max(1);
    if ejected >= max || available_after < od.min_health_percent as usize {
        return;
    }
    let times = ep.ejections.fetch_add(1, Ordering::Relaxed) + 1;
    let ms = (od.base_ejection_ms * u64::from(times)).min(300_000);
    ep.ejected_until_ms
        .store(crate::clock::precise_ms() + ms, Ordering::Relaxed);
    ep.consecutive_5xx.store(0, Ordering::Relaxed);
    ep.consecutive_gateway.store(0, Ordering::Relaxed);
    ep.consecutive_local.store(0, Ordering::Relaxed);
    info!(endpoint = %ep.addr, cluster = %cluster.name, ejection_ms = ms, times, ?outcome, "endpoint ejected by outlier detection");
}
