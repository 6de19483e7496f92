//! Each policy's distribution, measured at the sidecar's callers.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_splits_two_equal_endpoints_evenly() {
    let net = Net::new(11);
    let _b1 = net.backend(1, &[]).await;
    let _b2 = net.backend(2, &[]).await;
    net.service("backend", &[1, 2]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let c = load(net.addr(100, 15001), "backend", 1, 1000).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    for h in [1, 2] {
        let n = c.by_endpoint[&net.addr(h, 9090).to_string()];
        assert!((499..=501).contains(&n), "{:?}", c.by_endpoint);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_follows_rule_weights() {
    let net = Net::new(12);
    let _b: Vec<_> = futures_util::future::join_all((1..=3).map(|h| net.backend(h, &[]))).await;
    net.service("backend", &[1, 2, 3]);
    net.rule(
        "rule.yaml",
        "backend",
        &format!("simple: ROUND_ROBIN\nendpointWeights:\n- address: \"{}\"\n  weight: 2\n- pod: backend-*\n  weight: 1", net.ip(1)),
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let c = load(net.addr(100, 15001), "backend.default", 4, 2000).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    for (h, want) in [(1, 0.50), (2, 0.25), (3, 0.25)] {
        let got = c.share(net.addr(h, 9090));
        assert!(
            (got - want).abs() <= 0.01,
            "endpoint {h}: {got} vs {want}: {:?}",
            c.by_endpoint
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_spreads_over_three() {
    let net = Net::new(13);
    let _b: Vec<_> = futures_util::future::join_all((1..=3).map(|h| net.backend(h, &[]))).await;
    net.service("backend", &[1, 2, 3]);
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let c = load(
        net.addr(100, 15001),
        "backend.default.svc.cluster.local",
        4,
        3000,
    )
    .await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    for h in 1..=3 {
        let got = c.share(net.addr(h, 9090));
        assert!(
            (0.30..=0.37).contains(&got),
            "endpoint {h}: {got}: {:?}",
            c.by_endpoint
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_prefers_the_fast_endpoint() {
    let net = Net::new(14);
    let _slow = net.backend(1, &[("TIMING_50_PERCENTILE", "200ms")]).await;
    let _fast = net.backend(2, &[("TIMING_50_PERCENTILE", "10ms")]).await;
    net.service("backend", &[1, 2]);
    net.rule("rule.yaml", "backend", "simple: LEAST_REQUEST");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let c = load(net.addr(100, 15001), "backend:80", 20, 2000).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    let fast = c.share(net.addr(2, 9090));
    assert!(
        fast > 0.75,
        "fast endpoint served {fast}: {:?}",
        c.by_endpoint
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peak_ewma_keeps_a_replica_slow_regardless_of_load_out_while_fast_ones_are_busy() {
    // One replica at 200 ms, two at 30 ms; all serve side by side. With 12
    // clients, each fast replica has about six in flight: priced as if it
    // queued (30 ms × 7), a fast one would look slower than the idle slow
    // one (200 ms) and feed it. PEAK_EWMA learns they do not queue.
    let net = Net::new(128);
    let _slow = net
        .backend(
            1,
            &[("TIMING_50_PERCENTILE", "200ms"), ("TIMING_VARIANCE", "5")],
        )
        .await;
    let _f2 = net
        .backend(
            2,
            &[("TIMING_50_PERCENTILE", "30ms"), ("TIMING_VARIANCE", "10")],
        )
        .await;
    let _f3 = net
        .backend(
            3,
            &[("TIMING_50_PERCENTILE", "30ms"), ("TIMING_VARIANCE", "10")],
        )
        .await;
    net.service("backend", &[1, 2, 3]);
    net.rule("rule.yaml", "backend", "simple: PEAK_EWMA");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let proxy = net.addr(100, 15001);
    // Warm up: every replica answers a few, the fast ones under load.
    let warm = load(proxy, "backend:80", 12, 600).await;
    assert!(warm.failed.is_empty(), "{:?}", warm.failed);
    let c = load(proxy, "backend:80", 12, 3000).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    let slow = c.share(net.addr(1, 9090));
    assert!(
        slow < 0.005,
        "the slow replica served {:.2}% : {:?}",
        slow * 100.0,
        c.by_endpoint
    );
    eprintln!(
        "PEAK_EWMA, one replica of three at 200 ms, 12 clients: slow share {:.3}%, p99 {:?}",
        slow * 100.0,
        c.quantile(0.99)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_policy_is_least_request_and_h2c_and_proxy_form_work() {
    let net = Net::new(15);
    let _b1 = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    let _cp = net.control_plane().await;
    let sc = net.sidecar(100, &[]).await;
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "LEAST_REQUEST");

    // Proxy-style absolute-form request, as an HTTP_PROXY-aware client sends.
    let mut s = tokio::net::TcpStream::connect(net.addr(100, 15001))
        .await
        .expect("connect");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET http://backend/ HTTP/1.1\r\nHost: backend\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("\"name\": \"backend-1\""), "{out}");

    // HTTP/2 with prior knowledge (h2c).
    let stream = tokio::net::TcpStream::connect(net.addr(100, 15001))
        .await
        .expect("connect");
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let req = http::Request::get("http://backend.default.svc.cluster.local:80/")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("req");
    let resp = send.send_request(req).await.expect("h2 response");
    assert_eq!(resp.status(), 200);

    // An unknown host gets 404 with the reason.
    let (status, _, body) = get(net.addr(100, 15001), "nope.default", "/")
        .await
        .expect("response");
    assert_eq!(status, 404);
    assert_eq!(body.trim(), "minimesh: no route for host nope.default");

    // Metrics: per-endpoint counts and latency, pick duration per policy.
    let (_, _, metrics) = get(net.addr(100, 15000), "localhost", "/metrics")
        .await
        .expect("metrics");
    let labels = format!(
        "cluster=\"backend.default.svc.cluster.local:80\",endpoint=\"{}\",pod=\"backend-1\"",
        net.addr(1, 9090)
    );
    assert!(
        metrics.contains(&format!("minimesh_endpoint_requests_total{{{labels}}} 2\n")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "minimesh_endpoint_request_duration_seconds_count{{{labels}}} 2\n"
        )),
        "{metrics}"
    );
    // Picks are timed one in 16: of these two, the first.
    assert!(
        metrics.contains("minimesh_pick_duration_seconds_count{cluster=\"backend.default.svc.cluster.local:80\",policy=\"LEAST_REQUEST\"} 1\n"),
        "{metrics}"
    );
    drop(sc);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_ramps_a_new_endpoint_up_slowly() {
    let net = Net::new(16);
    let _b: Vec<_> = futures_util::future::join_all((1..=3).map(|h| net.backend(h, &[]))).await;
    net.service("backend", &[1, 2]);
    net.rule(
        "rule.yaml",
        "backend",
        "simple: ROUND_ROBIN\nwarmupDurationSecs: 4s",
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let proxy = net.addr(100, 15001);
    // At startup there is no slow start: both endpoints share evenly.
    let c = load(proxy, "backend", 2, 200).await;
    assert_eq!(c.share(net.addr(1, 9090)), 0.5, "{:?}", c.by_endpoint);
    net.service("backend", &[1, 2, 3]);
    wait_sidecar(
        net.addr(100, 15000),
        std::time::Duration::from_secs(2),
        |v| endpoints_of(v, "backend").len() == 3,
    )
    .await;
    let early = load(proxy, "backend", 2, 600).await;
    let early_share = early.share(net.addr(3, 9090));
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let late = load(proxy, "backend", 2, 900).await;
    let late_share = late.share(net.addr(3, 9090));
    assert!(early.failed.is_empty() && late.failed.is_empty());
    assert!(early_share < 0.2, "new endpoint took {early_share} at once");
    assert!(
        (late_share - 1.0 / 3.0).abs() < 0.02,
        "after warmup: {late_share}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_event_loops_share_one_balancer() {
    let net = Net::new(94);
    let _b1 = net.backend(1, &[]).await;
    let _b2 = net.backend(2, &[]).await;
    net.service("backend", &[1, 2]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let sc = net.sidecar(100, &["--worker-threads", "2"]).await;
    // Two loops: the sidecar's own thread plus one more serving the listeners.
    let threads = std::fs::read_dir(format!("/proc/{}/task", sc.child.id()))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(threads >= 2, "{threads} threads");
    // Connections land on either loop (SO_REUSEPORT); the split stays exact.
    let c = load(net.addr(100, 15001), "backend", 8, 2000).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    for h in [1, 2] {
        let n = c.by_endpoint[&net.addr(h, 9090).to_string()];
        assert!((990..=1010).contains(&n), "{:?}", c.by_endpoint);
    }

    // Keep-alive connections are spread evenly over the loops, whichever
    // socket the kernel's hash gives them (4/4 by the hash alone: 27%).
    let admin = net.addr(100, 15000);
    loops_become(admin, [0, 0]).await; // the load's connections are gone
    let mut conns = Vec::new();
    for _ in 0..8 {
        let mut c = Conn::open(net.addr(100, 15001)).await.expect("connect");
        let (status, _, _) = c.get("backend", "/").await.expect("response");
        assert_eq!(status, 200);
        conns.push(c);
    }
    loops_become(admin, [4, 4]).await;
    // And are counted out as they close.
    drop(conns);
    loops_become(admin, [0, 0]).await;

    // SO_REUSEPORT would let another process join those sockets and take a
    // share of the new connections unseen (a second mesh's gateway did);
    // a second sidecar on the address is refused instead, with either
    // number of loops.
    let outbound = net.addr(100, 15001);
    for loops in ["2", "1"] {
        let mut second = std::process::Command::new(bin("sidecar"))
            .args(["--xds-addr", &format!("http://{}", net.cp_xds())])
            .args(["--workload", "second", "--namespace", NS])
            .args(["--outbound", &outbound.to_string()])
            .args(["--admin", &net.addr(101, 15000).to_string()])
            .args(["--worker-threads", loops])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("sidecar starts");
        let mut exited = None;
        for _ in 0..100 {
            exited = second.try_wait().expect("wait");
            if exited.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if exited.is_none() {
            let _ = second.kill();
            panic!("a second sidecar with {loops} loop(s) runs on {outbound}, in use");
        }
        let mut err = String::new();
        std::io::Read::read_to_string(&mut second.stderr.take().expect("stderr"), &mut err)
            .expect("stderr");
        assert!(!exited.is_some_and(|s| s.success()), "{err}");
        assert!(
            err.contains(&format!(
                "binding outbound address {outbound}: Address already in use (os error 98): another process listens there"
            )),
            "{loops} loop(s): {err}"
        );
    }
    let c = load(outbound, "backend", 8, 200).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
}

/// Waits (up to 2 s) for the outbound listener's two loops to serve `want`
/// connections each.
async fn loops_become(admin: std::net::SocketAddr, want: [u64; 2]) {
    let want: Vec<String> = (0..2)
        .map(|i| {
            format!(
                "minimesh_listener_connections{{listener=\"outbound\",loop=\"{i}\"}} {}",
                want[i]
            )
        })
        .collect();
    let mut last = Vec::new();
    for _ in 0..100 {
        let (_, _, metrics) = get(admin, "localhost", "/metrics").await.expect("metrics");
        last = metrics
            .lines()
            .filter(|l| l.starts_with("minimesh_listener_connections{listener=\"outbound\""))
            .map(str::to_string)
            .collect::<Vec<_>>();
        if last == want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("loops never served {want:?}; last: {last:?}");
}

/// A Service with three ports, one rule: port 80 takes the destination's
/// ROUND_ROBIN, port 9000 hashes on a header, port 9001 weighs 3:1. A
/// portLevelSettings entry for a port the Service lacks is reported on the
/// rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_level_settings_give_each_service_port_its_own_policy() {
    let net = Net::new(17);
    let _b1 = net.backend(1, &[]).await;
    let _b2 = net.backend(2, &[]).await;
    let ports = [("http", 80), ("hash", 9000), ("weighted", 9001)];
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: backend, namespace: {NS}}}\nspec:\n  ports:\n"
    );
    for (name, port) in ports {
        yaml += &format!("  - {{name: {name}, port: {port}, targetPort: 9090}}\n");
    }
    yaml += &format!("---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: backend-abc\n  namespace: {NS}\n  labels: {{kubernetes.io/service-name: backend}}\naddressType: IPv4\nports:\n");
    for (name, _) in ports {
        yaml += &format!("- {{name: {name}, port: 9090}}\n");
    }
    yaml += "endpoints:\n";
    for h in [1, 2] {
        yaml += &endpoint_yaml(net.ip(h), &format!("backend-{h}"), None);
    }
    net.write("svc-backend.yaml", &yaml);
    net.write(
        "rule.yaml",
        &format!(
            "apiVersion: minimesh.io/v1alpha1
kind: DestinationRule
metadata: {{name: backend-dr}}
spec:
  host: backend
  trafficPolicy:
    loadBalancer: {{simple: ROUND_ROBIN}}
    portLevelSettings:
    - port: {{number: 9000}}
      loadBalancer: {{consistentHash: {{httpHeaderName: x-user}}}}
    - port: {{number: 9001}}
      loadBalancer:
        simple: ROUND_ROBIN
        endpointWeights: [{{address: \"{}\", weight: 3}}]
    - port: {{number: 9002}}
      loadBalancer: {{simple: RANDOM}}
",
            net.ip(1)
        ),
    );
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let mut conn = Conn::open(net.addr(100, 15001)).await.expect("sidecar");
    let mut served = BTreeMap::<(u16, String), u32>::new();
    for port in [80, 9000, 9001] {
        for _ in 0..400 {
            let (status, ep) = conn
                .get_with(&format!("backend:{port}"), "/", &[("x-user", "vu-7")])
                .await
                .expect("request");
            assert_eq!(status, 200);
            *served.entry((port, ep.unwrap_or_default())).or_default() += 1;
        }
    }
    let (e1, e2) = (net.addr(1, 9090).to_string(), net.addr(2, 9090).to_string());
    let n = |port: u16, ep: &str| served.get(&(port, ep.to_string())).copied().unwrap_or(0);
    // Round robin on port 80, header or not.
    assert_eq!((n(80, &e1), n(80, &e2)), (200, 200), "{served:?}");
    // One user, one endpoint on port 9000.
    assert!(n(9000, &e1) == 400 || n(9000, &e2) == 400, "{served:?}");
    // 3:1 on port 9001.
    assert_eq!((n(9001, &e1), n(9001, &e2)), (300, 100), "{served:?}");

    let cfg = get_json(net.cp_admin(), "/debug/config").await;
    let rule = &cfg["rules"][0];
    assert_eq!(rule["policy"], "ROUND_ROBIN", "{rule:#}");
    assert_eq!(
        rule["portPolicies"],
        serde_json::json!({"9000": "RING_HASH", "9001": "ROUND_ROBIN", "9002": "RANDOM"}),
        "{rule:#}"
    );
    assert_eq!(
        rule["message"],
        "spec.trafficPolicy.portLevelSettings: service backend.default has no port 9002 (its ports: 80, 9000, 9001); those settings apply to no traffic",
        "{rule:#}"
    );
}

/// Istio's locality failover, by zone: with outlier detection on, a sidecar
/// in zone a sends only to zone a while it is healthy, fails over to zone b
/// without a failed request when zone a dies, and a sidecar that does not
/// know its zone spreads over both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zone_failover_stays_in_the_callers_zone_until_it_fails() {
    let net = Net::new(19);
    let mut zone_a = vec![net.backend(1, &[]).await, net.backend(2, &[]).await];
    let _zone_b = [net.backend(3, &[]).await, net.backend(4, &[]).await];
    let mut yaml = service_yaml("backend", &[])
        .trim_end_matches("[]\n")
        .to_string();
    for (h, zone) in [(1, "a"), (2, "a"), (3, "b"), (4, "b")] {
        yaml += &endpoint_yaml(net.ip(h), &format!("backend-{h}"), Some(zone));
    }
    net.write("svc-backend.yaml", &yaml);
    // Outlier detection turns zone failover on, as in Istio.
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: backend-dr}\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer: {simple: ROUND_ROBIN}\n    outlierDetection: {consecutive5xxErrors: 5}\n",
    );
    let _cp = net.control_plane().await;
    let _in_a = net.sidecar(100, &["--zone", "a"]).await;
    let _unzoned = net.sidecar(101, &[]).await;
    let cfg = get_json(net.addr(100, 15000), "/debug/config").await;
    let local =
        &cfg["clusters"][format!("backend.{NS}.svc.cluster.local:80")]["local_zone_endpoints"];
    assert_eq!(
        local,
        &serde_json::json!([net.addr(1, 9090).to_string(), net.addr(2, 9090).to_string()]),
        "{cfg:#}"
    );

    let c = load(net.addr(100, 15001), "backend", 2, 400).await;
    assert_no_failures(&c, "zone a healthy");
    for (h, want) in [(1, 0.5), (2, 0.5), (3, 0.0), (4, 0.0)] {
        assert_eq!(c.share(net.addr(h, 9090)), want, "{:?}", c.by_endpoint);
    }
    let c = load(net.addr(101, 15001), "backend", 2, 400).await;
    assert_no_failures(&c, "no zone");
    for h in 1..=4 {
        assert_eq!(c.share(net.addr(h, 9090)), 0.25, "{:?}", c.by_endpoint);
    }

    // A sidecar without --zone beside a backend pod takes the zone of its
    // pod's endpoint: backend-3 is in zone b.
    let args: Vec<String> = [
        "--xds-addr",
        &format!("http://{}", net.cp_xds()),
        "--workload",
        "backend-3",
        "--namespace",
        NS,
        "--outbound",
        &net.addr(102, 15001).to_string(),
        "--admin",
        &net.addr(102, 15000).to_string(),
    ]
    .map(str::to_string)
    .to_vec();
    let _beside_b = net.spawn("sidecar-102", "sidecar", &args, &[]);
    wait_http(net.addr(102, 15000), "/ready").await;
    let cfg = get_json(net.addr(102, 15000), "/debug/config").await;
    assert_eq!(cfg["zone"], "b", "{cfg:#}");
    let c = load(net.addr(102, 15001), "backend", 2, 400).await;
    assert_no_failures(&c, "beside zone b");
    for (h, want) in [(1, 0.0), (2, 0.0), (3, 0.5), (4, 0.5)] {
        assert_eq!(c.share(net.addr(h, 9090)), want, "{:?}", c.by_endpoint);
    }

    // Zone a dies under load: every request is still answered, by zone b.
    let bg = Background::start(net.addr(100, 15001), "backend", 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for p in &mut zone_a {
        p.kill();
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let during = bg.finish().await;
    assert_no_failures(&during, "zone a killed under load");
    assert!(
        during.ok > 100,
        "{} requests during the failover",
        during.ok
    );
    // Zone b serves everything, near evenly: a dead endpoint whose connect
    // backoff runs out is tried again, and the retry after it is random.
    let c = load(net.addr(100, 15001), "backend", 2, 400).await;
    assert_no_failures(&c, "after zone a died");
    let (b3, b4) = (c.share(net.addr(3, 9090)), c.share(net.addr(4, 9090)));
    assert_eq!(b3 + b4, 1.0, "{:?}", c.by_endpoint);
    assert!((0.45..=0.55).contains(&b3), "{:?}", c.by_endpoint);
}
