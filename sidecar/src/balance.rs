//! Endpoint picking. A [`Balancer`] is built off the request path whenever a
//! cluster's endpoints or policy change (schedules, alias tables), and a pick
//! is then a few atomic loads and arithmetic: no lock, no allocation.

pub mod least_request;
pub mod random;
pub mod rng;
pub mod round_robin;
pub mod weighted;

use std::sync::Arc;

use minimesh_proto::v1::LbPolicy;

use crate::endpoint::EndpointState;

/// The policies this sidecar implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Smooth weighted round robin.
    RoundRobin,
    /// Weighted random.
    Random,
    /// Power of two choices on active requests per weight.
    LeastRequest,
}

impl Policy {
    /// The sidecar policy for a wire policy, or why it cannot serve it.
    pub fn from_wire(p: i32) -> Result<Policy, String> {
        match LbPolicy::try_from(p) {
            Ok(LbPolicy::RoundRobin) => Ok(Policy::RoundRobin),
            Ok(LbPolicy::Random) => Ok(Policy::Random),
            Ok(LbPolicy::LeastRequest) | Ok(LbPolicy::Unspecified) => Ok(Policy::LeastRequest),
            Ok(other) => Err(format!(
                "policy {} is not supported by this sidecar",
                other.as_str_name()
            )),
            Err(_) => Err(format!("unknown policy number {p}")),
        }
    }

    /// The name users write.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "ROUND_ROBIN",
            Policy::Random => "RANDOM",
            Policy::LeastRequest => "LEAST_REQUEST",
        }
    }
}

enum Picker {
    RoundRobin(round_robin::RoundRobin),
    Random(random::Random),
    LeastRequest(least_request::LeastRequest),
}

/// The endpoints of a cluster that may receive traffic, and how to pick one.
pub struct Balancer {
    endpoints: Vec<Arc<EndpointState>>,
    picker: Picker,
    policy: Policy,
}

impl Balancer {
    /// Builds a balancer over `(endpoint, weight)` pairs (weights >= 1).
    pub fn new(policy: Policy, endpoints: Vec<(Arc<EndpointState>, u32)>) -> Balancer {
        let weights: Vec<u32> = endpoints.iter().map(|(_, w)| (*w).max(1)).collect();
        let endpoints: Vec<Arc<EndpointState>> = endpoints.into_iter().map(|(e, _)| e).collect();
        let picker = match policy {
            Policy::RoundRobin => Picker::RoundRobin(round_robin::RoundRobin::new(&weights)),
            Policy::Random => Picker::Random(random::Random::new(&weights)),
            Policy::LeastRequest => {
                Picker::LeastRequest(least_request::LeastRequest::new(&weights))
            }
        };
        Balancer {
            endpoints,
            picker,
            policy,
        }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The endpoints, in config order.
    pub fn endpoints(&self) -> &[Arc<EndpointState>] {
        &self.endpoints
    }

    /// Picks an endpoint, skipping ones that are backing off after a connect
    /// failure and `avoid` (the endpoint a retry just failed on) when any
    /// other can serve. None only when there are no endpoints.
    #[inline]
    pub fn pick(&self, avoid: Option<&Arc<EndpointState>>) -> Option<&Arc<EndpointState>> {
        let n = self.endpoints.len();
        if n == 0 {
            return None;
        }
        let usable =
            |e: &Arc<EndpointState>| !e.is_failing() && !avoid.is_some_and(|a| Arc::ptr_eq(a, e));
        let mut first = None;
        for _ in 0..3 {
            let i = self.pick_index();
            let e = &self.endpoints[i];
            if usable(e) {
                return Some(e);
            }
            first.get_or_insert(i);
        }
        self.pick_slow(first.unwrap_or(0), avoid)
    }

    #[inline]
    fn pick_index(&self) -> usize {
        match &self.picker {
            Picker::RoundRobin(p) => p.pick(),
            Picker::Random(p) => p.pick(),
            Picker::LeastRequest(p) => p.pick(&self.endpoints),
        }
    }

    #[cold]
    fn pick_slow(
        &self,
        fallback: usize,
        avoid: Option<&Arc<EndpointState>>,
    ) -> Option<&Arc<EndpointState>> {
        let n = self.endpoints.len();
        let start = rng::below(n);
        let not_avoided = |e: &&Arc<EndpointState>| !avoid.is_some_and(|a| Arc::ptr_eq(a, e));
        let rotated = || (0..n).map(|k| &self.endpoints[(start + k) % n]);
        rotated()
            .filter(not_avoided)
            .find(|e| !e.is_failing())
            // Every endpoint is failing: try the one failing the shortest
            // rather than fail the request without trying (panic mode).
            .or_else(|| {
                rotated()
                    .filter(not_avoided)
                    .min_by_key(|e| e.fail_until_ms.load(std::sync::atomic::Ordering::Relaxed))
            })
            .or(Some(&self.endpoints[fallback]))
    }
}
