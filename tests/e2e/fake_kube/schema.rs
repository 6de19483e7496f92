//! Custom resources as the real API server treats them, from their CRDs'
//! structural schemas (the files in `crds/`, generated from the Rust types):
//! on every write, unknown fields are pruned (or, with
//! `fieldValidation=Strict`, as kubectl sends by default, refused), defaults
//! are filled, and the object is validated (types, enums, required fields,
//! bounds, `x-kubernetes-list-type` uniqueness) before the validating
//! webhooks are called; a refusal is a 422 whose message is worded as the
//! server's (`k8s.io/apiextensions-apiserver`'s schema validation through
//! kube-openapi, `field.ErrorList`).

use std::path::Path;

use serde_json::{json, Map, Value};

/// One served version of a CRD.
#[derive(Clone, Debug)]
pub struct Crd {
    pub group: String,
    pub kind: String,
    /// `openAPIV3Schema`.
    schema: Value,
    /// Whether the CRD declares the status subresource.
    pub status_subresource: bool,
}

impl Crd {
    /// The CRD in `path` (its first version).
    pub fn load(path: &Path) -> Crd {
        let text =
            std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let crd: Value = serde_saphyr::from_str(&text).expect("CRD YAML");
        let version = &crd["spec"]["versions"][0];
        Crd {
            group: crd["spec"]["group"].as_str().unwrap_or("").to_string(),
            kind: crd["spec"]["names"]["kind"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            schema: version["schema"]["openAPIV3Schema"].clone(),
            status_subresource: version["subresources"]["status"].is_object(),
        }
    }

    /// Decodes `obj` as the server does before admission: fields the schema
    /// does not declare are dropped (their paths returned, for a strict
    /// request's refusal or a warning), then defaults are filled in.
    pub fn prune_and_default(&self, obj: &mut Value) -> Vec<String> {
        let mut unknown = Vec::new();
        let Some(root) = obj.as_object_mut() else {
            return unknown;
        };
        for (key, value) in root.iter_mut() {
            if matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            if let Some(s) = self.schema["properties"].get(key) {
                prune(s, value, key, &mut unknown);
                default(s, value);
            }
        }
        root.retain(|k, _| {
            let keep = matches!(k.as_str(), "apiVersion" | "kind" | "metadata")
                || self.schema["properties"].get(k).is_some();
            if !keep {
                unknown.push(k.clone());
            }
            keep
        });
        for (key, s) in self.schema["properties"].as_object().into_iter().flatten() {
            if !root.contains_key(key) {
                if let Some(d) = s.get("default") {
                    root.insert(key.clone(), d.clone());
                }
            }
        }
        unknown
    }

    /// The schema's errors in `obj`, each "path: detail" as the server
    /// words it; `only` limits them to one top-level field (`status` for a
    /// write to the status subresource).
    pub fn validate(&self, obj: &Value, only: Option<&str>) -> Vec<(String, &'static str, String)> {
        let mut errors = Vec::new();
        for (key, s) in self.schema["properties"].as_object().into_iter().flatten() {
            if only.is_some_and(|o| o != key) {
                continue;
            }
            match obj.get(key) {
                Some(v) => check(s, v, key, &mut errors),
                None if required(&self.schema, key) => {
                    errors.push((key.clone(), "FieldValueRequired", "Required value".into()))
                }
                None => {}
            }
        }
        errors
    }

    /// The 422 the server answers for `errors` on object `name`.
    pub fn invalid(&self, name: &str, errors: &[(String, &'static str, String)]) -> Value {
        let each: Vec<String> = errors.iter().map(|(f, _, d)| format!("{f}: {d}")).collect();
        let list = if each.len() == 1 {
            each[0].clone()
        } else {
            format!("[{}]", each.join(", "))
        };
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{}.{} {name:?} is invalid: {list}", self.kind, self.group),
            "reason": "Invalid",
            "details": {
                "name": name, "group": self.group, "kind": self.kind,
                "causes": errors.iter().map(|(f, reason, d)| json!({
                    "reason": reason,
                    // The error's body, as `field.Error.ErrorBody()`.
                    "message": d,
                    "field": f,
                })).collect::<Vec<_>>(),
            },
            "code": 422,
        })
    }
}

fn required(schema: &Value, key: &str) -> bool {
    schema["required"]
        .as_array()
        .is_some_and(|r| r.iter().any(|k| k == key))
}

fn preserves_unknown(schema: &Value) -> bool {
    schema["x-kubernetes-preserve-unknown-fields"] == true
}

/// Drops what `schema` does not declare under `value` (at `path`).
fn prune(schema: &Value, value: &mut Value, path: &str, unknown: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(props) = schema["properties"].as_object() {
                if !preserves_unknown(schema) {
                    map.retain(|k, _| {
                        let keep = props.contains_key(k);
                        if !keep {
                            unknown.push(format!("{path}.{k}"));
                        }
                        keep
                    });
                }
                for (k, v) in map.iter_mut() {
                    if let Some(s) = props.get(k) {
                        prune(s, v, &format!("{path}.{k}"), unknown);
                    }
                }
            } else if let Some(s) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for (k, v) in map.iter_mut() {
                    prune(s, v, &format!("{path}[{k}]"), unknown);
                }
            } else if !preserves_unknown(schema) && schema["type"] == "object" {
                // An object with neither: every field is unknown.
                for k in map.keys() {
                    unknown.push(format!("{path}.{k}"));
                }
                map.clear();
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, v) in items.iter_mut().enumerate() {
                    prune(s, v, &format!("{path}[{i}]"), unknown);
                }
            }
        }
        _ => {}
    }
}

