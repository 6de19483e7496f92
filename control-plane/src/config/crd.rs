//! The CustomResourceDefinitions (`minimesh.io/v1alpha1`): `DestinationRule`,
//! generated from the Rust types of the spec (`config::rule::RuleSpec`) and
//! of the status written here, `PeerAuthentication` (`config::security`),
//! `VirtualService` (`config::virtual_service`) and `AuthorizationPolicy`
//! (`config::authorization`). `crds/` holds the
//! generated YAML; regenerate each with `cargo run -- crds KIND >
//! crds/KIND.minimesh.io.yaml` (a test fails when one is stale).

use kube::CustomResourceExt;
use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};

pub use super::rule::DestinationRuleResource;

/// Path of the generated CRD, relative to the repository root.
pub const CRD_PATH: &str = "crds/destinationrules.minimesh.io.yaml";

/// `status` of a DestinationRule, written by the elected control plane.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuleStatusResource {
    /// The `metadata.generation` of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The policy in force for the host (`ROUND_ROBIN`, `LEAST_REQUEST`,
    /// `RING_HASH`, `MAGLEV`, `PEAK_EWMA`, `LOAD_AWARE`, …).
    // Serialized as null when there is none: a merge patch then removes a stale one.
    #[serde(default)]
    pub policy: Option<String>,
    /// Conditions: `Accepted` says whether minimesh applies the rule,
    /// `Warnings` what it accepts without effect or overrides.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The last version of the spec minimesh accepted, kept when a newer
    /// one is invalid: what every control-plane replica keeps in force,
    /// including one that starts after the invalid version was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_good: Option<LastGood>,
}

/// The last accepted version of a rule's spec.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastGood {
    /// Its `metadata.generation`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The spec as accepted (its schema is the spec's, not repeated here).
    #[schemars(schema_with = "any_object")]
    pub spec: super::rule::RuleSpec,
}

/// A status condition, shaped as Kubernetes' `metav1.Condition`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Condition type: `Accepted` or `Warnings`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word: `Accepted`, `Invalid`, `Conflict` (another rule
    /// comes first for every caller that may see this one), `NoService`;
    /// for `Warnings`, `HasWarnings` or `NoWarnings`.
    pub reason: String,
    /// What is wrong, naming the field and the reason.
    #[serde(default)]
    pub message: String,
    /// The generation the condition was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When `status` last changed (RFC 3339).
    pub last_transition_time: String,
}

/// Schema of an Istio field minimesh accepts as any object (not yet used).
pub(crate) fn any_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// Schema of an Istio field minimesh reads only to refuse it by name: any
/// value (an object, a list, a string), kept by the API server so that the
/// validating webhook sees it and refuses it with the reason.
pub(crate) fn any_value(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// Schema of an Istio field minimesh accepts as a list of any objects.
pub(crate) fn any_objects(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
    })
}

/// Path of the generated PeerAuthentication CRD.
pub const PEER_AUTH_CRD_PATH: &str = "crds/peerauthentications.minimesh.io.yaml";

/// Path of the generated VirtualService CRD.
pub const VIRTUAL_SERVICE_CRD_PATH: &str = "crds/virtualservices.minimesh.io.yaml";

/// Path of the generated AuthorizationPolicy CRD.
pub const AUTHZ_CRD_PATH: &str = "crds/authorizationpolicies.minimesh.io.yaml";

/// The CRDs `minimesh crds <kind>` prints: (kind argument, file, YAML).
pub fn crds() -> [(&'static str, &'static str, String); 4] {
    [
        (
            "authorizationpolicies",
            AUTHZ_CRD_PATH,
            generated(
                super::authorization::AuthorizationPolicyResource::crd(),
                "authorization.rs",
                "authorizationpolicies",
                AUTHZ_CRD_PATH,
            ),
        ),
        ("destinationrules", CRD_PATH, crd_yaml()),
        (
            "peerauthentications",
            PEER_AUTH_CRD_PATH,
            peer_auth_crd_yaml(),
        ),
        (
            "virtualservices",
            VIRTUAL_SERVICE_CRD_PATH,
            virtual_service_crd_yaml(),
        ),
    ]
}

/// The DestinationRule CRD as YAML, exactly as committed in `crds/`.
pub fn crd_yaml() -> String {
    generated(
        DestinationRuleResource::crd(),
        "{rule,crd}.rs",
        "destinationrules",
        CRD_PATH,
    )
}

/// The PeerAuthentication CRD as YAML, exactly as committed in `crds/`.
pub fn peer_auth_crd_yaml() -> String {
    generated(
        super::security::PeerAuthenticationResource::crd(),
        "security.rs",
        "peerauthentications",
        PEER_AUTH_CRD_PATH,
    )
}

/// The VirtualService CRD as YAML, exactly as committed in `crds/`.
pub fn virtual_service_crd_yaml() -> String {
    generated(
        super::virtual_service::VirtualServiceResource::crd(),
        "virtual_service.rs",
        "virtualservices",
        VIRTUAL_SERVICE_CRD_PATH,
    )
}

fn generated(
    crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    from: &str,
    kind: &str,
    path: &str,
) -> String {
    let mut value = serde_json::to_value(&crd).unwrap_or_default();
    strip_closed_objects(&mut value);
    let body = serde_saphyr::to_string(&value).unwrap_or_default();
    format!(
        "# Generated from the Rust types in control-plane/src/config/{from}.\n\
         # Do not edit: run `cargo run -- crds {kind} > {path}`.\n{body}"
    )
}

