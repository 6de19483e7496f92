//! Strategic merge patch, as the API server applies one to a built-in kind
//! (kubectl sends them for `apply` and `patch`): a JSON merge patch, except
//! that each list merges as its field's Go type says (`patchStrategy` and
//! `patchMergeKey` in the Kubernetes API): by a merge key (a Pod's
//! `containers` by `name`, a container's `ports` by `containerPort`, a
//! Service's `ports` by `port`, …), as a set (`metadata.finalizers`), or
//! replaced whole (every list with no strategy: `tolerations`, `args`, an
//! EndpointSlice's `endpoints`). Directives: `$patch: delete` and
//! `$patch: replace`, `$setElementOrder/<list>`,
//! `$deleteFromPrimitiveList/<list>`, `$retainKeys`.

use serde_json::{json, Value};

/// How a list field merges.
#[derive(Clone, Copy, Debug, PartialEq)]
enum List {
    /// Element by element, on this key.
    Key(&'static str),
    /// A list of values merged as a set.
    Set,
    /// Replaced whole.
    Replace,
}

/// The strategy of the list at `path` (field names from the object's root)
/// in an object of `kind`, from the API's Go types.
fn strategy(kind: &str, path: &[&str]) -> List {
    // A Deployment's pod template is a Pod's metadata and spec.
    let (kind, path) = match (kind, path) {
        ("Deployment", ["spec", "template", rest @ ..]) => ("Pod", rest),
        other => other,
    };
    let container = |c: &str| matches!(c, "containers" | "initContainers" | "ephemeralContainers");
    match (kind, path) {
        (_, ["metadata", "finalizers"]) => List::Set,
        (_, ["metadata", "ownerReferences"]) => List::Key("uid"),
        ("Pod", ["spec", c]) if container(c) => List::Key("name"),
        (
            "Pod",
            ["spec", "volumes" | "imagePullSecrets" | "schedulingGates" | "resourceClaims"],
        ) => List::Key("name"),
        ("Pod", ["spec", "hostAliases"]) => List::Key("ip"),
        ("Pod", ["spec", "topologySpreadConstraints"]) => List::Key("topologyKey"),
        ("Pod", ["spec", c, "ports"]) if container(c) => List::Key("containerPort"),
        ("Pod", ["spec", c, "env"]) if container(c) => List::Key("name"),
        ("Pod", ["spec", c, "volumeMounts"]) if container(c) => List::Key("mountPath"),
        ("Pod", ["spec", c, "volumeDevices"]) if container(c) => List::Key("devicePath"),
        ("Service", ["spec", "ports"]) => List::Key("port"),
        ("MutatingWebhookConfiguration" | "ValidatingWebhookConfiguration", ["webhooks"]) => {
            List::Key("name")
        }
        ("ServiceAccount", ["secrets" | "imagePullSecrets"]) => List::Key("name"),
        _ => List::Replace,
    }
}

/// `patch` applied to `target`, an object of `kind`.
pub fn strategic_merge(kind: &str, target: &mut Value, patch: &Value) {
    merge_map(kind, &mut Vec::new(), target, patch);
}

fn merge_map<'a>(kind: &str, path: &mut Vec<&'a str>, target: &mut Value, patch: &'a Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() || p.get("$patch").and_then(Value::as_str) == Some("replace") {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("an object");
    if let Some(keep) = p.get("$retainKeys").and_then(Value::as_array) {
        t.retain(|k, _| keep.iter().any(|r| r == k));
    }
    for (k, v) in p {
        if let Some(list) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(items)), Some(gone)) = (t.get_mut(list), v.as_array()) {
                items.retain(|i| !gone.contains(i));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        path.push(k);
        match v {
            Value::Null => {
                t.remove(k);
            }
            Value::Array(items) => {
                let list = t.entry(k.clone()).or_insert_with(|| json!([]));
                let order = p
                    .get(&format!("$setElementOrder/{k}"))
                    .and_then(Value::as_array);
                merge_list(kind, path, list, items, order);
            }
            _ => merge_map(kind, path, t.entry(k.clone()).or_insert(Value::Null), v),
        }
        path.pop();
    }
}

