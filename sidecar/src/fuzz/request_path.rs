//! A client's bytes through the request path, as a listener serves them:
//! the entry point of the coverage-guided fuzz target
//! (`fuzz/fuzz_targets/request_path.rs`) and of the corpus test. Not part of
//! the sidecar's interface.
//!
//! Two listeners run in one process for every input: a gateway's (the edge:
//! outside clients) and a sidecar's inbound one (mesh callers, with a DENY
//! policy on `/deny*`), each in front of an app of its own that records what
//! reaches it and answers with mesh headers naming an address no client
//! may see. An input's first byte picks the listener; the rest is written
//! on one connection, which is then half-closed, and the answer read until
//! the proxy closes it. The properties, what a hostile client must not
//! get done:
//! - no panic, and the connection closed within 10 s of the client's end;
//! - no hop-by-hop header reaches an app (RFC 9110 §7.6.1: the fixed list
//!   and those the client's `Connection` names), nor, through the edge, a
//!   mesh header (`x-minimesh-*`) a client sent;
//! - every path reaches the app in its normal form (`proxy::path`), and
//!   none that the DENY policy names reaches the inbound app;
//! - the app's mesh headers never reach the client (the inbound listener
//!   strips its app's; the edge strips all), nor, through the edge, the
//!   address in a 5xx reason.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};

use hyper_util::rt::TokioIo;
use minimesh_proto::v1::{
    Authorization, AuthzAction, AuthzOperation, AuthzRule, RetryOn, UpstreamProtocol,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use minimesh_proto::headers;

use crate::balance::Policy;
use crate::endpoint::EndpointState;
use crate::proxy::{path, Edge, HeadLimits, Proxy, HOP_BY_HOP};
use crate::routing::{ClusterHandle, Routing};
use crate::upstream::PoolSettings;

/// What the apps answer with, and no client may see: in a mesh header, and
/// in a 5xx reason (the address of the endpoint that failed).
const APP_ADDRESS: &str = "198.18.99.99:9";
const FAILED_ADDRESS: &str = "198.18.88.88:8";

/// A request as an app received it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Its path and query.
    pub path: String,
    /// Its header fields, names lower-case.
    pub headers: Vec<(String, Vec<u8>)>,
}

struct Harness {
    rt: tokio::runtime::Runtime,
    edge: SocketAddr,
    inbound: SocketAddr,
    edge_seen: Arc<Mutex<Vec<Seen>>>,
    inbound_seen: Arc<Mutex<Vec<Seen>>>,
    /// Requests in flight to each app (its cluster's count).
    edge_busy: Arc<std::sync::atomic::AtomicU32>,
    inbound_busy: Arc<std::sync::atomic::AtomicU32>,
    _stop: watch::Sender<bool>,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(start)
}

/// An app: records each request, and answers 503 with a mesh error naming
/// an address for a path with `/err`, else 200, each with the mesh header
/// that names an endpoint.
async fn app(listener: TcpListener, seen: Arc<Mutex<Vec<Seen>>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let seen = seen.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let seen = seen.clone();
            async move {
                let path = req
                    .uri()
                    .path_and_query()
                    .map_or(String::new(), |p| p.to_string());
                let headers = req
                    .headers()
                    .iter()
                    .map(|(k, v)| (k.as_str().to_string(), v.as_bytes().to_vec()))
                    .collect();
                let failing = path.contains("/err");
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(Seen { path, headers });
                let _ = req.into_body().collect().await;
                let mut resp = Response::builder()
                    .header(headers::ENDPOINT, APP_ADDRESS)
                    .header("content-type", "text/plain");
                resp = if failing {
                    resp.status(StatusCode::SERVICE_UNAVAILABLE).header(
                        headers::ERROR,
                        format!("connect to {FAILED_ADDRESS} failed: refused"),
                    )
                } else {
                    resp.status(StatusCode::OK)
                };
                Ok::<_, Infallible>(
                    resp.body(Full::new(Bytes::from_static(b"ok\n")))
                        .unwrap_or_default(),
                )
            }
        });
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The cluster of one app at `addr`.
fn cluster(addr: SocketAddr, local_app: bool) -> Arc<ClusterHandle> {
    Arc::new(ClusterHandle {
        name: "fuzz|app".into(),
        hash: None,
        balancer: crate::balance::Balancer::new(
            Policy::LeastRequest,
            0,
            vec![(EndpointState::new(addr, "app".to_string()), 1)],
        ),
        retry_attempts: 1,
        timeout: Some(Duration::from_secs(5)),
        per_try_timeout: None,
        budget: Arc::new(crate::retry::Budget::new(20, 10)),
        pick_ns: Default::default(),
        outlier: None,
        // Counted (a limit turns the count on): the harness waits for it.
        max_requests: u32::MAX,
        retry_on: crate::retry::Conditions::new(RetryOn::ConnectFailure as u32, &[]),
        inflight: Default::default(),
        max_retries: 0,
        retries_inflight: Default::default(),
        pool: PoolSettings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(60),
            max_requests_per_connection: 0,
            max_connection_ms: 0,
            max_streams: 0,
        },
        rule: String::new(),
        protocol: UpstreamProtocol::Http1,
        local_app,
        weights: std::collections::HashMap::from([(addr, 1)]),
    })
}

