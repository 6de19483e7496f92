//! `minimesh bench` against the peers and at scale: nginx and HAProxy beside
//! minimesh when installed, the overhead report (plaintext, and a sidecar
//! pair over mutual TLS), and the control plane at scale, each reporting its
//! figures.

use std::process::Command;

use crate::bench::{bench_output, installed};
use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_and_haproxy_run_beside_minimesh_when_installed() {
    let net = Net::new(88);
    let only = [
        "--only",
        "ROUND_ROBIN",
        "--only",
        "nginx least_conn",
        "--only",
        "haproxy leastconn",
    ];
    let (v, stdout) = bench_output(&net, "lb-lab-steady", "0.03", &only);
    let runs = v["runs"].as_array().expect("runs");
    let kinds: Vec<&str> = runs.iter().filter_map(|r| r["kind"].as_str()).collect();
    let summary =
        std::fs::read_to_string(net.dir.join("bench/lb-lab-steady/summary.txt")).expect("summary");
    assert!(summary.contains("ROUND_ROBIN"), "{summary}");
    for (peer, name) in [
        ("nginx", "nginx least_conn"),
        ("haproxy", "haproxy leastconn"),
    ] {
        if installed(peer) {
            let r = runs
                .iter()
                .find(|r| r["policy"] == name)
                .unwrap_or_else(|| panic!("{name} did not report: {kinds:?}"));
            assert_eq!(r["kind"], peer);
            assert_eq!(r["errors"].as_u64(), Some(0), "{name}: {r:#}");
            // The apps are reached directly and name themselves.
            let served: u64 = r["backends"]
                .as_array()
                .expect("backends")
                .iter()
                .map(|b| b["requests"].as_u64().unwrap_or(0))
                .sum();
            assert_eq!(served, r["requests"].as_u64().unwrap_or(0), "{name}: {r:#}");
        } else {
            eprintln!("{peer} is not installed here: checking that the run said so");
            assert!(!kinds.contains(&peer));
            assert!(
                stdout.contains(&format!("{peer} is not installed: skipping 1 peer run(s)")),
                "{stdout}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overhead_and_control_plane_scale_report_their_figures() {
    let net = Net::new(89);
    let out = net.dir.join("bench");
    // Run where files are named like the built-in benchmarks (as the
    // control-plane binary is in target/release): the names still mean them.
    for name in ["overhead", "control-plane"] {
        std::fs::write(net.dir.join(name), b"\x7fELF not a scenario").expect("write");
    }
    let run = |args: &[&str]| {
        let o = Command::new(bin("minimesh"))
            .current_dir(&net.dir)
            .arg("--home")
            .arg(net.dir.join("home"))
            .arg("bench")
            .args(args)
            .arg("--out")
            .arg(&out)
            .args(["--network", &net.ip(0).to_string()])
            .output()
            .expect("runs");
        assert!(
            o.status.success(),
            "{args:?}: {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let ingress = net.addr(252, 30000).to_string();
    // The peers (when installed) with the built-in generator only: the
    // pairing of the sidecar with each of them, round by round, is checked once.
    let overhead = |generator: &str| {
        let with_peers = generator == "built-in";
        let mut args = vec![
            "overhead",
            "--scale",
            "0.1",
            "--ingress",
            &ingress,
            "--load-generator",
            generator,
            "--rounds",
            "2",
        ];
        if !with_peers {
            args.push("--no-peers");
        }
        run(&args);
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("overhead/overhead.json")).expect("overhead.json"),
        )
        .expect("JSON");
        let paths = v["paths"].as_array().expect("paths");
        let peers: Vec<&str> = ["nginx", "haproxy"]
            .into_iter()
            .filter(|p| with_peers && installed(p))
            .collect();
        // With nginx, nginx answering by itself too: the CPU floor.
        let floor = peers.contains(&"nginx");
        assert_eq!(paths.len(), 4 + peers.len() + floor as usize, "{v:#}");
        // The ingress gateway straight to the app, beside the sidecar rows.
        let gateway = paths
            .iter()
            .find(|p| p["path"] == "gateway (ingress -> app)")
            .unwrap_or_else(|| panic!("no gateway row: {v:#}"));
        if floor {
            let last = &paths[paths.len() - 1];
            assert_eq!(last["path"], "nginx answering itself (the floor)", "{v:#}");
            let server = last["cpu_s_per_1000"].as_f64().unwrap_or(0.0);
            let f = &v["cpu_floor"];
            assert_eq!(f["server_cpu_s_per_1000"].as_f64(), Some(server), "{f}");
            // Twice the server's figure; read back from JSON, whose parser
            // (serde_json without float_roundtrip) may be one ulp off.
            let proxy = f["proxy_cpu_s_per_1000"].as_f64().unwrap_or(0.0);
            assert!((proxy - 2.0 * server).abs() < 1e-12, "{f}");
            // Every proxy path is read against it, the pair against two proxies' floor.
            let ratios = f["ratios"].as_array().expect("ratios");
            assert_eq!(ratios.len(), 3 + peers.len(), "{f}");
            let pair = paths[2]["cpu_s_per_1000"].as_f64().unwrap_or(0.0);
            assert_eq!(ratios[1][0], paths[2]["path"], "{f}");
            assert!(
                (ratios[1][1].as_f64().unwrap_or(0.0) - pair / (4.0 * server)).abs() < 1e-9,
                "{f}"
            );
            let summary =
                std::fs::read_to_string(out.join("overhead/summary.txt")).expect("summary");
            assert!(
                summary.contains("CPU floor: nginx answering by itself"),
                "{summary}"
            );
        } else {
            assert!(v["cpu_floor"].is_null(), "{v:#}");
        }
        let pairs = v["sidecar_against_peers"].as_array().expect("pairs");
        let gateway_pairs: Vec<String> = peers.iter().map(|p| format!("{p}, gateway")).collect();
        assert_eq!(
            pairs
                .iter()
                .map(|p| p["peer"].as_str().unwrap_or(""))
                .collect::<Vec<_>>(),
            peers
                .iter()
                .copied()
                .chain(gateway_pairs.iter().map(String::as_str))
                .collect::<Vec<_>>(),
            "{v:#}"
        );
        for pair in pairs {
            // One ratio per round, each the sidecar's (or the gateway's)
            // top rate over the peer's in that round.
            let name = pair["peer"].as_str().unwrap_or("?");
            let (peer_name, ours) = match name.strip_suffix(", gateway") {
                Some(peer) => (peer, gateway),
                None => (name, &paths[1]),
            };
            let ratios = pair["max_rps_ratio"].as_array().expect("ratios");
            assert_eq!(ratios.len(), 2, "{pair}");
            for (round, r) in ratios.iter().enumerate() {
                let rate = |path: &serde_json::Value| {
                    path["max_rps_rounds"][round].as_f64().unwrap_or(0.0)
                };
                let peer = paths
                    .iter()
                    .find(|p| p["path"].as_str().unwrap_or("").starts_with(peer_name))
                    .expect("peer path");
                assert!(
                    (r.as_f64().unwrap_or(0.0) - rate(ours) / rate(peer)).abs() < 1e-9,
                    "{pair}"
                );
                // And CPU a request, ours over the peer's, in that round.
                let cpu = |path: &serde_json::Value| {
                    path["cpu_s_per_1000_rounds"][round].as_f64().unwrap_or(0.0)
                };
                let want = cpu(ours) / cpu(peer).max(1e-9);
                let got = pair["cpu_ratio"][round].as_f64().unwrap_or(-1.0);
                assert!((got - want).abs() < 1e-9, "{pair}");
            }
            assert_eq!(
                pair["cpu_saturated_ratio"].as_array().map(Vec::len),
                Some(2),
                "{pair}"
            );
            assert_eq!(
                pair["p99_diff_ms"].as_array().map(Vec::len),
                Some(2),
                "{pair}"
            );
        }
        if !peers.is_empty() {
            let summary =
                std::fs::read_to_string(out.join("overhead/summary.txt")).expect("summary");
            assert!(
                summary.contains("one sidecar against each peer, round by round")
                    && summary.contains("CPU at 1000 req/s")
                    && summary.contains("CPU saturated"),
                "{summary}"
            );
        }
        assert_eq!(v["rounds"], 2, "{v:#}");
        for p in paths {
            // Both rounds measured, the median reported between them.
            let rounds: Vec<f64> = p["max_rps_rounds"]
                .as_array()
                .expect("rounds")
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect();
            assert_eq!(rounds.len(), 2, "{p}");
            assert!(
                (p["max_rps"].as_f64().unwrap_or(0.0) - (rounds[0] + rounds[1]) / 2.0).abs() < 1e-6,
                "{p}"
            );
            assert_eq!(p["errors"], 0, "{p}");
            assert!(p["max_rps"].as_f64().unwrap_or(0.0) > 100.0, "{p}");
            assert!(p["p50_ms"].as_f64().unwrap_or(0.0) > 0.0, "{p}");
        }
        // The proxies' own memory and CPU are read from /proc; the direct
        // path has no proxy to measure.
        assert!(
            paths[1]["peak_rss_mib"].as_f64().unwrap_or(0.0) > 1.0,
            "{v:#}"
        );
        assert!(paths[0]["cpu_us_per_request_saturated"].is_null(), "{v:#}");
        let sat = paths[1]["cpu_us_per_request_saturated"]
            .as_f64()
            .unwrap_or(0.0);
        assert!(sat > 0.5 && sat < 10_000.0, "{v:#}");
        v["load_generator"].as_str().unwrap_or("").to_string()
    };
    assert_eq!(overhead("built-in"), "built-in");
    // oha when installed (`cargo install oha`); otherwise asking for it is an error that says how to get it.
    let oha = std::env::var_os("HOME")
        .map(|h| std::path::PathBuf::from(h).join(".cargo/bin/oha"))
        .filter(|p| p.is_file())
        .or_else(|| {
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .map(|d| d.join("oha"))
                .find(|p| p.is_file())
        });
    if oha.is_some() {
        assert!(overhead("oha").starts_with("oha ("));
    } else {
        let o = Command::new(bin("minimesh"))
            .args(["bench", "overhead", "--load-generator", "oha"])
            .output()
            .expect("runs");
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(
                "--load-generator oha: oha is not installed (cargo install oha), nor in PATH or ~/.cargo/bin"
            ),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        println!("oha is not installed: the oha path was not run");
    }

    // Without a rule: a load report every 10 s from every sidecar, no push
    // while nothing changes. With LOAD_AWARE: a report a second from each,
    // and new weights pushed as they move past the dead band.
    let control_plane = |extra: &[&str]| {
        let mut args = vec!["control-plane", "--sidecars", "200"];
        args.extend_from_slice(extra);
        run(&args);
        let v: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("control-plane/control-plane.json"))
                .expect("control-plane.json"),
        )
        .expect("JSON");
        let r = v["runs"][0].clone();
        assert_eq!(r["sidecars"], 200, "{v:#}");
        assert!(r["ack_p99_ms"].as_f64().unwrap_or(0.0) > 0.0, "{v:#}");
        assert!(r["kib_per_sidecar"].as_f64().unwrap_or(0.0) > 0.0, "{v:#}");
        assert!(r["cpu_cores"].as_f64().unwrap_or(-1.0) >= 0.0, "{v:#}");
        r
    };
    let r = control_plane(&[]);
    assert_eq!(r["load_aware"], false, "{r:#}");
    assert_eq!(r["report_interval_ms"], 10_000, "{r:#}");
    let reports = r["reports_per_s"].as_f64().unwrap_or(0.0);
    assert!(
        (10.0..=30.0).contains(&reports),
        "200 sidecars every 10 s: {r:#}"
    );
    assert_eq!(r["eds_pushes_per_sidecar_per_s"], 0.0, "{r:#}");
    assert_eq!(r["weights_moved"], false, "{r:#}");
    assert!(r["weights_settled_s"].is_null(), "{r:#}");
    assert_eq!(r["endpoints"], 3, "{r:#}");
    assert_eq!(r["services"], 1, "{r:#}");
    let r = control_plane(&["--load-aware", "--endpoints", "20", "--services", "4"]);
    assert_eq!(r["load_aware"], true, "{r:#}");
    assert_eq!(r["endpoints"], 20, "{r:#}");
    assert_eq!(r["services"], 4, "{r:#}");
    assert_eq!(r["weights_moved"], true, "{r:#}");
    assert!(
        r["weights_settled_s"].as_f64().is_some(),
        "LOAD_AWARE's weights settle within a minute: {r:#}"
    );
    assert_eq!(r["report_interval_ms"], 1_000, "{r:#}");
    let reports = r["reports_per_s"].as_f64().unwrap_or(0.0);
    assert!(
        (150.0..=250.0).contains(&reports),
        "200 sidecars every second: {r:#}"
    );
    let pushes = r["eds_pushes_per_sidecar_per_s"].as_f64().unwrap_or(-1.0);
    assert!(
        (0.0..=1.5).contains(&pushes),
        "new weights at most once a second: {r:#}"
    );
    // The same with the clients speaking Envoy's xDS v3: their per-endpoint
    // reports (no latency; Little's law) move LOAD_AWARE's weights too.
    let r = control_plane(&["--xds-v3", "--load-aware"]);
    assert_eq!(r["protocol"], "xds-v3", "{r:#}");
    assert_eq!(r["weights_moved"], true, "{r:#}");
    assert_eq!(r["report_interval_ms"], 1_000, "{r:#}");
    let reports = r["reports_per_s"].as_f64().unwrap_or(0.0);
    assert!(
        (150.0..=250.0).contains(&reports),
        "200 xDS v3 clients every second: {r:#}"
    );

    // The flags mean nothing to the other benchmarks: refused, not ignored.
    for (bench, flag, value) in [
        ("lb-lab-steady", "--load-aware", None),
        ("lb-lab-steady", "--endpoints", Some("3")),
        ("lb-lab-steady", "--services", Some("2")),
        ("lb-lab-steady", "--xds-v3", None),
        ("overhead", "--load-aware", None),
    ] {
        let o = Command::new(bin("minimesh"))
            .args(["bench", bench, flag])
            .args(value)
            .output()
            .expect("runs");
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(&format!(
                "{flag}: only `minimesh bench control-plane` takes it"
            )),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overhead_measures_a_sidecar_pair_over_mutual_tls_beside_the_plaintext_one() {
    let net = Net::new(125);
    let out = net.dir.join("bench");
    let o = Command::new(bin("minimesh"))
        .arg("--home")
        .arg(net.dir.join("home"))
        .args([
            "bench", "overhead", "--mtls", "--scale", "0.1", "--rounds", "1",
        ])
        .args(["--load-generator", "built-in"])
        .arg("--out")
        .arg(&out)
        .args(["--network", &net.ip(0).to_string()])
        .args(["--ingress", &net.addr(252, 30000).to_string()])
        .output()
        .expect("minimesh bench overhead runs");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = std::fs::read_to_string(out.join("overhead/overhead.json")).expect("overhead.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let paths: Vec<&str> = v["paths"]
        .as_array()
        .expect("paths")
        .iter()
        .map(|p| p["path"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        paths[..4],
        [
            "direct",
            "one sidecar (-> app)",
            "sidecar pair (-> sidecar -> app)",
            "sidecar pair, mutual TLS"
        ],
        "{v:#}"
    );
    for p in v["paths"].as_array().expect("paths") {
        assert_eq!(p["errors"], 0, "{p}");
        assert!(p["max_rps"].as_f64().unwrap_or(0.0) > 0.0, "{p}");
    }
    // With nginx installed, nginx as a pair over mutual TLS with the mesh's
    // certificates, and the sidecar pair compared with it round by round.
    if installed("nginx") {
        assert!(paths.contains(&"nginx pair, mutual TLS"), "{v:#}");
        let pairs = v["sidecar_against_peers"].as_array().expect("pairs");
        assert!(
            pairs.iter().any(|p| p["peer"] == "nginx pair, mutual TLS"),
            "{v:#}"
        );
    }
}
