//! Writes each HTTPRoute's `status.parents` entries for the parents
//! minimesh serves (`controllerName: minimesh.io/gateway-controller`), the
//! Gateway API's `Accepted` and `ResolvedRefs` conditions, through the
//! status subresource. Entries other controllers wrote are kept: the list
//! is read, minimesh's entries replaced, and written back. Only the
//! elected replica writes, only what changed; failed writes are retried.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::{Timestamp, Unit};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::Client;
use serde_json::{json, Value};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::config::parse::ObjectKey;

/// The controller name minimesh writes its entries under.
pub const CONTROLLER: &str = "minimesh.io/gateway-controller";

/// What each HTTPRoute's entries should say: its `status.parents` entries
/// for minimesh's parents, each `{parentRef, controllerName, conditions}`
/// with conditions of `{type, status, reason, message}`.
pub type DesiredRouteStatus = BTreeMap<ObjectKey, Vec<Value>>;

fn resource() -> ApiResource {
    ApiResource {
        group: "gateway.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "gateway.networking.k8s.io/v1".into(),
        kind: "HTTPRoute".into(),
        plural: "httproutes".into(),
    }
}

/// The entries to write: `want`'s, with `observedGeneration` and each
/// condition's `lastTransitionTime` (kept from `before` while its status
/// stays), then the other controllers' entries of `current`.
fn merged(want: &[Value], current: &[Value], generation: Option<i64>, now: &str) -> Vec<Value> {
    let ours = |e: &&Value| e["controllerName"] == CONTROLLER;
    let before: Vec<&Value> = current.iter().filter(ours).collect();
    let mut out: Vec<Value> = want
        .iter()
        .map(|w| {
            let was = before.iter().find(|b| b["parentRef"] == w["parentRef"]);
            let conditions: Vec<Value> = w["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    let since = was
                        .and_then(|b| b["conditions"].as_array())
                        .and_then(|cs| cs.iter().find(|x| x["type"] == c["type"]))
                        .filter(|x| x["status"] == c["status"])
                        .and_then(|x| x["lastTransitionTime"].as_str())
                        .unwrap_or(now);
                    let mut c = c.clone();
                    c["lastTransitionTime"] = since.into();
                    c["observedGeneration"] = json!(generation.unwrap_or(0));
                    c
                })
                .collect();
            json!({"parentRef": w["parentRef"], "controllerName": CONTROLLER, "conditions": conditions})
        })
        .collect();
    out.extend(current.iter().filter(|e| !ours(e)).cloned());
    out
}

/// Writes HTTPRoute status while `leader` is true.
pub async fn run(
    client: Client,
    mut desired: watch::Receiver<Arc<DesiredRouteStatus>>,
    mut leader: watch::Receiver<bool>,
) {
    let res = resource();
    let mut written: BTreeMap<ObjectKey, Vec<Value>> = BTreeMap::new();
    let mut retry = tokio::time::interval(Duration::from_secs(5));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if *leader.borrow_and_update() {
            let want = desired.borrow_and_update().clone();
            written.retain(|k, _| want.contains_key(k));
            for (key, entries) in want.iter() {
                if written.get(key) == Some(entries) {
                    continue;
                }
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), &key.namespace, &res);
                let current = match api.get_status(&key.name).await {
                    Ok(o) => o,
                    Err(kube::Error::Api(s)) if s.code == 404 => continue,
                    Err(e) => {
                        warn!(route = %key, error = %e, "reading HTTPRoute status failed; will retry");
                        continue;
                    }
                };
                let now = Timestamp::now()
                    .round(Unit::Second)
                    .unwrap_or_else(|_| Timestamp::now())
                    .to_string();
                let parents = current.data["status"]["parents"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let all = merged(entries, &parents, current.metadata.generation, &now);
                let patch = json!({"status": {"parents": all}});
                match api
                    .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        debug!(route = %key, "HTTPRoute status written");
                        written.insert(key.clone(), entries.clone());
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => {
                        warn!(route = %key, error = %e, "writing HTTPRoute status failed; will retry")
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
}
