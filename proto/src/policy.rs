//! The balancing policies: the names users write in a rule, the numbers on
//! the wire, and the one Rust type both sides use, so that a policy added
//! in one place cannot be missed in another.

use crate::v1::LbPolicy;

/// A balancing policy, as a valid rule resolves it and a sidecar runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Smooth weighted round robin.
    RoundRobin,
    /// Weighted random.
    Random,
    /// Power of two choices on active requests per weight.
    LeastRequest,
    /// Ring hash on the request's hash key.
    RingHash,
    /// Maglev table on the request's hash key.
    Maglev,
    /// Power of two choices on peak EWMA latency × (active + 1).
    PeakEwma,
    /// Weighted power of two choices, with weights the control plane
    /// computes from every sidecar's load reports.
    LoadAware,
}

impl Policy {
    /// Every policy, in wire order.
    pub const ALL: [Policy; 7] = [
        Policy::RoundRobin,
        Policy::Random,
        Policy::LeastRequest,
        Policy::RingHash,
        Policy::Maglev,
        Policy::PeakEwma,
        Policy::LoadAware,
    ];

    /// The name users write (`loadBalancer.simple`, `minimesh get`).
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "ROUND_ROBIN",
            Policy::Random => "RANDOM",
            Policy::LeastRequest => "LEAST_REQUEST",
            Policy::RingHash => "RING_HASH",
            Policy::Maglev => "MAGLEV",
            Policy::PeakEwma => "PEAK_EWMA",
            Policy::LoadAware => "LOAD_AWARE",
        }
    }

    /// The number on the wire.
    pub fn to_wire(self) -> LbPolicy {
        match self {
            Policy::RoundRobin => LbPolicy::RoundRobin,
            Policy::Random => LbPolicy::Random,
            Policy::LeastRequest => LbPolicy::LeastRequest,
            Policy::RingHash => LbPolicy::RingHash,
            Policy::Maglev => LbPolicy::Maglev,
            Policy::PeakEwma => LbPolicy::PeakEwma,
            Policy::LoadAware => LbPolicy::LoadAware,
        }
    }

    /// The policy of a wire number (unspecified: LEAST_REQUEST, the
    /// default), or why it cannot be served.
    pub fn from_wire(p: i32) -> Result<Policy, String> {
        match LbPolicy::try_from(p) {
            Ok(LbPolicy::Unspecified) => Ok(Policy::LeastRequest),
            Ok(wire) => Ok(Policy::ALL
                .into_iter()
                .find(|p| p.to_wire() == wire)
                .unwrap_or(Policy::LeastRequest)),
            Err(_) => Err(format!(
                "unknown policy number {p} (a newer control plane?)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_goes_over_the_wire_and_back() {
        for p in Policy::ALL {
            assert_eq!(Policy::from_wire(p.to_wire() as i32), Ok(p));
        }
        assert_eq!(Policy::from_wire(0), Ok(Policy::LeastRequest));
        assert_eq!(
            Policy::from_wire(99),
            Err("unknown policy number 99 (a newer control plane?)".into())
        );
    }
}
