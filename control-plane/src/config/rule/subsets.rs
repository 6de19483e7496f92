//! A DestinationRule's `subsets`: named groups of the Service's endpoints,
//! selected by their pods' labels, that routes send to by name.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::FieldError;

/// One subset.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subset {
    /// Its name (`v1`), as routes name it.
    pub name: String,
    /// The labels a pod must carry (all of them) for its endpoints to be in it.
    pub labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Written {
    name: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    traffic_policy: Option<Value>,
}

/// Most subsets one rule may have.
const MAX_SUBSETS: usize = 64;

/// Reads `spec.subsets`, refusing the first that is malformed or asks for
/// what minimesh does not implement (a subset's own traffic policy).
pub fn subsets(written: &[Value]) -> Result<Vec<Subset>, FieldError> {
    if written.len() > MAX_SUBSETS {
        return Err(FieldError::new(
            "spec.subsets",
            format!("{} subsets, more than {MAX_SUBSETS}", written.len()),
        ));
    }
    let mut out: Vec<Subset> = Vec::with_capacity(written.len());
    for (i, v) in written.iter().enumerate() {
        let at = format!("spec.subsets[{i}]");
        let s: Written = serde_json::from_value(v.clone())
            .map_err(|e| FieldError::new(at.clone(), e.to_string()))?;
        if s.traffic_policy.is_some() {
            return Err(FieldError::new(
                format!("{at}.trafficPolicy"),
                "a subset's own traffic policy is not implemented yet; this rule is not applied",
            ));
        }
        let label = |n: &str| {
            !n.is_empty()
                && n.len() <= 63
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        };
        if !label(&s.name) || s.name.contains('|') {
            return Err(FieldError::new(
                format!("{at}.name"),
                format!(
                    "{:?} is not a subset name (1 to 63 letters, digits, '-', '_', '.')",
                    s.name
                ),
            ));
        }
        if out.iter().any(|o| o.name == s.name) {
            return Err(FieldError::new(
                format!("{at}.name"),
                format!("subset {:?} is defined twice", s.name),
            ));
        }
        out.push(Subset {
            name: s.name,
            labels: s.labels,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::subsets;
    use serde_json::json;

    #[test]
    fn subsets_are_read_and_bad_ones_refused_by_field() {
        let s = subsets(&[
            json!({"name": "v1", "labels": {"version": "v1"}}),
            json!({"name": "v2", "labels": {"version": "v2"}}),
        ])
        .expect("valid");
        assert_eq!(s[1].name, "v2");
        assert_eq!(s[1].labels["version"], "v2");
        let e = subsets(&[json!({"name": "v1", "trafficPolicy": {}})]).unwrap_err();
        assert_eq!(e.field, "spec.subsets[0].trafficPolicy");
        let e = subsets(&[json!({"name": "v1"}), json!({"name": "v1"})]).unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.reason.as_str()),
            ("spec.subsets[1].name", "subset \"v1\" is defined twice")
        );
        let e = subsets(&[json!({"labels": {}})]).unwrap_err();
        assert_eq!(e.field, "spec.subsets[0]");
    }
}
