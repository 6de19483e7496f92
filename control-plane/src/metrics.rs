//! Control-plane metrics, registered on the registry the admin server encodes.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::discovery::registry::short_type;

/// Label set naming a resource type.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    /// Short type name (`Cluster`, `ClusterLoadAssignment`, `Route`).
    pub r#type: String,
}

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
    pub fn of(webhook: &'static str, v: crate::webhook::review::Verdict) -> Self {
        use crate::webhook::review::Verdict;
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

/// Every control-plane metric.
pub struct Metrics {
    /// Connected discovery streams.
    pub connected: Gauge,
    /// Load-report streams whose proxy has named itself.
    pub load_reporters: Gauge,
    /// Responses sent, by type.
    pub pushes: Family<TypeLabel, Counter>,
    /// NACKs received, by type.
    pub nacks: Family<TypeLabel, Counter>,
    /// Config changes that produced new resources.
    pub config_updates: Counter,
    /// Rejected objects in the current config.
    pub config_errors: Gauge,
    /// Seconds from the first change of a debounce window to publication.
    pub debounce_seconds: Histogram,
    /// Admission reviews of rules answered, by verdict.
    pub admission_reviews: Family<VerdictLabel, Counter>,
    /// Calls refused for their credentials.
    pub auth_refusals: Family<AuthLabel, Counter>,
    /// Workload tokens checked on Kubernetes, by outcome.
    pub token_reviews: Family<ReviewLabel, Counter>,
    /// Workload certificates issued.
    pub certificates_issued: Counter,
}

impl Metrics {
    /// Creates the metrics and registers them (names get the `minimesh_` prefix).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            connected: Gauge::default(),
            load_reporters: Gauge::default(),
            pushes: Family::default(),
            nacks: Family::default(),
            config_updates: Counter::default(),
            config_errors: Gauge::default(),
            debounce_seconds: Histogram::new([0.01, 0.05, 0.1, 0.15, 0.2, 0.5, 1.0, 2.0]),
            admission_reviews: Family::default(),
            auth_refusals: Family::default(),
            token_reviews: Family::default(),
            certificates_issued: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("minimesh");
        r.register(
            "xds_connected_proxies",
            "Connected discovery streams",
            m.connected.clone(),
        );
        r.register(
            "load_reporters_connected",
            "Connected load-report streams (proxies reporting load)",
            m.load_reporters.clone(),
        );
        r.register(
            "xds_pushes",
            "Discovery responses sent, by type",
            m.pushes.clone(),
        );
        r.register(
            "xds_nacks",
            "Discovery responses rejected by proxies, by type",
            m.nacks.clone(),
        );
        r.register(
            "config_updates",
            "Config changes that produced new resources",
            m.config_updates.clone(),
        );
        r.register(
            "config_errors",
            "Rejected objects in the current config",
            m.config_errors.clone(),
        );
        r.register(
            "config_debounce_seconds",
            "Time from the first change in a debounce window to publication",
            m.debounce_seconds.clone(),
        );
        r.register(
            "admission_reviews",
            "Admission reviews answered, by webhook (validate: rules; inject: pods) and verdict",
            m.admission_reviews.clone(),
        );
        r.register(
            "auth_refusals",
            "Calls refused for their credentials, by service (certificates, discovery, load_reports) and reason (missing, invalid, namespace, unavailable)",
            m.auth_refusals.clone(),
        );
        r.register(
            "token_reviews",
            "Workload tokens checked on Kubernetes, by result: accepted or refused by the API server's TokenReview, unavailable (it could not be asked), cached (an earlier answer), busy (too many reviews in flight) or rate_limited (the peer sent too many refused tokens; no review made)",
            m.token_reviews.clone(),
        );
        r.register(
            "certificates_issued",
            "Workload certificates signed by the mesh's CA",
            m.certificates_issued.clone(),
        );
        for webhook in ["validate", "inject"] {
            for v in [
                crate::webhook::review::Verdict::Allowed,
                crate::webhook::review::Verdict::Denied,
                crate::webhook::review::Verdict::Malformed,
            ] {
                let _ = m
                    .admission_reviews
                    .get_or_create(&VerdictLabel::of(webhook, v));
            }
        }
        // Every type's counters exist from the start at 0, so that a rate or
        // an increase over them reads 0 rather than no data.
        for t in minimesh_proto::ALL_TYPES
            .into_iter()
            .chain(minimesh_proto::xds_v3::ALL_TYPES)
        {
            let _ = m.pushes.get_or_create(&label(t));
            let _ = m.nacks.get_or_create(&label(t));
        }
        m
    }

    /// Counts a push of `type_url`.
    pub fn push(&self, type_url: &str) {
        self.pushes.get_or_create(&label(type_url)).inc();
    }

    /// Counts a NACK of `type_url`.
    pub fn nack(&self, type_url: &str) {
        self.nacks.get_or_create(&label(type_url)).inc();
    }
}

/// minimesh's types by their short name (`Cluster`); Envoy's, served to
/// xDS v3 clients, by their full name (`envoy.config.cluster.v3.Cluster`),
/// so that the two encodings' pushes and NACKs are counted apart.
fn label(type_url: &str) -> TypeLabel {
    let name = type_url
        .strip_prefix("type.googleapis.com/")
        .unwrap_or(type_url);
    TypeLabel {
        r#type: if name.starts_with("envoy.") {
            name.to_string()
        } else {
            short_type(type_url).to_string()
        },
    }
}
