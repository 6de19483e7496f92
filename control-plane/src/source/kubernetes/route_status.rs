//! Writes the Gateway API's status for what minimesh serves, through the
//! status subresource: each HTTPRoute's `status.parents` entries for the
//! parents minimesh serves (`controllerName: minimesh.io/gateway-controller`),
//! with the `Accepted` and `ResolvedRefs` conditions, keeping the entries
//! other controllers wrote (the list is read, minimesh's entries replaced,
//! and written back); and each Gateway of class `minimesh`'s `conditions`
//! (`Accepted`, `Programmed`) and `listeners[]` (`attachedRoutes` and their
//! conditions). Only the elected replica writes, only what changed; failed
//! writes are retried. A condition keeps its `lastTransitionTime` while its
//! status stays.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::{Timestamp, Unit};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::Client;
use serde_json::{json, Value};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::config::parse::{ObjectKey, K8S_GATEWAY_KIND};
use crate::config::status::{DesiredRouteStatus, Wanted};

/// The controller name minimesh writes its entries under.
pub const CONTROLLER: &str = "minimesh.io/gateway-controller";

fn resource(kind: &str) -> ApiResource {
    let (kind, plural) = match kind {
        K8S_GATEWAY_KIND => ("Gateway", "gateways"),
        _ => ("HTTPRoute", "httproutes"),
    };
    ApiResource {
        group: "gateway.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "gateway.networking.k8s.io/v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// `want`'s conditions with `observedGeneration`, and each one's
/// `lastTransitionTime` kept from `before` while its status stays.
fn stamped(want: &Value, before: Option<&Value>, generation: Option<i64>, now: &str) -> Vec<Value> {
    want.as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let since = before
                .and_then(|b| b.as_array())
                .and_then(|cs| cs.iter().find(|x| x["type"] == c["type"]))
                .filter(|x| x["status"] == c["status"])
                .and_then(|x| x["lastTransitionTime"].as_str())
                .unwrap_or(now);
            let mut c = c.clone();
            c["lastTransitionTime"] = since.into();
            c["observedGeneration"] = json!(generation.unwrap_or(0));
            c
        })
        .collect()
}

/// The entries to write: `want`'s, stamped, then the other controllers'
/// entries of `current`.
fn merged(want: &[Value], current: &[Value], generation: Option<i64>, now: &str) -> Vec<Value> {
    let ours = |e: &&Value| e["controllerName"] == CONTROLLER;
    let before: Vec<&Value> = current.iter().filter(ours).collect();
    let mut out: Vec<Value> = want
        .iter()
        .map(|w| {
            let was = before.iter().find(|b| b["parentRef"] == w["parentRef"]);
            let conditions = stamped(&w["conditions"], was.map(|b| &b["conditions"]), generation, now);
            json!({"parentRef": w["parentRef"], "controllerName": CONTROLLER, "conditions": conditions})
        })
        .collect();
    out.extend(current.iter().filter(|e| !ours(e)).cloned());
    out
}

/// A Gateway's status to write: `want`'s conditions and listeners, stamped
/// against the `current` status (listeners matched by name).
fn gateway_status(want: &Value, current: &Value, generation: Option<i64>, now: &str) -> Value {
    let listeners: Vec<Value> = want["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|l| {
            let was = current["listeners"]
                .as_array()
                .and_then(|ls| ls.iter().find(|x| x["name"] == l["name"]));
            let mut l = l.clone();
            l["conditions"] = stamped(
                &l["conditions"],
                was.map(|w| &w["conditions"]),
                generation,
                now,
            )
            .into();
            l
        })
        .collect();
    json!({
        "conditions": stamped(&want["conditions"], Some(&current["conditions"]), generation, now),
        "listeners": listeners,
    })
}

