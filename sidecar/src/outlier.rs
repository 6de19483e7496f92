//! Passive outlier detection: each attempt's outcome counts towards its
//! endpoint's consecutive-error thresholds, and an endpoint that crosses
//! one is ejected for a while, within the cluster's limits (Envoy's
//! semantics). The module owns the counts ([`State`], one per endpoint) and
//! knows nothing of endpoints, clusters or I/O: the time is passed in.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use http::StatusCode;
use minimesh_proto::v1::OutlierDetection;

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

/// One endpoint's outlier-detection state, kept across config updates.
#[derive(Debug, Default)]
pub struct State {
    /// Consecutive 5xx responses.
    consecutive_5xx: AtomicU32,
    /// Consecutive gateway errors: 502/503/504, and local-origin failures
    /// unless the rule splits them off.
    consecutive_gateway: AtomicU32,
    /// Consecutive local-origin failures (when split).
    consecutive_local: AtomicU32,
    /// Times ejected (the ejection time grows with it).
    ejections: AtomicU32,
    /// Ejected until this time (the sidecar clock's milliseconds).
    ejected_until_ms: AtomicU64,
}

impl State {
    /// True while ejected, at `now_ms`.
    #[inline]
    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }

    /// When the ejection in force ends (0: never ejected).
    pub fn ejected_until_ms(&self) -> u64 {
        self.ejected_until_ms.load(Ordering::Relaxed)
    }

    /// A response under 500 resets every consecutive count; true if
    /// `outcome` was one.
    pub fn reset_on_success(&self, outcome: Outcome) -> bool {
        if matches!(outcome, Outcome::Status(s) if !s.is_server_error()) {
            for c in [
                &self.consecutive_5xx,
                &self.consecutive_gateway,
                &self.consecutive_local,
            ] {
                if c.load(Ordering::Relaxed) != 0 {
                    c.store(0, Ordering::Relaxed);
                }
            }
            return true;
        }
        false
    }
}

/// An ejection [`count`] made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ejection {
    /// How long, ms: the base time multiplied by the times ejected, at
    /// most [`MAX_EJECTION_MS`].
    pub ms: u64,
    /// Times this endpoint has been ejected, this one included.
    pub times: u32,
}

/// The longest ejection (Envoy's `max_ejection_time` default: 300 s).
pub const MAX_EJECTION_MS: u64 = 300_000;

