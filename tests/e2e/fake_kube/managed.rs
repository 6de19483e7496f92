//! Field ownership as server-side apply keeps it (`metadata.managedFields`
//! on the real server): each field of an object has the managers that set
//! it, by Apply or by Update. An apply that would change a field another
//! manager owns is refused 409 with the real server's message, unless
//! forced (`force=true`, kubectl's `--force-conflicts`), which takes the
//! field from them; an update takes the fields it changes; an applier's
//! field it stops applying is removed when nobody else owns it.
//!
//! Fields are leaves of nested objects (a list counts as one field, as an
//! atomic list does); `apiVersion`, `kind`, `status` and the object's
//! identity in `metadata` are nobody's. The fake keeps ownership beside the
//! object, not in `metadata.managedFields`, so kubectl's migration of
//! client-side-apply ownership before a server-side apply (which reads that
//! field) is done here instead: its ownership passes to the applier.

use std::collections::{BTreeMap, BTreeSet};

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::wire::json_response;
use super::Body;

/// A field: the keys from the object's root.
pub(super) type Path = Vec<String>;

/// How a manager set a field.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Op {
    Apply,
    /// An update (create, replace, patch) in this API version at this time.
    Update {
        api_version: String,
        time: String,
    },
}

/// The managers of each field of one object.
#[derive(Clone, Debug, Default)]
pub(super) struct Owners(BTreeMap<Path, BTreeMap<String, Op>>);

/// A field another manager owns, which an apply would change.
#[derive(Debug, PartialEq)]
pub(super) struct Conflict {
    pub(super) path: Path,
    pub(super) manager: String,
    pub(super) op: Op,
}

/// The manager kubectl's client-side apply updates with.
pub(super) const CLIENT_SIDE_APPLY: &str = "kubectl-client-side-apply";

/// The fields of `obj` with their values.
pub(super) fn leaves(obj: &Value) -> BTreeMap<Path, Value> {
    let mut out = BTreeMap::new();
    let Some(top) = obj.as_object() else {
        return out;
    };
    for (k, v) in top {
        match k.as_str() {
            "apiVersion" | "kind" | "status" => {}
            // Of metadata, only labels and annotations are anyone's.
            "metadata" => {
                for field in ["labels", "annotations"] {
                    if let Some(v) = v.get(field) {
                        walk(vec![k.clone(), field.to_string()], v, &mut out);
                    }
                }
            }
            _ => walk(vec![k.clone()], v, &mut out),
        }
    }
    out
}

fn walk(path: Path, v: &Value, out: &mut BTreeMap<Path, Value>) {
    match v.as_object() {
        Some(o) if !o.is_empty() => {
            for (k, v) in o {
                let mut p = path.clone();
                p.push(k.clone());
                walk(p, v, out);
            }
        }
        _ => {
            out.insert(path, v.clone());
        }
    }
}

/// A path as the server prints it: `.spec.host`.
pub(super) fn printed(path: &Path) -> String {
    path.iter().map(|k| format!(".{k}")).collect()
}

impl Owners {
    /// An update by `manager` from `before` (Null for a create) to
    /// `after`: it owns every field it changed or added, alone; fields gone
    /// have no owner left.
    pub(super) fn updated(&mut self, manager: &str, op: Op, before: &Value, after: &Value) {
        let (old, new) = (leaves(before), leaves(after));
        self.0.retain(|path, _| new.contains_key(path));
        for (path, v) in new {
            if old.get(&path) != Some(&v) {
                self.0
                    .insert(path, BTreeMap::from([(manager.to_string(), op.clone())]));
            }
        }
    }

    /// kubectl's migration before a server-side apply: the fields
    /// client-side apply set become `manager`'s, as applied.
    pub(super) fn migrate_client_side_apply(&mut self, manager: &str) {
        for owners in self.0.values_mut() {
            if owners.remove(CLIENT_SIDE_APPLY).is_some() {
                owners.insert(manager.to_string(), Op::Apply);
            }
        }
    }

    /// The fields of `config` another manager owns whose value it changes,
    /// by path then manager.
    pub(super) fn conflicts(
        &self,
        manager: &str,
        config: &Value,
        current: &Value,
    ) -> Vec<Conflict> {
        let now = leaves(current);
        let mut out = Vec::new();
        for (path, v) in leaves(config) {
            if now.get(&path) == Some(&v) {
                continue;
            }
            for (other, op) in self.0.get(&path).into_iter().flatten() {
                if other != manager {
                    out.push(Conflict {
                        path: path.clone(),
                        manager: other.clone(),
                        op: op.clone(),
                    });
                }
            }
        }
        out
    }

