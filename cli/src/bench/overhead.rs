//! `minimesh bench overhead`: what a proxy costs. A zero-latency backend is
//! reached directly, through one sidecar (a client pod's sidecar straight to
//! the app), through a sidecar pair (the client pod's sidecar, then the
//! server pod's inbound sidecar), through the ingress gateway (straight to
//! the app, as nginx in front of it), and through nginx and HAProxy when
//! installed. For each path:
//! the latency added at a fixed 1,000 requests a second (p50, p99 over the
//! direct path), the highest rate it reaches with 64 connections, the
//! proxies' CPU seconds per 1,000 requests at the fixed rate and CPU per
//! request at the highest, and their peak RSS (from /proc).
//! With nginx installed, nginx answering by itself (`return 200`) is
//! measured too: the machine's cost of one connection and one wake-up per
//! request, of which a proxy pays two, and so the floor that every proxy's
//! CPU figure is read against (a figure in CPU seconds alone depends on the
//! day's machine more than on the proxy).
//! The paths take turns over several rounds and each figure is the median of
//! its rounds: on a shared machine one pass per path lets a burst of someone
//! else's work decide a ratio. The one-sidecar path and the gateway are also
//! set against each peer round by round, so that a claim such as "at least nginx's top rate"
//! can be read as how many rounds it held in.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::drive::{self, Target};
use super::peers;
use crate::mesh::{Mesh, UpArgs};

mod generator;
pub use generator::Generator;

mod captured;
mod mtls;
mod paired;
mod rounds;

pub use paired::Paired;
use paired::{paired, paired_line};
use rounds::rounds_of;

/// One path's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PathResult {
    /// The path.
    pub path: String,
    /// p50 at the fixed rate, ms.
    pub p50_ms: f64,
    /// p99 at the fixed rate, ms.
    pub p99_ms: f64,
    /// p50 added over the direct path, ms.
    pub added_p50_ms: f64,
    /// p99 added over the direct path, ms.
    pub added_p99_ms: f64,
    /// Failed requests at the fixed rate.
    pub errors: u64,
    /// Requests per second at saturation.
    pub max_rps: f64,
    /// CPU seconds the proxies used per 1,000 requests at the fixed rate.
    pub cpu_s_per_1000: Option<f64>,
    /// CPU the proxies used per request at saturation, microseconds: what
    /// they take from the generator and the backend sharing the cores, and
    /// so what the top rate depends on.
    pub cpu_us_per_request_saturated: Option<f64>,
    /// Peak RSS of the proxies at the fixed rate, MiB.
    pub peak_rss_mib: Option<f64>,
    /// Peak RSS of the proxies over every round, saturation included, MiB.
    pub peak_rss_overall_mib: Option<f64>,
    /// Requests per second at saturation in each round (`max_rps` is their
    /// median).
    pub max_rps_rounds: Vec<f64>,
    /// p50 and p99 at the fixed rate in each round, ms.
    pub p50_ms_rounds: Vec<f64>,
    /// See `p50_ms_rounds`.
    pub p99_ms_rounds: Vec<f64>,
    /// `cpu_s_per_1000` in each round (empty for a path with no proxy).
    pub cpu_s_per_1000_rounds: Vec<f64>,
    /// `cpu_us_per_request_saturated` in each round.
    pub cpu_us_per_request_saturated_rounds: Vec<f64>,
}

const TOPOLOGY: &str = "# Written by minimesh bench overhead.
apiVersion: minimesh.io/v1alpha1
kind: LocalMesh
metadata: {name: overhead}
spec:
  namespace: overhead
  network: 127.0.12.0
  # Plaintext, as the nginx and HAProxy rows it is set beside.
  mtls: false
  ingress:
    listen: 127.0.12.252:30000
    defaultService: echo
    # The gateway row: the ingress straight to the echo app, as nginx's row.
    hosts: {echo-direct: echo-direct}
    # As a gateway the public reaches runs (and as nginx, which adds no
    # header): no mesh headers on responses.
    debugHeaders: false
  services:
  - name: echo
    deployments:
    - name: echo
      env: {MESSAGE: echo}
  - name: client
    deployments:
    - name: client
      env: {MESSAGE: client}
";

