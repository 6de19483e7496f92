//! How long a rule change takes to reach every proxy of the demo mesh: from
//! the file write to the last proxy's ACK of the new version, as the control
//! plane records them. `cargo bench --bench rule_to_ack`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROUNDS: usize = 60;

fn get(addr: &str, path: &str) -> Option<serde_json::Value> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let body = out.split_once("\r\n\r\n")?.1;
    serde_json::from_str(body).ok()
}

fn main() {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let home = std::env::temp_dir().join(format!("minimesh-bench-{}", std::process::id()));
    let mut up = Command::new(env!("CARGO_BIN_EXE_minimesh"))
        .current_dir(&repo)
        .args([
            "--home",
            home.to_str().expect("utf-8 path"),
            "up",
            "--network",
            "127.0.8.0",
            "--ingress",
            "127.0.8.250:30000",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("minimesh up");
    let admin = "127.0.8.254:15014";
    let start = Instant::now();
    while get(admin, "/debug/proxies").and_then(|p| p.as_array().map(|a| a.len())) != Some(5) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "mesh did not come up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(1));
    let rule = home.join("config/rules/destinationrule.istioinaction.bench.yaml");
    let mut samples = Vec::new();
    for i in 0..ROUNDS {
        let policy = ["ROUND_ROBIN", "RANDOM", "LEAST_REQUEST"][i % 3];
        let text = format!(
            "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: bench}}\nspec:\n  host: simple-backend\n  trafficPolicy:\n    loadBalancer:\n      simple: {policy}\n    retries: {{attempts: {}}}\n",
            i % 5
        );
        let tmp = rule.with_extension("tmp");
        std::fs::write(&tmp, text).expect("write");
        let written = Instant::now();
        std::fs::rename(&tmp, &rule).expect("rename");
        let old = get(admin, "/debug/versions").expect("versions")["Cluster"].clone();
        loop {
            let v = get(admin, "/debug/versions").expect("versions");
            let proxies = get(admin, "/debug/proxies").expect("proxies");
            let acked = proxies.as_array().is_some_and(|a| {
                a.iter()
                    .all(|p| p["types"]["Cluster"]["acked"] == v["Cluster"])
            });
            if v["Cluster"] != old && acked {
                samples.push(written.elapsed());
                break;
            }
            assert!(
                written.elapsed() < Duration::from_secs(5),
                "round {i}: no ACK within 5 s"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    let _ = up.kill();
    let _ = up.wait();
    let _ = std::fs::remove_dir_all(&home);
    samples.sort();
    let q = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    println!(
        "rule change -> all 5 proxies ACKed ({ROUNDS} changes; poll 50 ms, debounce 100 ms): p50 {:?}  p90 {:?}  p99 {:?}  max {:?}",
        q(0.5),
        q(0.9),
        q(0.99),
        samples[samples.len() - 1]
    );
}
