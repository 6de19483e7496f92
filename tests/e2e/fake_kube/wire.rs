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

/// RFC 6902 JSON Patch, as the API server applies one (from a client's
/// PATCH or an admission webhook's answer): `add`, `remove`, `replace`,
/// `move`, `copy`, `test`, in order; the first that fails fails the whole
/// patch, naming the operation's path and why.
pub fn json_patch(target: &mut Value, ops: &[Value]) -> Result<(), String> {
    for op in ops {
        let path = op["path"].as_str().ok_or("an operation has no path")?;
        let at = pointer(path)?;
        let from = || {
            op["from"]
                .as_str()
                .ok_or_else(|| format!("{path}: no from"))
                .and_then(pointer)
        };
        match op["op"].as_str() {
            Some("add") => add(
                target,
                &at,
                op.get("value").ok_or(format!("{path}: no value"))?.clone(),
            )
            .map_err(|e| format!("{path}: {e}"))?,
            Some("remove") => {
                take(target, &at).map_err(|e| format!("{path}: {e}"))?;
            }
            Some("replace") => {
                let value = op.get("value").ok_or(format!("{path}: no value"))?.clone();
                take(target, &at).map_err(|e| format!("{path}: {e}"))?;
                add(target, &at, value).map_err(|e| format!("{path}: {e}"))?;
            }
            Some("move") => {
                let from = from()?;
                if at.len() > from.len() && at.starts_with(&from) {
                    return Err(format!("{path}: a value cannot move into itself"));
                }
                let value = take(target, &from).map_err(|e| format!("{path}: from: {e}"))?;
                add(target, &at, value).map_err(|e| format!("{path}: {e}"))?;
            }
            Some("copy") => {
                let value = get(target, &from()?)
                    .ok_or(format!("{path}: from: does not exist"))?
                    .clone();
                add(target, &at, value).map_err(|e| format!("{path}: {e}"))?;
            }
            Some("test") => {
                if get(target, &at) != op.get("value") {
                    return Err(format!("testing value {path} failed"));
                }
            }
            other => return Err(format!("{path}: unsupported operation {other:?}")),
        }
    }
    Ok(())
}

/// An RFC 6901 JSON Pointer's reference tokens (`~1` is `/`, `~0` is `~`).
fn pointer(p: &str) -> Result<Vec<String>, String> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = p.strip_prefix('/') else {
        return Err(format!("{p}: a JSON pointer starts with /"));
    };
    Ok(rest
        .split('/')
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn get<'a>(v: &'a Value, at: &[String]) -> Option<&'a Value> {
    at.iter().try_fold(v, |v, s| match v {
        Value::Object(m) => m.get(s),
        Value::Array(a) => index(s).and_then(|i| a.get(i)),
        _ => None,
    })
}

/// An array index token: digits, no leading zero.
fn index(s: &str) -> Option<usize> {
    (s == "0" || !s.starts_with('0'))
        .then(|| s.parse().ok())
        .flatten()
}

fn parent_of<'a>(v: &'a mut Value, at: &[String]) -> Result<&'a mut Value, String> {
    let mut node = v;
    for s in at {
        node = match node {
            Value::Object(m) => m.get_mut(s),
            Value::Array(a) => index(s).and_then(|i| a.get_mut(i)),
            _ => None,
        }
        .ok_or_else(|| format!("{s} does not exist"))?;
    }
    Ok(node)
}

fn add(v: &mut Value, at: &[String], value: Value) -> Result<(), String> {
    let Some((last, parents)) = at.split_last() else {
        *v = value;
        return Ok(());
    };
    match parent_of(v, parents)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
        }
        Value::Array(a) if last == "-" => a.push(value),
        Value::Array(a) => match index(last) {
            Some(i) if i <= a.len() => a.insert(i, value),
            _ => return Err("index out of range".into()),
        },
        _ => return Err("the parent is not a container".into()),
    }
    Ok(())
}

