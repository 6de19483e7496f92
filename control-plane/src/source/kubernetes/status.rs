//! Writes each minimesh.io DestinationRule's `status` (the `Accepted` and
//! `Warnings` conditions, `observedGeneration`, the policy in force, the
//! last good spec) through the status subresource, and an Event on the rule
//! each time a new version is accepted or refused (or its verdict changes).
//! Only the elected replica writes; a write is made only when what it would
//! say changed, and failed writes are retried.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::{Timestamp, Unit};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Client;
use serde_json::json;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::config::crd::{Condition, LastGood, RuleStatusResource};
use crate::config::parse::ObjectKey;
use crate::config::status::RuleStatus;
use crate::store::Store;

/// What one rule's status should say.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    /// The generation it describes.
    pub generation: Option<i64>,
    /// The rule's `metadata.uid`.
    pub uid: Option<String>,
    /// `Accepted` condition status.
    pub accepted: bool,
    /// One word: `Accepted`, `Invalid`, `Conflict`, `NoService`.
    pub reason: String,
    /// Detail naming the field and the reason.
    pub message: String,
    /// The policy in force (of the last good version).
    pub policy: Option<String>,
    /// What the `Warnings` condition lists: fields accepted without effect,
    /// Istio rules this one overrides.
    pub warnings: Vec<String>,
    /// The current version when it is valid (kept in the status, for a
    /// replica that starts after an invalid version was applied).
    pub last_good: Option<LastGood>,
}

/// Desired status of every minimesh.io rule, by object.
pub type DesiredStatus = BTreeMap<ObjectKey, Desired>;

/// The API version whose rules get a status (Istio's rules belong to Istio).
pub const STATUS_API_VERSION: &str = "minimesh.io/v1alpha1";

/// Computes the status of every rule object from the store and the
/// translation's verdicts.
pub fn desired(store: &Store, verdicts: &BTreeMap<ObjectKey, RuleStatus>) -> DesiredStatus {
    let mut out = DesiredStatus::new();
    for (key, seen) in &store.rule_objects {
        if seen.api_version != STATUS_API_VERSION {
            continue;
        }
        let in_force = store.rules.get(key).map(|(r, _)| r);
        let policy = in_force.map(|r| r.resolved.policy.as_str().to_string());
        // The fields' warnings are the current version's: none when it is
        // invalid (the version in force is an older one).
        let mut warnings = match (&seen.error, in_force) {
            (None, Some(r)) => r.warnings.clone(),
            _ => vec![],
        };
        warnings.extend(
            verdicts
                .get(key)
                .into_iter()
                .flat_map(|v| v.warnings.clone()),
        );
        let last_good = match (&seen.error, in_force) {
            (None, Some(r)) => Some(LastGood {
                generation: seen.generation,
                spec: r.rule.spec.clone(),
            }),
            _ => None,
        };
        let d = if let Some(e) = &seen.error {
            let mut message = match &e.field {
                Some(f) => format!("{f}: {}", e.reason),
                None => e.reason.clone(),
            };
            if in_force.is_some() {
                message.push_str("; the previous good version stays in force");
            }
            Desired {
                generation: seen.generation,
                uid: seen.uid.clone(),
                accepted: false,
                reason: "Invalid".into(),
                message,
                policy,
                warnings,
                last_good,
            }
        } else {
            match verdicts.get(key) {
                Some(v) => Desired {
                    generation: seen.generation,
                    uid: seen.uid.clone(),
                    accepted: v.accepted,
                    reason: v.reason.clone(),
                    message: if v.message.is_empty() && !v.clusters.is_empty() {
                        format!("applied to {}", v.clusters.join(", "))
                    } else if v.message.is_empty() {
                        "applied".into()
                    } else {
                        v.message.clone()
                    },
                    policy: if v.accepted { policy } else { None },
                    warnings,
                    last_good,
                },
                None => Desired {
                    generation: seen.generation,
                    uid: seen.uid.clone(),
                    accepted: true,
                    reason: "Accepted".into(),
                    message: "applied".into(),
                    policy,
                    warnings,
                    last_good,
                },
            }
        };
        out.insert(key.clone(), d);
    }
    out
}

/// The conditions stored on rule `name`, by type: status and when it last
/// changed; empty when it has none or cannot be read (then a transition is
/// dated now).
async fn stored_transitions(api: &Api<DynamicObject>, name: &str) -> (Transitions, Verdict) {
    let Ok(obj) = api.get_status(name).await else {
        return Default::default();
    };
    let status = &obj.data["status"];
    let accepted = status["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Accepted"));
    let verdict = Verdict {
        generation: status["observedGeneration"].as_i64(),
        accepted: accepted.map(|c| c["status"] == "True"),
        reason: accepted.and_then(|c| c["reason"].as_str().map(str::to_string)),
    };
    let transitions = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            Some((
                c["type"].as_str()?.to_string(),
                (
                    c["status"] == "True",
                    c["lastTransitionTime"].as_str()?.to_string(),
                ),
            ))
        })
        .collect();
    (transitions, verdict)
}

