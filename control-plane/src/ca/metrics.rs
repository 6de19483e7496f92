//! The CA's and the callers' checks' metrics: credentials refused, tokens
//! reviewed, certificates issued, registered on the control plane's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Label set of a refused credential.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthLabel {
    /// `certificates`, `discovery` or `load_reports`.
    pub service: &'static str,
    /// `missing`, `invalid`, `namespace` (the token's identity may not
    /// speak for the node's namespace) or `unavailable` (the API server's
    /// TokenReview failed).
    pub reason: &'static str,
}

/// Label set of a token's review.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReviewLabel {
    /// `accepted` or `refused` (the API server's answer), `unavailable`
    /// (it could not be asked), `cached` (answered from an earlier review),
    /// `busy` (too many reviews in flight) or `rate_limited` (the peer sent
    /// too many refused tokens).
    pub result: &'static str,
}

/// The CA's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Calls refused for their credentials.
    pub auth_refusals: Family<AuthLabel, Counter>,
    /// Workload tokens checked on Kubernetes, by outcome.
    pub token_reviews: Family<ReviewLabel, Counter>,
    /// Workload certificates issued.
    pub certificates_issued: Counter,
}

impl Metrics {
    /// Creates the metrics and registers them on `registry` (the control
    /// plane's, prefixed `minimesh_`).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics::default();
        registry.register(
            "auth_refusals",
            "Calls refused for their credentials, by service (certificates, discovery, load_reports) and reason (missing, invalid, namespace, unavailable)",
            m.auth_refusals.clone(),
        );
        registry.register(
            "token_reviews",
            "Workload tokens checked on Kubernetes, by result: accepted or refused by the API server's TokenReview, unavailable (it could not be asked), cached (an earlier answer), busy (too many reviews in flight) or rate_limited (the peer sent too many refused tokens; no review made)",
            m.token_reviews.clone(),
        );
        registry.register(
            "certificates_issued",
            "Workload certificates signed by the mesh's CA",
            m.certificates_issued.clone(),
        );
        m
    }
}