fn take(v: &mut Value, at: &[String]) -> Result<Value, String> {
    let Some((last, parents)) = at.split_last() else {
        return Ok(std::mem::take(v));
    };
    match parent_of(v, parents)? {
        Value::Object(m) => m.remove(last).ok_or_else(|| "does not exist".into()),
        Value::Array(a) => match index(last) {
            Some(i) if i < a.len() => Ok(a.remove(i)),
            _ => Err("index out of range".into()),
        },
        _ => Err("does not exist".into()),
    }
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

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::{json_patch, merge};

    /// Known answers: RFC 7386's Appendix A, every case.
    #[test]
    fn merge_patch_gives_rfc_7386s_results() {
        let cases = [
            (json!({"a": "b"}), json!({"a": "c"}), json!({"a": "c"})),
            (
                json!({"a": "b"}),
                json!({"b": "c"}),
                json!({"a": "b", "b": "c"}),
            ),
            (json!({"a": "b"}), json!({"a": null}), json!({})),
            (
                json!({"a": "b", "b": "c"}),
                json!({"a": null}),
                json!({"b": "c"}),
            ),
            (json!({"a": ["b"]}), json!({"a": "c"}), json!({"a": "c"})),
            (json!({"a": "c"}), json!({"a": ["b"]}), json!({"a": ["b"]})),
            (
                json!({"a": {"b": "c"}}),
                json!({"a": {"b": "d", "c": null}}),
                json!({"a": {"b": "d"}}),
            ),
            (
                json!({"a": [{"b": "c"}]}),
                json!({"a": [1]}),
                json!({"a": [1]}),
            ),
            (json!(["a", "b"]), json!(["c", "d"]), json!(["c", "d"])),
            (json!({"a": "b"}), json!(["c"]), json!(["c"])),
            (json!({"a": "foo"}), Value::Null, Value::Null),
            (json!({"a": "foo"}), json!("bar"), json!("bar")),
            (
                json!({"e": null}),
                json!({"a": 1}),
                json!({"e": null, "a": 1}),
            ),
            (
                json!([1, 2]),
                json!({"a": "b", "c": null}),
                json!({"a": "b"}),
            ),
            (
                json!({}),
                json!({"a": {"bb": {"ccc": null}}}),
                json!({"a": {"bb": {}}}),
            ),
        ];
        for (target, patch, want) in cases {
            let mut got = target.clone();
            merge(&mut got, &patch);
            assert_eq!(got, want, "{target} + {patch}");
        }
    }

    /// Known answers: RFC 6902's Appendix A (A.1 to A.16; A.13, a
    /// document with a duplicate key, is no JSON serde reads).
    #[test]
    fn json_patch_gives_rfc_6902s_results() {
        let ok = [
            (
                json!({"foo": "bar"}),
                json!([{"op": "add", "path": "/baz", "value": "qux"}]),
                json!({"baz": "qux", "foo": "bar"}),
            ),
            (
                json!({"foo": ["bar", "baz"]}),
                json!([{"op": "add", "path": "/foo/1", "value": "qux"}]),
                json!({"foo": ["bar", "qux", "baz"]}),
            ),
            (
                json!({"baz": "qux", "foo": "bar"}),
                json!([{"op": "remove", "path": "/baz"}]),
                json!({"foo": "bar"}),
            ),
            (
                json!({"foo": ["bar", "qux", "baz"]}),
                json!([{"op": "remove", "path": "/foo/1"}]),
                json!({"foo": ["bar", "baz"]}),
            ),
            (
                json!({"baz": "qux", "foo": "bar"}),
                json!([{"op": "replace", "path": "/baz", "value": "boo"}]),
                json!({"baz": "boo", "foo": "bar"}),
            ),
            (
                json!({"foo": {"bar": "baz", "waldo": "fred"}, "qux": {"corge": "grault"}}),
                json!([{"op": "move", "from": "/foo/waldo", "path": "/qux/thud"}]),
                json!({"foo": {"bar": "baz"}, "qux": {"corge": "grault", "thud": "fred"}}),
            ),
            (
                json!({"foo": ["all", "grass", "cows", "eat"]}),
                json!([{"op": "move", "from": "/foo/1", "path": "/foo/3"}]),
                json!({"foo": ["all", "cows", "eat", "grass"]}),
            ),
            (
                json!({"baz": "qux", "foo": ["a", 2, "c"]}),
                json!([{"op": "test", "path": "/baz", "value": "qux"}, {"op": "test", "path": "/foo/1", "value": 2}]),
                json!({"baz": "qux", "foo": ["a", 2, "c"]}),
            ),
            (
                json!({"foo": "bar"}),
                json!([{"op": "add", "path": "/child", "value": {"grandchild": {}}}]),
                json!({"foo": "bar", "child": {"grandchild": {}}}),
            ),
            (
                json!({"foo": "bar"}),
                json!([{"op": "add", "path": "/baz", "value": "qux", "xyz": 123}]),
                json!({"foo": "bar", "baz": "qux"}),
            ),
            (
                json!({"/": 9, "~1": 10}),
                json!([{"op": "test", "path": "/~01", "value": 10}]),
                json!({"/": 9, "~1": 10}),
            ),
            (
                json!({"foo": ["bar"]}),
                json!([{"op": "add", "path": "/foo/-", "value": ["abc", "def"]}]),
                json!({"foo": ["bar", ["abc", "def"]]}),
            ),
        ];
        for (target, patch, want) in ok {
            let mut got = target.clone();
            let ops = patch.as_array().expect("ops").clone();
            json_patch(&mut got, &ops).unwrap_or_else(|e| panic!("{patch}: {e}"));
            assert_eq!(got, want, "{patch}");
        }
        let refused = [
            (
                json!({"baz": "qux"}),
                json!([{"op": "test", "path": "/baz", "value": "bar"}]),
            ),
            (
                json!({"foo": "bar"}),
                json!([{"op": "add", "path": "/baz/bat", "value": "qux"}]),
            ),
            (
                json!({"/": 9, "~1": 10}),
                json!([{"op": "test", "path": "/~01", "value": "10"}]),
            ),
        ];
        for (target, patch) in refused {
            let mut got = target.clone();
            let ops = patch.as_array().expect("ops").clone();
            assert!(
                json_patch(&mut got, &ops).is_err(),
                "{patch} applied: {got}"
            );
        }
    }
}
