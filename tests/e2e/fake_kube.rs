//! A small fake of the Kubernetes API server, served over real HTTP: list
//! (with resourceVersion), watch (ADDED/MODIFIED/DELETED events, BOOKMARKs,
//! an `ERROR` 410 Expired for a resourceVersion older than the compaction
//! point), get, create, replace (optimistic concurrency: 409 on a stale
//! resourceVersion), merge-patch of an object and of its status
//! subresource, delete. Enough of the protocol for kube-rs watchers, the
//! status writer and Lease election, and (`kubectl.rs`) for the real
//! kubectl: discovery, OpenAPI v3, Tables, field selectors. Creates and
//! updates go through validating admission webhooks over HTTPS
//! (`admission.rs`); otherwise it stores JSON and validates nothing, as an
//! API server with a permissive schema would. As the real one, it writes an
//! EndpointSlice's empty `endpoints` and `ports` as `null`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Method, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::sync::mpsc;

mod admission;
mod auth;
mod kubectl;
pub mod rbac;
mod reads;
mod rollout;
pub mod schema;
pub mod wire;
mod writes;

use auth::{ADMIN_TOKEN, CONTROL_PLANE_TOKEN};
use writes::{conflict, PatchType};

use wire::{
    api_version, bad_selector, gone, json_response, label_match, merge, now, percent_decode, route,
    status_response, watch_line,
};

type Body = BoxBody<Bytes, Infallible>;

/// The collections the fake serves: (group, version, plural, kind).
/// Istio's kinds ([`ISTIO`]) are served only when the fake is started with
/// Istio's CRDs "installed".
const COLLECTIONS: [(&str, &str, &str, &str); 20] = [
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
    ("", "v1", "secrets", "Secret"),
    (
        "admissionregistration.k8s.io",
        "v1",
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
    ),
    ("events.k8s.io", "v1", "events", "Event"),
    (
        "admissionregistration.k8s.io",
        "v1",
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
    ),
    ("", "v1", "namespaces", "Namespace"),
    ("", "v1", "pods", "Pod"),
    ("apps", "v1", "deployments", "Deployment"),
    ("", "v1", "configmaps", "ConfigMap"),
    (
        "minimesh.io",
        "v1alpha1",
        "peerauthentications",
        "PeerAuthentication",
    ),
    ("", "v1", "serviceaccounts", "ServiceAccount"),
    (
        "networking.istio.io",
        "v1",
        "virtualservices",
        "VirtualService",
    ),
    ("networking.istio.io", "v1", "gateways", "Gateway"),
    ("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute"),
    ("gateway.networking.k8s.io", "v1", "gateways", "Gateway"),
    (
        "minimesh.io",
        "v1alpha1",
        "virtualservices",
        "VirtualService",
    ),
];
/// Istio's and the Gateway API's collections: served only when the fake
/// has their CRDs.
const ISTIO: [usize; 5] = [4, 15, 16, 17, 18];
const WEBHOOKS: usize = 6;
const MUTATING_WEBHOOKS: usize = 8;
const NAMESPACES: usize = 9;
const PODS: usize = 10;
const DEPLOYMENTS: usize = 11;

/// Whether a collection's objects live outside namespaces.
fn cluster_scoped(c: usize) -> bool {
    [WEBHOOKS, MUTATING_WEBHOOKS, NAMESPACES].contains(&c)
}

/// An open watch: what it selects, where its event lines go.
struct Watch {
    c: usize,
    tx: mpsc::UnboundedSender<Bytes>,
    bookmarks: bool,
    /// Only this namespace's objects (a namespaced watch).
    namespace: Option<String>,
    /// Only the object of this name (`fieldSelector=metadata.name=...`).
    name: Option<String>,
    /// Only objects whose labels match (`labelSelector`).
    labels: Option<String>,
}

impl Watch {
    fn selects(&self, c: usize, obj: &Value) -> bool {
        self.c == c
            && self
                .namespace
                .as_ref()
                .is_none_or(|n| obj["metadata"]["namespace"] == *n.as_str())
            && self
                .name
                .as_ref()
                .is_none_or(|n| obj["metadata"]["name"] == *n.as_str())
            && self
                .labels
                .as_ref()
                .is_none_or(|l| label_match(l, &obj["metadata"]["labels"]))
    }
}

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from a resourceVersion older than this get 410 Expired.
    compacted: u64,
    /// (collection, namespace, name) -> object.
    objects: BTreeMap<(usize, String, String), Value>,
    /// Every change: (resourceVersion, collection, event type, object).
    history: Vec<(u64, usize, &'static str, Value)>,
    /// Open watches.
    watches: Vec<Watch>,
    /// "LIST plural", "WATCH plural rv", "PATCH-STATUS name", … in order.
    log: Vec<String>,
}

