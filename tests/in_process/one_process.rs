//! The tier's own premise: a control plane and two sidecars share one
//! process, and each stops when told.

use std::time::{Duration, Instant};

use tokio::net::TcpStream;

use crate::harness::*;

/// A control plane and two sidecars in this one process: the caller's
/// sidecar balances over the backend's sidecar (its inbound listener in
/// front of the app) and the app answers; a rule changed in the config
/// directory reaches the caller; everything stops when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_and_two_sidecars_share_one_process() {
    let started = Instant::now();
    let net = Net::new(200);
    // The backend: its app on 8080, its sidecar's inbound on 9090.
    let _app = net.app(2).await;
    net.service("backend", &[2]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let control_plane = net.control_plane().await;
    let inbound = net.inbound_flags(2);
    let flags: Vec<&str> = inbound.iter().map(String::as_str).collect();
    let backend = net.sidecar(2, &flags).await;
    let web = net.sidecar(1, &[]).await;

    // web -> web's sidecar -> backend's sidecar -> backend's app.
    let (outbound, admin) = (net.addr(1, 15001), net.addr(1, 15000));
    let (status, _, body) = get(outbound, "backend", "/hello")
        .await
        .expect("a response");
    assert_eq!(status, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).expect("fake-service's JSON");
    assert_eq!(body["name"], "backend-2");
    assert_eq!(body["uri"], "/hello");
    // The rule as web's sidecar holds it, and a change of it.
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "backend") == "ROUND_ROBIN"
    })
    .await;
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    wait_sidecar(admin, Duration::from_secs(10), |v| {
        policy_of(v, "backend") == "RANDOM"
    })
    .await;
    let c = load(outbound, "backend", 2, 20).await;
    assert_no_failures(&c, "");
    assert_eq!(c.ok, 20);

    web.stop().await;
    backend.stop().await;
    drop(control_plane);
    wait_closed(net.cp_xds()).await;
    assert!(
        get(outbound, "backend", "/").await.is_err(),
        "web's sidecar stopped listening"
    );
    assert!(
        TcpStream::connect(admin).await.is_err(),
        "web's admin server stopped"
    );
    eprintln!("in-process: {:?}", started.elapsed());
}

/// Waits (up to 10 s) until nothing listens at `addr`.
async fn wait_closed(addr: std::net::SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "{addr} still listening 10 s after its stop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
