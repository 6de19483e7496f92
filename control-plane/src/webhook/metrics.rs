//! The webhooks' metrics: admission reviews answered, by webhook and
//! verdict, registered on the control plane's registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::review::Verdict;

/// Label set of an admission review's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerdictLabel {
    /// `validate` (rules) or `inject` (pods).
    pub webhook: &'static str,
    /// `allowed`, `denied` or `malformed`.
    pub verdict: &'static str,
}

impl VerdictLabel {
    /// The label of a review's verdict by `webhook`.
    pub fn of(webhook: &'static str, v: Verdict) -> Self {
        VerdictLabel {
            webhook,
            verdict: match v {
                Verdict::Allowed => "allowed",
                Verdict::Denied => "denied",
                Verdict::Malformed => "malformed",
            },
        }
    }
}

/// Admission reviews answered, by webhook and verdict.
pub type Reviews = Family<VerdictLabel, Counter>;

/// Creates the reviews' counters, every label at 0 from the start, and
/// registers them on `registry` (the control plane's, prefixed `minimesh_`).
pub fn reviews(registry: &mut Registry) -> Reviews {
    let reviews = Reviews::default();
    registry.register(
        "admission_reviews",
        "Admission reviews answered, by webhook (validate: rules; inject: pods) and verdict",
        reviews.clone(),
    );
    for webhook in ["validate", "inject"] {
        for v in [Verdict::Allowed, Verdict::Denied, Verdict::Malformed] {
            let _ = reviews.get_or_create(&VerdictLabel::of(webhook, v));
        }
    }
    reviews
}