/// Kubernetes structural schemas cannot say `additionalProperties: false`
/// beside `properties` (the API server prunes unknown fields instead), so
/// the `deny_unknown_fields` of the local parser is left out of the CRD.
fn strip_closed_objects(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            if map.get("additionalProperties") == Some(&serde_json::Value::Bool(false)) {
                map.remove("additionalProperties");
            }
            map.values_mut().for_each(strip_closed_objects);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_closed_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_file(path: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path)
    }

    #[test]
    fn committed_crds_are_up_to_date() {
        for (kind, path, yaml) in crds() {
            let committed = std::fs::read_to_string(repo_file(path)).unwrap_or_default();
            assert!(
                committed == yaml,
                "{path} is stale: regenerate it with `cargo run -- crds {kind} > {path}`"
            );
        }
    }

    /// The rules the API server applies to a CRD schema ("structural"):
    /// every node has a type unless it preserves unknown fields, no `$ref`,
    /// and `additionalProperties` never sits beside `properties`.
    fn check_structural(path: &str, node: &serde_json::Value, errors: &mut Vec<String>) {
        let Some(map) = node.as_object() else {
            errors.push(format!("{path}: not an object schema"));
            return;
        };
        for banned in ["$ref", "definitions", "$defs", "$schema"] {
            if map.contains_key(banned) {
                errors.push(format!("{path}: has {banned}"));
            }
        }
        let open = map.get("x-kubernetes-preserve-unknown-fields") == Some(&true.into())
            || map.get("x-kubernetes-int-or-string") == Some(&true.into());
        if !open && !map.contains_key("type") {
            errors.push(format!("{path}: no type"));
        }
        if map.contains_key("properties") && map.contains_key("additionalProperties") {
            errors.push(format!("{path}: properties beside additionalProperties"));
        }
        if let Some(props) = map.get("properties").and_then(|p| p.as_object()) {
            for (name, sub) in props {
                check_structural(&format!("{path}.{name}"), sub, errors);
            }
        }
        if let Some(items) = map.get("items") {
            check_structural(&format!("{path}[]"), items, errors);
        }
        if let Some(extra) = map.get("additionalProperties").filter(|a| a.is_object()) {
            check_structural(&format!("{path}{{}}"), extra, errors);
        }
    }

    #[test]
    fn crd_schema_is_structural_and_documents_every_field() {
        let crd: serde_json::Value = serde_saphyr::from_str(&crd_yaml()).expect("CRD parses");
        let version = &crd["spec"]["versions"][0];
        assert_eq!(version["name"], "v1alpha1");
        assert_eq!(version["subresources"]["status"], serde_json::json!({}));
        // Not Istio's `dr`: with Istio installed too, `kubectl get dr` would be
        // ambiguous.
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "mdr");
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        let columns: Vec<&str> = version["additionalPrinterColumns"]
            .as_array()
            .expect("columns")
            .iter()
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert_eq!(
            columns,
            ["Host", "Policy", "Accepted", "Warnings", "Message", "Age"]
        );
        assert_eq!(crd["spec"]["names"]["categories"][0], "minimesh");
        let conditions = &version["schema"]["openAPIV3Schema"]["properties"]["status"]
            ["properties"]["conditions"];
        assert_eq!(conditions["x-kubernetes-list-type"], "map");
        assert_eq!(conditions["x-kubernetes-list-map-keys"][0], "type");
        let schema = &version["schema"]["openAPIV3Schema"];
        let mut errors = Vec::new();
        check_structural("", schema, &mut errors);
        assert!(errors.is_empty(), "not structural: {errors:#?}");
        let lb = &schema["properties"]["spec"]["properties"]["trafficPolicy"]["properties"]
            ["loadBalancer"]["properties"];
        let simple: Vec<&str> = lb["simple"]["enum"]
            .as_array()
            .expect("simple is an enum")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert!(simple.contains(&"LOAD_AWARE") && simple.contains(&"ROUND_ROBIN"));
        assert!(lb["consistentHash"]["properties"]["maglev"]["description"]
            .as_str()
            .is_some_and(|d| !d.is_empty()));
    }

    #[test]
    fn virtual_service_crd_is_structural_and_keeps_refused_fields() {
        let crd: serde_json::Value =
            serde_saphyr::from_str(&virtual_service_crd_yaml()).expect("CRD parses");
        assert_eq!(crd["metadata"]["name"], "virtualservices.minimesh.io");
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "mvs");
        let version = &crd["spec"]["versions"][0];
        assert!(version["subresources"].is_null(), "no status is written");
        let schema = &version["schema"]["openAPIV3Schema"];
        let mut errors = Vec::new();
        check_structural("", schema, &mut errors);
        assert!(errors.is_empty(), "not structural: {errors:#?}");
        // A field minimesh refuses is kept whatever its shape, so that the
        // webhook sees it and says why (pruned, it would vanish silently).
        let http = &schema["properties"]["spec"]["properties"]["http"]["items"]["properties"];
        for refused in ["mirror", "mirrors", "corsPolicy", "delegate"] {
            assert_eq!(
                http[refused]["x-kubernetes-preserve-unknown-fields"], true,
                "{refused}"
            );
        }
        assert!(http["timeout"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("0.5s")));
    }

    #[test]
    fn peer_authentication_crd_is_structural() {
        let crd: serde_json::Value =
            serde_saphyr::from_str(&peer_auth_crd_yaml()).expect("CRD parses");
        assert_eq!(crd["metadata"]["name"], "peerauthentications.minimesh.io");
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "mpa");
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let mut errors = Vec::new();
        check_structural("", schema, &mut errors);
        assert!(errors.is_empty(), "not structural: {errors:#?}");
        let mode = &schema["properties"]["spec"]["properties"]["mtls"]["properties"]["mode"];
        assert!(mode["description"]
            .as_str()
            .is_some_and(|d| d.contains("STRICT")));
    }
}
