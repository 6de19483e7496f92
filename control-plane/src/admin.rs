//! Admin HTTP: `/healthz`, `/readyz`, `/metrics` (OpenMetrics text of the
//! registry every module registers on) and JSON
//! debug views (`/debug/proxies`, `/debug/config`, `/debug/endpoints`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use minimesh_proto::prost::Message;
use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, HealthStatus, LbPolicy, UpstreamProtocol,
};
use minimesh_proto::{CLUSTER_TYPE, ENDPOINTS_TYPE};
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::debug;

use crate::cache::Snapshot;
use crate::config::ConfigError;
use crate::discovery::registry::Registry as Proxies;

/// What the config views show, replaced on every publication.
#[derive(Clone, Debug, Default)]
pub struct ConfigView {
    /// Rules with their status.
    pub rules: Vec<Value>,
    /// Which rule the callers of each namespace get, per service.
    pub rule_scope: Vec<Value>,
    /// PeerAuthentications in force, with their modes.
    pub peer_authentications: Vec<Value>,
    /// VirtualServices applied, with what their routes set.
    pub virtual_services: Vec<Value>,
    /// Istio's Gateways read, with the hosts they bind.
    pub gateways: Vec<Value>,
    /// The Gateway API's HTTPRoutes, with their status per parent.
    pub http_routes: Vec<Value>,
    /// AuthorizationPolicies in force.
    pub authorization_policies: Vec<Value>,
    /// Rejected input.
    pub errors: Vec<ConfigError>,
    /// Caveats.
    pub warnings: Vec<String>,
    /// True once the source has been read completely once.
    pub synced: bool,
}

/// Shared state of the admin server.
pub struct Admin {
    /// Aggregated load reports.
    pub load: Arc<crate::load::Aggregator>,
    /// Every metric of the control plane: each module registers its own.
    pub metrics: Registry,
    /// Connected proxies.
    pub proxies: Arc<Proxies>,
    /// Current resources.
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
    /// Current config view.
    pub config: RwLock<Arc<ConfigView>>,
    /// What each Kubernetes rule's status should say (read by the status writer).
    pub status: watch::Sender<Arc<crate::source::kubernetes::status::DesiredStatus>>,
    /// What each HTTPRoute's status should say (read by its status writer).
    pub route_status: watch::Sender<Arc<crate::config::status::DesiredRouteStatus>>,
    /// Serve `/debug/*` to every caller, not only loopback ones
    /// (`--admin-debug`; see [`minimesh_proto::admin`]).
    pub debug_for_all: bool,
    /// Shutting down: not ready while the endpoints drop this replica
    /// (`--termination-drain`).
    pub draining: std::sync::atomic::AtomicBool,
    /// Before the first complete read: what the Kubernetes source waits for
    /// (an API discovery, watches whose first list has not completed), for
    /// `/readyz` to name.
    pub waiting_for: watch::Sender<Vec<String>>,
}

impl Admin {
    fn config(&self) -> Arc<ConfigView> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the config view.
    pub fn set_config(&self, view: ConfigView) {
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(view);
    }
}

/// Serves the admin API on `listener` forever.
pub async fn serve(listener: TcpListener, admin: Arc<Admin>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let admin = admin.clone();
                async move {
                    if !minimesh_proto::admin::allowed(req.uri().path(), peer, admin.debug_for_all)
                    {
                        let refused = minimesh_proto::admin::DEBUG_REFUSED;
                        return Ok::<_, Infallible>(text(StatusCode::FORBIDDEN, refused.into()));
                    }
                    Ok::<_, Infallible>(handle(&admin, req))
                }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            // With a timer, hyper closes a connection that sends no whole
            // request head for 30 s: idle keep-alive, or headers too slow.
            builder.http1().timer(hyper_util::rt::TokioTimer::new());
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                debug!(error = %e, "admin connection ended");
            }
        });
    }
}

