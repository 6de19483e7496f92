//! Envoy's xDS v3, consumed by gRPC's own xDS client: Python grpcio (gRPC's
//! C core) dialling `xds:///echo.default:50051` with `GRPC_XDS_BOOTSTRAP`
//! naming the control plane (tests/interop/xds_client.py, bootstrap from
//! examples/grpc/xds-bootstrap.json), calling three grpcio servers on
//! loopback (tests/interop/grpc_mesh.py) behind an EndpointSlice. No
//! sidecar: the client balances by itself, with minimesh's policy.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::grpc_interop::interop;
use crate::harness::*;

pub(crate) const PORT: u16 = 50051;
const TARGET: &str = "echo.default:50051";
pub(crate) const CLUSTER: &str = "echo.default.svc.cluster.local:50051";

/// The echo Service (gRPC on 50051) and its EndpointSlice: `hosts` ready.
pub(crate) fn echo_yaml(net: &Net, hosts: &[u8]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: echo\n  namespace: {NS}\nspec:\n  ports:\n  - name: grpc\n    port: {PORT}\n    appProtocol: grpc\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: echo-abc\n  namespace: {NS}\n  labels:\n    kubernetes.io/service-name: echo\naddressType: IPv4\nports:\n- name: grpc\n  port: {PORT}\nendpoints:\n"
    );
    for h in hosts {
        y.push_str(&endpoint_yaml(net.ip(*h), &format!("echo-{h}"), None));
    }
    y
}

pub(crate) fn rule(net: &Net, load_balancer: &str) {
    net.rule("rule.yaml", "echo", load_balancer);
}

