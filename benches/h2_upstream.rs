//! What HTTP/2 to the endpoints costs against HTTP/1.1: one sidecar in front
//! of a zero-latency fake-service (which serves both), 64 client
//! connections for 8 s, its Service port declared plain (HTTP/1.1: a
//! connection per request in flight) or `appProtocol: http2` (streams on
//! one shared connection). The two take turns over rounds, each on a fresh
//! sidecar; requests per second, the sidecar's CPU per request (from
//! /proc) and its upstream connections are printed per round, then the
//! medians and the paired ratios. `cargo bench --bench h2_upstream`
//! (about 2 minutes).

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
use minimesh_cli::bench::overhead::cpu_ticks;

const ROUNDS: usize = 5;
const SECONDS: u64 = 8;
const CLIENTS: usize = 64;

fn service(net: &Net, h2: bool) {
    let yaml = service_yaml("echo", &[(net.ip(1), "echo-0".into())]);
    let yaml = if h2 {
        yaml.replacen(
            "  - name: http\n    port: 80\n",
            "  - name: http\n    port: 80\n    appProtocol: http2\n",
            1,
        )
    } else {
        yaml
    };
    net.write("svc-echo.yaml", &yaml);
}

struct Run {
    rps: f64,
    cpu_us: f64,
    conns: u64,
}

async fn run(net: &Net, h2: bool) -> Run {
    service(net, h2);
    let sidecar = net.sidecar(10, &[]).await;
    let want = if h2 { "HTTP/2" } else { "HTTP/1.1" };
    wait_sidecar(net.addr(10, 15000), Duration::from_secs(10), |v| {
        v["clusters"][format!("echo.{NS}.svc.cluster.local:80")]["protocol"] == want
    })
    .await;
    // Warm-up: connections opened, caches filled.
    let w = Background::start(net.addr(10, 15001), "echo", CLIENTS);
    tokio::time::sleep(Duration::from_secs(1)).await;
    w.finish().await;

    let pid = sidecar.child.id();
    let t0 = cpu_ticks(pid);
    let start = std::time::Instant::now();
    let load = Background::start(net.addr(10, 15001), "echo", CLIENTS);
    tokio::time::sleep(Duration::from_secs(SECONDS)).await;
    let counts = load.finish().await;
    let elapsed = start.elapsed().as_secs_f64();
    let ticks = cpu_ticks(pid) - t0;
    assert_no_failures(&counts, want);
    let v = get_json(net.addr(10, 15000), "/debug/config").await;
    let conns = v["clusters"][format!("echo.{NS}.svc.cluster.local:80")]["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["connections"].as_u64().unwrap_or(0))
        .sum();
    Run {
        rps: counts.ok as f64 / elapsed,
        cpu_us: ticks as f64 * 10_000.0 / counts.ok.max(1) as f64,
        conns,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let net = Net::new(34);
    let _backend = net.backend(1, &[]).await;
    service(&net, false);
    let _cp = net.control_plane().await;
    println!(
        "{:<8} {:<9} {:>9} {:>14} {:>18}",
        "round", "upstream", "req/s", "CPU µs / req", "upstream conns"
    );
    let mut pairs = Vec::new();
    for round in 1..=ROUNDS {
        let h1 = run(&net, false).await;
        let h2 = run(&net, true).await;
        for (name, r) in [("HTTP/1.1", &h1), ("HTTP/2", &h2)] {
            println!(
                "{round:<8} {name:<9} {:>9.0} {:>14.2} {:>18}",
                r.rps, r.cpu_us, r.conns
            );
        }
        pairs.push((h1, h2));
    }
    let med = |f: &dyn Fn(&(Run, Run)) -> f64| median(pairs.iter().map(f).collect());
    println!(
        "\nmedians: HTTP/1.1 {:.0} req/s at {:.2} µs a request; HTTP/2 {:.0} req/s at {:.2} µs",
        med(&|p| p.0.rps),
        med(&|p| p.0.cpu_us),
        med(&|p| p.1.rps),
        med(&|p| p.1.cpu_us)
    );
    println!(
        "HTTP/2 against HTTP/1.1, round by round (median): {:.2}× the requests per second, {:.2}× the CPU per request",
        med(&|p| p.1.rps / p.0.rps),
        med(&|p| p.1.cpu_us / p.0.cpu_us)
    );
}
