//! AdmissionReview decoding: arbitrary bytes as the API server's request to
//! each webhook (`/validate`, `/inject`, `/inject-conflict`). The
//! properties: no panic; a body that is no AdmissionReview is an error (a
//! 400), never an answer; an answer is an `admission.k8s.io` AdmissionReview
//! for the request's own uid, allowed or not, and an injection's patch is a
//! base64 JSON Patch whose operations each have an `op` and a `path`.

use base64::Engine;
use serde_json::Value;

use crate::webhook::inject::{self, Template};
use crate::webhook::review;

fn template() -> Template {
    Template {
        image: "minimesh:fuzz".into(),
        init_image: "minimesh-init:fuzz".into(),
        xds_addr: "https://minimesh-control-plane.minimesh-system.svc:15010".into(),
        identity: Some(inject::Identity {
            root_pem: "-----BEGIN CERTIFICATE-----\nfuzz\n-----END CERTIFICATE-----\n".into(),
            trust_domain: "cluster.local".into(),
            audience: "minimesh".into(),
        }),
    }
}

/// The request's uid, when `data` is JSON with one.
fn uid(data: &[u8]) -> Option<String> {
    let v: Value = serde_json::from_slice(data).ok()?;
    v["request"]["uid"].as_str().map(String::from)
}

fn answer_is_for(answer: &Value, uid: Option<&str>) {
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    assert!(
        answer["apiVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("admission.k8s.io/")),
        "{answer}"
    );
    let response = &answer["response"];
    assert!(response["allowed"].is_boolean(), "{answer}");
    assert_eq!(response["uid"].as_str(), uid, "{answer}");
}

/// Checks one input; panics on a violated property.
pub fn check(data: &[u8]) {
    let uid = uid(data);
    if let Ok((_, answer)) = review::review(data) {
        answer_is_for(&answer, uid.as_deref());
    }
    if let Ok((_, answer)) = inject::review(data, &template()) {
        answer_is_for(&answer, uid.as_deref());
        if let Some(patch) = answer["response"]["patch"].as_str() {
            assert_eq!(answer["response"]["patchType"], "JSONPatch");
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(patch)
                .expect("the patch is base64");
            let ops: Vec<Value> = serde_json::from_slice(&bytes).expect("the patch is JSON");
            for op in &ops {
                assert!(op["op"].is_string() && op["path"].is_string(), "{op}");
            }
        }
    }
    if let Ok((_, answer, _)) = inject::conflict_review(data) {
        answer_is_for(&answer, uid.as_deref());
        assert_eq!(answer["response"]["allowed"], false);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_corpus_replays() {
        let corpus = super::super::corpus("admission");
        assert!(!corpus.is_empty());
        for input in corpus {
            super::check(&input);
        }
    }
}
