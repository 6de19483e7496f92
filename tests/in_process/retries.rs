//! Retries: where they go, what they hide, and the budget that bounds them.

use std::net::SocketAddr;
use std::time::Duration;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_rule_a_replica_shedding_503s_costs_callers_almost_nothing() {
    let net = Net::new(201);
    // One replica of three answers 503 to 30% of its requests.
    let _shedding = net
        .backend(1, &[("ERROR_RATE", "0.3"), ("ERROR_CODE", "503")])
        .await;
    let _b2 = net.backend(2, &[]).await;
    let _b3 = net.backend(3, &[]).await;
    net.service("backend", &[1, 2, 3]);
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    const N: u64 = 3000;
    let c = load(net.addr(100, 15001), "backend", 4, N).await;
    // Istio's default retries 503 on another endpoint: about 10% of first
    // tries fail, and nearly none of the requests.
    let failed = c.failed.len() as f64 / N as f64;
    assert!(
        failed < 0.005,
        "{} of {N} failed: {:?}",
        c.failed.len(),
        &c.failed[..c.failed.len().min(3)]
    );
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    let cluster = &v["clusters"]["backend.default.svc.cluster.local:80"];
    let retries = cluster["retries"].as_u64().expect("retries");
    // The extra load is the shed share, within the budget (20%).
    assert!(
        (N / 20..=N / 5).contains(&retries),
        "{retries} retries for {N} requests"
    );
    eprintln!(
        "a replica shedding 30% with 503, no rule: {} of {N} failed, {retries} retries",
        c.failed.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stay_within_the_budget_when_every_backend_fails() {
    let net = Net::new(202);
    // Three endpoints, none listening: every attempt is refused.
    net.service("backend", &[1, 2, 3]);
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let start = tokio::time::Instant::now();
    let c = load(net.addr(100, 15001), "backend", 4, 600).await;
    let secs = start.elapsed().as_secs_f64().ceil();
    assert_eq!(c.ok, 0);
    assert_eq!(c.failed.len(), 600);
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    let cluster = &v["clusters"]["backend.default.svc.cluster.local:80"];
    let retries = cluster["retries"].as_u64().expect("retries");
    let exhausted = cluster["retry_budget_exhausted"]
        .as_u64()
        .expect("exhausted");
    // 20% of requests plus 10 a second (windows are whole seconds: one more may straddle).
    let allowed = (0.2 * 600.0 + 10.0 * (secs + 1.0)) as u64;
    assert!(
        retries <= allowed,
        "{retries} retries for 600 requests in {secs} s (allowed {allowed})"
    );
    assert!(exhausted > 0, "budget never ran out: {retries} retries");
    assert!(
        c.failed
            .iter()
            .any(|f| f.contains("retry budget exhausted")),
        "{:?}",
        &c.failed[..3]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_on_5xx_hides_a_failing_replica() {
    let net = Net::new(203);
    let _bad = net.backend(1, &[("ERROR_RATE", "0.5")]).await;
    let _good = net.backend(2, &[]).await;
    net.service("backend", &[1, 2]);
    // Ejection off: this test counts retries, and five 500s in a row (one
    // run of five in 32) would eject the bad replica for 30 s.
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: backend-dr}\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer: {simple: ROUND_ROBIN}\n    retries: {attempts: 2, retryOn: \"5xx,connect-failure\", budgetPercent: 50}\n    outlierDetection: {consecutive5xxErrors: 0}\n",
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let c = load(net.addr(100, 15001), "backend", 4, 400).await;
    assert_no_failures(&c, "");
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    let retries = v["clusters"]["backend.default.svc.cluster.local:80"]["retries"]
        .as_u64()
        .expect("retries");
    assert!(
        (40..=160).contains(&retries),
        "{retries} retries for ~100 injected errors"
    );

    // A bad token is refused with the field and the reason.
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: backend-dr}\nspec:\n  host: backend\n  trafficPolicy:\n    retries: {retryOn: \"5xx,sometimes\"}\n",
    );
    let cfg = wait_cp_config(&net, |v| v["errors"][0]["field"].is_string()).await;
    assert_eq!(
        cfg["errors"][0]["field"],
        "spec.trafficPolicy.retries.retryOn"
    );
    assert!(cfg["errors"][0]["reason"]
        .as_str()
        .expect("reason")
        .starts_with("unknown token \"sometimes\""));
}

/// Listens at `addr` as a replica that crashes mid-request: it reads each
/// request's head, then resets the connection without answering. Counts
/// the requests it dropped.
async fn resetting_replica(
    addr: SocketAddr,
) -> (
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    let dropped = std::sync::Arc::new(AtomicU64::new(0));
    let count = dropped.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                count.fetch_add(1, Ordering::Relaxed);
                // Closing with SO_LINGER 0 sends RST: the caller reads a
                // reset, not an end of stream.
                let _ = s.set_zero_linger();
            });
        }
    });
    (task, dropped)
}

/// Istio's default retry policy sends each retry to a host the request
/// has not tried yet (Envoy's `previous_hosts` predicate). With two
/// replicas failing in flight (which backs neither off) and one healthy,
/// a request's three attempts reach the healthy one at the latest; had a
/// retry avoided only the endpoint it last failed on, the third attempt
/// could go back to the first (one request in six under RANDOM).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_never_returns_to_an_endpoint_the_request_already_failed_on() {
    use std::sync::atomic::Ordering;
    let net = Net::new(204);
    let (r1, dropped1) = resetting_replica(net.addr(1, 9090)).await;
    let (r2, dropped2) = resetting_replica(net.addr(2, 9090)).await;
    let _good = net.backend(3, &[]).await;
    net.service("backend", &[1, 2, 3]);
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    const N: u64 = 600;
    for policy in ["RANDOM", "LEAST_REQUEST", "ROUND_ROBIN"] {
        // Two thirds of first attempts fail and about a third of second
        // ones: the budget is raised so that only where retries go is
        // tested; ejection is off so that the failing replicas stay in.
        net.write(
            "rule.yaml",
            &format!("apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: backend-dr}}\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer: {{simple: {policy}}}\n    retries: {{budgetPercent: 100, minRetriesPerSecond: 1000}}\n    outlierDetection: {{consecutive5xxErrors: 0}}\n"),
        );
        wait_sidecar(net.addr(100, 15000), Duration::from_secs(15), |v| {
            policy_of(v, "backend") == policy
        })
        .await;
        let before = (
            dropped1.load(Ordering::Relaxed),
            dropped2.load(Ordering::Relaxed),
        );
        let c = load(net.addr(100, 15001), "backend", 4, N).await;
        assert_no_failures(&c, &format!("{policy}: "));
        assert_eq!(c.ok, N, "{policy}");
        let dropped = (
            dropped1.load(Ordering::Relaxed) - before.0,
            dropped2.load(Ordering::Relaxed) - before.1,
        );
        // Each failing replica took its share of attempts: the retries
        // were exercised, not avoided.
        assert!(
            dropped.0 >= N / 6 && dropped.1 >= N / 6,
            "{policy}: the failing replicas dropped {dropped:?} of {N} requests"
        );
        eprintln!("{policy}: {N} requests, none failed; the failing replicas dropped {dropped:?}");
    }
    r1.abort();
    r2.abort();
}
