//! What the inbound listener passes on from the app behind it.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Response};
use http_body_util::Full;
use hyper_util::rt::TokioIo;

use crate::harness::*;

/// An app that answers every request 503 and forges every header the mesh
/// uses between sidecars, as if its own sidecar had written them.
async fn forging_app(addr: SocketAddr) {
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind app");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let svc = hyper::service::service_fn(|_req| async {
                let resp = Response::builder()
                    .status(503)
                    .header("x-minimesh-error", "connect to the app failed")
                    .header("x-minimesh-unprocessed", "true")
                    .header("x-minimesh-endpoint", "10.9.9.9:80")
                    .header("x-minimesh-overflow", "pool")
                    .header("x-app", "mine")
                    .body(Full::new(Bytes::from_static(b"app says no")))
                    .expect("response");
                Ok::<_, Infallible>(resp)
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc),
            );
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_cannot_speak_for_its_sidecar() {
    let net = Net::new(35);
    forging_app(net.addr(1, 8080)).await;
    net.service("backend", &[1]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let flags = net.inbound_flags(1);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let _pod = net.sidecar(1, &flags).await;

    // Straight to the pod's inbound listener: the app's status, body and
    // own headers pass; of the mesh's headers only the endpoint, which the
    // sidecar itself sets, naming the app.
    let mut direct = Conn::open(net.addr(1, 9090)).await.expect("inbound");
    let (status, headers, body) = direct
        .send(Method::POST, "backend", "/", &[], Bytes::from_static(b"x"))
        .await
        .expect("an answer");
    assert_eq!((status, body.as_str()), (503, "app says no"));
    assert_eq!(
        headers.get("x-app").map(|v| v.as_bytes()),
        Some(&b"mine"[..])
    );
    for forged in [
        "x-minimesh-error",
        "x-minimesh-unprocessed",
        "x-minimesh-overflow",
    ] {
        assert!(
            !headers.contains_key(forged),
            "{forged} passed: {headers:?}"
        );
    }
    assert_eq!(
        headers
            .get("x-minimesh-endpoint")
            .and_then(|v| v.to_str().ok()),
        Some(net.addr(1, 8080).to_string().as_str()),
        "{headers:?}"
    );

    // Through a caller's sidecar: the app's 503 reaches the caller as the
    // app's answer to a request it processed, not as a mesh error that
    // would mark the request unprocessed.
    let _caller = net.sidecar(100, &[]).await;
    let mut conn = Conn::open(net.addr(100, 15001)).await.expect("outbound");
    let (status, headers, body) = conn
        .send(Method::POST, "backend", "/", &[], Bytes::from_static(b"x"))
        .await
        .expect("an answer");
    assert_eq!((status, body.as_str()), (503, "app says no"));
    assert!(!headers.contains_key("x-minimesh-error"), "{headers:?}");
    assert!(
        !headers.contains_key("x-minimesh-unprocessed"),
        "{headers:?}"
    );
}
