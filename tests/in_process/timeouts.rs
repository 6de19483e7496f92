//! The rule's `timeout`: it bounds the whole request, whatever its
//! attempts, per-try timeouts and backoffs would still take.

use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_timeout_ends_attempts_and_backoffs_with_504() {
    let net = Net::new(215);
    // An endpoint that accepts and never answers: every attempt waits.
    let listener = TcpListener::bind(net.addr(1, 9090)).await.expect("bind");
    let _silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    // One service per way the request's time can run out: during a backoff
    // between attempts that time out on their own (retried on the one
    // endpoint: 200 ms, 25 ms back-off, 200 ms, 50 ms, 200 ms, then a
    // 100 ms back-off that would end past 700 ms); during an attempt whose
    // own timeout is later; with no per-try timeout.
    let cases = [
        (
            "backoff",
            "timeout: 700ms\n    retries: {attempts: 5, perTryTimeout: 200ms}",
            700,
        ),
        (
            "attempt",
            "timeout: 300ms\n    retries: {attempts: 2, perTryTimeout: 1s}",
            300,
        ),
        ("alone", "timeout: 300ms", 300),
    ];
    for (service, policy, _) in &cases {
        net.service(service, &[1]);
        net.write(
            &format!("{service}-rule.yaml"),
            &format!("apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: {service}}}\nspec:\n  host: {service}\n  trafficPolicy:\n    {policy}\n"),
        );
    }
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    wait_sidecar(net.addr(100, 15000), Duration::from_secs(10), |v| {
        cases.iter().all(|(s, _, _)| {
            !v["clusters"][format!("{s}.default.svc.cluster.local:80")]["rule"].is_null()
        })
    })
    .await;
    for (service, _, ms) in cases {
        let started = Instant::now();
        let (status, _, body) = get(net.addr(100, 15001), service, "/")
            .await
            .expect("an answer");
        let took = started.elapsed();
        assert_eq!(status, 504, "{service}: {body}");
        assert!(body.contains("request timeout"), "{service}: {body}");
        let timeout = Duration::from_millis(ms);
        assert!(
            took >= timeout && took < timeout + Duration::from_millis(400),
            "{service}: answered after {took:?}, timeout {timeout:?}"
        );
    }
}

/// `--client-idle-timeout`: a client that holds a connection without
/// sending a whole request head (headers that never end, or an idle
/// keep-alive connection) is closed after it; a response that takes longer
/// than it is not cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_send_no_request_are_closed_but_slow_responses_are_not() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let net = Net::new(216);
    let _b = net.backend(1, &[("TIMING_50_PERCENTILE", "1200ms")]).await;
    net.service("backend", &[1]);
    let _cp = net.control_plane().await;
    let _s = net.sidecar(100, &["--client-idle-timeout", "500ms"]).await;
    let proxy = net.addr(100, 15001);
    // Sends `bytes`; returns what came back and when the proxy closed.
    let exchange = |bytes: &'static [u8]| async move {
        let start = std::time::Instant::now();
        let mut io = tokio::net::TcpStream::connect(proxy)
            .await
            .expect("connect");
        io.write_all(bytes).await.expect("write");
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), io.read_to_end(&mut got))
            .await
            .expect("the proxy closes the connection")
            .expect("a clean close");
        (start.elapsed(), String::from_utf8_lossy(&got).into_owned())
    };

    let (after, got) = exchange(b"").await;
    assert_eq!(got, "", "a connection that sends nothing gets no answer");
    assert!(
        after >= Duration::from_millis(450) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );

    let (after, got) = exchange(b"GET / HTTP/1.1\r\nHost: backend\r\n").await;
    assert_eq!(got, "", "headers that never end get no answer");
    assert!(
        after >= Duration::from_millis(450) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );

    // Answered after 1.2 s, then closed once idle for 0.5 s.
    let (after, got) = exchange(b"GET / HTTP/1.1\r\nHost: backend\r\n\r\n").await;
    assert!(got.starts_with("HTTP/1.1 200 OK"), "{got}");
    assert!(
        after >= Duration::from_millis(1600) && after < Duration::from_secs(5),
        "closed after {after:?}"
    );
}
