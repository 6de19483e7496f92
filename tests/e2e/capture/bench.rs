//! `minimesh bench overhead` with capture set against the explicit
//! listener.

use std::process::Command;

use super::{cannot_run, stdout_of, STARTS};
use crate::harness::*;

/// `minimesh bench overhead --capture`: the capture pod's two paths (its
/// sidecar through capture, and through its explicit listener) are
/// measured in the same rounds with no request failed, and set against
/// each other round by round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_overhead_sets_capture_against_the_explicit_listener() {
    if cannot_run().is_some() {
        return;
    }
    let net = Net::new(145);
    // Its pod network is made somewhere in the run: shared all along.
    let _shared = STARTS.read().await;
    let out = net.dir.join("bench");
    let o = Command::new(bin("minimesh"))
        .arg("--home")
        .arg(net.dir.join("home"))
        .args([
            "bench",
            "overhead",
            "--capture",
            "--scale",
            "0.1",
            "--rounds",
            "2",
        ])
        .args(["--no-peers", "--load-generator", "built-in"])
        .args(["--network", &net.ip(0).to_string()])
        .args(["--ingress", &net.addr(252, 30000).to_string()])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("runs");
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("overhead/overhead.json")).expect("overhead.json"),
    )
    .expect("JSON");
    let path = |name: &str| {
        v["paths"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["path"] == name))
            .unwrap_or_else(|| panic!("no {name} row: {v:#}"))
            .clone()
    };
    let (explicit, captured) = (
        path("capture: explicit inbound"),
        path("capture: captured inbound"),
    );
    for row in [&explicit, &captured] {
        assert_eq!(row["errors"], 0, "{row}");
        assert!(row["max_rps"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
    }
    let c = &v["capture_against_explicit"];
    for round in 0..2 {
        let cpu =
            |row: &serde_json::Value| row["cpu_s_per_1000_rounds"][round].as_f64().unwrap_or(0.0);
        if cpu(&explicit) > 0.0 {
            let got = c["cpu_ratio_rounds"][round].as_f64().unwrap_or(-1.0);
            assert!((got - cpu(&captured) / cpu(&explicit)).abs() < 1e-9, "{c}");
        }
        let p50 = |row: &serde_json::Value| row["p50_ms_rounds"][round].as_f64().unwrap_or(0.0);
        let got = c["p50_diff_ms_rounds"][round].as_f64().unwrap_or(-1.0);
        assert!(
            (got - (p50(&captured) - p50(&explicit))).abs() < 1e-9,
            "{c}"
        );
    }
    let summary = std::fs::read_to_string(out.join("overhead/summary.txt")).expect("summary");
    assert!(
        summary.contains("capture against the explicit listener"),
        "{summary}"
    );
    // The capture pod's network is gone with the bench.
    let netns = stdout_of(Command::new("ip").args(["netns", "list"]));
    assert!(!netns.contains("overhead-echo"), "{netns}");
}