/// Counts `outcome` of an attempt at the endpoint whose state is `ep`, one
/// of the cluster's `endpoints` (its own state among them), under the
/// settings `od` at `now_ms`; the ejection it caused, if any. As Envoy does
/// it: unless the rule splits them off, local-origin failures count as the
/// 503 (504 for a timeout) Envoy maps them to, towards both the 5xx and the
/// gateway-error thresholds; split, they count only towards
/// `consecutiveLocalOriginFailures`, which any response resets. At most
/// `max_ejection_percent` of the endpoints (always one) are ejected at once,
/// and none below `min_health_percent`.
pub fn count<'a>(
    od: &OutlierDetection,
    endpoints: impl Iterator<Item = &'a State>,
    ep: &State,
    outcome: Outcome,
    now_ms: u64,
) -> Option<Ejection> {
    if ep.reset_on_success(outcome) {
        return None;
    }
    let status = match outcome {
        Outcome::Status(s) => s,
        Outcome::Failed => StatusCode::SERVICE_UNAVAILABLE,
        Outcome::TimedOut => StatusCode::GATEWAY_TIMEOUT,
    };
    let local = !matches!(outcome, Outcome::Status(_));
    if od.ignore_503 && !local && status == StatusCode::SERVICE_UNAVAILABLE {
        // The default detector leaves overload alone: a 503 neither counts
        // nor resets (see ignore_503).
        return None;
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
    if !tripped || ep.is_ejected(now_ms) {
        return None;
    }
    let (n, ejected) = endpoints.fold((0usize, 0usize), |(n, e), s| {
        (n + 1, e + usize::from(s.is_ejected(now_ms)))
    });
    // As Envoy: at least one endpoint may always be ejected.
    let max = (n * od.max_ejection_percent as usize / 100).max(1);
    let available_after = n.saturating_sub(ejected + 1) * 100 / n.max(1);
    if ejected >= max || available_after < od.min_health_percent as usize {
        return None;
    }
    let times = ep.ejections.fetch_add(1, Ordering::Relaxed) + 1;
    let ms = (od.base_ejection_ms * u64::from(times)).min(MAX_EJECTION_MS);
    ep.ejected_until_ms.store(now_ms + ms, Ordering::Relaxed);
    ep.consecutive_5xx.store(0, Ordering::Relaxed);
    ep.consecutive_gateway.store(0, Ordering::Relaxed);
    ep.consecutive_local.store(0, Ordering::Relaxed);
    Some(Ejection { ms, times })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(n: u8) -> Vec<State> {
        (0..n).map(|_| State::default()).collect()
    }

    /// Istio's defaults: 5 consecutive 5xx, 30 s, 10% of endpoints.
    fn istio() -> OutlierDetection {
        OutlierDetection {
            consecutive_5xx: 5,
            base_ejection_ms: 30_000,
            max_ejection_percent: 10,
            ..Default::default()
        }
    }

    const E500: Outcome = Outcome::Status(StatusCode::INTERNAL_SERVER_ERROR);
    const OK: Outcome = Outcome::Status(StatusCode::OK);

    /// `n` outcomes in a row at `now`; the last one's ejection.
    fn times(
        od: &OutlierDetection,
        eps: &[State],
        i: usize,
        outcome: Outcome,
        n: u32,
        now: u64,
    ) -> Option<Ejection> {
        let mut last = None;
        for _ in 0..n {
            last = count(od, eps.iter(), &eps[i], outcome, now);
        }
        last
    }

    #[test]
    fn five_in_a_row_eject_and_each_ejection_lasts_longer() {
        let (od, eps) = (istio(), endpoints(4));
        assert_eq!(times(&od, &eps, 0, E500, 4, 1_000), None);
        // A success resets the count.
        assert_eq!(count(&od, eps.iter(), &eps[0], OK, 1_000), None);
        assert_eq!(times(&od, &eps, 0, E500, 4, 1_000), None);
        assert_eq!(
            count(&od, eps.iter(), &eps[0], E500, 1_000),
            Some(Ejection {
                ms: 30_000,
                times: 1
            })
        );
        assert_eq!(
            eps[0].ejected_until_ms(),
            31_000,
            "ejected from now for the base time"
        );
        // Back, fails again: twice the base time, then capped at 300 s.
        let back = 31_001;
        assert_eq!(
            times(&od, &eps, 0, E500, 5, back),
            Some(Ejection {
                ms: 60_000,
                times: 2
            })
        );
        let mut now = back + 60_001;
        let mut last = None;
        for _ in 0..10 {
            last = times(&od, &eps, 0, E500, 5, now);
            now += last.map_or(0, |e| e.ms) + 1;
        }
        assert_eq!(last.map(|e| e.ms), Some(MAX_EJECTION_MS));
    }

    #[test]
    fn at_most_the_share_of_endpoints_and_always_one() {
        let (od, eps) = (istio(), endpoints(4));
        // 10% of 4 is 0: one may always go, a second may not while it is out.
        assert!(times(&od, &eps, 0, E500, 5, 0).is_some());
        assert_eq!(times(&od, &eps, 1, E500, 5, 0), None);
        // Once the first is back, the second, still failing, goes at its
        // next failure: its count went on while it could not be ejected.
        assert!(count(&od, eps.iter(), &eps[1], E500, 30_001).is_some());
        // Below min_health_percent, no ejection at all.
        let strict = OutlierDetection {
            min_health_percent: 80,
            max_ejection_percent: 100,
            ..istio()
        };
        let eps = endpoints(4);
        assert_eq!(times(&strict, &eps, 0, E500, 5, 0), None);
    }

    #[test]
    fn the_default_detector_leaves_503_alone_and_local_failures_count_as_503() {
        let default = OutlierDetection {
            ignore_503: true,
            ..istio()
        };
        let eps = endpoints(2);
        let e503 = Outcome::Status(StatusCode::SERVICE_UNAVAILABLE);
        // 503s neither count nor reset.
        assert_eq!(times(&default, &eps, 0, E500, 4, 0), None);
        assert_eq!(times(&default, &eps, 0, e503, 10, 0), None);
        assert!(count(&default, eps.iter(), &eps[0], E500, 0).is_some());
        // A refused connection counts as a 503 would under a rule's own
        // detector: five eject.
        let eps = endpoints(2);
        assert!(times(&istio(), &eps, 0, Outcome::Failed, 5, 0).is_some());
        // Split off, local failures count only towards their own threshold.
        let split = OutlierDetection {
            split_local_origin: true,
            consecutive_local_origin: 3,
            ..istio()
        };
        let eps = endpoints(2);
        assert_eq!(times(&split, &eps, 0, E500, 4, 0), None);
        assert_eq!(times(&split, &eps, 0, Outcome::TimedOut, 2, 0), None);
        assert!(count(&split, eps.iter(), &eps[0], Outcome::TimedOut, 0).is_some());
    }
}
