//! A small fake of the Kubernetes API server, served over real HTTP: list
//! (with resourceVersion), watch (ADDED/MODIFIED/DELETED events, BOOKMARKs,
//! an `ERROR` 410 Expired for a resourceVersion older than the compaction
//! point), get, create, replace (optimistic concurrency: 409 on a stale
//! resourceVersion), merge-patch of the status subresource, delete. Enough
//! of the protocol for kube-rs watchers, the status writer and Lease
//! election; it stores JSON and validates nothing, as an API server with a
//! permissive schema would. As the real one, it writes an EndpointSlice's
//! empty `endpoints` and `ports` as `null`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Method, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::sync::mpsc;

type Body = BoxBody<Bytes, Infallible>;

/// The collections the fake serves: (group, version, plural, kind).
/// Istio's DestinationRule comes last: served only when the fake is started
/// with Istio's CRD "installed".
const COLLECTIONS: [(&str, &str, &str, &str); 5] = [
    (
        "minimesh.io",
        "v1alpha1",
        "destinationrules",
        "DestinationRule",
    ),
    ("", "v1", "services", "Service"),
    ("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    ("coordination.k8s.io", "v1", "leases", "Lease"),
    (
        "networking.istio.io",
        "v1",
        "destinationrules",
        "DestinationRule",
    ),
];
const ISTIO: usize = 4;

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from a resourceVersion older than this get 410 Expired.
    compacted: u64,
    /// (collection, namespace, name) -> object.
    objects: BTreeMap<(usize, String, String), Value>,
    /// Every change: (resourceVersion, collection, event type, object).
    history: Vec<(u64, usize, &'static str, Value)>,
    /// Open watches: collection, sender of event lines, wants bookmarks.
    watches: Vec<(usize, mpsc::UnboundedSender<Bytes>, bool)>,
    /// "LIST plural", "WATCH plural rv", "PATCH-STATUS name", … in order.
    log: Vec<String>,
}

/// The fake API server; dropped with the test.
#[derive(Clone)]
pub struct FakeKube {
    inner: Arc<Mutex<Inner>>,
    pub addr: SocketAddr,
    istio: bool,
}

fn collection_of(api_version: &str, kind: &str) -> usize {
    COLLECTIONS
        .iter()
        .position(|(g, v, _, k)| {
            let av = if g.is_empty() {
                v.to_string()
            } else {
                format!("{g}/{v}")
            };
            av == api_version && *k == kind
        })
        .unwrap_or_else(|| panic!("fake API serves no {api_version} {kind}"))
}

impl FakeKube {
    /// Serves on `addr` until the test ends; sends bookmarks every 200 ms.
    pub async fn start(addr: SocketAddr) -> FakeKube {
        Self::start_with(addr, false).await
    }

    /// The same; with `istio`, Istio's DestinationRule CRD is installed too.
    pub async fn start_with(addr: SocketAddr, istio: bool) -> FakeKube {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind fake API");
        let fake = FakeKube {
            inner: Arc::default(),
            addr,
            istio,
        };
        let f = fake.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let f = f.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let f = f.clone();
                        async move { Ok::<_, Infallible>(f.handle(req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let f = fake.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                f.bookmark();
            }
        });
        fake
    }

    /// Writes a kubeconfig pointing at the fake.
    pub fn write_kubeconfig(&self, path: &Path) {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: test\n    namespace: default\ncurrent-context: fake\nusers:\n- name: test\n  user:\n    token: test-token\n",
                self.addr
            ),
        )
        .expect("write kubeconfig");
    }

    /// Creates or updates an object as `kubectl apply` would: the generation
    /// goes up when the spec changes; the status is kept.
    pub fn apply(&self, mut obj: Value) {
        let c = collection_of(
            obj["apiVersion"].as_str().unwrap_or(""),
            obj["kind"].as_str().unwrap_or(""),
        );
        let ns = obj["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_string();
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        let mut inner = self.inner.lock().expect("lock");
        let key = (c, ns.clone(), name);
        let previous = inner.objects.get(&key).cloned();
        obj["metadata"]["namespace"] = ns.into();
        let event = match &previous {
            None => {
                obj["metadata"]["generation"] = 1.into();
                obj["metadata"]["uid"] = format!("uid-{}", inner.rv + 1).into();
                obj["metadata"]["creationTimestamp"] = "2026-12-02T00:00:00Z".into();
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

    /// Compacts history up to now, as etcd does: every open watch gets an
    /// `ERROR` 410 Expired and ends, and no watch can resume from before now.
    pub fn expire(&self) {
        let mut inner = self.inner.lock().expect("lock");
        inner.compacted = inner.rv;
        let line = watch_line("ERROR", &gone(inner.rv, inner.rv));
        for (_, tx, _) in inner.watches.drain(..) {
            let _ = tx.send(line.clone());
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

    fn bookmark(&self) {
        let mut inner = self.inner.lock().expect("lock");
        let rv = inner.rv;
        inner.watches.retain(|(c, tx, bookmarks)| {
            if !bookmarks {
                return !tx.is_closed();
            }
            let (g, v, _, kind) = COLLECTIONS[*c];
            let obj = json!({
                "apiVersion": api_version(g, v), "kind": kind,
                "metadata": {"resourceVersion": rv.to_string()}
            });
            tx.send(watch_line("BOOKMARK", &obj)).is_ok()
        });
    }

    async fn handle(&self, req: http::Request<hyper::body::Incoming>) -> Response<Body> {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query: BTreeMap<String, String> = req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let Some((c, ns, name, sub)) = route(&path).filter(|r| r.0 != ISTIO || self.istio) else {
            return status_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            );
        };
        let plural = COLLECTIONS[c].2;
        match (method, name, sub.as_deref()) {
            (Method::GET, None, _)
                if query.get("watch").is_some_and(|w| w == "true" || w == "1") =>
            {
                let from: u64 = query
                    .get("resourceVersion")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let bookmarks = query
                    .get("allowWatchBookmarks")
                    .is_some_and(|b| b == "true");
                self.watch(c, ns, from, bookmarks, plural)
            }
            (Method::GET, None, _) => {
                let mut inner = self.inner.lock().expect("lock");
                inner.log.push(format!("LIST {plural}"));
                let items: Vec<Value> = inner
                    .objects
                    .iter()
                    .filter(|((oc, ons, _), _)| *oc == c && ns.as_ref().is_none_or(|n| n == ons))
                    .map(|(_, o)| {
                        let mut o = o.clone();
                        // Built-in kinds' list items carry no apiVersion/kind.
                        if COLLECTIONS[c].0 != "minimesh.io" {
                            if let Some(m) = o.as_object_mut() {
                                m.remove("apiVersion");
                                m.remove("kind");
                            }
                        }
                        o
                    })
                    .collect();
                let (g, v, _, kind) = COLLECTIONS[c];
                json_response(
                    StatusCode::OK,
                    &json!({
                        "apiVersion": api_version(g, v), "kind": format!("{kind}List"),
                        "metadata": {"resourceVersion": inner.rv.to_string()},
                        "items": items
                    }),
                )
            }
            // The object, or its status subresource (the whole object too).
            (Method::GET, Some(name), None | Some("status")) => {
                let inner = self.inner.lock().expect("lock");
                match inner
                    .objects
                    .get(&(c, ns.unwrap_or_default(), name.clone()))
                {
                    Some(o) => json_response(StatusCode::OK, o),
                    None => status_response(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{plural} \"{name}\" not found"),
                    ),
                }
            }
            (Method::POST, None, _) => {
                let Ok(mut obj) = serde_json::from_slice::<Value>(&body) else {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
                };
                let ns = ns.unwrap_or_default();
                let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
                let mut inner = self.inner.lock().expect("lock");
                inner.log.push(format!("CREATE {plural} {name}"));
                let key = (c, ns.clone(), name.clone());
                if inner.objects.contains_key(&key) {
                    return status_response(
                        StatusCode::CONFLICT,
                        "AlreadyExists",
                        &format!("{plural} \"{name}\" already exists"),
                    );
                }
                obj["metadata"]["namespace"] = ns.into();
                obj["metadata"]["generation"] = 1.into();
                let obj = inner.commit(key, "ADDED", obj);
                json_response(StatusCode::CREATED, &obj)
            }
            (Method::PUT, Some(name), None) => {
                let Ok(mut obj) = serde_json::from_slice::<Value>(&body) else {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
                };
                let mut inner = self.inner.lock().expect("lock");
                inner.log.push(format!("REPLACE {plural} {name}"));
                let key = (c, ns.unwrap_or_default(), name.clone());
                let Some(current) = inner.objects.get(&key) else {
                    return status_response(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{plural} \"{name}\" not found"),
                    );
                };
                if obj["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
                    return status_response(
                        StatusCode::CONFLICT,
                        "Conflict",
                        &format!("Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
                    );
                }
                obj["metadata"]["generation"] = current["metadata"]["generation"].clone();
                let obj = inner.commit(key, "MODIFIED", obj);
                json_response(StatusCode::OK, &obj)
            }
            (Method::PATCH, Some(name), Some("status")) => {
                let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
                };
                let mut inner = self.inner.lock().expect("lock");
                inner.log.push(format!("PATCH-STATUS {plural} {name}"));
                let key = (c, ns.unwrap_or_default(), name.clone());
                let Some(mut obj) = inner.objects.get(&key).cloned() else {
                    return status_response(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{plural} \"{name}\" not found"),
                    );
                };
                // The status subresource changes only status.
                if let Some(status) = patch.get("status") {
                    merge(&mut obj["status"], status);
                }
                let obj = inner.commit(key, "MODIFIED", obj);
                json_response(StatusCode::OK, &obj)
            }
            (Method::DELETE, Some(name), None) => {
                let mut inner = self.inner.lock().expect("lock");
                let key = (c, ns.unwrap_or_default(), name.clone());
                match inner.objects.get(&key).cloned() {
                    Some(obj) => {
                        let obj = inner.commit(key, "DELETED", obj);
                        json_response(StatusCode::OK, &obj)
                    }
                    None => status_response(StatusCode::NOT_FOUND, "NotFound", "not found"),
                }
            }
            _ => status_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not supported by the fake",
            ),
        }
    }

    fn watch(
        &self,
        c: usize,
        ns: Option<String>,
        from: u64,
        bookmarks: bool,
        plural: &str,
    ) -> Response<Body> {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let mut inner = self.inner.lock().expect("lock");
        inner.log.push(format!("WATCH {plural} {from}"));
        if from < inner.compacted {
            let _ = tx.send(watch_line("ERROR", &gone(from, inner.compacted)));
            drop(tx);
        } else {
            for (rv, hc, kind, obj) in &inner.history {
                if *rv > from
                    && *hc == c
                    && ns
                        .as_ref()
                        .is_none_or(|n| obj["metadata"]["namespace"] == *n.as_str())
                {
                    let _ = tx.send(watch_line(kind, obj));
                }
            }
            inner.watches.push((c, tx, bookmarks));
        }
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
            .map(|b| Ok::<_, Infallible>(Frame::data(b)));
        Response::builder()
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .expect("response")
    }
}