/// Waits until the control plane serves `policy` for the echo rule.
pub(crate) async fn rule_in_force(net: &Net, policy: &str) {
    wait_cp_config(net, |v| {
        v["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["policy"] == policy && r["accepted"] == true && r["clusters"][0] == CLUSTER)
    })
    .await;
}

/// Waits until the control plane's echo endpoints are exactly `hosts`.
async fn endpoints_are(net: &Net, hosts: &[u8]) {
    let want: Vec<String> = hosts
        .iter()
        .map(|h| net.addr(*h, PORT).to_string())
        .collect();
    wait_cp_json(net, "/debug/endpoints", |v| {
        let mut got: Vec<String> = v[CLUSTER]["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["address"].as_str().map(str::to_string))
            .collect();
        got.sort();
        got == want
    })
    .await;
}

/// Starts grpcio echo servers `echo-<h>` at .h:50051, each answering after
/// its delay (ms), and waits until they accept connections.
pub(crate) async fn backends(net: &Net, hosts: &[(u8, u64)]) -> Vec<Proc> {
    let logs = net.config().parent().expect("net dir").join("logs");
    let mut procs = Vec::new();
    for (h, delay) in hosts {
        let log = logs.join(format!("echo-{h}.log"));
        let out = std::fs::File::create(&log).expect("log");
        let child = Command::new("python3")
            .arg(interop("grpc_mesh.py"))
            .args([
                "server".to_string(),
                format!("echo-{h}"),
                net.addr(*h, PORT).to_string(),
                delay.to_string(),
            ])
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("python3 runs");
        procs.push(Proc {
            name: format!("echo-{h}"),
            child,
            log,
        });
    }
    for (h, _) in hosts {
        let addr = net.addr(*h, PORT);
        let start = tokio::time::Instant::now();
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "echo-{h} never listened"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    procs
}

/// Runs the proxyless client to completion; its stdout.
async fn client(net: &Net, args: &[&str]) -> String {
    client_with(net, &[], args).await
}

/// The same, with more environment.
async fn client_with(net: &Net, env: &[(&str, &str)], args: &[&str]) -> String {
    crate::grpc_interop::grpcio().await;
    let mut cmd = Command::new("python3");
    cmd.envs(env.iter().copied())
        .arg(interop("xds_client.py"))
        .arg(args[0])
        .arg(net.cp_xds().to_string())
        .arg(format!("client-{}", net.ip(200)))
        .arg(TARGET)
        .args(&args[1..]);
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "the xDS client failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Runs `minimesh ARGS --control-plane-admin <this control plane>`; its
/// output.
pub(crate) fn minimesh(net: &Net, args: &[&str]) -> String {
    let out = Command::new(bin("minimesh"))
        .args(args)
        .args(["--control-plane-admin", &net.cp_admin().to_string()])
        .output()
        .expect("minimesh runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "minimesh {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn json_counts(out: &str) -> BTreeMap<String, u64> {
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// A client calling at a steady rate in the background: every call's
/// completion time (ms since the epoch) and result, as they come.
pub(crate) struct Flow {
    proc: Proc,
    calls: Arc<Mutex<Vec<(u64, String)>>>,
    reader: std::thread::JoinHandle<()>,
}

impl Flow {
    pub(crate) async fn start(net: &Net, extra_env: &[(&str, &str)], args: &[&str]) -> Flow {
        crate::grpc_interop::grpcio().await;
        let logs = net.config().parent().expect("net dir").join("logs");
        let log = logs.join(format!("xds-client-{}.log", args[0]));
        let mut cmd = Command::new("python3");
        cmd.arg(interop("xds_client.py"))
            .arg(args[0])
            .arg(net.cp_xds().to_string())
            .arg(format!("client-{}", net.ip(200)))
            .arg(TARGET)
            .args(&args[1..])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log"));
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("python3 runs");
        let stdout = child.stdout.take().expect("piped");
        let calls = Arc::new(Mutex::new(Vec::new()));
        let sink = calls.clone();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some((ms, what)) = line.split_once(' ') {
                    if let Ok(ms) = ms.parse() {
                        sink.lock().expect("lock").push((ms, what.to_string()));
                    }
                }
            }
        });
        Flow {
            proc: Proc {
                name: "xds-client".into(),
                child,
                log,
            },
            calls,
            reader,
        }
    }

    /// Calls completed so far.
    fn count(&self) -> usize {
        self.calls.lock().expect("lock").len()
    }

    /// Waits until `n` calls have completed.
    async fn until(&self, n: usize) {
        let start = tokio::time::Instant::now();
        while self.count() < n {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the client made {} calls of {n}; its log:\n{}",
                self.count(),
                self.proc.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the client to finish; every call.
    pub(crate) async fn finish(mut self) -> Vec<(u64, String)> {
        let status = tokio::task::spawn_blocking(move || {
            let s = self.proc.child.wait();
            let _ = self.reader.join();
            (s, self.proc)
        })
        .await
        .expect("join");
        let (s, proc) = status;
        assert!(
            s.is_ok_and(|s| s.success()),
            "the client failed: {}",
            proc.log_text()
        );
        let calls = self.calls.lock().expect("lock").clone();
        calls
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub(crate) fn failures(calls: &[(u64, String)]) -> Vec<&(u64, String)> {
    calls
        .iter()
        .filter(|(_, r)| r.starts_with("ERROR"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxyless_grpc_balances_by_round_robin_weights_and_ring_hash() {
    let net = Net::new(101);
    let _b = backends(&net, &[(1, 0), (2, 0), (3, 0)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2, 3]));
    let _cp = net.control_plane().await;

    // ROUND_ROBIN (no rule): 600 calls, 200 each. The client counts from
    // the call after it has reached every backend once: before that, round
    // robin has only the backends already connected to choose from.
    let got = json_counts(&client(&net, &["spread", "600"]).await);
    eprintln!("round robin, 600 calls: {got:?}");
    for h in 1..=3 {
        let n = got[&format!("echo-{h}")];
        assert!(n.abs_diff(200) <= 2, "round robin: {got:?}");
    }

    // Endpoint weights 2:1:1 over 2,000 calls: 50/25/25. Each endpoint is
    // a locality of its own, and gRPC's weighted_target picks a locality at
    // random by weight, so each count is binomial: within 4.5 standard
    // deviations (5.0 points for 50%, 4.4 for 25%; a false failure about
    // once in 50,000 runs over the three counts), and 1:1:1 (weights
    // ignored) is 17 points off.
    rule(
        &net,
        &format!(
            "simple: ROUND_ROBIN\nendpointWeights:\n- address: \"{}\"\n  weight: 2",
            net.ip(1)
        ),
    );
    rule_in_force(&net, "ROUND_ROBIN").await;
    let weighted_in_force = |v: &serde_json::Value| v.to_string().contains("\"weight\":2");
    wait_cp_json(&net, "/debug/endpoints", weighted_in_force).await;
    let got = json_counts(&client(&net, &["spread", "2000"]).await);
    eprintln!("weights 2:1:1, 2,000 calls: {got:?}");
    let total: u64 = got.values().sum();
    assert_eq!(total, 2000, "{got:?}");
    for (h, want) in [(1, 0.5), (2, 0.25), (3, 0.25)] {
        let share = got[&format!("echo-{h}")] as f64 / 2000.0;
        let sd = (want * (1.0 - want) / 2000.0_f64).sqrt();
        assert!(
            (share - want).abs() <= 4.5 * sd,
            "weights 2:1:1: {got:?}; echo-{h} {:.1}% against {:.0}% ± {:.1}",
            100.0 * share,
            100.0 * want,
            450.0 * sd
        );
    }

    // Ring hash on a header: 1,000 calls, 50 values; each value on one
    // backend every time.
    rule(&net, "consistentHash:\n  httpHeaderName: x-user");
    rule_in_force(&net, "RING_HASH").await;
    let placed = |out: &str| -> BTreeMap<String, String> {
        let v: BTreeMap<String, BTreeMap<String, u64>> =
            serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        v.into_iter()
            .map(|(key, servers)| {
                assert_eq!(servers.len(), 1, "{key} went to {servers:?}");
                let server = servers.into_keys().next().unwrap_or_default();
                assert!(!server.starts_with("ERROR"), "{key}: {server}");
                (key, server)
            })
            .collect()
    };
    let before = placed(&client(&net, &["hash", "1000", "50", "x-user"]).await);
    assert_eq!(before.len(), 50);
    let used: std::collections::BTreeSet<&String> = before.values().collect();
    assert_eq!(used.len(), 3, "50 values over 3 backends: {before:?}");

    // Backend 3 leaves the EndpointSlice: only its values move.
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2]));
    endpoints_are(&net, &[1, 2]).await;
    let after = placed(&client(&net, &["hash", "1000", "50", "x-user"]).await);
    let moved = before.iter().filter(|(k, was)| after[*k] != **was).count();
    let on_3 = before.values().filter(|s| *s == "echo-3").count();
    eprintln!("ring hash: {on_3} of 50 values were on echo-3; {moved} moved when it left");
    for (key, was) in &before {
        let now = &after[key];
        if was == "echo-3" {
            assert_ne!(now, "echo-3", "{key}");
        } else {
            assert_eq!(
                now, was,
                "{key} moved from {was} to {now}, though {was} stayed"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_change_is_followed_within_a_second_with_no_failed_call() {
    let net = Net::new(102);
    let _b = backends(&net, &[(1, 0), (2, 0), (3, 0)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2, 3]));
    let _cp = net.control_plane().await;
    // 20 calls/s, every one with the same x-user.
    let flow = Flow::start(&net, &[], &["flow", "20", "8", "x-user", "alice"]).await;
    flow.until(40).await;
    rule(&net, "consistentHash:\n  httpHeaderName: x-user");
    let changed = now_ms();
    let calls = flow.finish().await;
    assert!(failures(&calls).is_empty(), "{:?}", failures(&calls));
    let before: std::collections::BTreeSet<&String> = calls
        .iter()
        .filter(|(t, _)| *t < changed)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(before.len(), 3, "round robin before the change: {before:?}");
    // Ring hash: from some call on, alice always lands on one backend.
    let last = &calls.last().expect("calls").1;
    let settled = calls
        .iter()
        .rposition(|(_, r)| r != last)
        .map_or(0, |i| i + 1);
    let followed_ms = calls[settled].0.saturating_sub(changed);
    eprintln!("ring hash in force {followed_ms} ms after the rule was written");
    assert!(
        calls[settled].0 >= changed && followed_ms <= 1000,
        "followed after {followed_ms} ms: {calls:?}"
    );
    assert!(calls.len() - settled >= 60, "{calls:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_backend_is_no_longer_called_once_withdrawn() {
    let net = Net::new(103);
    let mut b = backends(&net, &[(1, 0), (2, 0), (3, 0)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2, 3]));
    let _cp = net.control_plane().await;
    let flow = Flow::start(&net, &[], &["flow", "50", "6"]).await;
    flow.until(50).await;
    b[1].kill();
    let killed = now_ms();
    flow.until(flow.count() + 25).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 3]));
    endpoints_are(&net, &[1, 3]).await;
    let withdrawn = now_ms();
    let calls = flow.finish().await;
    let late: Vec<_> = calls
        .iter()
        .filter(|(t, r)| *t > withdrawn + 1000 && r == "echo-2")
        .collect();
    assert!(
        late.is_empty(),
        "echo-2 called after it was withdrawn: {late:?}"
    );
    let failed = failures(&calls);
    // gRPC's own behaviour, reported rather than asserted away: calls that
    // failed between the kill and the client's reconnect or retry.
    eprintln!(
        "{} calls, {} failed after echo-2 was killed (withdrawn {} ms after the kill): {:?}",
        calls.len(),
        failed.len(),
        withdrawn - killed,
        failed
    );
    assert!(failed.len() * 20 <= calls.len(), "{failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_cluster_shows_in_get_proxies_and_the_client_keeps_its_config() {
    let net = Net::new(106);
    let _b = backends(&net, &[(1, 0), (2, 0), (3, 0)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2, 3]));
    // Exact policies: RANDOM is sent as RANDOM alone, which gRPC lacks
    // (and so is the default LEAST_REQUEST, which gRPC's C core lacks: the
    // client starts on ROUND_ROBIN).
    rule(&net, "simple: ROUND_ROBIN");
    let _cp = net.control_plane_with(&["--xds-v3-exact-policies"]).await;
    rule_in_force(&net, "ROUND_ROBIN").await;
    let flow = Flow::start(&net, &[], &["flow", "20", "6"]).await;
    flow.until(20).await;
    rule(&net, "simple: RANDOM");
    let proxies = wait_cp_json(&net, "/debug/proxies", |v| {
        v.as_array().into_iter().flatten().any(|p| {
            p["protocol"] == "xds-v3 sotw"
                && p["types"]["Cluster"]["last_nack"]["message"].is_string()
        })
    })
    .await;
    let message = proxies
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|p| p["types"]["Cluster"]["last_nack"]["message"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(message.contains(CLUSTER), "{message}");
    let text = minimesh(&net, &["get", "proxies"]);
    assert!(text.contains(&format!("client-{}", net.ip(200))), "{text}");
    let first_line = message.lines().next().unwrap_or_default();
    assert!(
        text.contains(&first_line[..first_line.len().min(40)]),
        "{text}\nwant: {message}"
    );
    let nacked = now_ms();
    let calls = flow.finish().await;
    assert!(failures(&calls).is_empty(), "{:?}", failures(&calls));
    // Its last good config (round robin over all three) stays in force.
    let after: std::collections::BTreeSet<&String> = calls
        .iter()
        .filter(|(t, _)| *t > nacked)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(after.len(), 3, "{after:?}");
}

/// The echo pods' labels, for a DestinationRule's subsets.
fn pods_yaml(net: &Net, versions: &[(u8, &str)]) -> String {
    versions
        .iter()
        .map(|(h, v)| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: echo-{h}\n  namespace: {NS}\n  labels: {{app: echo, version: {v}}}\nstatus:\n  podIP: \"{}\"\n---\n",
                net.ip(*h)
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxyless_grpc_follows_a_virtual_services_split_and_header_match() {
    let net = Net::new(137);
    let _b = backends(&net, &[(1, 0), (2, 0)]).await;
    net.write("echo.yaml", &echo_yaml(&net, &[1, 2]));
    net.write("pods.yaml", &pods_yaml(&net, &[(1, "v1"), (2, "v2")]));
    net.write(
        "rule.yaml",
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {name: echo}\nspec:\n  host: echo\n  subsets:\n  - {name: v1, labels: {version: v1}}\n  - {name: v2, labels: {version: v2}}\n",
    );
    net.write(
        "vs.yaml",
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: echo}\nspec:\n  hosts: [echo]\n  http:\n  - match: [{headers: {x-fault: {exact: abort}}}]\n    fault: {abort: {httpStatus: 503, percentage: {value: 100}}}\n    route: [{destination: {host: echo, subset: v1}}]\n  - match: [{headers: {x-canary: {exact: \"yes\"}}}]\n    route: [{destination: {host: echo, subset: v2}}]\n  - route:\n    - {destination: {host: echo, subset: v1}, weight: 90}\n    - {destination: {host: echo, subset: v2}, weight: 10}\n",
    );
    let _cp = net.control_plane().await;
    wait_cp_json(&net, "/debug/endpoints", |v| {
        v[format!("{CLUSTER}|v2")]["endpoints"]
            .as_array()
            .is_some_and(|e| e.len() == 1)
    })
    .await;
    // The split, as gRPC's weighted_clusters picks: each count binomial,
    // 10% ± 3 points over 2,000 calls is 4.5 standard deviations.
    let two = [("EXPECT_BACKENDS", "2")];
    let got = json_counts(&client_with(&net, &two, &["spread", "2000"]).await);
    eprintln!("90/10 split, 2,000 calls: {got:?}");
    assert_eq!(got.values().sum::<u64>(), 2000, "{got:?}");
    let v2 = got.get("echo-2").copied().unwrap_or(0) as f64 / 2000.0;
    assert!((0.07..=0.13).contains(&v2), "v2 took {v2:.3}: {got:?}");
    // The header match: every call to v2.
    let one = [("EXPECT_BACKENDS", "1")];
    let got = json_counts(&client_with(&net, &one, &["spread", "200", "x-canary", "yes"]).await);
    assert_eq!(got.get("echo-2"), Some(&200), "{got:?}");
    // The fault: gRPC's fault filter (gRFC A33) aborts every matching call
    // with 503, which gRPC reports as UNAVAILABLE; none reaches a backend.
    let got = json_counts(&client_with(&net, &one, &["spread", "50", "x-fault", "abort"]).await);
    assert_eq!(got.get("ERROR UNAVAILABLE"), Some(&50), "{got:?}");
}
