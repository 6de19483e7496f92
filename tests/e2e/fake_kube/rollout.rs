//! Admission as the fake runs it for a create or an update (the webhooks'
//! inputs gathered from the store: configurations, Services, the
//! namespace's labels), and what the Deployment and ReplicaSet controllers
//! do with a Deployment: its Pods, named by `generateName` after admission.

use serde_json::{json, Value};

use super::wire::now;
use super::{admission, FakeKube, COLLECTIONS, MUTATING_WEBHOOKS, NAMESPACES, PODS, WEBHOOKS};

impl FakeKube {
    /// Runs admission for a create or an update of collection `c`: the
    /// mutating webhooks may change `object`.
    pub(super) async fn admit(
        &self,
        c: usize,
        operation: &str,
        object: &mut Value,
        old_object: Option<&Value>,
    ) -> Result<Vec<String>, admission::Refused> {
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let (mutating, validating, services, namespace_labels) = {
            let inner = self.inner.lock().expect("lock");
            let of = |kind: usize| -> Vec<Value> {
                inner
                    .objects
                    .iter()
                    .filter(|((oc, _, _), _)| *oc == kind)
                    .map(|(_, o)| o.clone())
                    .collect()
            };
            // A namespace's labels, with the one the API server sets on all.
            let mut labels = inner
                .objects
                .get(&(NAMESPACES, String::new(), namespace.clone()))
                .map(|n| n["metadata"]["labels"].clone())
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            labels["kubernetes.io/metadata.name"] = namespace.clone().into();
            (
                of(MUTATING_WEBHOOKS),
                of(WEBHOOKS),
                self.services.lock().expect("lock").clone(),
                labels,
            )
        };
        let (group, version, resource, kind) = COLLECTIONS[c];
        let attempt = admission::Attempt {
            group,
            version,
            resource,
            kind,
            namespace: &namespace,
            name: &name,
            operation,
            old_object,
        };
        admission::admit(
            &mutating,
            &validating,
            &services,
            &namespace_labels,
            &attempt,
            object,
        )
        .await
    }

    /// What the Deployment and ReplicaSet controllers do, in one step: the
    /// pods of `deployment` (those of an older template deleted) created
    /// through admission, as the controller's requests are. A pod refused
    /// is logged ("FAILEDCREATE pod: reason"), as the controller's Event.
    pub(super) async fn roll_out(&self, deployment: &Value) {
        let ns = deployment["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let name = deployment["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let revision = deployment["metadata"]["generation"].as_i64().unwrap_or(1);
        {
            let mut inner = self.inner.lock().expect("lock");
            let old: Vec<(usize, String, String)> = inner
                .objects
                .iter()
                .filter(|((c, ons, _), o)| {
                    *c == PODS
                        && *ons == ns
                        && o["metadata"]["ownerReferences"][0]["name"] == name.as_str()
                })
                .map(|(k, _)| k.clone())
                .collect();
            for key in old {
                if let Some(obj) = inner.objects.get(&key).cloned() {
                    inner.commit(key, "DELETED", obj);
                }
            }
        }
        let template = &deployment["spec"]["template"];
        for i in 0..deployment["spec"]["replicas"].as_u64().unwrap_or(1) {
            // A ReplicaSet names its pods by `generateName`: admission sees
            // no name; the API server makes one after it, as here.
            let generate = format!("{name}-{revision:x}f5c9d-");
            let pod_name = format!("{generate}{i}x7kq");
            let mut pod = json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "generateName": generate, "namespace": ns,
                    "labels": template["metadata"]["labels"],
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name, "uid": deployment["metadata"]["uid"], "controller": true}],
                },
                "spec": template["spec"],
            });
            if let Some(a) = template["metadata"]["annotations"].as_object() {
                pod["metadata"]["annotations"] = Value::Object(a.clone());
            }
            match self.admit(PODS, "CREATE", &mut pod, None).await {
                Ok(_) => {
                    pod["metadata"]["name"] = pod_name.clone().into();
                    let mut inner = self.inner.lock().expect("lock");
                    pod["metadata"]["uid"] = format!("uid-{}", inner.rv + 1).into();
                    pod["metadata"]["creationTimestamp"] = now().into();
                    inner.commit((PODS, ns.clone(), pod_name), "ADDED", pod);
                }
                Err(r) => {
                    let mut inner = self.inner.lock().expect("lock");
                    inner.log.push(format!(
                        "FAILEDCREATE {pod_name}: {}",
                        r.status["message"].as_str().unwrap_or("")
                    ));
                }
            }
        }
    }
}