fn handle(admin: &Admin, req: Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => {
            if admin.draining.load(std::sync::atomic::Ordering::Relaxed) {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "draining: shutting down\n".into(),
                )
            } else if admin.config().synced {
                text(StatusCode::OK, "ready\n".into())
            } else {
                let waiting = admin.waiting_for.borrow().join(", ");
                let why = match waiting.is_empty() {
                    true => "config not synced yet\n".to_string(),
                    false => format!("config not synced yet: waiting for {waiting}\n"),
                };
                text(StatusCode::SERVICE_UNAVAILABLE, why)
            }
        }
        "/metrics" => {
            let mut out = String::new();
            if prometheus_client::encoding::text::encode(&mut out, &admin.metrics).is_err() {
                return text(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n".into());
            }
            let mut resp = text(StatusCode::OK, out);
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
            );
            resp
        }
        "/debug/proxies" => json_response(&json!(admin.proxies.list())),
        "/debug/load" => {
            let known = admin.snapshots.borrow().endpoint_addresses();
            json_response(&admin.load.view(&known))
        }
        "/debug/config" => {
            let c = admin.config();
            let errors: Vec<Value> = c
                .errors
                .iter()
                .map(|e| json!({"file": e.file, "object": e.object, "field": e.field, "reason": e.reason, "message": e.to_string()}))
                .collect();
            json_response(&json!({"rules": c.rules, "ruleScope": c.rule_scope, "peerAuthentications": c.peer_authentications, "virtualServices": c.virtual_services, "gateways": c.gateways, "httpRoutes": c.http_routes, "authorizationPolicies": c.authorization_policies, "errors": errors, "warnings": c.warnings, "synced": c.synced}))
        }
        "/debug/endpoints" => json_response(&endpoints_view(&admin.snapshots.borrow())),
        "/debug/versions" => {
            // The versions a sidecar ACKs, by type (minimesh's encoding; the
            // cache also holds Envoy's, whose short names would collide).
            let snap = admin.snapshots.borrow().clone();
            let v: BTreeMap<&str, &str> = snap
                .types
                .iter()
                .filter(|(t, _)| minimesh_proto::ALL_TYPES.contains(t))
                .map(|(t, ts)| (crate::discovery::registry::short_type(t), ts.version.as_str()))
                .collect();
            json_response(&json!(v))
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /healthz /readyz /metrics /debug/proxies /debug/config /debug/endpoints /debug/versions /debug/load\n".into(),
        ),
    }
}

fn endpoints_view(snap: &Snapshot) -> Value {
    let mut out = BTreeMap::new();
    let clusters = snap.get(CLUSTER_TYPE);
    if let Some(eps) = snap.get(ENDPOINTS_TYPE) {
        for (name, entry) in &eps.resources {
            let Ok(cla) = ClusterLoadAssignment::decode(entry.any.value.as_slice()) else {
                continue;
            };
            let cluster = clusters
                .and_then(|c| c.resources.get(name))
                .and_then(|e| Cluster::decode(e.any.value.as_slice()).ok());
            let policy = cluster
                .as_ref()
                .and_then(|c| LbPolicy::try_from(c.policy).ok())
                .map(|p| p.as_str_name());
            let endpoints: Vec<Value> = cla
                .endpoints
                .iter()
                .map(|e| {
                    json!({
                        "address": e.address,
                        "pod": e.pod,
                        "weight": e.weight,
                        "health": HealthStatus::try_from(e.health).map(|h| h.as_str_name()).unwrap_or("UNKNOWN"),
                        "zone": e.zone,
                    })
                })
                .collect();
            out.insert(
                name.clone(),
                json!({
                    "policy": policy,
                    "zoneFailover": cluster.as_ref().is_some_and(|c| c.zone_failover),
                    // The HTTP version sidecars speak to the endpoints.
                    "protocol": cluster.as_ref().map(|c| match UpstreamProtocol::try_from(c.upstream_protocol) {
                        Ok(UpstreamProtocol::Http2) => "HTTP/2",
                        Ok(UpstreamProtocol::Client) => "client",
                        _ => "HTTP/1.1",
                    }),
                    "rule": cluster.map(|c| c.rule),
                    "version": entry.version,
                    "endpoints": endpoints,
                }),
            );
        }
    }
    json!(out)
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

fn json_response(v: &Value) -> Response<Full<Bytes>> {
    let mut r = text(StatusCode::OK, format!("{v:#}\n"));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// Binds the admin listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