/// Fills the defaults `schema` gives for what `value` leaves out (and a
/// `null` where the schema takes none but has a default).
fn default(schema: &Value, value: &mut Value) {
    if value.is_null() && schema["nullable"] != true {
        if let Some(d) = schema.get("default") {
            *value = d.clone();
        }
    }
    match value {
        Value::Object(map) => {
            for (k, s) in schema["properties"].as_object().into_iter().flatten() {
                match map.get_mut(k) {
                    Some(v) => default(s, v),
                    None => {
                        if let Some(d) = s.get("default") {
                            map.insert(k.clone(), d.clone());
                        }
                    }
                }
            }
            if let Some(s) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for v in map.values_mut() {
                    default(s, v);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for v in items {
                    default(s, v);
                }
            }
        }
        _ => {}
    }
}

/// The JSON type name kube-openapi reports for `v`.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Checks `v` (at `path`) against `schema`.
fn check(schema: &Value, v: &Value, path: &str, errors: &mut Vec<(String, &'static str, String)>) {
    if v.is_null() {
        if schema["nullable"] != true && schema.get("type").is_some() {
            errors.push((
                path.to_string(),
                "FieldValueTypeInvalid",
                format!(
                    "Invalid value: \"null\": {path} in body must be of type {}: \"null\"",
                    schema["type"].as_str().unwrap_or("")
                ),
            ));
        }
        return;
    }
    if let Some(want) = schema["type"].as_str() {
        let got = type_name(v);
        // An integer is a number too.
        if want != got && !(want == "number" && got == "integer") {
            errors.push((
                path.to_string(),
                "FieldValueTypeInvalid",
                format!(
                    "Invalid value: \"{got}\": {path} in body must be of type {want}: \"{got}\""
                ),
            ));
            return;
        }
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(v) {
            let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
            errors.push((
                path.to_string(),
                "FieldValueNotSupported",
                format!(
                    "Unsupported value: {v}: supported values: {}",
                    list.join(", ")
                ),
            ));
        }
    }
    if let Some(n) = v.as_f64() {
        if let Some(min) = schema["minimum"].as_f64().filter(|m| n < *m) {
            errors.push((
                path.to_string(),
                "FieldValueInvalid",
                format!(
                    "Invalid value: {v}: {path} in body should be greater than or equal to {min}"
                ),
            ));
        }
        if let Some(max) = schema["maximum"].as_f64().filter(|m| n > *m) {
            errors.push((
                path.to_string(),
                "FieldValueInvalid",
                format!("Invalid value: {v}: {path} in body should be less than or equal to {max}"),
            ));
        }
    }
    match v {
        Value::Object(map) => {
            for (k, s) in schema["properties"].as_object().into_iter().flatten() {
                match map.get(k) {
                    Some(child) => check(s, child, &format!("{path}.{k}"), errors),
                    None if required(schema, k) => errors.push((
                        format!("{path}.{k}"),
                        "FieldValueRequired",
                        "Required value".into(),
                    )),
                    None => {}
                }
            }
            if let Some(s) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for (k, child) in map {
                    check(s, child, &format!("{path}[{k}]"), errors);
                }
            }
        }
        Value::Array(items) => {
            if let Some(max) = schema["maxItems"]
                .as_u64()
                .filter(|m| items.len() as u64 > *m)
            {
                errors.push((
                    path.to_string(),
                    "FieldValueTooMany",
                    format!("Too many: {}: must have at most {max} items", items.len()),
                ));
            }
            if let Some(s) = schema.get("items") {
                for (i, child) in items.iter().enumerate() {
                    check(s, child, &format!("{path}[{i}]"), errors);
                }
            }
            duplicates(schema, items, path, errors);
        }
        _ => {}
    }
}