/// Writes HTTPRoute and Gateway status while `leader` is true.
pub async fn run(
    client: Client,
    mut desired: watch::Receiver<Arc<DesiredRouteStatus>>,
    mut leader: watch::Receiver<bool>,
) {
    let mut written: BTreeMap<ObjectKey, Wanted> = BTreeMap::new();
    let mut retry = tokio::time::interval(Duration::from_secs(5));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if *leader.borrow_and_update() {
            let want = desired.borrow_and_update().clone();
            written.retain(|k, _| want.contains_key(k));
            for (key, wanted) in want.iter() {
                if written.get(key) == Some(wanted) {
                    continue;
                }
                let res = resource(key.kind);
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), &key.namespace, &res);
                let current = match api.get_status(&key.name).await {
                    Ok(o) => o,
                    Err(kube::Error::Api(s)) if s.code == 404 => continue,
                    Err(e) => {
                        warn!(object = %key, error = %e, "reading status failed; will retry");
                        continue;
                    }
                };
                let now = Timestamp::now()
                    .round(Unit::Second)
                    .unwrap_or_else(|_| Timestamp::now())
                    .to_string();
                let generation = current.metadata.generation;
                let patch = match wanted {
                    Wanted::Parents(entries) => {
                        let parents = current.data["status"]["parents"]
                            .as_array()
                            .cloned()
                            .unwrap_or_default();
                        json!({"status": {"parents": merged(entries, &parents, generation, &now)}})
                    }
                    Wanted::Gateway(st) => json!({
                        "status": gateway_status(st, &current.data["status"], generation, &now)
                    }),
                };
                match api
                    .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        debug!(object = %key, "status written");
                        written.insert(key.clone(), wanted.clone());
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => {
                        warn!(object = %key, error = %e, "writing status failed; will retry")
                    }
                }
            }
        } else {
            written.clear();
        }
        tokio::select! {
            r = desired.changed() => if r.is_err() { return },
            r = leader.changed() => if r.is_err() { return },
            _ = retry.tick() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_controllers_entries_stay_and_unchanged_conditions_keep_their_time() {
        let parent = json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "default", "name": "gw"});
        let want = [json!({"parentRef": parent, "conditions": [
            {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "attached"},
            {"type": "ResolvedRefs", "status": "False", "reason": "BackendNotFound", "message": "no Service default/x"},
        ]})];
        let current = [
            json!({"parentRef": parent, "controllerName": CONTROLLER, "conditions": [
                {"type": "Accepted", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "ResolvedRefs", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ]}),
            json!({"parentRef": {"name": "other"}, "controllerName": "example.com/other", "conditions": []}),
        ];
        let out = merged(&want, &current, Some(3), "2026-12-07T00:00:00Z");
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(
            out[0]["conditions"][1]["lastTransitionTime"],
            "2026-12-07T00:00:00Z"
        );
        assert_eq!(out[0]["conditions"][1]["observedGeneration"], 3);
        assert_eq!(out[1]["controllerName"], "example.com/other");
    }

    #[test]
    fn a_gateways_listeners_keep_their_conditions_time_by_name() {
        let cond = |s: &str| json!([{"type": "Programmed", "status": s, "reason": "Programmed"}]);
        let want = json!({"conditions": cond("True"), "listeners": [
            {"name": "http", "attachedRoutes": 2, "conditions": cond("True")},
            {"name": "new", "attachedRoutes": 0, "conditions": cond("True")},
        ]});
        let before = json!([{"type": "Programmed", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
        let current =
            json!({"conditions": before, "listeners": [{"name": "http", "conditions": before}]});
        let out = gateway_status(&want, &current, Some(2), "2026-12-07T00:00:00Z");
        assert_eq!(
            out["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(
            out["listeners"][0]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(out["listeners"][0]["attachedRoutes"], 2);
        assert_eq!(
            out["listeners"][1]["conditions"][0]["lastTransitionTime"],
            "2026-12-07T00:00:00Z"
        );
        assert_eq!(
            out["listeners"][1]["conditions"][0]["observedGeneration"],
            2
        );
    }
}