fn merge_list<'a>(
    kind: &str,
    path: &mut Vec<&'a str>,
    list: &mut Value,
    items: &'a [Value],
    order: Option<&Vec<Value>>,
) {
    // `{"$patch": "replace"}` among the elements: the list is the others.
    let replace = items
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"));
    let strategy = if replace {
        List::Replace
    } else {
        strategy(kind, path)
    };
    if strategy == List::Replace {
        *list = Value::Array(
            items
                .iter()
                .filter(|i| i.get("$patch").is_none())
                .cloned()
                .collect(),
        );
        return;
    }
    if !list.is_array() {
        *list = json!([]);
    }
    let list = list.as_array_mut().expect("a list");
    match strategy {
        List::Set => {
            for i in items {
                if !list.contains(i) {
                    list.push(i.clone());
                }
            }
            if let Some(order) = order {
                list.sort_by_key(|e| order.iter().position(|o| o == e).unwrap_or(usize::MAX));
            }
        }
        List::Key(key) => {
            for item in items {
                let Some(id) = item.get(key) else {
                    continue;
                };
                let at = list.iter().position(|e| e.get(key) == Some(id));
                match (at, item.get("$patch").and_then(Value::as_str)) {
                    (Some(i), Some("delete")) => {
                        list.remove(i);
                    }
                    (None, Some("delete")) => {}
                    (Some(i), _) => merge_map(kind, path, &mut list[i], item),
                    (None, _) => {
                        let mut e = json!({});
                        merge_map(kind, path, &mut e, item);
                        list.push(e);
                    }
                }
            }
            if let Some(order) = order {
                let rank = |e: &Value| {
                    e.get(key)
                        .and_then(|id| order.iter().position(|o| o.get(key) == Some(id)))
                        .unwrap_or(usize::MAX)
                };
                list.sort_by_key(rank);
            }
        }
        List::Replace => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::strategic_merge;

    fn patched(kind: &str, mut obj: Value, patch: Value) -> Value {
        strategic_merge(kind, &mut obj, &patch);
        obj
    }

    fn deployment() -> Value {
        json!({"spec": {"replicas": 2, "template": {"spec": {
            "containers": [{"name": "patch-demo-ctr", "image": "nginx"}],
            "tolerations": [{"effect": "NoSchedule", "key": "dedicated", "value": "test-team"}]
        }}}})
    }

    /// Known answers: the examples of the Kubernetes task page "Update API
    /// Objects in Place Using kubectl patch". A container patched into a
    /// Deployment joins the one there (merged by `name`); tolerations, a
    /// list with no patch strategy, are replaced; `$retainKeys` drops the
    /// keys it does not name.
    #[test]
    fn lists_merge_as_the_kinds_go_types_say() {
        let d = patched(
            "Deployment",
            deployment(),
            json!({"spec": {"template": {"spec": {"containers": [{"name": "patch-demo-ctr-2", "image": "redis"}]}}}}),
        );
        assert_eq!(
            d["spec"]["template"]["spec"]["containers"],
            json!([{"name": "patch-demo-ctr", "image": "nginx"}, {"name": "patch-demo-ctr-2", "image": "redis"}])
        );
        let d = patched(
            "Deployment",
            deployment(),
            json!({"spec": {"template": {"spec": {"tolerations": [{"effect": "NoSchedule", "key": "disktype", "value": "ssd"}]}}}}),
        );
        assert_eq!(
            d["spec"]["template"]["spec"]["tolerations"],
            json!([{"effect": "NoSchedule", "key": "disktype", "value": "ssd"}])
        );
        let mut with_strategy = deployment();
        with_strategy["spec"]["strategy"] =
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%"}});
        let d = patched(
            "Deployment",
            with_strategy,
            json!({"spec": {"strategy": {"$retainKeys": ["type"], "type": "Recreate"}}}),
        );
        assert_eq!(d["spec"]["strategy"], json!({"type": "Recreate"}));
    }

    /// A Service's ports merge by `port`; a container's by `containerPort`
    /// and its env by `name`; `$patch: delete` removes one element,
    /// `$setElementOrder` orders them; finalizers merge as a set and
    /// `$deleteFromPrimitiveList` takes one out; an EndpointSlice's
    /// endpoints (no strategy) are replaced.
    #[test]
    fn merge_keys_directives_and_sets() {
        let svc = json!({"spec": {"ports": [{"name": "http", "port": 80}, {"name": "grpc", "port": 50051}]}});
        let s = patched(
            "Service",
            svc,
            json!({"spec": {
                "$setElementOrder/ports": [{"port": 8080}, {"port": 80}],
                "ports": [{"port": 8080, "name": "admin"}, {"port": 50051, "$patch": "delete"}]
            }}),
        );
        assert_eq!(
            s["spec"]["ports"],
            json!([{"port": 8080, "name": "admin"}, {"name": "http", "port": 80}])
        );
        let pod = json!({"metadata": {"finalizers": ["a", "b"]}, "spec": {"containers": [{
            "name": "app", "ports": [{"containerPort": 8080}], "env": [{"name": "A", "value": "1"}]
        }]}});
        let p = patched(
            "Pod",
            pod,
            json!({
                "metadata": {"finalizers": ["c"], "$deleteFromPrimitiveList/finalizers": ["a"]},
                "spec": {"containers": [{"name": "app", "ports": [{"containerPort": 9090}], "env": [{"name": "A", "value": "2"}]}]}
            }),
        );
        assert_eq!(p["metadata"]["finalizers"], json!(["b", "c"]));
        assert_eq!(
            p["spec"]["containers"][0]["ports"],
            json!([{"containerPort": 8080}, {"containerPort": 9090}])
        );
        assert_eq!(
            p["spec"]["containers"][0]["env"],
            json!([{"name": "A", "value": "2"}])
        );
        let slice =
            json!({"endpoints": [{"addresses": ["10.0.0.1"]}, {"addresses": ["10.0.0.2"]}]});
        let e = patched(
            "EndpointSlice",
            slice,
            json!({"endpoints": [{"addresses": ["10.0.0.3"]}]}),
        );
        assert_eq!(e["endpoints"], json!([{"addresses": ["10.0.0.3"]}]));
    }
}
