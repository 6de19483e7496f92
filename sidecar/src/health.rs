//! Active health checks: per cluster with a `healthCheck`, one task probes
//! every endpoint with `GET path` each interval; `unhealthyThreshold`
//! failures in a row take an endpoint out of rotation, `healthyThreshold`
//! successes bring it back. Endpoints start healthy, so a new config never
//! blacks a cluster out while the first probes run.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, Method, Uri};
use http_body_util::BodyExt;
use minimesh_proto::v1::{Cluster, HealthCheck, UpstreamProtocol};
use tokio::task::JoinHandle;
use tracing::info;

use crate::endpoint::EndpointState;
use crate::h1::encode;
use crate::pool::{ConnPool, PoolSettings};
use crate::routing::Routing;

/// The running checkers, one per cluster that asks for one.
#[derive(Default)]
pub struct HealthCheckers {
    tasks: HashMap<String, (HealthCheck, JoinHandle<()>)>,
}

impl HealthCheckers {
    /// Starts, restarts or stops checkers so that they match `clusters`.
    pub fn reconcile(
        &mut self,
        clusters: &BTreeMap<String, Cluster>,
        routing: &Arc<ArcSwap<Routing>>,
    ) {
        self.tasks.retain(|name, (hc, task)| {
            let keep = clusters.get(name).and_then(|c| c.health_check.as_ref()) == Some(hc);
            if !keep {
                task.abort();
            }
            keep
        });
        for (name, c) in clusters {
            let Some(hc) = &c.health_check else { continue };
            if self.tasks.contains_key(name) {
                continue;
            }
            let task = tokio::spawn(check_loop(name.clone(), hc.clone(), routing.clone()));
            self.tasks.insert(name.clone(), (hc.clone(), task));
        }
    }
}

impl Drop for HealthCheckers {
    fn drop(&mut self) {
        for (_, (_, t)) in self.tasks.drain() {
            t.abort();
        }
    }
}

async fn check_loop(cluster: String, hc: HealthCheck, routing: Arc<ArcSwap<Routing>>) {
    let interval = Duration::from_millis(hc.interval_ms.max(100));
    let timeout = Duration::from_millis(hc.timeout_ms.max(1));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (endpoints, protocol): (Vec<Arc<EndpointState>>, _) =
            match routing.load().clusters.get(&cluster) {
                Some(c) => (c.balancer.endpoints().to_vec(), c.protocol),
                None => continue,
            };
        let kind = if hc.grpc {
            Probe::Grpc(&hc.grpc_service)
        } else if protocol == UpstreamProtocol::Http2 {
            Probe::H2(&hc.path)
        } else {
            Probe::H1(&hc.path)
        };
        let probes = endpoints.into_iter().map(|ep| {
            let cluster = cluster.as_str();
            let hc = &hc;
            async move {
                let ok = tokio::time::timeout(timeout, probe(&ep, kind, timeout))
                    .await
                    .unwrap_or(false);
                record(cluster, &ep, ok, hc);
            }
        });
        futures_util::future::join_all(probes).await;
    }
}