/// CPU ticks (user + system, 1/100 s) of process `pid`, from /proc.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat: 12 and 13 after ')'.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// CPU ticks (user + system) and peak RSS (kB) of `pid` and its children.
fn usage(pid: u32) -> (u64, u64) {
    let mut pids = vec![pid];
    pids.extend(peers::children_of(pid));
    let (mut ticks, mut hwm) = (0, 0);
    for p in pids {
        ticks += cpu_ticks(p);
        let status = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
        hwm += status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    (ticks, hwm)
}

/// Workers of every proxy compared: nginx `worker_processes`, HAProxy
/// `nbthread`, the sidecars' `--worker-threads`.
const PEER_WORKERS: usize = 2;

/// The path on which nginx answers by itself (`return 200`, no upstream):
/// one connection read and written and one wake-up per request, about the
/// least an HTTP server can spend on this machine. A proxy does that twice per
/// request (the caller's connection and the app's), so twice this path's
/// CPU is the floor every proxy's figure is read against.
pub const FLOOR: &str = "nginx answering itself (the floor)";

/// The CPU floor of one proxy and each proxy path's CPU against it.
#[derive(Debug, Clone, Serialize)]
pub struct CpuFloor {
    /// CPU seconds per 1,000 requests of nginx answering by itself.
    pub server_cpu_s_per_1000: f64,
    /// Twice that: two connections served per proxied request.
    pub proxy_cpu_s_per_1000: f64,
    /// Each proxy path's CPU at the fixed rate over the floor of the proxies
    /// on it (two for the sidecar pair).
    pub ratios: Vec<(String, f64)>,
}

fn cpu_floor(results: &[PathResult]) -> Option<CpuFloor> {
    let server = results
        .iter()
        .find(|r| r.path == FLOOR)?
        .cpu_s_per_1000
        .filter(|c| *c > 0.0)?;
    let proxy = 2.0 * server;
    let ratios = results
        .iter()
        .filter(|r| r.path != FLOOR)
        .filter_map(|r| {
            let proxies = if r.path.starts_with("sidecar pair") {
                2.0
            } else {
                1.0
            };
            Some((r.path.clone(), r.cpu_s_per_1000? / (proxy * proxies)))
        })
        .collect();
    Some(CpuFloor {
        server_cpu_s_per_1000: server,
        proxy_cpu_s_per_1000: proxy,
        ratios,
    })
}

/// Clock ticks per second of /proc/PID/stat (USER_HZ, 100 on Linux).
pub(crate) const TICKS: f64 = 100.0;

/// Runs the overhead measurement; writes `overhead.json` and `summary.txt`
/// under `--out`/overhead.
pub async fn run(home: &Path, args: &super::BenchArgs, generator: Generator) -> anyhow::Result<()> {
    let out = &args.out.join("overhead");
    let (scale, no_peers, rounds) = (args.scale, args.no_peers, args.rounds as usize);
    let (network, ingress) = (args.network, args.ingress);
    let duration = Duration::from_secs_f64((10.0 * scale).max(1.0));
    let rate = 1000.0;
    std::fs::create_dir_all(out)?;
    let topology = out.join("overhead.topology.yaml");
    std::fs::write(&topology, mtls::topology(args)?)?;
    println!(
        "minimesh bench overhead: a zero-latency backend at {rate} req/s for {duration:?} per path (10 connections), then saturated with 64; {rounds} round(s), the paths taking turns, medians reported; {PEER_WORKERS} workers per proxy; load generator: {}",
        generator.name()
    );
    let mesh = Mesh::start(
        &home.join("bench"),
        &UpArgs {
            topology: topology.clone(),
            network,
            ingress,
            // As many event loops as nginx has workers and HAProxy threads.
            sidecar_worker_threads: Some(PEER_WORKERS),
            restart_after: crate::mesh::RestartAfter(None),
            workload_cert_ttl: None,
            capture: false,
        },
    )
    .await?;
    let baseline = args.baseline_sidecar.as_deref();
    let capture_pod = match args.capture {
        true => match captured::CapturePod::start(out).await {
            Ok(p) => Some(p),
            Err(e) => {
                mesh.stop().await;
                return Err(e);
            }
        },
        false => None,
    };
    let result = paths(
        &mesh,
        out,
        rate,
        duration,
        no_peers,
        &generator,
        rounds,
        baseline,
        args.mtls,
        capture_pod.as_ref(),
    )
    .await;
    drop(capture_pod);
    mesh.stop().await;
    let results = result?;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{:<34} {:>9} {:>9} {:>10} {:>10} {:>7} {:>10} {:>17} {:>14} {:>14} {:>10}",
        "path",
        "p50",
        "p99",
        "+p50",
        "+p99",
        "failed",
        "max rps",
        "(rounds' range)",
        "CPU s/1000req",
        "CPU us/req sat",
        "peak RSS"
    );
    for r in &results {
        // The floor is another server, not a path to the app: nothing added.
        let added = |ms: f64| {
            if r.path == FLOOR {
                "-".to_string()
            } else {
                format!("{ms:.3}ms")
            }
        };
        let _ =
            writeln!(
            s,
            "{:<34} {:>7.3}ms {:>7.3}ms {:>10} {:>10} {:>7} {:>10.0} {:>17} {:>14} {:>14} {:>10}",
            r.path,
            r.p50_ms,
            r.p99_ms,
            added(r.added_p50_ms),
            added(r.added_p99_ms),
            r.errors,
            r.max_rps,
            {
                let lo = r.max_rps_rounds.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = r.max_rps_rounds.iter().copied().fold(0.0, f64::max);
                format!("{lo:.0}-{hi:.0}")
            },
            r.cpu_s_per_1000.map_or("-".into(), |c| format!("{c:.4}")),
            r.cpu_us_per_request_saturated
                .map_or("-".into(), |c| format!("{c:.1}")),
            r.peak_rss_mib.map_or("-".into(), |m| format!("{m:.1} MiB"))
        );
    }
    let _ = writeln!(
        s,
        "(medians of the rounds; +p50/+p99: added over the direct path; CPU and RSS of the proxies on the path, from /proc: CPU s/1000req at the fixed rate, CPU us/req at saturation; peak RSS at the fixed rate, before any saturation)"
    );
    let capture_cost = captured::cost(&results);
    if let Some(c) = &capture_cost {
        s.push_str(&captured::summary(c));
    }
    let floor = cpu_floor(&results);
    if let Some(f) = &floor {
        let _ = writeln!(
            s,
            "\nCPU floor: nginx answering by itself (return 200, no upstream) used {:.4} CPU s per 1,000 requests, one connection and one wake-up per request; a proxy serves two connections per request, so about {:.4} is the least a proxy can use on this machine today (two proxies on the sidecar pair: {:.4}). Each path's CPU at the fixed rate against that floor: {}",
            f.server_cpu_s_per_1000,
            f.proxy_cpu_s_per_1000,
            2.0 * f.proxy_cpu_s_per_1000,
            f.ratios
                .iter()
                .map(|(p, r)| format!("{p} {r:.2}x"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let pairs = paired(&results);
    if !pairs.is_empty() {
        let _ = writeln!(
            s,
            "\none sidecar against each peer, round by round (measured in the same round; \"<peer>, gateway\": the ingress gateway against it; \"{}\": the sidecar pair over mutual TLS against it):",
            paired::NGINX_MTLS_PAIR
        );
    }
    for p in &pairs {
        let _ = writeln!(
            s,
            "  {:<8} max RPS ratio  {}\n  {:<8} p50 difference {}\n  {:<8} p99 difference {}",
            p.peer,
            paired_line(&p.max_rps_ratio, |r| r >= 1.0, |r| format!("{r:.2}x")),
            "",
            paired_line(&p.p50_diff_ms, |d| d <= 0.0, |d| format!("{d:+.3}ms")),
            "",
            paired_line(&p.p99_diff_ms, |d| d <= 0.0, |d| format!("{d:+.3}ms")),
        );
        // CPU a request against the peer's (lower is ahead), at the fixed
        // rate and saturated.
        for (what, ratios) in [
            (format!("CPU at {rate} req/s"), &p.cpu_ratio),
            ("CPU saturated".to_string(), &p.cpu_saturated_ratio),
        ] {
            if !ratios.is_empty() {
                let line = paired_line(ratios, |r| r <= 1.0, |r| format!("{r:.2}x"));
                let _ = writeln!(s, "  {:<8} {what} {line}", "");
            }
        }
    }
    super::save(
        out,
        &s,
        "overhead.json",
        &serde_json::json!({
            "rate": rate,
            "duration_s": duration.as_secs_f64(),
            "rounds": rounds,
            "load_generator": generator.name(),
            "paths": results,
            "sidecar_against_peers": pairs,
            "cpu_floor": floor,
            "capture_against_explicit": capture_cost,
        }),
    )
}

#[allow(clippy::too_many_arguments)]
async fn paths(
    mesh: &Mesh,
    out: &Path,
    rate: f64,
    duration: Duration,
    no_peers: bool,
    generator: &Generator,
    rounds: usize,
    baseline: Option<&Path>,
    mtls: bool,
    capture: Option<&captured::CapturePod>,
) -> anyhow::Result<Vec<PathResult>> {
    let pod = mesh
        .state
        .pods
        .iter()
        .find(|p| p.service == "echo")
        .context("no echo pod")?
        .clone();
    let client = mesh
        .state
        .pods
        .iter()
        .find(|p| p.service == "client")
        .context("no client pod")?
        .clone();
    // The client pod's sidecar: what an app in that pod would call.
    let outbound = SocketAddr::from((client.ip, crate::mesh::OUTBOUND_PORT));
    // echo-direct: the same pod's app, without its sidecar (one proxy on the path).
    let ns = &mesh.state.namespace;
    let direct_yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: echo-direct, namespace: {ns}}}\nspec:\n  ports: [{{name: http, port: 80, targetPort: {port}}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: echo-direct-local\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: echo-direct}}\naddressType: IPv4\nports: [{{name: http, port: {port}}}]\nendpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n",
        port = crate::mesh::APP_PORT,
        ip = pod.ip
    );
    crate::mesh::write_atomic(
        &mesh
            .state
            .config_dir
            .join("services")
            .join("echo-direct.yaml"),
        &direct_yaml,
    )?;
    if mtls {
        mtls::services(mesh, out, &pod).await?;
    }
    crate::mesh::wait_converged(&mesh.state, Duration::from_secs(10)).await?;
    let target = |addr: SocketAddr, host: &str| Target {
        addr,
        host: host.to_string(),
        path: "/".into(),
        backends: Arc::new(vec![pod.ip]),
        timeout: Duration::from_secs(10),
    };
    let client_sidecar = mesh.pid(&format!("{}.sidecar", client.name));
    let server_sidecar = mesh.pid(&format!("{}.sidecar", pod.name));
    let mut specs = vec![
        ("direct".to_string(), target(pod.app(), "echo"), vec![]),
        (
            "one sidecar (-> app)".to_string(),
            target(outbound, "echo-direct"),
            client_sidecar.into_iter().collect::<Vec<_>>(),
        ),
        (
            "sidecar pair (-> sidecar -> app)".to_string(),
            target(outbound, "echo"),
            client_sidecar
                .into_iter()
                .chain(server_sidecar)
                .collect::<Vec<_>>(),
        ),
    ];
    let pair_pids = client_sidecar.into_iter().chain(server_sidecar);
    let mtls_pair = (
        paired::MTLS_PAIR.to_string(),
        target(outbound, "echo-mtls"),
        pair_pids.collect(),
    );
    specs.extend(mtls.then_some(mtls_pair));
    if let Some(c) = capture {
        specs.extend(c.specs(target));
    }
    // The ingress gateway straight to the app: the row set against nginx
    // in front of an app (issue 31).
    if let Some(ingress) = mesh.state.ingress {
        specs.push((
            paired::GATEWAY.to_string(),
            target(ingress, "echo-direct"),
            mesh.pid("ingress-gateway").into_iter().collect(),
        ));
    }
    // Another build's sidecar, beside the client pod's: the same flags, its
    // own address, the same control plane.
    let mut baseline_proc = None;
    if let Some(binary) = baseline {
        let o = client.ip.octets();
        let ip = Ipv4Addr::new(o[0], o[1], o[2], 249);
        let listen = SocketAddr::from((ip, crate::mesh::OUTBOUND_PORT));
        let log = std::fs::File::create(out.join("baseline-sidecar.log"))?;
        let child = tokio::process::Command::new(binary)
            .args([
                "--xds-addr",
                &format!("http://{}", mesh.state.control_plane_xds),
            ])
            .args([
                "--workload",
                "baseline",
                "--namespace",
                &mesh.state.namespace,
            ])
            .args(["--outbound", &listen.to_string()])
            .args(["--admin", &SocketAddr::from((ip, 15000)).to_string()])
            .args(["--worker-threads", &PEER_WORKERS.to_string()])
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting the baseline sidecar {}", binary.display()))?;
        let admin = SocketAddr::from((ip, 15000));
        let started = tokio::time::Instant::now();
        while !matches!(
            crate::http::get(&admin.to_string(), "/ready").await,
            Ok((200, _))
        ) {
            if started.elapsed() > Duration::from_secs(10) {
                anyhow::bail!(
                    "the baseline sidecar {} was not ready within 10 s (see {})",
                    binary.display(),
                    out.join("baseline-sidecar.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        specs.push((
            "baseline sidecar (-> app)".to_string(),
            target(listen, "echo-direct"),
            child.id().into_iter().collect(),
        ));
        baseline_proc = Some(child);
    }
    // The peers run side by side (one port each) for the whole measurement,
    // so that the rounds can alternate between every path.
    let mut running = Vec::new();
    let mut floor_spec = None;
    if !no_peers {
        let o = pod.ip.octets();
        for (port, kind, directives) in [
            (30000, peers::Kind::Nginx, ""),
            (30001, peers::Kind::Haproxy, "balance roundrobin"),
        ] {
            let Some(binary) = peers::find(kind.binary()) else {
                println!(
                    "  {} is not installed: skipping it (apt-get install {})",
                    kind.binary(),
                    kind.package()
                );
                continue;
            };
            let listen = SocketAddr::from((Ipv4Addr::new(o[0], o[1], o[2], 251), port));
            // nginx also answers by itself, on port 30002: the floor.
            let floor = (kind == peers::Kind::Nginx)
                .then(|| SocketAddr::from((Ipv4Addr::new(o[0], o[1], o[2], 251), 30002)));
            let config = peers::PeerConfig {
                listen,
                servers: vec![(&pod, 1)],
                directives,
                timeout: Duration::from_secs(10),
                retry_5xx: false,
                static_listen: floor,
            };
            let peer = match peers::start(kind, &binary, &out.join(kind.binary()), &config).await {
                Ok(p) => p,
                Err(e) => {
                    for p in running {
                        peers::Peer::stop(p).await;
                    }
                    return Err(e);
                }
            };
            specs.push((
                format!("{} (-> app)", kind.binary()),
                target(listen, "echo"),
                peer.pid().into_iter().collect(),
            ));
            if let Some(floor) = floor {
                floor_spec = Some((
                    FLOOR.to_string(),
                    target(floor, "echo"),
                    peer.pid().into_iter().collect(),
                ));
            }
            running.push(peer);
        }
    }
    if mtls && !no_peers {
        let o = pod.ip.octets();
        let at = |port| SocketAddr::from((Ipv4Addr::new(o[0], o[1], o[2], 251), port));
        // On an error, `running`'s peers are killed as they drop.
        let pair = mtls::nginx_pair(mesh, out, &pod, at(30003), at(30004)).await?;
        if let Some((pids, pair)) = pair {
            specs.push((
                paired::NGINX_MTLS_PAIR.to_string(),
                target(at(30003), "echo"),
                pids,
            ));
            running.extend([pair.front, pair.back]);
        }
    }
    specs.extend(floor_spec);
    let measured = rounds_of(&specs, rounds, rate, duration, generator).await;
    for p in running {
        p.stop().await;
    }
    if let Some(mut child) = baseline_proc {
        let _ = child.kill().await;
    }
    let mut results = measured?;
    let (b50, b99) = (results[0].p50_ms, results[0].p99_ms);
    for r in results.iter_mut().filter(|r| r.path != FLOOR) {
        r.added_p50_ms = r.p50_ms - b50;
        r.added_p99_ms = r.p99_ms - b99;
    }
    Ok(results)
}
