//! A fake of the Kubernetes API server, served over real HTTP and strict
//! where the real one is: authentication and RBAC before routing
//! (`auth.rs`, `rbac.rs`), custom resources decoded by their CRD's schema
//! (`schema.rs`), writes through the admission webhooks over HTTPS
//! (`writes.rs`, `admission.rs`), patches by content type and server-side
//! apply (`writes.rs`, `wire.rs`), lists and watches with resourceVersions,
//! BOOKMARKs and `410 Expired` past the compaction point (`reads.rs`,
//! `store.rs`), what kubectl reads (`kubectl.rs`: discovery, OpenAPI v3,
//! Tables), and a Deployment controller's rollout (`rollout.rs`). A test
//! drives it beside the API (`controls.rs`). As the real server, it writes
//! an EndpointSlice's empty `endpoints` and `ports` as `null`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;

mod admission;
mod auth;
mod controls;
mod kubectl;
mod managed;
pub mod rbac;
mod reads;
mod rollout;
pub mod schema;
mod store;
mod strategic;
pub mod wire;
mod writes;

use store::{Inner, Watch};
use writes::PatchType;

use wire::{json_response, percent_decode, route, status_response};

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
    /// Who owns each field of each object (server-side apply's managed
    /// fields), by (collection, namespace, name).
    owners: Arc<Mutex<BTreeMap<ObjectKey, managed::Owners>>>,
    /// Requests refused 403 by RBAC, with the server's message.
    denied: Arc<Mutex<Vec<String>>>,
    /// The longest a watch stays open, in ms (0: its `timeoutSeconds`),
    /// so that a test sees clients watch again in seconds, not minutes.
    watch_cap_ms: Arc<std::sync::atomic::AtomicU64>,
    /// The period of a watch's BOOKMARKs, in ms: the real server's minute
    /// unless a test shortens it ([`FakeKube::bookmark_every`]).
    bookmark_every_ms: Arc<std::sync::atomic::AtomicU64>,
}

/// An object's place: (collection, namespace, name).
type ObjectKey = (usize, String, String);

/// The API server's bookmark period (`defaultBookmarkFrequency`).
const BOOKMARK_EVERY: Duration = Duration::from_secs(60);

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
    /// Serves on `addr` until the test ends; bookmarks each watch that asks
    /// for them as the real server does (about a minute apart, and two
    /// seconds before the watch's deadline).
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
            owners: Arc::default(),
            watch_cap_ms: Arc::default(),
            bookmark_every_ms: Arc::new((BOOKMARK_EVERY.as_millis() as u64).into()),
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
            // Which watches are due is checked often; each is sent one when
            // due (the real server checks once a second).
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tick.tick().await;
                f.bookmark();
            }
        });
        fake
    }

    /// The period between a watch's BOOKMARKs.
    fn bookmark_period(&self) -> Duration {
        Duration::from_millis(
            self.bookmark_every_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    /// One request, as the real server takes it: throttling, then
    /// authentication and authorization before routing, then the verb.
    async fn handle(&self, req: http::Request<hyper::body::Incoming>) -> Response<Body> {
        if let Some(r) = self.throttled(&req) {
            return r;
        }
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let mut query: BTreeMap<String, String> = req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), percent_decode(v)))
            .collect();
        // A write's field manager: the one it names, else (but for an
        // apply, which must name one) its User-Agent up to the first `/`,
        // as the real server defaults it.
        let user_agent = req
            .headers()
            .get("user-agent")
            .and_then(|u| u.to_str().ok())
            .unwrap_or("")
            .to_string();
        let kubectl = user_agent.starts_with("kubectl/");
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
        if patch_type != Some(PatchType::Apply) && !query.contains_key("fieldManager") {
            let agent = user_agent.split('/').next().unwrap_or("");
            let manager = if agent.is_empty() { "unknown" } else { agent };
            query.insert("fieldManager".into(), manager.to_string());
        }
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
        if let Some(r) = self.cluster_wide_forbidden(&method, &path, &query) {
            return r;
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
        if let Some(reason) = query
            .get("labelSelector")
            .and_then(|l| wire::bad_selector(l))
        {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", &reason);
        }
        let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
        match (method, name, sub.as_deref()) {
            (Method::GET, None, _) if watch => self.watch_request(c, ns, only, &query),
            (Method::GET, None, _) => self.list_request(c, ns, only, &query, table),
            (Method::GET, Some(name), None | Some("status")) => {
                self.get_request(c, ns, &name, table)
            }
            (Method::POST, None, _) => {
                let Ok(obj) = serde_json::from_slice::<Value>(&body) else {
                    return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
                };
                self.create(c, ns.unwrap_or_default(), obj, &query).await
            }
            // Server-side apply: creates the object when it is missing.
            (Method::PATCH, Some(name), None) if patch_type == Some(PatchType::Apply) => {
                self.apply_patch(c, ns.unwrap_or_default(), name, &body, &query, kubectl)
                    .await
            }
            (method @ (Method::PUT | Method::PATCH), Some(name), None) => {
                let replace = method == Method::PUT;
                self.replace_or_patch(c, ns, name, replace, &body, patch_type, &query)
                    .await
            }
            (Method::PATCH, Some(name), Some("status"))
                if self.crds.get(&c).is_none_or(|crd| crd.status_subresource) =>
            {
                self.patch_status(c, ns, &name, &body)
            }
            (Method::DELETE, Some(name), None) => self.delete_request(c, ns, &name),
            _ => status_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "not supported by the fake",
            ),
        }
    }

    /// Every n-th request (`throttle_every`) is answered `429 Too Many
    /// Requests` with `Retry-After: 1`, as API Priority and Fairness does.
    fn throttled(&self, req: &http::Request<hyper::body::Incoming>) -> Option<Response<Body>> {
        use std::sync::atomic::Ordering::Relaxed;
        let every = self.throttle.load(Relaxed);
        if every == 0 || !(self.requests.fetch_add(1, Relaxed) + 1).is_multiple_of(every) {
            return None;
        }
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
        Some(r)
    }
}