/// How an endpoint is probed.
#[derive(Clone, Copy)]
enum Probe<'a> {
    /// `GET path` over HTTP/1.1; 2xx is healthy.
    H1(&'a str),
    /// `GET path` over HTTP/2 (the cluster's endpoints speak HTTP/2).
    H2(&'a str),
    /// gRPC's `grpc.health.v1.Health/Check` for this service; SERVING is healthy.
    Grpc(&'a str),
}

/// One probe on a connection of its own (closed after it), as Envoy keeps
/// health-check traffic apart from requests.
async fn probe(ep: &EndpointState, kind: Probe<'_>, timeout: Duration) -> bool {
    let mut headers = http::HeaderMap::with_capacity(4);
    headers.insert(
        header::USER_AGENT,
        http::HeaderValue::from_static("minimesh-health-check"),
    );
    let settings = PoolSettings {
        connect_timeout: timeout,
        idle_timeout: timeout,
        max_requests_per_connection: 1,
        max_connection_ms: 0,
        max_streams: 0,
    };
    let (method, path, body) = match kind {
        Probe::H1(path) => {
            let Ok(uri) = path.parse::<Uri>() else {
                return false;
            };
            let target = uri.path_and_query().map_or("/", |p| p.as_str());
            let body = crate::pool::UpstreamBody::Buffered(Bytes::new());
            let mut req = encode(
                &Method::GET,
                target,
                &headers,
                Some(ep.authority.as_str()),
                body,
            );
            let conns = ConnPool::default();
            conns.set_peer(ep.pool().peer());
            return matches!(conns.send(ep.addr, &settings, &mut req, crate::clock::tick(), &mut || true).await, Ok(r) if r.status().is_success());
        }
        Probe::H2(path) => (Method::GET, path.to_string(), Bytes::new()),
        Probe::Grpc(service) => {
            headers.insert(
                header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            (
                Method::POST,
                GRPC_HEALTH_CHECK.to_string(),
                grpc_health_request(service),
            )
        }
    };
    let Ok(path) = http::uri::PathAndQuery::try_from(path) else {
        return false;
    };
    let pool = crate::h2::H2Pool::new(1);
    let open = Arc::default();
    let Ok(stream) = pool
        .stream(ep.addr, &settings, &open, ep.pool().peer().as_deref())
        .await
    else {
        return false;
    };
    let req = crate::h2::request(
        &method,
        Some(&path),
        &headers,
        &ep.authority,
        matches!(kind, Probe::Grpc(_)),
        http_body_util::Either::Left(http_body_util::Full::new(body)),
    );
    let Ok(resp) = pool
        .send(
            ep.addr,
            &settings,
            &open,
            ep.pool().peer().as_deref(),
            stream,
            req,
        )
        .await
    else {
        return false;
    };
    if !resp.status().is_success() {
        return false;
    }
    if !matches!(kind, Probe::Grpc(_)) {
        return true;
    }
    // A trailers-only answer (an error status) has no message.
    if resp.headers().contains_key("grpc-status") {
        return false;
    }
    let Ok(all) = resp.into_body().collect().await else {
        return false;
    };
    let ok_status = all
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .is_some_and(|v| v == "0");
    ok_status && grpc_serving(&all.to_bytes())
}

/// gRPC's health checking method.
const GRPC_HEALTH_CHECK: &str = "/grpc.health.v1.Health/Check";

/// A gRPC message (uncompressed, length-prefixed) holding
/// `HealthCheckRequest { service }`.
fn grpc_health_request(service: &str) -> Bytes {
    let mut msg = Vec::with_capacity(service.len() + 8);
    if !service.is_empty() {
        msg.push(0x0a); // field 1, length-delimited
        let mut n = service.len();
        while n >= 0x80 {
            msg.push((n as u8 & 0x7f) | 0x80);
            n >>= 7;
        }
        msg.push(n as u8);
        msg.extend_from_slice(service.as_bytes());
    }
    let mut frame = Vec::with_capacity(5 + msg.len());
    frame.push(0);
    frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    frame.extend_from_slice(&msg);
    frame.into()
}

/// True when `body` is one gRPC message holding
/// `HealthCheckResponse { status: SERVING }` (field 1, varint 1).
fn grpc_serving(body: &[u8]) -> bool {
    let Some((head, msg)) = body.split_first_chunk::<5>() else {
        return false;
    };
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    head[0] == 0 && msg.len() == len && msg == [0x08, 0x01]
}

fn record(cluster: &str, ep: &EndpointState, ok: bool, hc: &HealthCheck) {
    let threshold = |failing| {
        if failing {
            hc.healthy_threshold
        } else {
            hc.unhealthy_threshold
        }
    };
    if let Some(failing) = ep.record_health_check(ok, threshold) {
        info!(cluster, endpoint = %ep.addr, healthy = !failing, "health check changed the endpoint's state");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_health_messages() {
        assert_eq!(&grpc_health_request("")[..], [0, 0, 0, 0, 0]);
        assert_eq!(
            &grpc_health_request("mesh.Echo")[..],
            b"\x00\x00\x00\x00\x0b\x0a\x09mesh.Echo"
        );
        assert!(grpc_serving(b"\x00\x00\x00\x00\x02\x08\x01"));
        assert!(
            !grpc_serving(b"\x00\x00\x00\x00\x02\x08\x02"),
            "NOT_SERVING"
        );
        assert!(!grpc_serving(b"\x00\x00\x00\x00\x00"), "UNKNOWN");
        assert!(!grpc_serving(b"\x01\x00\x00\x00\x02\x08\x01"), "compressed");
        assert!(!grpc_serving(b"\x00\x00\x00"), "short");
    }
}
