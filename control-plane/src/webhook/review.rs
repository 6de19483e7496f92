//! One admission review: the request Kubernetes sends about a minimesh.io
//! DestinationRule, answered with exactly the validation `minimesh apply`
//! and the control plane's own source run (`config::parse::parse_object`).

use std::path::Path;

use serde_json::{json, Value};

use crate::config::parse::parse_object;
use crate::config::Object;

/// What the review decided (for the metrics and the log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Valid, or nothing minimesh reads (a DELETE, another kind).
    Allowed,
    /// Invalid: refused with the field and the reason.
    Denied,
    /// Not an AdmissionReview at all: answered 400.
    Malformed,
}

/// Answers an `admission.k8s.io/v1` AdmissionReview (the request body) with
/// the AdmissionReview to send back, or says why the body is not one.
pub fn review(body: &[u8]) -> Result<(Verdict, Value), String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    if v["kind"] != "AdmissionReview" {
        return Err("not an AdmissionReview: kind is not AdmissionReview".into());
    }
    // Answered in the request's version, which must be one of the API's
    // (the fuzz target found one echoed back that was not).
    if !v["apiVersion"]
        .as_str()
        .is_some_and(|a| a.starts_with("admission.k8s.io/"))
    {
        return Err("not an AdmissionReview: apiVersion is not admission.k8s.io/*".into());
    }
    let request = &v["request"];
    let uid = request["uid"]
        .as_str()
        .ok_or("not an AdmissionReview: request.uid is missing")?;
    let answer = |verdict: Verdict, response: Value| {
        let mut response = response;
        response["uid"] = uid.into();
        let api_version = v["apiVersion"]
            .as_str()
            .unwrap_or("admission.k8s.io/v1")
            .to_string();
        Ok((
            verdict,
            json!({ "apiVersion": api_version, "kind": "AdmissionReview", "response": response }),
        ))
    };
    // A DELETE carries no object; nothing to validate.
    let object = &request["object"];
    if object.is_null() {
        return answer(Verdict::Allowed, json!({ "allowed": true }));
    }
    let namespace = request["namespace"].as_str().unwrap_or("default");
    let Some(doc) = parse_object(Path::new("admission"), object.clone(), namespace) else {
        return answer(Verdict::Allowed, json!({ "allowed": true }));
    };
    match doc.result {
        Ok(Object::Rule(rule)) if !rule.warnings.is_empty() => answer(
            Verdict::Allowed,
            json!({ "allowed": true, "warnings": rule.warnings }),
        ),
        Ok(_) => answer(Verdict::Allowed, json!({ "allowed": true })),
        Err(e) => {
            let message = match &e.field {
                Some(field) => format!("{field}: {}", e.reason),
                None => e.reason.clone(),
            };
            answer(
                Verdict::Denied,
                json!({
                    "allowed": false,
                    "status": { "status": "Failure", "code": 422, "reason": "Invalid", "message": message },
                }),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(object: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "minimesh.io", "version": "v1alpha1", "kind": "DestinationRule"},
                "resource": {"group": "minimesh.io", "version": "v1alpha1", "resource": "destinationrules"},
                "namespace": "istioinaction", "operation": "CREATE", "object": object
            }
        }))
        .expect("json")
    }

    fn rule(spec: Value) -> Value {
        json!({
            "apiVersion": "minimesh.io/v1alpha1", "kind": "DestinationRule",
            "metadata": {"name": "simple-backend-dr", "namespace": "istioinaction"},
            "spec": spec
        })
    }

    #[test]
    fn a_valid_rule_is_allowed_with_the_uid_echoed() {
        let (verdict, out) = review(&request(rule(json!({
            "host": "simple-backend", "trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}
        }))))
        .expect("review");
        assert_eq!(verdict, Verdict::Allowed);
        assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(out["kind"], "AdmissionReview");
        assert_eq!(
            out["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(out["response"]["allowed"], true);
        assert!(out["response"].get("warnings").is_none(), "{out}");
    }

    #[test]
    fn an_invalid_rule_is_denied_with_the_field_and_reason() {
        let (verdict, out) = review(&request(rule(json!({
            "host": "simple-backend", "trafficPolicy": {"loadBalancer": {"simple": "FASTEST"}}
        }))))
        .expect("review");
        assert_eq!(verdict, Verdict::Denied);
        let r = &out["response"];
        assert_eq!(r["allowed"], false);
        assert_eq!(r["status"]["code"], 422);
        let message = r["status"]["message"].as_str().expect("message");
        assert!(
            message.starts_with("spec.trafficPolicy.loadBalancer.simple: "),
            "{message}"
        );
        assert!(message.contains("FASTEST"), "{message}");
    }

    #[test]
    fn fields_without_effect_come_back_as_warnings() {
        let (verdict, out) = review(&request(rule(json!({
            "host": "simple-backend",
            "trafficPolicy": {"connectionPool": {"http": {"h2UpgradePolicy": "UPGRADE"}}}
        }))))
        .expect("review");
        assert_eq!(verdict, Verdict::Allowed);
        let w = out["response"]["warnings"][0].as_str().expect("a warning");
        assert!(
            w.starts_with("spec.trafficPolicy.connectionPool.http.h2UpgradePolicy: "),
            "{w}"
        );
    }

    #[test]
    fn a_delete_is_allowed_and_garbage_is_refused() {
        let (verdict, _) = review(&request(Value::Null)).expect("review");
        assert_eq!(verdict, Verdict::Allowed);
        assert_eq!(
            review(b"{\"kind\": \"Pod\"}").unwrap_err(),
            "not an AdmissionReview: kind is not AdmissionReview"
        );
        assert!(review(b"\xff")
            .unwrap_err()
            .starts_with("not an AdmissionReview: "));
    }
}