    /// An apply of `config` by `manager` over `current` (its conflicts
    /// forced or none): it owns every field of `config` (alone where it
    /// changes the value). Returned: what it applied before and no longer
    /// lists that nobody else has a field in, to be removed whole (as the
    /// real server prunes: an object it stops listing goes with the
    /// defaults the schema filled in, unless another manager owns a field
    /// in it).
    pub(super) fn applied(&mut self, manager: &str, config: &Value, current: &Value) -> Vec<Path> {
        let (now, wanted) = (leaves(current), leaves(config));
        let mut before = BTreeSet::new();
        let mut others = BTreeSet::new();
        for (path, owners) in &self.0 {
            if owners.get(manager) == Some(&Op::Apply) {
                before.extend(prefixes(path));
            }
            if owners.keys().any(|m| m != manager) {
                others.extend(prefixes(path));
            }
        }
        let listed: BTreeSet<Path> = wanted.keys().flat_map(prefixes).collect();
        let removable: BTreeSet<&Path> = before
            .iter()
            .filter(|p| !listed.contains(*p) && !others.contains(*p))
            .collect();
        // Each removable field not inside another one.
        let gone: Vec<Path> = removable
            .iter()
            .filter(|p| !(1..p.len()).any(|n| removable.contains(&p[..n].to_vec())))
            .map(|p| p.to_vec())
            .collect();
        self.0.retain(|path, owners| {
            if wanted.contains_key(path) {
                return true;
            }
            owners.remove(manager);
            !owners.is_empty() && !gone.iter().any(|g| path.starts_with(g))
        });
        for (path, v) in wanted {
            let owners = self.0.entry(path.clone()).or_default();
            if now.get(&path) != Some(&v) {
                owners.clear();
            }
            owners.insert(manager.to_string(), Op::Apply);
        }
        gone
    }
}

/// `path` and every path above it (`.spec`, `.spec.host`).
fn prefixes(path: &Path) -> Vec<Path> {
    (1..=path.len()).map(|n| path[..n].to_vec()).collect()
}

/// Removes the field at `path` from `obj`, whatever it holds.
pub(super) fn remove(obj: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut node = &mut *obj;
    for k in parents {
        match node.get_mut(k) {
            Some(n) => node = n,
            None => return,
        }
    }
    if let Some(o) = node.as_object_mut() {
        o.remove(last);
    }
}

/// A manager as the server names it in a conflict: an updater with its API
/// version and time (`"kubectl-edit" using v1 at 2026-...`).
fn printed_manager(manager: &str, op: &Op) -> String {
    match op {
        Op::Apply => format!("{manager:?}"),
        Op::Update { api_version, time } => format!("{manager:?} using {api_version} at {time}"),
    }
}