impl Inner {
    /// Stores (or, for DELETED, removes) an object at a new resourceVersion
    /// and tells the watches of its collection.
    fn commit(
        &mut self,
        key: (usize, String, String),
        event: &'static str,
        mut obj: Value,
    ) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = self.rv.to_string().into();
        let (g, v, _, kind) = COLLECTIONS[key.0];
        obj["apiVersion"] = api_version(g, v).into();
        obj["kind"] = kind.into();
        if kind == "EndpointSlice" {
            // As the real API server writes an empty list of its Go types
            // (no omitempty on these fields): `null`, not `[]`.
            for field in ["endpoints", "ports"] {
                if obj[field].as_array().is_none_or(Vec::is_empty) {
                    obj[field] = Value::Null;
                }
            }
        }
        if event == "DELETED" {
            self.objects.remove(&key);
        } else {
            self.objects.insert(key.clone(), obj.clone());
        }
        self.history.push((self.rv, key.0, event, obj.clone()));
        let line = watch_line(event, &obj);
        self.watches
            .retain(|(c, tx, _)| *c != key.0 || tx.send(line.clone()).is_ok());
        obj
    }
}

fn api_version(group: &str, version: &str) -> String {
    if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    }
}

/// What a request path addresses: collection, namespace, name, subresource.
type Target = (usize, Option<String>, Option<String>, Option<String>);

/// `/api/v1/...` or `/apis/{group}/{version}/...` -> what it addresses.
fn route(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
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

fn watch_line(kind: &str, obj: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": obj})).expect("json");
    line.push(b'\n');
    Bytes::from(line)
}

fn gone(asked: u64, oldest: u64) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("too old resource version: {asked} ({oldest})"),
        "reason": "Expired", "code": 410
    })
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
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

fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(v).expect("json"))).boxed())
        .expect("response")
}

fn status_response(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16()
        }),
    )
}
