//! Instructions the sidecar executes per proxied request, counted by
//! valgrind's callgrind. CPU time on this shared 2-core machine moves by
//! 10% and more between runs; this count moves by about 0.2%, so it can tell
//! a change of 1% in the request path from noise. One sidecar (outbound
//! listener) in front of a zero-latency fake-service over HTTP/1.1 runs
//! under callgrind for `SHORT` requests, then a fresh one for `LONG` (8
//! connections each); the difference over `LONG - SHORT` is the cost of a
//! request, start-up and configuration cancelling out. User space only: the
//! kernel's share, most of a request's cost (see BENCHMARKS.md), is not
//! counted. `cargo bench --bench instructions` (about two minutes; needs
//! valgrind, `apt-get install valgrind`). The callgrind files are kept, for
//! `callgrind_annotate`. `MINIMESH_BENCH_SIDECAR=PATH` measures another
//! build's sidecar binary against the same backend and control plane (an
//! A/B: run it once per build). `MINIMESH_BENCH_ROUTES=1` gives the echo
//! Service a VirtualService of 10 routes whose first every request matches
//! (the cost of the route table on the request path).

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

use std::process::{Command, Stdio};
use std::time::Duration;

use harness::*;

const ROUNDS: usize = 3;
const SHORT: u64 = 2_000;
const LONG: u64 = 12_000;
const CLIENTS: usize = 8;

/// Instructions of a sidecar that proxied `n` requests, start to exit.
async fn instructions(net: &Net, sidecar: &str, n: u64, out: &std::path::Path) -> u64 {
    let log = net.dir.join("logs").join(format!("sidecar-{n}.log"));
    let file = std::fs::File::create(&log).expect("log file");
    let child = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(sidecar)
        .args(["--xds-addr", &format!("http://{}", net.cp_xds())])
        .args(["--workload", "client", "--namespace", NS])
        .args(["--outbound", &net.addr(10, 15001).to_string()])
        .args(["--admin", &net.addr(10, 15000).to_string()])
        .args(["--drain", "0s"])
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("log file"))
        .stderr(file)
        .spawn()
        .expect("valgrind");
    let mut sidecar = Proc {
        name: "sidecar under callgrind".into(),
        child,
        log,
    };
    wait_http(net.addr(10, 15000), "/ready").await;
    let counts = load(net.addr(10, 15001), "echo", CLIENTS, n).await;
    assert_no_failures(&counts, "");
    sidecar.signal("TERM");
    for _ in 0..600 {
        if sidecar.child.try_wait().ok().flatten().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = std::fs::read_to_string(out).expect("callgrind output");
    text.lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("a summary line")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let found = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        println!("valgrind is not installed (apt-get install valgrind): nothing measured");
        return;
    }
    let sidecar = std::env::var("MINIMESH_BENCH_SIDECAR").unwrap_or_else(|_| bin("sidecar").into());
    println!("sidecar: {sidecar}");
    let net = Net::new(35);
    let _backend = net.backend(1, &[]).await;
    net.write(
        "svc-echo.yaml",
        &service_yaml("echo", &[(net.ip(1), "echo-0".into())]),
    );
    if std::env::var_os("MINIMESH_BENCH_ROUTES").is_some() {
        let mut vs = String::from("apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: echo}\nspec:\n  hosts: [echo]\n  http:\n  - match: [{uri: {prefix: /}}]\n    route: [{destination: {host: echo}}]\n");
        for i in 1..10 {
            vs.push_str(&format!(
                "  - match: [{{uri: {{prefix: /r{i}}}}}]\n    route: [{{destination: {{host: echo}}}}]\n"
            ));
        }
        net.write("vs-echo.yaml", &vs);
        println!("routes: a VirtualService of 10 routes; every request matches the first");
    }
    let _cp = net.control_plane().await;
    let keep = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("instructions");
    std::fs::create_dir_all(&keep).expect("output directory");
    println!(
        "{:<6} {:>16} {:>16} {:>18}",
        "round",
        format!("{SHORT} requests"),
        format!("{LONG} requests"),
        "per request"
    );
    let mut per = Vec::new();
    for round in 1..=ROUNDS {
        let file = |n: u64| keep.join(format!("callgrind.{round}.{n}"));
        let short = instructions(&net, &sidecar, SHORT, &file(SHORT)).await;
        let long = instructions(&net, &sidecar, LONG, &file(LONG)).await;
        let p = (long.saturating_sub(short)) as f64 / (LONG - SHORT) as f64;
        println!("{round:<6} {short:>16} {long:>16} {p:>18.0}");
        per.push(p);
    }
    per.sort_by(f64::total_cmp);
    println!(
        "\nthe sidecar executes {:.0} instructions (user space) per proxied request (median of {ROUNDS}; range {:.0}-{:.0}); callgrind files in {}",
        per[ROUNDS / 2],
        per[0],
        per[ROUNDS - 1],
        keep.display()
    );
}
