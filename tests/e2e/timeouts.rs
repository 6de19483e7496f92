//! The rule's `timeout`: it bounds the whole request, whatever its
//! attempts, per-try timeouts and backoffs would still take.

use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use super::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_timeout_ends_attempts_and_backoffs_with_504() {
    let net = Net::new(131);
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