/// `x-kubernetes-list-type: set` (items unique) and `map` (items unique by
/// their `x-kubernetes-list-map-keys`).
fn duplicates(
    schema: &Value,
    items: &[Value],
    path: &str,
    errors: &mut Vec<(String, &'static str, String)>,
) {
    let keys: Vec<&str> = schema["x-kubernetes-list-map-keys"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let key_of = |item: &Value| -> Value {
        match schema["x-kubernetes-list-type"].as_str() {
            Some("map") => Value::Object(
                keys.iter()
                    .map(|k| (k.to_string(), item[*k].clone()))
                    .collect::<Map<_, _>>(),
            ),
            _ => item.clone(),
        }
    };
    if !matches!(
        schema["x-kubernetes-list-type"].as_str(),
        Some("map" | "set")
    ) {
        return;
    }
    for (i, item) in items.iter().enumerate() {
        let key = key_of(item);
        if items[..i].iter().any(|earlier| key_of(earlier) == key) {
            let shown = match &key {
                Value::Object(m) => format!(
                    "map[string]interface {{}}{{{}}}",
                    m.iter()
                        .map(|(k, v)| format!("{k:?}:{v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                other => other.to_string(),
            };
            errors.push((
                format!("{path}[{i}]"),
                "FieldValueDuplicate",
                format!("Duplicate value: {shown}"),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dr() -> Crd {
        Crd::load(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("crds/destinationrules.minimesh.io.yaml"),
        )
    }

    /// What the real server answers, word for word (kube-openapi's
    /// validation errors in a `field.ErrorList`).
    #[test]
    fn errors_are_worded_as_the_real_servers() {
        let crd = dr();
        let obj = json!({"spec": {"trafficPolicy": {"loadBalancer": {"simple": "FASTEST"}}}});
        let errors = crd.validate(&obj, None);
        let status = crd.invalid("bad", &errors);
        let message = status["message"].as_str().unwrap();
        assert!(
            message.starts_with("DestinationRule.minimesh.io \"bad\" is invalid: [spec.host: Required value, spec.trafficPolicy.loadBalancer.simple: Unsupported value: \"FASTEST\": supported values: \"UNSPECIFIED\""),
            "{message}"
        );
        let obj = json!({"spec": {"host": 7}});
        let errors = crd.validate(&obj, None);
        assert_eq!(
            crd.invalid("bad", &errors)["message"],
            "DestinationRule.minimesh.io \"bad\" is invalid: spec.host: Invalid value: \"integer\": spec.host in body must be of type string: \"integer\""
        );
    }

    #[test]
    fn unknown_fields_are_pruned_and_defaults_filled() {
        let crd = dr();
        let mut obj = json!({
            "apiVersion": "minimesh.io/v1alpha1", "kind": "DestinationRule",
            "metadata": {"name": "r", "anything": 1},
            "spec": {"host": "web", "hots": "typo"},
            "extra": true,
        });
        let unknown = crd.prune_and_default(&mut obj);
        assert_eq!(unknown, ["spec.hots", "extra"]);
        assert_eq!(obj["spec"]["host"], "web");
        assert!(obj["spec"].get("hots").is_none() && obj.get("extra").is_none());
        // Metadata is the server's, not the schema's.
        assert_eq!(obj["metadata"]["anything"], 1);
        assert_eq!(obj["spec"]["exportTo"], json!([]), "{obj:#}");
    }
}