/// The real server's 409 for an apply's conflicts (apimachinery's
/// `NewApplyConflict` with `getConflictMessage`): one line for one
/// conflict, else the conflicts grouped by manager in the managers' order.
pub(super) fn conflict_response(conflicts: &[Conflict]) -> Response<Body> {
    let message = match conflicts {
        [one] => format!(
            "Apply failed with 1 conflict: conflict with {}: {}",
            printed_manager(&one.manager, &one.op),
            printed(&one.path)
        ),
        _ => {
            let mut by_manager: BTreeMap<&str, (String, Vec<String>)> = BTreeMap::new();
            for c in conflicts {
                by_manager
                    .entry(&c.manager)
                    .or_insert_with(|| (printed_manager(&c.manager, &c.op), Vec::new()))
                    .1
                    .push(printed(&c.path));
            }
            let lines: Vec<String> = by_manager
                .values()
                .flat_map(|(m, paths)| {
                    std::iter::once(format!("conflicts with {m}:"))
                        .chain(paths.iter().map(|p| format!("- {p}")))
                })
                .collect();
            format!(
                "Apply failed with {} conflicts: {}",
                conflicts.len(),
                lines.join("\n")
            )
        }
    };
    let causes: Vec<Value> = conflicts
        .iter()
        .map(|c| {
            json!({
                "type": "FieldManagerConflict",
                "message": format!("conflict with {}", printed_manager(&c.manager, &c.op)),
                "field": printed(&c.path),
            })
        })
        .collect();
    json_response(
        StatusCode::CONFLICT,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": message, "reason": "Conflict",
            "details": {"causes": causes}, "code": 409
        }),
    )
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use serde_json::{json, Value};

    use super::*;

    fn rule(simple: &str) -> Value {
        json!({"apiVersion": "minimesh.io/v1alpha1", "kind": "DestinationRule",
               "metadata": {"name": "r", "namespace": "default", "resourceVersion": "3"},
               "spec": {"host": "backend", "trafficPolicy": {"loadBalancer": {"simple": simple}}}})
    }

    async fn body(r: Response<Body>) -> Value {
        let bytes = r.into_body().collect().await.expect("body").to_bytes();
        serde_json::from_slice(&bytes).expect("JSON")
    }

    const SIMPLE: &str = ".spec.trafficPolicy.loadBalancer.simple";

    /// Known answers: the real server's Status for one conflict with an
    /// applier, and for several with an applier and an updater.
    #[tokio::test]
    async fn conflicts_are_answered_as_the_api_server_words_them() {
        let mut owners = Owners::default();
        owners.applied("team-a", &rule("RANDOM"), &Value::Null);
        let found = owners.conflicts("team-b", &rule("ROUND_ROBIN"), &rule("RANDOM"));
        let v = body(conflict_response(&found)).await;
        assert_eq!(v["code"], 409);
        assert_eq!(v["reason"], "Conflict");
        assert_eq!(
            v["message"],
            format!("Apply failed with 1 conflict: conflict with \"team-a\": {SIMPLE}")
        );
        assert_eq!(
            v["details"]["causes"],
            json!([{"type": "FieldManagerConflict", "message": "conflict with \"team-a\"", "field": SIMPLE}])
        );

        let update = Op::Update {
            api_version: "minimesh.io/v1alpha1".into(),
            time: "2026-12-07T10:00:00Z".into(),
        };
        let mut other = rule("RANDOM");
        other["spec"]["host"] = "frontend".into();
        owners.updated("kubectl-edit", update, &rule("RANDOM"), &other);
        let mut wanted = rule("LEAST_REQUEST");
        wanted["spec"]["host"] = "web".into();
        let found = owners.conflicts("team-b", &wanted, &other);
        let v = body(conflict_response(&found)).await;
        assert_eq!(
            v["message"],
            format!("Apply failed with 2 conflicts: conflicts with \"kubectl-edit\" using minimesh.io/v1alpha1 at 2026-12-07T10:00:00Z:\n- .spec.host\nconflicts with \"team-a\":\n- {SIMPLE}")
        );
    }

    /// The same value applied by two managers is shared, no conflict; a
    /// forced apply takes the field; an object its only applier stops
    /// listing goes whole (with its defaults), a shared one stays; kubectl's client-side apply's fields pass
    /// to the server-side applier.
    #[test]
    fn ownership_is_shared_taken_and_given_up_as_applies_say() {
        let mut owners = Owners::default();
        owners.applied("team-a", &rule("RANDOM"), &Value::Null);
        assert!(owners
            .conflicts("team-b", &rule("RANDOM"), &rule("RANDOM"))
            .is_empty());
        owners.applied("team-b", &rule("RANDOM"), &rule("RANDOM"));
        // Forced: team-b alone owns the value it changed.
        assert_eq!(
            owners
                .conflicts("team-b", &rule("ROUND_ROBIN"), &rule("RANDOM"))
                .len(),
            1
        );
        owners.applied("team-b", &rule("ROUND_ROBIN"), &rule("RANDOM"));
        let back = owners.conflicts("team-a", &rule("RANDOM"), &rule("ROUND_ROBIN"));
        assert_eq!(
            back.iter().map(|c| c.manager.as_str()).collect::<Vec<_>>(),
            ["team-b"]
        );
        // team-a stops listing the policy: team-b owns it, it stays; then
        // team-b stops listing it too: it goes, with its empty parents.
        let host_only = json!({"spec": {"host": "backend"}});
        assert!(owners
            .applied("team-a", &host_only, &rule("ROUND_ROBIN"))
            .is_empty());
        let gone = owners.applied("team-b", &host_only, &rule("ROUND_ROBIN"));
        assert_eq!(
            gone.iter().map(printed).collect::<Vec<_>>(),
            [".spec.trafficPolicy"]
        );
        let mut obj = rule("ROUND_ROBIN");
        obj["spec"]["trafficPolicy"]["portLevelSettings"] = json!([]); // a default
        remove(&mut obj, &gone[0]);
        assert_eq!(obj["spec"], json!({"host": "backend"}));

        let mut csa = Owners::default();
        let update = Op::Update {
            api_version: "minimesh.io/v1alpha1".into(),
            time: "2026-12-07T10:00:00Z".into(),
        };
        csa.updated(CLIENT_SIDE_APPLY, update, &Value::Null, &rule("RANDOM"));
        assert_eq!(
            csa.conflicts("kubectl", &rule("ROUND_ROBIN"), &rule("RANDOM"))
                .len(),
            1
        );
        csa.migrate_client_side_apply("kubectl");
        assert!(csa
            .conflicts("kubectl", &rule("ROUND_ROBIN"), &rule("RANDOM"))
            .is_empty());
    }
}
