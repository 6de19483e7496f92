//! What the real `kubectl` asks of an API server beyond the watch protocol:
//! discovery (the legacy documents, which kubectl falls back to when the
//! server offers no aggregated discovery), OpenAPI v3 saying which kinds
//! take `fieldValidation` (so that kubectl leaves validation to the server,
//! as with a real one), and `Table` responses for `kubectl get`, with the
//! columns of the shipped CRD's `additionalPrinterColumns`.

use serde_json::{json, Value};

use super::wire::{api_version, stored_version, SERVED_VERSIONS};
use super::{cluster_scoped, COLLECTIONS};

/// The shipped CRD of a minimesh.io collection (`plural`).
fn crd(plural: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("crds/{plural}.minimesh.io.yaml"));
    serde_saphyr::from_str(&std::fs::read_to_string(path).expect("CRD")).expect("CRD YAML")
}

/// A collection's APIResource entry (and its status subresource's).
fn resources(c: usize) -> Vec<Value> {
    let (group, _, plural, kind) = COLLECTIONS[c];
    let mut r = json!({
        "name": plural, "singularName": kind.to_lowercase(), "namespaced": !cluster_scoped(c),
        "kind": kind,
        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
    });
    if group == "minimesh.io" {
        let names = &crd(plural)["spec"]["names"];
        r["shortNames"] = names["shortNames"].clone();
        if names.get("categories").is_some() {
            r["categories"] = names["categories"].clone();
        }
    }
    // Istio's CRD names its DestinationRule as Istio's installer does.
    if group == "networking.istio.io" {
        let short = match plural {
            "destinationrules" => "dr",
            "virtualservices" => "vs",
            _ => "gw",
        };
        r["shortNames"] = json!([short]);
        r["categories"] = json!(["istio-io", "networking-istio-io"]);
    }
    let status = json!({
        "name": format!("{plural}/status"), "singularName": "", "namespaced": !cluster_scoped(c),
        "kind": kind, "verbs": ["get", "patch", "update"],
    });
    vec![r, status]
}

/// `/api`, `/apis`, `/api/v1`, `/apis/{group}/{version}`.
pub fn discovery(path: &str, served: impl Fn(usize) -> bool) -> Option<Value> {
    let served: Vec<usize> = (0..COLLECTIONS.len()).filter(|c| served(*c)).collect();
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api"] => Some(json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1:6443"}]
        })),
        ["apis"] => {
            let mut groups: Vec<(&str, &str)> = Vec::new();
            for c in &served {
                let gv = (COLLECTIONS[*c].0, COLLECTIONS[*c].1);
                if !gv.0.is_empty() && !groups.contains(&gv) {
                    groups.push(gv);
                }
            }
            let groups: Vec<Value> = groups
                .iter()
                .map(|(g, v)| {
                    let gv = json!({"groupVersion": format!("{g}/{v}"), "version": v});
                    let mut versions = vec![gv.clone()];
                    for (_, also, _) in SERVED_VERSIONS
                        .iter()
                        .filter(|(sg, _, st)| sg == g && st == v)
                    {
                        versions
                            .push(json!({"groupVersion": format!("{g}/{also}"), "version": also}));
                    }
                    json!({"name": g, "versions": versions, "preferredVersion": gv})
                })
                .collect();
            Some(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}))
        }
        ["api", v] => Some(resource_list("", v, &served)),
        ["apis", g, v] => {
            let mut list = resource_list(g, stored_version(g, v), &served);
            list["groupVersion"] = api_version(g, v).into();
            Some(list)
        }
        _ => None,
    }
}

fn resource_list(group: &str, version: &str, served: &[usize]) -> Value {
    let resources: Vec<Value> = served
        .iter()
        .filter(|c| COLLECTIONS[**c].0 == group && COLLECTIONS[**c].1 == version)
        .flat_map(|c| resources(*c))
        .collect();
    json!({
        "kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": api_version(group, version), "resources": resources
    })
}

/// `/openapi/v3` (the index) and `/openapi/v3/{api|apis/group}/{version}`:
/// for each kind, a patch operation taking `fieldValidation`, which is what
/// kubectl looks for before it sends `fieldValidation=Strict`.
pub fn openapi(path: &str, served: impl Fn(usize) -> bool) -> Option<Value> {
    let rest = path.strip_prefix("/openapi/v3")?;
    let served: Vec<usize> = (0..COLLECTIONS.len()).filter(|c| served(*c)).collect();
    let gv_path = |c: usize| {
        let (g, v, _, _) = COLLECTIONS[c];
        if g.is_empty() {
            format!("api/{v}")
        } else {
            format!("apis/{g}/{v}")
        }
    };
    if rest.is_empty() || rest == "/" {
        let mut paths = serde_json::Map::new();
        for c in &served {
            let (g, v, _, _) = COLLECTIONS[*c];
            let also = SERVED_VERSIONS
                .iter()
                .filter(|(sg, _, st)| *sg == g && *st == v)
                .map(|(_, a, _)| format!("apis/{g}/{a}"));
            for p in std::iter::once(gv_path(*c)).chain(also) {
                paths.insert(
                    p.clone(),
                    json!({"serverRelativeURL": format!("/openapi/v3/{p}?hash=fake")}),
                );
            }
        }
        return Some(json!({ "paths": paths }));
    }
    let wanted = rest.trim_start_matches('/');
    let (wanted_group, wanted_version) = match wanted.split('/').collect::<Vec<_>>().as_slice() {
        ["apis", g, v] => (g.to_string(), v.to_string()),
        ["api", v] => (String::new(), v.to_string()),
        _ => return None,
    };
    let stored = stored_version(&wanted_group, &wanted_version);
    let mut paths = serde_json::Map::new();
    for c in served
        .iter()
        .filter(|c| COLLECTIONS[**c].0 == wanted_group && COLLECTIONS[**c].1 == stored)
    {
        let (g, _, plural, kind) = COLLECTIONS[*c];
        let gvk = json!({"group": g, "version": wanted_version, "kind": kind});
        let item = if cluster_scoped(*c) {
            format!("/{wanted}/{plural}/{{name}}")
        } else {
            format!("/{wanted}/namespaces/{{namespace}}/{plural}/{{name}}")
        };
        let op = |verb: &str| {
            json!({
                "operationId": format!("{verb}{kind}"),
                "x-kubernetes-action": verb,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [
                    {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
                    {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": true}},
                ],
                "responses": {"200": {"description": "OK"}}
            })
        };
        paths.insert(
            item,
            json!({"get": op("get"), "put": op("put"), "patch": op("patch"), "delete": op("delete")}),
        );
    }
    if paths.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0"},
        "paths": paths,
        "components": {"schemas": {}}
    }))
}