fn proxy(cluster: Arc<ClusterHandle>, edge: bool) -> Arc<Proxy> {
    let authz = (!edge).then(|| {
        let shared = crate::authz::Shared::new();
        let deny = Authorization {
            namespace: "fuzz".into(),
            name: "deny".into(),
            action: AuthzAction::AuthzDeny as i32,
            rules: vec![AuthzRule {
                to: vec![AuthzOperation {
                    paths: vec!["/deny*".into()],
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        shared.set(crate::authz::Authz::compile([&deny], "fuzz", &[]));
        (shared, 8080)
    });
    Arc::new(Proxy {
        routing: Arc::new(ArcSwap::from_pointee(Routing::only(cluster))),
        ready: Arc::new(AtomicBool::new(true)),
        trust_forwarded_for: false,
        client_idle_timeout: Some(Duration::from_secs(1)),
        client_body_timeout: Some(Duration::from_secs(1)),
        head_limits: HeadLimits::default(),
        inbound: !edge,
        edge: edge.then_some(Edge {
            debug_headers: false,
        }),
        authz,
        tls: crate::tls::Tls::new(None),
    })
}

fn start() -> Harness {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let edge_seen = Arc::new(Mutex::new(Vec::new()));
    let inbound_seen = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = watch::channel(false);
    let mut busy = Vec::new();
    let (edge, inbound) = rt.block_on(async {
        let mut addrs = Vec::new();
        for (seen, is_edge) in [(&edge_seen, true), (&inbound_seen, false)] {
            let app_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let app_addr = app_listener.local_addr().expect("addr");
            tokio::spawn(app(app_listener, seen.clone()));
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            addrs.push(listener.local_addr().expect("addr"));
            let name = if is_edge { "edge" } else { "inbound" };
            let cluster = cluster(app_addr, !is_edge);
            busy.push(cluster.inflight.clone());
            tokio::spawn(crate::listener::serve(
                name,
                listener,
                proxy(cluster, is_edge),
                None,
                stopped.clone(),
                Duration::from_secs(1),
                crate::listener::Loops::new(1),
                0,
            ));
        }
        (addrs[0], addrs[1])
    });
    Harness {
        rt,
        edge,
        inbound,
        edge_seen,
        inbound_seen,
        inbound_busy: busy.pop().expect("two"),
        edge_busy: busy.pop().expect("two"),
        _stop: stop,
    }
}

fn has(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

/// The header names an HTTP/1.1 client's `Connection` headers list, over
/// every request head in `data` that parses.
fn nominated(mut data: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let mut fields = [httparse::EMPTY_HEADER; 128];
        let mut req = httparse::Request::new(&mut fields);
        let Ok(httparse::Status::Complete(n)) = req.parse(data) else {
            return out;
        };
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("connection") {
                for name in String::from_utf8_lossy(h.value).split(',') {
                    out.push(name.trim().to_ascii_lowercase());
                }
            }
        }
        // Bodies are not skipped: a head found later is looked at too.
        data = &data[n..];
    }
}

/// The header names of each HTTP/1.1 response head found in `data`.
fn response_header_names(data: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(i) = data[at..].windows(9).position(|w| w == b"HTTP/1.1 ") {
        let start = at + i;
        let mut fields = [httparse::EMPTY_HEADER; 128];
        let mut resp = httparse::Response::new(&mut fields);
        if let Ok(httparse::Status::Complete(_)) = resp.parse(&data[start..]) {
            out.extend(resp.headers.iter().map(|h| h.name.to_ascii_lowercase()));
        }
        at = start + 9;
    }
    out
}

/// Sends one input; panics on a violated property. Returns the bytes the
/// client got back.
pub fn check(data: &[u8]) -> Vec<u8> {
    let Some((&first, sent)) = data.split_first() else {
        return Vec::new();
    };
    let h = harness();
    let edge = first & 1 == 0;
    let (to, seen, busy) = match edge {
        true => (h.edge, &h.edge_seen, &h.edge_busy),
        false => (h.inbound, &h.inbound_seen, &h.inbound_busy),
    };
    seen.lock().unwrap_or_else(|p| p.into_inner()).clear();
    let got = h.rt.block_on(async {
        let mut s = TcpStream::connect(to)
            .await
            .expect("connect to the listener");
        let _ = s.write_all(sent).await;
        // The answers first: a client's end aborts what it asked (hyper's,
        // nginx's and Envoy's way), so the connection is half-closed only
        // once nothing is on its way (no answer for 20 ms, nothing in
        // flight to the app).
        let mut got = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        let mut closed = false;
        while got.len() < 1 << 20 {
            match tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    closed = true;
                    break;
                }
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) if busy.load(Ordering::Relaxed) == 0 => break,
                Err(_) => {}
            }
        }
        if closed {
            return got;
        }
        let _ = s.shutdown().await;
        let read = async {
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 || got.len() > 1 << 20 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .is_err()
        {
            panic!("the connection stayed open 10 s after the client's end");
        }
        got
    });
    let named = nominated(sent);
    for r in seen.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        for (name, value) in &r.headers {
            let hop = HOP_BY_HOP.iter().any(|h| h.as_str() == name);
            // What the proxy writes itself is not the client's.
            let own = matches!(
                name.as_str(),
                "host" | "content-length" | "transfer-encoding"
            );
            assert!(!hop, "hop-by-hop {name}: {value:?} reached the app: {r:?}");
            assert!(
                own || !named.contains(name),
                "{name}, which the client's Connection names, reached the app: {r:?}"
            );
            assert!(
                !(edge && name.starts_with(headers::PREFIX)),
                "a client's {name} reached the app through the edge: {r:?}"
            );
        }
        assert!(
            edge || !r.path.starts_with("/deny"),
            "a request the DENY policy names reached the app: {r:?}"
        );
        let path = r.path.split('?').next().unwrap_or_default();
        assert_eq!(
            path::normalize(path),
            Ok(None),
            "a path not in its normal form reached the app: {r:?}"
        );
    }
    if !has(sent, APP_ADDRESS.as_bytes()) {
        assert!(
            !has(&got, APP_ADDRESS.as_bytes()),
            "the app's mesh header reached the client: {:?}",
            String::from_utf8_lossy(&got)
        );
    }
    if edge {
        if !has(sent, FAILED_ADDRESS.as_bytes()) {
            assert!(
                !has(&got, FAILED_ADDRESS.as_bytes()),
                "a 5xx reason's address reached an outside client: {:?}",
                String::from_utf8_lossy(&got)
            );
        }
        let names = response_header_names(&got);
        assert!(
            !names.iter().any(|n| n.starts_with(headers::PREFIX)),
            "a mesh header reached an outside client: {names:?}"
        );
    }
    got
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fuzz_corpus_holds() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/request_path");
        let mut answered = 0;
        for e in std::fs::read_dir(dir).expect("the corpus") {
            let path = e.expect("entry").path();
            let data = std::fs::read(&path).expect("read");
            let got = super::check(&data);
            answered += usize::from(got.starts_with(b"HTTP/1.1 "));
        }
        // The seeds are answered (requests that went through), not only
        // refused at the door.
        assert!(answered >= 4, "{answered}");
    }
}