/// What a written status said of a version: an Event is published when
/// the next one says something else.
#[derive(Clone, Debug, Default, PartialEq)]
struct Verdict {
    generation: Option<i64>,
    accepted: Option<bool>,
    reason: Option<String>,
}

impl Verdict {
    fn of(d: &Desired) -> Self {
        Verdict {
            generation: d.generation,
            accepted: Some(d.accepted),
            reason: Some(d.reason.clone()),
        }
    }
}

/// The Event for a rule's new verdict: Normal when accepted, Warning not.
fn event(d: &Desired) -> Event {
    let mut note = d.message.clone();
    if note.len() > 1000 {
        let mut end = 1000;
        while !note.is_char_boundary(end) {
            end -= 1;
        }
        note.truncate(end);
    }
    Event {
        type_: if d.accepted {
            EventType::Normal
        } else {
            EventType::Warning
        },
        reason: d.reason.clone(),
        note: Some(note),
        action: "Validate".into(),
        secondary: None,
    }
}

/// Each condition's status and the time it last changed, by type.
type Transitions = BTreeMap<String, (bool, String)>;

/// The conditions of `d`: (type, status, reason, message).
fn conditions(d: &Desired) -> [(&'static str, bool, String, String); 2] {
    [
        ("Accepted", d.accepted, d.reason.clone(), d.message.clone()),
        (
            "Warnings",
            !d.warnings.is_empty(),
            if d.warnings.is_empty() {
                "NoWarnings"
            } else {
                "HasWarnings"
            }
            .into(),
            d.warnings.join("; "),
        ),
    ]
}

/// Writes status while `leader` is true.
pub async fn run(
    client: Client,
    identity: String,
    mut desired: watch::Receiver<Arc<DesiredStatus>>,
    mut leader: watch::Receiver<bool>,
) {
    let resource = super::watched()
        .into_iter()
        .map(|w| w.resource)
        .find(|r| r.api_version == STATUS_API_VERSION)
        .expect("minimesh.io rules are watched");
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "minimesh-control-plane".into(),
            instance: Some(identity),
        },
    );
    // What was written, with each condition's last transition.
    let mut written: BTreeMap<ObjectKey, (Desired, Transitions)> = BTreeMap::new();
    let mut retry = tokio::time::interval(Duration::from_secs(5));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if *leader.borrow_and_update() {
            let want = desired.borrow_and_update().clone();
            written.retain(|k, _| want.contains_key(k));
            for (key, d) in want.iter() {
                let previous = written.get(key);
                if previous.is_some_and(|(p, _)| p == d) {
                    continue;
                }
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), &key.namespace, &resource);
                // A replica that has written nothing for this rule (it has
                // just been elected) reads what the last leader wrote, so
                // that a condition whose status did not change keeps the
                // time it last changed.
                let (before, said) = match previous {
                    Some((p, t)) => (t.clone(), Verdict::of(p)),
                    None => stored_transitions(&api, &key.name).await,
                };
                let now = Timestamp::now()
                    .round(Unit::Second)
                    .unwrap_or_else(|_| Timestamp::now())
                    .to_string();
                let mut transitions = Transitions::new();
                let conditions = conditions(d).map(|(type_, status, reason, message)| {
                    let since = match before.get(type_) {
                        Some((was, t)) if *was == status => t.clone(),
                        _ => now.clone(),
                    };
                    transitions.insert(type_.to_string(), (status, since.clone()));
                    Condition {
                        type_: type_.into(),
                        status: if status { "True" } else { "False" }.into(),
                        reason,
                        message,
                        observed_generation: d.generation,
                        last_transition_time: since,
                    }
                });
                let status = RuleStatusResource {
                    observed_generation: d.generation,
                    policy: d.policy.clone(),
                    conditions: conditions.to_vec(),
                    last_good: d.last_good.clone(),
                };
                let patch = json!({ "status": status });
                match api
                    .patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        debug!(rule = %key, accepted = d.accepted, reason = d.reason, "status written");
                        written.insert(key.clone(), (d.clone(), transitions));
                        if said != Verdict::of(d) {
                            let reference = ObjectReference {
                                api_version: Some(STATUS_API_VERSION.into()),
                                kind: Some("DestinationRule".into()),
                                name: Some(key.name.clone()),
                                namespace: Some(key.namespace.clone()),
                                uid: d.uid.clone(),
                                ..Default::default()
                            };
                            if let Err(e) = recorder.publish(&event(d), &reference).await {
                                warn!(rule = %key, error = %e, "publishing an Event failed");
                            }
                        }
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {} // deleted meanwhile
                    Err(e) => warn!(rule = %key, error = %e, "writing status failed; will retry"),
                }
            }
        } else {
            // A new leader rewrites everything it is not sure of.
            written.clear();
        }
        tokio::select! {
            r = desired.changed() => if r.is_err() { return },
            r = leader.changed() => if r.is_err() { return },
            _ = retry.tick() => {}
        }
    }
}
