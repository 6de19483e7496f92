//! Istio's `connectionPool` settings, seen from the upstream side: how many
//! connections a backend receives, when idle ones close, how long a connect
//! may take, and how many retries may be in flight.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};

use crate::harness::*;

/// A backend that answers every request with 200 on keep-alive connections
/// and counts the connections it accepted and those still open.
struct CountingServer {
    accepted: Arc<AtomicU32>,
    open: Arc<AtomicU32>,
}

impl CountingServer {
    async fn start(addr: SocketAddr) -> CountingServer {
        let l = TcpListener::bind(addr).await.expect("bind");
        let accepted = Arc::new(AtomicU32::new(0));
        let open = Arc::new(AtomicU32::new(0));
        let (a, o) = (accepted.clone(), open.clone());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let o = o.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        // Requests here are GETs without bodies: one per header block.
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            let resp = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if s.write_all(resp).await.is_err() {
                                break;
                            }
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        CountingServer { accepted, open }
    }
}

fn rule(service: &str, traffic_policy: &str) -> String {
    format!(
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: {service}-dr}}\nspec:\n  host: {service}\n  trafficPolicy:\n{}\n",
        traffic_policy
            .lines()
            .map(|l| format!("    {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_max_requests_per_connection_and_idle_timeout() {
    let net = Net::new(210);
    let reused = CountingServer::start(net.addr(1, 9090)).await;
    let capped = CountingServer::start(net.addr(2, 9090)).await;
    net.service("reused", &[1]);
    net.service("capped", &[2]);
    net.write(
        "capped-rule.yaml",
        &rule(
            "capped",
            "connectionPool:\n  http: {maxRequestsPerConnection: 5, idleTimeout: 300ms}",
        ),
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let mut conn = Conn::open(net.addr(100, 15001)).await.expect("connect");
    for _ in 0..50 {
        for host in ["reused", "capped"] {
            let (status, _, body) = conn.get(host, "/").await.expect("response");
            assert_eq!((status, body.as_str()), (200, "ok"));
        }
    }
    // Default: one keep-alive connection carries all 50 requests.
    assert_eq!(reused.accepted.load(Ordering::SeqCst), 1);
    // maxRequestsPerConnection 5: 50 requests on exactly 10 connections.
    assert_eq!(capped.accepted.load(Ordering::SeqCst), 10);
    // The sidecar reports the connection it keeps open.
    let (_, _, metrics) = get(net.addr(100, 15000), "localhost", "/metrics")
        .await
        .expect("metrics");
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("minimesh_endpoint_connections{")
                && l.contains(&net.addr(1, 9090).to_string())
        })
        .expect("connections metric");
    assert!(line.ends_with(" 1"), "{line}");
    // idleTimeout 300ms: the idle connection is closed (swept within a
    // second); the default keeps its connection open.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while capped.open.load(Ordering::SeqCst) != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "idle connection never closed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(reused.open.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connection_duration_retires_old_connections() {
    let net = Net::new(211);
    let reused = CountingServer::start(net.addr(1, 9090)).await;
    let aged = CountingServer::start(net.addr(2, 9090)).await;
    net.service("reused", &[1]);
    net.service("aged", &[2]);
    net.write(
        "aged-rule.yaml",
        &rule(
            "aged",
            "connectionPool:\n  tcp: {maxConnectionDuration: 250ms}",
        ),
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let mut conn = Conn::open(net.addr(100, 15001)).await.expect("connect");
    // Six bursts of three requests, 300 ms apart: each burst finds the
    // previous connection past 250 ms and opens one, which its other two
    // requests reuse.
    for _ in 0..6 {
        for _ in 0..3 {
            for host in ["reused", "aged"] {
                let (status, _, body) = conn.get(host, "/").await.expect("response");
                assert_eq!((status, body.as_str()), (200, "ok"));
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(reused.accepted.load(Ordering::SeqCst), 1);
    let n = aged.accepted.load(Ordering::SeqCst);
    // 6, or a few more if a burst straddles a connection's 250 ms.
    assert!((6..=9).contains(&n), "{n} connections for 6 bursts");
    // Retired connections are closed, not left open.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while aged.open.load(Ordering::SeqCst) > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "old connections left open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A listener whose accept queue is full: connects to it hang, as to a
/// host that drops SYNs.
async fn hung_listener(addr: SocketAddr) -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>) {
    let sock = TcpSocket::new_v4().expect("socket");
    sock.bind(addr).expect("bind");
    let l = sock.listen(0).expect("listen");
    // Fill the queue; nothing ever accepts.
    let mut held = Vec::new();
    for _ in 0..4 {
        let s = TcpSocket::new_v4().expect("socket");
        if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_millis(100), s.connect(addr)).await {
            held.push(c);
        }
    }
    (l, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_timeout_from_the_rule_moves_on_to_another_endpoint() {
    let net = Net::new(212);
    let _hung = hung_listener(net.addr(1, 9090)).await;
    let _good = net.backend(2, &[]).await;
    net.service("backend", &[1, 2]);
    net.service("lonely", &[1]);
    for svc in ["backend", "lonely"] {
        net.write(
            &format!("{svc}-rule.yaml"),
            &rule(
                svc,
                "loadBalancer: {simple: ROUND_ROBIN}\nconnectionPool:\n  tcp: {connectTimeout: 200ms}",
            ),
        );
    }
    let _cp = net.control_plane().await;
    // The sidecar's own default would wait 10 s: the rule's 200ms must win.
    let _sc = net.sidecar(100, &["--connect-timeout", "10s"]).await;
    let proxy = net.addr(100, 15001);
    let t0 = tokio::time::Instant::now();
    let mut conn = Conn::open(proxy).await.expect("connect");
    for _ in 0..10 {
        let (status, ep, _) = conn.get("backend", "/").await.expect("response");
        assert_eq!(status, 200);
        assert_eq!(ep, Some(net.addr(2, 9090).to_string()));
    }
    let (status, _, body) = conn.get("lonely", "/").await.expect("response");
    assert_eq!(status, 503);
    assert!(
        body.contains(&format!(
            "connect to {} failed: connect timed out after 200ms",
            net.addr(1, 9090)
        )),
        "{body}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}: the rule's connect timeout was not applied",
        t0.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_retries_bounds_retries_in_flight() {
    let net = Net::new(213);
    // Two endpoints that accept and never answer: every attempt times out.
    let mut silent = Vec::new();
    for host in [1, 2] {
        let l = TcpListener::bind(net.addr(host, 9090)).await.expect("bind");
        silent.push(tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        }));
    }
    net.service("backend", &[1, 2]);
    net.write(
        "rule.yaml",
        &rule(
            "backend",
            "retries: {attempts: 1, perTryTimeout: 300ms, retryOn: reset}\nconnectionPool:\n  http: {maxRetries: 1}",
        ),
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let proxy = net.addr(100, 15001);
    let requests: Vec<_> = (0..3)
        .map(|_| {
            tokio::spawn(async move {
                let mut c = Conn::open(proxy).await.expect("connect");
                c.get("backend", "/").await.expect("response")
            })
        })
        .collect();
    let mut statuses = Vec::new();
    let mut overflowed = 0;
    for r in requests {
        let (status, _, body) = r.await.expect("join");
        statuses.push(status);
        if body.contains("has 1 retries in flight (connectionPool.http.maxRetries)") {
            overflowed += 1;
        }
    }
    statuses.sort();
    // All three first attempts time out together; one retry is admitted
    // (and times out too: 504), the other two are refused at once (503).
    assert_eq!(statuses, vec![503, 503, 504]);
    assert_eq!(overflowed, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflowing_the_connection_pool_is_answered_at_once_with_the_reason() {
    let net = Net::new(214);
    let _b = net.backend(1, &[("TIMING_50_PERCENTILE", "500ms")]).await;
    net.service("backend", &[1]);
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: backend-dr}\nspec:\n  host: backend\n  trafficPolicy:\n    connectionPool:\n      tcp: {maxConnections: 2}\n      http: {http1MaxPendingRequests: 2}\n",
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let proxy = net.addr(100, 15001);
    let slow: Vec<_> = (0..4)
        .map(|_| tokio::spawn(async move { get(proxy, "backend", "/").await }))
        .collect();
    // The four in flight (and none answered: the backend takes 500 ms).
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(5), |v| {
        v["clusters"]["backend.default.svc.cluster.local:80"]["endpoints"][0]["active"] == 4
    })
    .await;
    let mut c = Conn::open(proxy).await.expect("connect");
    let (status, _, body) = c.get("backend", "/").await.expect("response");
    // Answered at once: before any of the four in flight was.
    assert!(
        slow.iter().all(|s| !s.is_finished()),
        "the overflow waited for a request in flight to end"
    );
    assert_eq!(status, 503);
    assert_eq!(body.trim(), "minimesh: cluster backend.default.svc.cluster.local:80 has 4 requests in flight (connectionPool limit)");
    for s in slow {
        let (status, _, _) = s.await.expect("join").expect("response");
        assert_eq!(status, 200);
    }
    // Once they finish, requests are admitted again.
    let (status, _, _) = c.get("backend", "/").await.expect("response");
    assert_eq!(status, 200);
}
