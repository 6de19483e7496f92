//! `minimesh up`, `apply`, `get` and `demo` on the example topology.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::*;

fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `minimesh up TOPOLOGY` on `net` (home `net.dir/home`) until it
/// says the mesh is up.
async fn up(net: &Net, topology: &str, ingress: std::net::SocketAddr) -> Proc {
    up_with(net, topology, ingress, &[]).await
}

/// The same, with more `minimesh up` flags.
async fn up_with(net: &Net, topology: &str, ingress: std::net::SocketAddr, extra: &[&str]) -> Proc {
    let home = path_str(&net.dir.join("home"));
    let mut up = Proc {
        name: "minimesh up".into(),
        log: net.dir.join("logs/up.log"),
        child: Command::new(bin("minimesh"))
            .args([
                "--home",
                &home,
                "up",
                &path_str(&repo().join(topology)),
                "--network",
                &net.ip(0).to_string(),
                "--ingress",
                &ingress.to_string(),
            ])
            .args(extra)
            .stdout(std::fs::File::create(net.dir.join("logs/up.log")).expect("log"))
            .stderr(Stdio::inherit())
            .spawn()
            .expect("minimesh up"),
    };
    printed(&mut up, "Ctrl-C stops everything", Duration::from_secs(60)).await;
    up
}

