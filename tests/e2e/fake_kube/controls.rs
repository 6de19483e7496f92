//! What a test does to the fake beside the API: kubeconfigs for kubectl
//! and the control plane, objects put, read and deleted directly, history
//! compacted, watches capped or dropped, requests throttled or forbidden,
//! and the log of requests served.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use super::auth::{ADMIN_TOKEN, CONTROL_PLANE_TOKEN};
use super::wire::{gone, now, watch_line};
use super::{cluster_scoped, collection_of, FakeKube, COLLECTIONS};

impl FakeKube {
    /// Writes a kubeconfig pointing at the fake, as the cluster's admin
    /// (kubectl in the tests: every request allowed).
    pub fn write_kubeconfig(&self, path: &Path) {
        self.write_kubeconfig_with(path, ADMIN_TOKEN);
    }

    /// Writes a kubeconfig pointing at the fake, as the control plane's
    /// service account: its requests are authorized by
    /// `deploy/base/rbac.yaml`, as on a cluster.
    pub fn write_control_plane_kubeconfig(&self, path: &Path) {
        self.write_kubeconfig_with(path, CONTROL_PLANE_TOKEN);
    }

    fn write_kubeconfig_with(&self, path: &Path, token: &str) {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: test\n    namespace: default\ncurrent-context: fake\nusers:\n- name: test\n  user:\n    token: {token}\n",
                self.addr
            ),
        )
        .expect("write kubeconfig");
    }

    /// The requests RBAC refused so far, each with the server's message.
    pub fn denied(&self) -> Vec<String> {
        self.denied.lock().expect("lock").clone()
    }

    /// Creates or updates an object as `kubectl apply` would: the generation
    /// goes up when the spec changes; the status is kept.
    pub fn apply(&self, mut obj: Value) {
        let c = collection_of(
            obj["apiVersion"].as_str().unwrap_or(""),
            obj["kind"].as_str().unwrap_or(""),
        );
        let ns = if cluster_scoped(c) {
            String::new()
        } else {
            obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string()
        };
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        let mut inner = self.inner.lock().expect("lock");
        let key = (c, ns.clone(), name);
        let previous = inner.objects.get(&key).cloned();
        if !ns.is_empty() {
            obj["metadata"]["namespace"] = ns.into();
        }
        let event = match &previous {
            None => {
                obj["metadata"]["generation"] = 1.into();
                obj["metadata"]["uid"] = format!("uid-{}", inner.rv + 1).into();
                obj["metadata"]["creationTimestamp"] = now().into();
                "ADDED"
            }
            Some(p) => {
                let generation = p["metadata"]["generation"].as_i64().unwrap_or(1);
                let changed = p.get("spec") != obj.get("spec");
                obj["metadata"]["generation"] = (generation + i64::from(changed)).into();
                obj["metadata"]["uid"] = p["metadata"]["uid"].clone();
                obj["metadata"]["creationTimestamp"] = p["metadata"]["creationTimestamp"].clone();
                if let Some(status) = p.get("status") {
                    obj["status"] = status.clone();
                }
                "MODIFIED"
            }
        };
        inner.commit(key, event, obj);
    }

    /// From now on, the caller holds namespaced Roles only: a list or
    /// watch of a namespaced kind across all namespaces is 403 Forbidden
    /// (served or not: authorization comes before routing).
    pub fn namespaced_roles(&self) {
        self.namespaced_roles
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// From now on, every watch ends after `cap` at most (its own
    /// `timeoutSeconds` if sooner), as the real server ends a watch at its
    /// timeout: the client must watch again from the last resourceVersion.
    pub fn cap_watches(&self, cap: Duration) {
        self.watch_cap_ms
            .store(cap.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// From now on, BOOKMARKs come `every` apart instead of the real
    /// server's minute (the bookmark two seconds before a watch's deadline
    /// stays), so that a test sees a client's resourceVersion kept current
    /// in a second.
    pub fn bookmark_every(&self, every: Duration) {
        self.bookmark_every_ms.store(
            every.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.inner.lock().expect("lock").rv
    }

    /// Whether every open watch of `plural` that asked for BOOKMARKs has
    /// been sent one at `rv` or later.
    pub fn bookmarked_at(&self, plural: &str, rv: u64) -> bool {
        let inner = self.inner.lock().expect("lock");
        let mut watches = inner
            .watches
            .iter()
            .filter(|w| w.bookmarks && COLLECTIONS[w.c].2 == plural)
            .peekable();
        watches.peek().is_some() && watches.all(|w| w.bookmarked >= rv)
    }

    /// From now on, answers every `n`-th request `429 Too Many Requests`
    /// with `Retry-After: 1`, as a busy API server does (0: never).
    pub fn throttle_every(&self, n: usize) {
        self.throttle.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Routes Service `namespace/name` to `addr`, as its endpoints would.
    pub fn route_service(&self, namespace: &str, name: &str, addr: SocketAddr) {
        self.services
            .lock()
            .expect("lock")
            .insert(format!("{namespace}/{name}"), addr);
    }

    /// Deletes an object.
    pub fn delete(&self, api_version: &str, kind: &str, ns: &str, name: &str) {
        let c = collection_of(api_version, kind);
        let mut inner = self.inner.lock().expect("lock");
        let key = (c, ns.to_string(), name.to_string());
        if let Some(obj) = inner.objects.get(&key).cloned() {
            inner.commit(key, "DELETED", obj);
        }
    }

    /// The stored object.
    pub fn get(&self, api_version: &str, kind: &str, ns: &str, name: &str) -> Option<Value> {
        let c = collection_of(api_version, kind);
        let inner = self.inner.lock().expect("lock");
        inner
            .objects
            .get(&(c, ns.to_string(), name.to_string()))
            .cloned()
    }

    /// Every stored object of a kind.
    pub fn list(&self, api_version: &str, kind: &str) -> Vec<Value> {
        let c = collection_of(api_version, kind);
        let inner = self.inner.lock().expect("lock");
        inner
            .objects
            .iter()
            .filter(|((oc, _, _), _)| *oc == c)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// Compacts history up to now, as etcd does: every open watch gets an
    /// `ERROR` 410 Expired and ends, and no watch can resume from before now.
    pub fn expire(&self) {
        let mut inner = self.inner.lock().expect("lock");
        inner.compacted = inner.rv;
        let line = watch_line("ERROR", &gone(inner.rv, inner.rv));
        for w in inner.watches.drain(..) {
            let _ = w.tx.send(line.clone());
        }
    }

    /// Ends every open watch without an error (a dropped connection) and
    /// compacts history up to now: only a client that kept its
    /// resourceVersion current (bookmarks) resumes without a relist.
    pub fn drop_watches_and_compact(&self) {
        let mut inner = self.inner.lock().expect("lock");
        inner.compacted = inner.rv;
        inner.watches.clear();
    }

    /// Advances the resourceVersion with changes to a collection nobody here watches.
    pub fn churn_unwatched(&self, n: usize) {
        for i in 0..n {
            self.apply(json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": format!("churn-{i}"), "namespace": "kube-system"},
                "spec": {"holderIdentity": format!("x-{}", i % 7)}
            }));
        }
    }

    /// Requests served so far, one line each ("LIST services", "WATCH services 12", …).
    pub fn log(&self) -> Vec<String> {
        self.inner.lock().expect("lock").log.clone()
    }

    /// How many log lines start with `prefix`.
    pub fn count(&self, prefix: &str) -> usize {
        self.log().iter().filter(|l| l.starts_with(prefix)).count()
    }
}