/// The fake API server; dropped with the test.
#[derive(Clone)]
pub struct FakeKube {
    inner: Arc<Mutex<Inner>>,
    pub addr: SocketAddr,
    istio: bool,
    /// Where each Service ("namespace/name") is reached: the admission
    /// webhook's.
    services: Arc<Mutex<BTreeMap<String, SocketAddr>>>,
    /// Every n-th request is answered 429 (0: none), as API Priority and
    /// Fairness answers a busy client.
    throttle: Arc<std::sync::atomic::AtomicUsize>,
    requests: Arc<std::sync::atomic::AtomicUsize>,
    /// Service-account tokens the TokenReview API authenticates: token ->
    /// (namespace, service account, audiences).
    tokens: Arc<Mutex<BTreeMap<String, TokenOwner>>>,
    /// The control plane bound only to namespaced Roles (docs/kubernetes.md's
    /// narrowest RBAC): a list or watch of a namespaced kind across all
    /// namespaces is forbidden, with the real server's message.
    namespaced_roles: Arc<std::sync::atomic::AtomicBool>,
    /// The control plane's RBAC (`deploy/base/rbac.yaml`): every request
    /// with its service account's token is authorized by it.
    rbac: Arc<rbac::Rbac>,
    /// The CRDs of minimesh's kinds (`crds/`), by collection: their
    /// schemas prune, default and validate every write.
    crds: Arc<BTreeMap<usize, schema::Crd>>,
    /// What each field manager last applied to each object (server-side
    /// apply): (collection, namespace, name, manager) -> applied config.
    applied: Arc<Mutex<BTreeMap<Managed, Value>>>,
    /// Requests refused 403 by RBAC, with the server's message.
    denied: Arc<Mutex<Vec<String>>>,
    /// The longest a watch stays open, in ms (0: its `timeoutSeconds`),
    /// so that a test sees clients watch again in seconds, not minutes.
    watch_cap_ms: Arc<std::sync::atomic::AtomicU64>,
}

/// The control plane's RBAC: `deploy/base/rbac.yaml`, or the file
/// `MINIMESH_FAKE_RBAC` names (`scripts/rbac-rules-needed.sh` runs the tests
/// with each rule removed in turn).
fn rbac_manifests() -> String {
    let path = std::env::var_os("MINIMESH_FAKE_RBAC")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/base/rbac.yaml"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// minimesh's CRDs, as `kubectl apply -f crds/` installs them.
fn crds() -> BTreeMap<usize, schema::Crd> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
    COLLECTIONS
        .iter()
        .enumerate()
        .filter(|(_, (g, ..))| *g == "minimesh.io")
        .map(|(c, (g, _, plural, _))| {
            (
                c,
                schema::Crd::load(&dir.join(format!("{plural}.{g}.yaml"))),
            )
        })
        .collect()
}

/// An object's fields as one manager applied them: (collection,
/// namespace, name, field manager).
type Managed = (usize, String, String, String);

