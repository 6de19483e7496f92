//! Three backends of unequal capacity (CONCURRENCY 16/4/2, base latency
//! 20/40/60 ms) under 120 concurrent clients through two sidecars: LOAD_AWARE
//! against ROUND_ROBIN with equal weights, the best static weights by hand
//! (24:3:1, capacity = concurrency / latency), and LEAST_REQUEST, in one run.
//! `cargo bench --bench unequal_capacity` (about 2 minutes).

// Test support: each bench uses part of it.
#[allow(dead_code, unused_imports)]
#[path = "../tests/support/client.rs"]
mod client;
#[allow(dead_code, unused_imports)]
#[path = "../tests/e2e/harness.rs"]
mod harness;
#[allow(dead_code, unused_imports)]
#[path = "../tests/support/loopback.rs"]
mod loopback;
#[allow(dead_code, unused_imports)]
#[path = "../tests/support/views.rs"]
mod views;
#[allow(dead_code, unused_imports)]
#[path = "../tests/e2e/watchdog.rs"]
mod watchdog;
#[allow(dead_code, unused_imports)]
#[path = "../tests/support/yaml.rs"]
mod yaml;

use std::time::Duration;

use harness::*;

const SECONDS: u64 = 20;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let net = Net::new(90);
    let _procs = mesh(&net, &UNEQUAL, "simple: ROUND_ROBIN", &[100, 101]).await;
    let runs = [
        ("ROUND_ROBIN (equal)", "simple: ROUND_ROBIN".to_string()),
        (
            "ROUND_ROBIN 24:3:1 (by hand)",
            format!(
                "simple: ROUND_ROBIN\nendpointWeights:\n- {{address: \"{}\", weight: 24}}\n- {{address: \"{}\", weight: 3}}\n- {{address: \"{}\", weight: 1}}",
                net.ip(1),
                net.ip(2),
                net.ip(3)
            ),
        ),
        ("LEAST_REQUEST", "simple: LEAST_REQUEST".to_string()),
        ("LOAD_AWARE", "simple: LOAD_AWARE".to_string()),
    ];
    println!(
        "{:<30} {:>9} {:>9} {:>9} {:>9} {:>9}  share 1/2/3",
        "policy", "requests", "success", "p50", "p95", "p99"
    );
    for (name, lb) in runs {
        net.rule("rule.yaml", "backend", &lb);
        tokio::time::sleep(Duration::from_millis(500)).await;
        // LOAD_AWARE needs its first reports: let it warm up for 5 s, as users would.
        if name == "LOAD_AWARE" {
            let w = Background::start(net.addr(100, 15001), "backend", 60);
            let w2 = Background::start(net.addr(101, 15001), "backend", 60);
            tokio::time::sleep(Duration::from_secs(5)).await;
            let _ = (w.finish().await, w2.finish().await);
        }
        let a = Background::start(net.addr(100, 15001), "backend", 60);
        let b = Background::start(net.addr(101, 15001), "backend", 60);
        tokio::time::sleep(Duration::from_secs(SECONDS)).await;
        let (a, b) = (a.finish().await, b.finish().await);
        let mut all = a.clone();
        all.ok += b.ok;
        all.failed.extend(b.failed.clone());
        all.lat_us.extend(b.lat_us.clone());
        for (k, v) in &b.by_endpoint {
            *all.by_endpoint.entry(k.clone()).or_default() += v;
        }
        let total = all.ok + all.failed.len() as u64;
        let shares: Vec<String> = (1..=3)
            .map(|h| format!("{:.0}%", all.share(net.addr(h, 9090)) * 100.0))
            .collect();
        println!(
            "{name:<30} {total:>9} {:>8.2}% {:>7.0}ms {:>7.0}ms {:>7.0}ms  {}",
            all.ok as f64 * 100.0 / total.max(1) as f64,
            all.quantile(0.5).as_secs_f64() * 1000.0,
            all.quantile(0.95).as_secs_f64() * 1000.0,
            all.quantile(0.99).as_secs_f64() * 1000.0,
            shares.join("/")
        );
    }
}
