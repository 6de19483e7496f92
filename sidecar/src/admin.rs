//! Sidecar admin HTTP: `/healthz`, `/ready` (200 once config arrived),
//! `/metrics` (OpenMetrics text of the registry [`crate::metrics`] fills) and `/debug/config` (clusters, endpoints and
//! their live state as JSON; to loopback callers only unless
//! `--admin-debug`), and the app's probes for the kubelet
//! (`/app-health/...`, [`crate::app_probe`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use minimesh_proto::v1::UpstreamProtocol;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::net::TcpListener;
use tracing::debug;

use crate::routing::Routing;

/// What the admin server reads.
pub struct Admin {
    /// Outbound routing.
    pub routing: Arc<ArcSwap<Routing>>,
    /// Config received.
    pub ready: Arc<AtomicBool>,
    /// Node id, for the debug view.
    pub node_id: String,
    /// Every metric of the sidecar ([`crate::metrics`]).
    pub metrics: Registry,
    /// Serve `/debug/*` to every caller, not only loopback ones
    /// (`--admin-debug`; see [`minimesh_proto::admin`]).
    pub debug_for_all: bool,
    /// The app's HTTP probes, served at `/app-health/...` for the kubelet.
    pub app_probes: crate::app_probe::AppProbes,
    /// The AuthorizationPolicies the inbound listeners enforce.
    pub authz: Arc<crate::authz::Shared>,
    /// The sidecar's mutual TLS: its certificate and inbound mode.
    pub tls: Arc<crate::tls::Tls>,
}

/// How long the app has to answer a probe the sidecar makes for the
/// kubelet (whose own `timeoutSeconds` bounds the whole probe too).
const APP_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves the admin API forever.
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
                        return Ok::<_, Infallible>(text(
                            StatusCode::FORBIDDEN,
                            refused.into(),
                            "text/plain",
                        ));
                    }
                    if let Some(probe) = admin.app_probes.get(req.uri().path()) {
                        let (status, body) = crate::app_probe::run(probe, APP_PROBE_TIMEOUT).await;
                        return Ok(text(status, body, "text/plain"));
                    }
                    Ok::<_, Infallible>(handle(&admin, &req))
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

fn handle(admin: &Admin, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into(), "text/plain"),
        "/ready" => {
            let certified = admin.tls.mesh().is_none_or(|m| m.spiffe_id().is_some());
            if !certified {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "waiting for a workload certificate from the control plane\n".into(),
                    "text/plain",
                )
            } else if admin.ready.load(Ordering::Relaxed) {
                text(StatusCode::OK, "ready\n".into(), "text/plain")
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "waiting for config from the control plane\n".into(),
                    "text/plain",
                )
            }
        }
        "/metrics" => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, &admin.metrics) {
                Ok(()) => text(
                    StatusCode::OK,
                    out,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
                Err(_) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "encoding failed\n".into(),
                    "text/plain",
                ),
            }
        }
        "/debug/config" => text(
            StatusCode::OK,
            format!("{:#}\n", config(admin)),
            "application/json",
        ),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; try /healthz /ready /metrics /debug/config\n".into(),
            "text/plain",
        ),
    }
}

fn config(admin: &Admin) -> serde_json::Value {
    let routing = admin.routing.load();
    let clusters: serde_json::Map<String, serde_json::Value> = routing
        .clusters
        .iter()
        .map(|(name, c)| {
            let eps: Vec<_> = c
                .balancer
                .endpoints()
                .iter()
                .map(|e| {
                    json!({
                        "address": e.addr.to_string(),
                        "pod": e.pod,
                        "weight": c.weights.get(&e.addr),
                        "active": e.active(),
                        "connections": e.pool().open_connections(),
                        "failing": e.is_failing(),
                        "ejected": e.is_ejected(),
                        "health_check_failing": e.is_health_check_failing(),
                        "requests": e.counters().issued(),
                        "mtls": e.pool().mtls(),
                        "identities": e.pool().peer().map(|p| p.accounts().to_vec()).unwrap_or_default(),
                        "identity_refused": e.pool().peer().map_or(0, |p| p.refused()),
                    })
                })
                .collect();
            (
                name.clone(),
                json!({
                    "policy": c.balancer.policy().as_str(),
                    "rule": c.rule,
                    // HTTP/1.1, HTTP/2, or the caller's version.
                    "protocol": match c.protocol {
                        UpstreamProtocol::Http1 => "HTTP/1.1",
                        UpstreamProtocol::Http2 => "HTTP/2",
                        UpstreamProtocol::Client => "client",
                    },
                    "endpoints": eps,
                    // With zone failover: the endpoints of this sidecar's zone.
                    "local_zone_endpoints": c.balancer.local_endpoints().map(|l| {
                        l.iter().map(|e| e.addr.to_string()).collect::<Vec<_>>()
                    }),
                    // What outlier detection enforces (null: off).
                    "outlier_detection": c.outlier.as_ref().map(|o| json!({
                        "consecutive_5xx": o.consecutive_5xx,
                        "consecutive_gateway_errors": o.consecutive_gateway_errors,
                        "split_local_origin": o.split_local_origin,
                        "consecutive_local_origin": o.consecutive_local_origin,
                        "base_ejection_ms": o.base_ejection_ms,
                        "max_ejection_percent": o.max_ejection_percent,
                        "min_health_percent": o.min_health_percent,
                        "ignore_503": o.ignore_503,
                    })),
                    // The request's time and attempts (a rule's, or its
                    // VirtualService's route's).
                    "timeout_ms": c.timeout.map(|t| t.as_millis() as u64),
                    "per_try_timeout_ms": c.per_try_timeout.map(|t| t.as_millis() as u64),
                    "retry_attempts": c.retry_attempts,
                    "retries": c.budget.retried.load(Ordering::Relaxed),
                    "retry_budget_exhausted": c.budget.exhausted.load(Ordering::Relaxed),
                }),
            )
        })
        .collect();
    let mut hosts: Vec<&str> = routing.hosts().collect();
    hosts.sort();
    let mtls = admin.tls.mesh().map(|m| {
        json!({
            "spiffe_id": m.spiffe_id().map(|s| s.to_string()),
            "inbound_mode": if admin.tls.strict() { "STRICT" } else { "PERMISSIVE" },
        })
    });
    json!({"node": admin.node_id, "zone": routing.zone, "ready": admin.ready.load(Ordering::Relaxed), "mtls": mtls, "authz": admin.authz.load().view(), "clusters": clusters, "hosts": hosts})
}

fn text(status: StatusCode, body: String, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}
