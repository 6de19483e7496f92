//! The fake API server's wire pieces: paths, query values, watch lines,
//! merge patches, timestamps and the responses (Status objects, admission
//! refusals and warnings) as the API server writes them.

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use super::{admission, Body, COLLECTIONS};

/// Now, as the API server writes timestamps (RFC 3339, whole seconds).
pub fn now() -> String {
    use k8s_openapi::jiff::{Timestamp, Unit};
    Timestamp::now()
        .round(Unit::Second)
        .unwrap_or_else(|_| Timestamp::now())
        .to_string()
}

/// A query value with its `%XX` escapes (and `+`) decoded.
pub fn percent_decode(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn api_version(group: &str, version: &str) -> String {
    if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    }
}

/// What a request path addresses: collection, namespace, name, subresource.
pub type Target = (usize, Option<String>, Option<String>, Option<String>);

/// The versions a group also serves its collections in, converting to
/// and from the one stored (as Istio's CRDs serve `v1alpha3` and `v1beta1`
/// beside `v1`): (group, served version, stored version).
pub const SERVED_VERSIONS: [(&str, &str, &str); 2] = [
    ("networking.istio.io", "v1alpha3", "v1"),
    ("networking.istio.io", "v1beta1", "v1"),
];

/// The stored version of `version` of `group`.
pub fn stored_version<'a>(group: &str, version: &'a str) -> &'a str {
    SERVED_VERSIONS
        .iter()
        .find(|(g, v, _)| *g == group && *v == version)
        .map_or(version, |(_, _, stored)| stored)
}

/// `/api/v1/...` or `/apis/{group}/{version}/...` -> what it addresses.
pub fn route(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, stored_version(g, v), rest),
        _ => return None,
    };
    let (ns, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return None,
    };
    let c = COLLECTIONS
        .iter()
        .position(|(g, v, p, _)| *g == group && *v == version && *p == plural)?;
    Some((c, ns, name, sub))
}

pub fn watch_line(kind: &str, obj: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": obj})).expect("json");
    line.push(b'\n');
    Bytes::from(line)
}

pub fn gone(asked: u64, oldest: u64) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("too old resource version: {asked} ({oldest})"),
        "reason": "Expired", "code": 410
    })
}

/// RFC 7386 JSON merge patch.
pub fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().expect("object");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

pub fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(v).expect("json"))).boxed())
        .expect("response")
}

/// A refusal by admission, as the API server sends it.
pub fn refused(r: admission::Refused) -> Response<Body> {
    json_response(
        StatusCode::from_u16(r.code).unwrap_or(StatusCode::FORBIDDEN),
        &r.status,
    )
}

/// Admission warnings as the API server sends them (kubectl prints each).
pub fn with_warnings(mut resp: Response<Body>, warnings: &[String]) -> Response<Body> {
    for w in warnings {
        let value = format!("299 - \"{}\"", w.replace('"', "\\\""));
        if let Ok(v) = http::HeaderValue::from_str(&value) {
            resp.headers_mut().append("warning", v);
        }
    }
    resp
}

pub fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16()
        }),
    )
}

/// RFC 6902 JSON Patch, the operations admission webhooks send (`add`,
/// `replace`, `remove`; `-` appends to an array).
pub fn json_patch(target: &mut Value, ops: &[Value]) -> Result<(), String> {
    for op in ops {
        let path = op["path"].as_str().ok_or("an operation has no path")?;
        let mut segments: Vec<String> = path
            .split('/')
            .skip(1)
            .map(|s| s.replace("~1", "/").replace("~0", "~"))
            .collect();
        let last = segments
            .pop()
            .ok_or_else(|| format!("{path}: empty path"))?;
        let mut parent = &mut *target;
        for s in &segments {
            parent = match parent {
                Value::Object(m) => m.get_mut(s),
                Value::Array(a) => s.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
                _ => None,
            }
            .ok_or_else(|| format!("{path}: {s} does not exist"))?;
        }
        let value = op["value"].clone();
        match (op["op"].as_str(), parent) {
            (Some("add" | "replace"), Value::Object(m)) => {
                m.insert(last, value);
            }
            (Some("add"), Value::Array(a)) if last == "-" => a.push(value),
            (Some("add"), Value::Array(a)) => {
                let i: usize = last.parse().map_err(|_| format!("{path}: not an index"))?;
                if i > a.len() {
                    return Err(format!("{path}: index out of range"));
                }
                a.insert(i, value);
            }
            (Some("replace"), Value::Array(a)) => {
                let i: usize = last.parse().map_err(|_| format!("{path}: not an index"))?;
                *a.get_mut(i)
                    .ok_or_else(|| format!("{path}: index out of range"))? = value;
            }
            (Some("remove"), Value::Object(m)) => {
                m.remove(&last)
                    .ok_or_else(|| format!("{path}: does not exist"))?;
            }
            (Some("remove"), Value::Array(a)) => {
                let i: usize = last.parse().map_err(|_| format!("{path}: not an index"))?;
                if i >= a.len() {
                    return Err(format!("{path}: index out of range"));
                }
                a.remove(i);
            }
            (op, _) => return Err(format!("{path}: unsupported operation {op:?}")),
        }
    }
    Ok(())
}

/// Whether `labels` match a label selector in kubectl's syntax (`k=v`,
/// `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-joined).
pub fn label_match(selector: &str, labels: &Value) -> bool {
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in selector.char_indices() {
        match ch {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .iter()
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .all(|t| {
            let get = |k: &str| labels[k.trim()].as_str();
            let set = |list: &str| -> Vec<String> {
                list.trim()
                    .trim_start_matches('(')
                    .trim_end_matches(')')
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .collect()
            };
            if let Some((k, v)) = t.split_once("!=") {
                get(k) != Some(v.trim())
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                get(k) == Some(v.trim())
            } else if let Some((k, v)) = t.split_once(" notin ") {
                get(k).is_none_or(|x| !set(v).iter().any(|s| s == x))
            } else if let Some((k, v)) = t.split_once(" in ") {
                get(k).is_some_and(|x| set(v).iter().any(|s| s == x))
            } else if let Some(k) = t.strip_prefix('!') {
                get(k).is_none()
            } else {
                get(t).is_some()
            }
        })
}

/// Why the API server would refuse a label selector, if it would: an
/// unbalanced parenthesis or a term with no key.
pub fn bad_selector(selector: &str) -> Option<String> {
    let open = selector.matches('(').count();
    if open != selector.matches(')').count() {
        return Some(format!(
            "unable to parse requirement: found '{}', expected: ')'",
            selector.trim()
        ));
    }
    if open == 0
        && selector
            .split(',')
            .any(|t| t.trim().trim_start_matches('!').is_empty())
    {
        return Some("unable to parse requirement: found '', expected: identifier".into());
    }
    None
}