/// A `Table` of `items` of collection `c`: NAME, the CRD's printer columns
/// for minimesh's kinds, AGE for the rest.
pub fn table(c: usize, items: &[Value], resource_version: u64) -> Value {
    let columns: Vec<(String, String, String, u64)> = if COLLECTIONS[c].0 == "minimesh.io" {
        crd(COLLECTIONS[c].2)["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|col| {
                (
                    col["name"].as_str().unwrap_or("").to_string(),
                    col["type"].as_str().unwrap_or("string").to_string(),
                    col["jsonPath"].as_str().unwrap_or("").to_string(),
                    col["priority"].as_u64().unwrap_or(0),
                )
            })
            .collect()
    } else {
        vec![(
            "Age".into(),
            "date".into(),
            ".metadata.creationTimestamp".into(),
            0,
        )]
    };
    let mut definitions = vec![
        json!({"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}),
    ];
    definitions.extend(columns.iter().map(|(name, ty, _, priority)| {
        json!({"name": name, "type": ty, "format": "", "description": "", "priority": priority})
    }));
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let mut cells = vec![o["metadata"]["name"].clone()];
            cells.extend(columns.iter().map(|(_, ty, path, _)| {
                let v = jsonpath(o, path);
                match (ty.as_str(), v.as_str()) {
                    // As the API server renders a date column: an age.
                    ("date", Some(t)) => age(t).map_or(v.clone(), Value::from),
                    _ => v,
                }
            }));
            json!({
                "cells": cells,
                "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}
            })
        })
        .collect();
    json!({
        "kind": "Table", "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version.to_string()},
        "columnDefinitions": definitions, "rows": rows
    })
}

/// How long ago `t` (RFC 3339) was, as kubectl's AGE column says it.
fn age(t: &str) -> Option<String> {
    use k8s_openapi::jiff::Timestamp;
    let then: Timestamp = t.parse().ok()?;
    let s = Timestamp::now()
        .as_second()
        .saturating_sub(then.as_second())
        .max(0);
    let (m, h, d) = (s / 60, s / 3600, s / 86400);
    Some(match s {
        0..120 => format!("{s}s"),
        120..600 => format!("{m}m{}s", s % 60),
        600..10_800 => format!("{m}m"),
        10_800..28_800 => format!("{h}h{}m", m % 60),
        28_800..172_800 => format!("{h}h"),
        172_800..691_200 => format!("{d}d{}h", h % 24),
        _ => format!("{d}d"),
    })
}

/// The printer columns' JSONPath: `.a.b`, and `.a[?(@.k=="v")].b`. A
/// missing value is `null`, which kubectl prints as `<none>`.
fn jsonpath(obj: &Value, path: &str) -> Value {
    let mut current = obj.clone();
    let mut rest = path.trim_start_matches('.');
    while !rest.is_empty() {
        let end = rest.find(['.', '[']).unwrap_or(rest.len());
        let (field, after) = rest.split_at(end);
        if !field.is_empty() {
            current = current.get(field).cloned().unwrap_or(Value::Null);
        }
        rest = after;
        if let Some(filter) = rest.strip_prefix("[?(@.") {
            let Some((cond, after)) = filter.split_once(")]") else {
                return Value::Null;
            };
            let Some((key, want)) = cond.split_once("==") else {
                return Value::Null;
            };
            let want = want.trim_matches('"');
            current = current
                .as_array()
                .and_then(|a| a.iter().find(|e| e[key] == want).cloned())
                .unwrap_or(Value::Null);
            rest = after;
        }
        rest = rest.trim_start_matches('.');
    }
    current
}

#[test]
fn printer_column_paths_read_fields_and_filtered_conditions() {
    let o = json!({"spec": {"host": "backend"}, "status": {"conditions": [
        {"type": "Warnings", "status": "False"}, {"type": "Accepted", "status": "True"}]}});
    assert_eq!(jsonpath(&o, ".spec.host"), "backend");
    assert_eq!(
        jsonpath(&o, ".status.conditions[?(@.type==\"Accepted\")].status"),
        "True"
    );
    assert_eq!(jsonpath(&o, ".status.policy"), Value::Null);
}