/// Which simple-backend replicas answered `n` requests through the ingress.
async fn backends_seen(
    ingress: std::net::SocketAddr,
    n: usize,
) -> std::collections::BTreeMap<String, u32> {
    let mut bodies = std::collections::BTreeMap::new();
    for _ in 0..n {
        let (status, _, body) = get(ingress, "simple-web.istioinaction.io", "/")
            .await
            .expect("ingress");
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["name"], "simple-web");
        *bodies
            .entry(
                v["upstream_calls"][0]["body"]
                    .as_str()
                    .expect("upstream body")
                    .to_string(),
            )
            .or_insert(0) += 1;
    }
    bodies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_walkthrough_up_curl_apply_get() {
    let net = Net::new(51);
    let home = path_str(&net.dir.join("home"));
    let ingress = net.addr(250, 30000);
    let mut up = up(&net, "examples/local/topology.yaml", ingress).await;
    let summary = up.log_text();
    assert!(
        summary.contains(&format!("ingress         http://{ingress}")),
        "{summary}"
    );

    // The seed's curl, through the ingress by Host.
    let bodies = backends_seen(ingress, 30).await;
    assert_eq!(
        bodies.keys().collect::<Vec<_>>(),
        vec!["Hello from simple-backend-1", "Hello from simple-backend-2"],
        "{bodies:?}"
    );

    // apply the RANDOM rule; get shows it.
    let out = Command::new(bin("minimesh"))
        .args([
            "--home",
            &home,
            "apply",
            "-f",
            &path_str(&repo().join("examples/rules/simple-backend-dr-random.yaml")),
        ])
        .output()
        .expect("apply");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "destinationrule istioinaction/simple-backend-dr applied: RANDOM"
    );
    let out = Command::new(bin("minimesh"))
        .args(["--home", &home, "get", "rules"])
        .output()
        .expect("get");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("simple-backend-dr") && l.contains("RANDOM") && l.contains("true")),
        "{text}"
    );
    let out = Command::new(bin("minimesh"))
        .args(["--home", &home, "get", "proxies"])
        .output()
        .expect("get");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().filter(|l| l.contains("SYNCED")).count(),
        5,
        "{text}"
    );
    let out = Command::new(bin("minimesh"))
        .args(["--home", &home, "get", "endpoints"])
        .output()
        .expect("get");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("simple-backend.istioinaction") && l.contains("HEALTHY"))
            .count(),
        3,
        "{text}"
    );
    for _ in 0..30 {
        let (status, _, _) = get(ingress, "simple-web.istioinaction.io", "/")
            .await
            .expect("ingress");
        assert_eq!(status, 200);
    }

    // `minimesh top` shows every simple-backend replica as the sidecars
    // report them, each at the latency a load generator measures: the
    // backends take 150 ms (±10%), simple-web and the sidecars next to
    // nothing, so the generator's p50 through the ingress is the backends'.
    let c = load(ingress, "simple-web.istioinaction.io", 20, 400).await;
    assert_no_failures(&c, "through the ingress: ");
    let measured = c.quantile(0.5).as_secs_f64() * 1000.0;
    let mut text = String::new();
    let mut p50s = Vec::new();
    for _ in 0..100 {
        let out = Command::new(bin("minimesh"))
            .args(["--home", &home, "top", "--once"])
            .output()
            .expect("top");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(text.starts_with("CLUSTER"), "{text}");
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("simple-backend.istioinaction.svc.cluster.local:80"))
            .collect();
        assert_eq!(rows.len(), 3, "{text}");
        assert!(rows.iter().all(|r| r.contains("100.00%")), "{text}");
        // CLUSTER ENDPOINT SHARE RPS SUCCESS P50 ...: P50 is the sixth.
        p50s = rows
            .iter()
            .filter_map(|r| {
                r.split_whitespace()
                    .nth(5)?
                    .strip_suffix("ms")?
                    .parse::<f64>()
                    .ok()
            })
            .collect();
        let within = |p: &f64| (p - measured).abs() / measured <= 0.05;
        if p50s.len() == 3 && p50s.iter().all(within) {
            eprintln!("generator p50 {measured:.1} ms; top's p50s {p50s:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        p50s.len() == 3 && p50s.iter().all(|p| (p - measured).abs() / measured <= 0.05),
        "top's p50s {p50s:?} are not within 5% of the generator's {measured:.1} ms:\n{text}"
    );

    // The chapter's Gateway and VirtualService, applied: the ingress
    // serves the host by their route; then the canary's subsets.
    let apply = |file: &str| {
        let out = Command::new(bin("minimesh"))
            .args([
                "--home",
                &home,
                "apply",
                "-f",
                &path_str(&repo().join(file)),
            ])
            .output()
            .expect("apply");
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let routes = || {
        let out = Command::new(bin("minimesh"))
            .args(["--home", &home, "get", "routes"])
            .output()
            .expect("get routes");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // The topology's ingress hosts are a Gateway and VirtualServices too.
    let text = routes();
    assert!(
        text.lines()
            .any(|l| l.starts_with("istioinaction    ingress-simple-web ")),
        "{text}"
    );
    let text = apply("examples/routes/simple-web-gateway.yaml");
    let yielded = "  warning: spec.hosts: simple-web.istioinaction.io is routed by VirtualService istioinaction/simple-web-vs-for-gateway, applied for the same gateways; this one takes it back when that one goes";
    assert!(routes().contains(yielded), "{}", routes());
    assert_eq!(
        text.trim(),
        "gateway istioinaction/simple-web-gateway applied: serves simple-web.istioinaction.io:80\nvirtualservice istioinaction/simple-web-vs-for-gateway applied: routes simple-web.istioinaction.io at istioinaction/simple-web-gateway: 1 route",
    );
    let text = apply("examples/routes/simple-backend-canary.yaml");
    assert!(text.contains("virtualservice istioinaction/simple-backend-vs applied: routes simple-backend.istioinaction: 2 routes"), "{text}");
    for _ in 0..30 {
        let (status, _, body) = get(ingress, "simple-web.istioinaction.io", "/")
            .await
            .expect("ingress");
        assert_eq!(status, 200, "{body}");
    }
    // delete, as kubectl's: by file, then by kind and name.
    let delete = |args: &[&str]| {
        Command::new(bin("minimesh"))
            .args(["--home", &home, "delete"])
            .args(args)
            .output()
            .expect("delete")
    };
    let canary = path_str(&repo().join("examples/routes/simple-backend-canary.yaml"));
    let out = delete(&["-f", &canary]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "destinationrule istioinaction/simple-backend-dr deleted\nvirtualservice istioinaction/simple-backend-vs deleted"
    );
    let out = delete(&["vs", "simple-backend-vs"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("virtualservice istioinaction/simple-backend-vs not found"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = delete(&["gateway", "simple-web-gateway", "-n", "istioinaction"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (status, _, _) = get(ingress, "simple-web.istioinaction.io", "/")
        .await
        .expect("ingress");
    assert_eq!(status, 200, "the topology's own host again");
    // The warning goes with the control plane's next publication: polled.
    let start = tokio::time::Instant::now();
    while routes().contains(yielded) {
        assert!(start.elapsed() < Duration::from_secs(10), "{}", routes());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // SIGTERM stops everything: no process of the mesh is left.
    up.signal("TERM");
    let status = up.exited(Duration::from_secs(30)).await;
    assert!(status.success(), "minimesh up exited with {status}");
    // The processes are gone once their listeners are (polled: the kernel
    // closes a killed process's sockets a moment after it exits).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while get(ingress, "x", "/").await.is_ok() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        get(ingress, "x", "/").await.is_err(),
        "ingress still answers after stop"
    );
    assert!(
        get(net.addr(254, 15014), "x", "/healthz").await.is_err(),
        "control plane still answers after stop"
    );
    // Each sidecar and the gateway were stopped as Kubernetes stops a pod
    // (SIGTERM, then a drain), not killed: each says so last in its log.
    let logs = std::fs::read_dir(net.dir.join("home/logs")).expect("logs");
    let mut proxies = 0;
    for log in logs.map(|e| e.expect("log").path()) {
        let name = log
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        if name.ends_with(".sidecar.log") || name == "ingress-gateway.log" {
            proxies += 1;
            let text = std::fs::read_to_string(&log).expect("log");
            let last = text.lines().last().unwrap_or_default();
            assert!(last.contains("sidecar stopped"), "{name} ends with: {last}");
        }
    }
    assert!(proxies >= 4, "{proxies} proxy logs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_every_example_rule_without_errors() {
    let net = Net::new(52);
    let out = tokio::task::spawn_blocking({
        let home = path_str(&net.dir.join("home"));
        let network = net.ip(0).to_string();
        let ingress = net.addr(250, 30000).to_string();
        move || {
            Command::new(bin("minimesh"))
                .current_dir(repo())
                .args([
                    "--home",
                    &home,
                    "demo",
                    "--duration",
                    "2s",
                    "--qps",
                    "50",
                    "--network",
                    &network,
                    "--ingress",
                    &ingress,
                ])
                .output()
                .expect("demo")
        }
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for policy in ["ROUND_ROBIN", "RANDOM", "LEAST_REQUEST"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(policy))
            .unwrap_or_else(|| panic!("no {policy} line: {stdout}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[2], "0", "errors for {policy}: {line}");
        assert!(cols[1].parse::<u64>().expect("requests") >= 90, "{line}");
    }
    assert!(stdout.contains("Hello from simple-backend-1"), "{stdout}");
}

/// `examples/local/zones.yaml`: simple-web in zone-a calls only the
/// simple-backend replica of its zone under the zone-failover rule it
/// applies at start; the slices carry each pod's zone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zones_topology_keeps_simple_web_in_its_zone() {
    let net = Net::new(20);
    let ingress = net.addr(250, 30000);
    let _up = up(&net, "examples/local/zones.yaml", ingress).await;
    let slices = std::fs::read_to_string(net.dir.join("home/config/services/simple-backend.yaml"))
        .expect("simple-backend's slice");
    assert_eq!(slices.matches("zone: zone-a").count(), 1, "{slices}");
    assert_eq!(slices.matches("zone: zone-b").count(), 2, "{slices}");
    let web = get_json(net.addr(1, 15000), "/debug/config").await;
    assert_eq!(web["zone"], "zone-a", "{web:#}");
    let bodies = backends_seen(ingress, 30).await;
    assert_eq!(
        bodies.into_iter().collect::<Vec<_>>(),
        vec![("Hello from simple-backend-1".to_string(), 30)]
    );
    let out = Command::new(bin("minimesh"))
        .args([
            "--home",
            &path_str(&net.dir.join("home")),
            "get",
            "endpoints",
        ])
        .output()
        .expect("get");
    let text = String::from_utf8_lossy(&out.stdout);
    let backend: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("simple-backend.istioinaction"))
        .collect();
    assert_eq!(backend.len(), 3, "{text}");
    assert!(backend.iter().all(|l| l.contains("ROUND_ROBIN*")), "{text}");
    assert_eq!(
        backend.iter().filter(|l| l.contains(" zone-b ")).count(),
        2,
        "{text}"
    );
}

/// Runs `minimesh --home HOME kill ARGS…`: exit success, stdout, stderr.
fn kill(net: &Net, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin("minimesh"))
        .args(["--home", &path_str(&net.dir.join("home")), "kill"])
        .args(args)
        .output()
        .expect("minimesh kill");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until `minimesh up` has printed `line` (it must keep running).
async fn printed(up: &mut Proc, line: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while !up.log_text().contains(line) {
        up.assert_running();
        assert!(
            tokio::time::Instant::now() < deadline,
            "minimesh up never printed {line:?}: {}",
            up.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimesh_kill_takes_a_pod_down_under_load_and_up_brings_it_back() {
    let net = Net::new(28);
    let ingress = net.addr(250, 30000);
    let mut up = up_with(
        &net,
        "examples/local/topology.yaml",
        ingress,
        &["--restart-after", "1s"],
    )
    .await;
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(net.dir.join("home/mesh.json")).expect("mesh.json"),
    )
    .expect("json");
    let pid = |name: &str| state["pids"][name].as_u64().expect("pid") as u32;
    let (app, sidecar) = (
        pid("simple-backend-1-0.app"),
        pid("simple-backend-1-0.sidecar"),
    );
    let alive = |pid: u32| std::path::Path::new(&format!("/proc/{pid}")).exists();
    assert!(alive(app) && alive(sidecar));

    let load = Background::start(ingress, "simple-web.istioinaction.io", 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (ok, out, err) = kill(&net, &["simple-backend-1-0"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        format!(
            "sent SIGKILL to simple-backend-1-0.app (pid {app})\n\
             sent SIGKILL to simple-backend-1-0.sidecar (pid {sidecar})\n\
             minimesh up publishes its endpoint as not ready, starts it again after 1s, and ready once it passes its checks\n"
        )
    );
    let endpoint = format!("{}:9090", net.ip(2));
    printed(
        &mut up,
        &format!("simple-backend-1-0.app exited (signal: 9 (SIGKILL)); starting it again in 1s; endpoint {endpoint} of simple-backend not ready"),
        Duration::from_secs(30),
    )
    .await;
    assert!(!alive(app) && !alive(sidecar));
    // The control plane publishes it as such: no sidecar sends it requests.
    let slice = std::fs::read_to_string(net.dir.join("home/config/services/simple-backend.yaml"))
        .expect("slice");
    assert_eq!(slice.matches("ready: false").count(), 1, "{slice}");
    printed(
        &mut up,
        "simple-backend-1-0.app started again (pid ",
        Duration::from_secs(30),
    )
    .await;
    printed(
        &mut up,
        &format!("simple-backend-1-0 is ready: endpoint {endpoint} of simple-backend ready again"),
        Duration::from_secs(30),
    )
    .await;
    let c = load.finish().await;
    assert!(c.ok > 20, "too little load: {c:?}");
    assert_no_failures(&c, "");
    // Back in service, under its new process ids.
    let seen = backends_seen(ingress, 30).await;
    assert!(seen.contains_key("Hello from simple-backend-1"), "{seen:?}");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(net.dir.join("home/mesh.json")).expect("mesh.json"),
    )
    .expect("json");
    let again = state["pids"]["simple-backend-1-0.app"]
        .as_u64()
        .expect("pid") as u32;
    assert!(again != app && alive(again));

    // Bad targets get the reason, and nothing is signalled.
    let (ok, out, err) = kill(&net, &["simple-backend-9"]);
    assert!(!ok && out.is_empty());
    assert_eq!(
        err,
        "minimesh kill: no pod or process simple-backend-9 in mesh istioinaction: pods are \
         simple-web-0, simple-backend-1-0, simple-backend-2-0, simple-backend-2-1; processes are \
         control-plane, ingress-gateway, and <pod>.app, <pod>.sidecar\n"
    );
    let (ok, _, err) = kill(&net, &["control-plane", "--app"]);
    assert!(!ok);
    assert_eq!(
        err,
        "minimesh kill: --app takes a pod name; control-plane is a process\n"
    );
    let (ok, _, err) = kill(&net, &["simple-backend-2-0", "--signal", "USR1"]);
    assert!(!ok);
    assert_eq!(
        err,
        "minimesh kill: --signal USR1 goes to an app (add --app, or name <pod>.app): a sidecar, the control plane or the gateway would exit on it\n"
    );

    // A replica that fails fast (its database went away): simple-web's
    // sidecar ejects it after 5 consecutive 500s: no rule sets
    // outlierDetection, the default does it.
    let pid = state["pids"]["simple-backend-2-0.app"]
        .as_u64()
        .expect("pid");
    let (ok, out, err) = kill(&net, &["simple-backend-2-0", "--app", "--signal", "USR1"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        format!(
            "sent SIGUSR1 to simple-backend-2-0.app (pid {pid})\n\
             it answers every request with its ERROR_CODE until `minimesh kill simple-backend-2-0 --app --signal USR2`; callers eject it after 5 consecutive 5xx other than 503 (unless their rule counts 503s)\n"
        )
    );
    let mut statuses = Vec::new();
    for _ in 0..60 {
        let (status, _, _) = get(ingress, "simple-web.istioinaction.io", "/")
            .await
            .expect("ingress");
        statuses.push(status);
    }
    // Exactly five: the ones that ejected it, none after.
    let failed = statuses.iter().filter(|s| **s != 200).count();
    assert_eq!(failed, 5, "{statuses:?}");
    up.assert_running();
}