/// Whose a token is: (namespace, service account, audiences).
type TokenOwner = (String, String, Vec<String>);

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

    /// The same; with `istio`, Istio's CRDs (DestinationRule, VirtualService,
    /// Gateway) and the Gateway API's (HTTPRoute, Gateway) are installed too.
    pub async fn start_with(addr: SocketAddr, istio: bool) -> FakeKube {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind fake API");
        let fake = FakeKube {
            inner: Arc::default(),
            addr,
            istio,
            services: Arc::default(),
            throttle: Arc::default(),
            requests: Arc::default(),
            tokens: Arc::default(),
            namespaced_roles: Arc::default(),
            rbac: Arc::new(rbac::Rbac::from_manifests(&rbac_manifests())),
            denied: Arc::default(),
            crds: Arc::new(crds()),
            applied: Arc::default(),
            watch_cap_ms: Arc::default(),
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

    fn bookmark(&self) {
        let mut inner = self.inner.lock().expect("lock");
        let rv = inner.rv;
        inner.watches.retain(|w| {
            if !w.bookmarks {
                return !w.tx.is_closed();
            }
            let (g, v, _, kind) = COLLECTIONS[w.c];
            let obj = json!({
                "apiVersion": api_version(g, v), "kind": kind,
                "metadata": {"resourceVersion": rv.to_string()}
            });
            w.tx.send(watch_line("BOOKMARK", &obj)).is_ok()
        });
    }

    async fn handle(&self, req: http::Request<hyper::body::Incoming>) -> Response<Body> {
        use std::sync::atomic::Ordering::Relaxed;
        let every = self.throttle.load(Relaxed);
        if every > 0 && (self.requests.fetch_add(1, Relaxed) + 1).is_multiple_of(every) {
            self.inner.lock().expect("lock").log.push(format!(
                "THROTTLED {} {}",
                req.method(),
                req.uri().path()
            ));
            let mut r = status_response(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                "Too many requests, please try again later.",
            );
            r.headers_mut()
                .insert("retry-after", http::HeaderValue::from_static("1"));
            return r;
        }
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query: BTreeMap<String, String> = req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), percent_decode(v)))
            .collect();
        // Authentication, then authorization, before routing, as the real
        // server: a request refused never reaches the storage.
        let Some(user) = Self::authenticate(&req) else {
            return status_response(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized");
        };
        if let Some(message) = self.forbidden(user, &method, &path, &query) {
            return status_response(StatusCode::FORBIDDEN, "Forbidden", &message);
        }
        // A patch's type is its content type (kubectl patches built-in
        // kinds with a strategic merge patch, custom ones with a merge patch).
        let content_type = req
            .headers()
            .get("content-type")
            .and_then(|t| t.to_str().ok())
            .unwrap_or("")
            .to_string();
        let patch_type = PatchType::of(&content_type);
        // `kubectl get` asks for a Table.
        let table = req
            .headers()
            .get("accept")
            .and_then(|a| a.to_str().ok())
            .is_some_and(|a| a.contains("as=Table"));
        // `fieldSelector=metadata.name=NAME` (kubectl wait): that object only.
        let only = query
            .get("fieldSelector")
            .and_then(|f| f.strip_prefix("metadata.name="))
            .map(str::to_string);
        let body = req
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        if method == Method::POST && path == "/apis/authentication.k8s.io/v1/tokenreviews" {
            return self.review_token(&body);
        }
        // Authorization comes before routing, as in the real server: a
        // cluster-wide read is forbidden whether or not the kind is served.
        if self
            .namespaced_roles
            .load(std::sync::atomic::Ordering::Relaxed)
            && method == Method::GET
        {
            if let Some((c, None, None, None)) = route(&path) {
                if !cluster_scoped(c) {
                    let (group, _, plural, _) = COLLECTIONS[c];
                    let verb = match query.get("watch").is_some_and(|w| w == "true" || w == "1") {
                        true => "watch",
                        false => "list",
                    };
                    let resource = match group {
                        "" => plural.to_string(),
                        g => format!("{plural}.{g}"),
                    };
                    return status_response(
                        StatusCode::FORBIDDEN,
                        "Forbidden",
                        &format!("{resource} is forbidden: User \"system:serviceaccount:minimesh-system:minimesh-control-plane\" cannot {verb} resource \"{plural}\" in API group \"{group}\" at the cluster scope"),
                    );
                }
            }
        }
        let served = |c: usize| !ISTIO.contains(&c) || self.istio;
        let Some((c, ns, name, sub)) = route(&path).filter(|r| served(r.0)) else {
            if method == Method::GET {
                let doc =
                    kubectl::openapi(&path, served).or_else(|| kubectl::discovery(&path, served));
                if let Some(doc) = doc {
                    return json_response(StatusCode::OK, &doc);
                }
            }
            return status_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            );
        };
        let plural = COLLECTIONS[c].2;
        if let Some(reason) = query.get("labelSelector").and_then(|l| bad_selector(l)) {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", &reason);
        }
        match (method, name, sub.as_deref()) {
            (Method::GET, None, _)
                if query.get("watch").is_some_and(|w| w == "true" || w == "1") =>
            {
                self.watch_request(c, ns, only, &query)
            }
            (Method::GET, None, _) => self.list_request(c, ns, only, &query, table),
            // The object, or its status subresource (the whole object too).
            (Method::GET, Some(name), None | Some("status")) => {
                let inner = self.inner.lock().expect("lock");
                match inner
                    .objects
                    .get(&(c, ns.unwrap_or_default(), name.clone()))
                {
                    Some(o) if table => json_response(
                        StatusCode::OK,
                        &kubectl::table(c, std::slice::from_ref(o), inner.rv),
                    ),
                    Some(o) => json_response(StatusCode::OK, o),
                    None => status_response(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{plural} \"{name}\" not found"),
                    ),
                }
            }
            (Method::POST, None, _) => {
                let Ok(obj) = serde_json::from_slice::<Value>(&body) else {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
                };
                self.create(c, ns.unwrap_or_default(), obj, &query).await
            }
            // Server-side apply: creates the object when it is missing.
            (Method::PATCH, Some(name), None) if patch_type == Some(PatchType::Apply) => {
                self.apply_patch(c, ns.unwrap_or_default(), name, &body, &query)
                    .await
            }
            // Replace (optimistic concurrency on resourceVersion) and patch
            // (JSON patch, merge patch, strategic merge patch).
            (method @ (Method::PUT | Method::PATCH), Some(name), None) => {
                let Ok(body) = serde_json::from_slice::<Value>(&body) else {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
                };
                let key = (c, ns.unwrap_or_default(), name.clone());
                let Some(current) = self.inner.lock().expect("lock").objects.get(&key).cloned()
                else {
                    return status_response(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!("{plural} \"{name}\" not found"),
                    );
                };
                let obj = if method == Method::PUT {
                    if body["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]
                    {
                        return conflict(plural, &name);
                    }
                    body
                } else {
                    match self.patched(c, &current, &body, patch_type) {
                        Ok(o) => o,
                        Err(r) => return r,
                    }
                };
                let verb = if method == Method::PUT {
                    "REPLACE"
                } else {
                    "PATCH"
                };
                self.update(key, current, obj, verb, &query).await
            }
            (Method::PATCH, Some(name), Some("status"))
                if self.crds.get(&c).is_none_or(|crd| crd.status_subresource) =>
            {
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
                // The status subresource changes only status, which the
                // schema checks as any write.
                if let Some(status) = patch.get("status") {
                    merge(&mut obj["status"], status);
                }
                if let Some(crd) = self.crds.get(&c) {
                    crd.prune_and_default(&mut obj);
                    let errors = crd.validate(&obj, Some("status"));
                    if !errors.is_empty() {
                        return json_response(
                            StatusCode::UNPROCESSABLE_ENTITY,
                            &crd.invalid(&name, &errors),
                        );
                    }
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
        mut w: Watch,
        from: u64,
        plural: &str,
        ends: Option<Duration>,
    ) -> Response<Body> {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        if let Some(after) = ends {
            // Dropping the watch's sender ends its stream: the response ends.
            let (inner, ending) = (self.inner.clone(), tx.downgrade());
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                if let Some(tx) = ending.upgrade() {
                    let mut inner = inner.lock().expect("lock");
                    inner.watches.retain(|w| !w.tx.same_channel(&tx));
                }
            });
        }
        w.tx = tx;
        let mut inner = self.inner.lock().expect("lock");
        inner.log.push(match &w.namespace {
            Some(ns) => format!("WATCH {plural} {from} in {ns}"),
            None => format!("WATCH {plural} {from}"),
        });
        if from < inner.compacted {
            let _ = w.tx.send(watch_line("ERROR", &gone(from, inner.compacted)));
        } else {
            for (rv, hc, kind, obj) in &inner.history {
                if *rv > from && w.selects(*hc, obj) {
                    let _ = w.tx.send(watch_line(kind, obj));
                }
            }
            inner.watches.push(w);
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
        let previous = if event == "DELETED" {
            self.objects.remove(&key)
        } else {
            self.objects.insert(key.clone(), obj.clone())
        };
        self.history.push((self.rv, key.0, event, obj.clone()));
        // A change that takes an object into or out of a watch's selection
        // reaches that watch as ADDED or DELETED, as from the watch cache.
        self.watches.retain(|w| {
            let now = w.selects(key.0, &obj);
            let before = previous.as_ref().is_some_and(|p| w.selects(key.0, p));
            let seen = match (event, before, now) {
                ("MODIFIED", true, false) => "DELETED",
                ("MODIFIED", false, true) => "ADDED",
                (_, _, true) => event,
                _ => return !w.tx.is_closed(),
            };
            w.tx.send(watch_line(seen, &obj)).is_ok()
        });
        obj
    }
}
