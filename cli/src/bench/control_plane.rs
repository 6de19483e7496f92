//! `minimesh bench control-plane`: how many sidecars one control plane
//! holds and how fast a change reaches them all. N simulated sidecars, all in
//! this process, each do what a real sidecar does on its one TCP (HTTP/2)
//! connection: a discovery stream that subscribes to every type and ACKs
//! every response, and a load-report stream. We measure the control
//! plane's memory per connected sidecar (RSS from /proc) and the time from
//! an EndpointSlice change on disk to each sidecar's ACK of it (p50, p99,
//! max), over several changes.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;
use tokio::time::Instant;

mod sidecar;
mod v3;

use sidecar::{sidecar, Shared, CALLED, STEADY_SECS};

/// Figures for one N.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleResult {
    /// Simulated sidecars connected.
    pub sidecars: usize,
    /// Services in the mesh (`--services`); every sidecar gets them all.
    pub services: usize,
    /// Endpoints of each service before the changes (each change adds one
    /// to the first).
    pub endpoints: usize,
    /// Time to connect them all and deliver their first config, s.
    pub connect_s: f64,
    /// Control plane RSS with no sidecar, MiB.
    pub base_rss_mib: f64,
    /// Control plane RSS with all of them, MiB.
    pub rss_mib: f64,
    /// (rss - base) / sidecars, KiB.
    pub kib_per_sidecar: f64,
    /// Every service had a LOAD_AWARE rule (`--load-aware`).
    pub load_aware: bool,
    /// What the simulated clients spoke: `minimesh` (as sidecars) or
    /// `xds-v3` (as Envoy, `--xds-v3`).
    pub protocol: &'static str,
    /// Load-report interval the control plane asked for, ms.
    pub report_interval_ms: u64,
    /// Load reports received a second, at steady state.
    pub reports_per_s: f64,
    /// Endpoint (EDS) pushes each sidecar received a second, at steady
    /// state (LOAD_AWARE's new weights; nothing else changes then).
    pub eds_pushes_per_sidecar_per_s: f64,
    /// Endpoint assignments those pushes carried, KiB per sidecar a second
    /// (the resources' encoded size).
    pub eds_kib_per_sidecar_per_s: f64,
    /// With `--load-aware`: seconds from every sidecar configured until
    /// every cluster's weights had settled, each cluster's at the last
    /// change before 3 s without one (the steady state is measured after
    /// that); null when some had not settled within 60 s.
    pub weights_settled_s: Option<f64>,
    /// Some sidecar was pushed endpoints of unequal weights (LOAD_AWARE's,
    /// once its controller moved them).
    pub weights_moved: bool,
    /// Control plane CPU at steady state, cores (1.0 = one core busy).
    pub cpu_cores: f64,
    /// Change to ACK, over every sidecar and change: p50, p99, max (ms).
    pub ack_p50_ms: f64,
    /// p99.
    pub ack_p99_ms: f64,
    /// Slowest.
    pub ack_max_ms: f64,
    /// Changes made.
    pub changes: usize,
}

fn rss_kib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Service `k`'s name: `backend`, then `backend-1`, `backend-2`, ...
fn service_name(k: usize) -> String {
    match k {
        0 => "backend".into(),
        k => format!("backend-{k}"),
    }
}

/// The cluster whose endpoints the changes add to: service 0's.
const CHANGED_CLUSTER: &str = "backend.default.svc.cluster.local:80";

/// Service `k` and its EndpointSlice of `endpoints` addresses (each
/// service its own 10.x.y.z range: k < 1000, endpoints < 1000).
fn service(k: usize, endpoints: usize) -> String {
    let name = service_name(k);
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  ports: [{{name: http, port: 80, targetPort: 9090}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-abc\n  namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports: [{{name: http, port: 9090}}]\nendpoints:\n",
    );
    for i in 0..endpoints {
        let _ = writeln!(
            y,
            "- addresses: [\"10.{}.{}.{}\"]\n  conditions: {{ready: true}}",
            1 + k / 64,
            (k % 64) * 4 + i / 250,
            i % 250 + 1
        );
    }
    y
}

/// The LOAD_AWARE rules `--load-aware` applies, one per service.
fn load_aware_rules(services: usize) -> String {
    (0..services)
        .map(|k| {
            let name = service_name(k);
            format!("apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  host: {name}\n  trafficPolicy: {{loadBalancer: {{simple: LOAD_AWARE}}}}\n")
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// With `--load-aware`: seconds without a change of a cluster's weights
/// after which they count as settled, and the longest wait for that.
const SETTLED_SECS: u64 = 3;
const SETTLE_LIMIT_SECS: u64 = 60;

/// EndpointSlice changes made in each run.
const CHANGES: usize = 5;

async fn one(
    n: usize,
    dir: &Path,
    network: Ipv4Addr,
    load_aware: bool,
    xds_v3: bool,
    endpoints: usize,
    services: usize,
) -> anyhow::Result<ScaleResult> {
    let config = dir.join("config");
    let _ = std::fs::remove_dir_all(&config);
    std::fs::create_dir_all(&config)?;
    for k in 0..services {
        let file = config.join(format!("{}.yaml", service_name(k)));
        crate::mesh::write_atomic(&file, &service(k, endpoints))?;
    }
    let svc = config.join("backend.yaml");
    if load_aware {
        crate::mesh::write_atomic(&config.join("rules.yaml"), &load_aware_rules(services))?;
    }
    let o = network.octets();
    let cp = Ipv4Addr::new(o[0], o[1], o[2], 254);
    let xds = SocketAddr::from((cp, 15010));
    let admin = SocketAddr::from((cp, 15014));
    let log = std::fs::File::create(dir.join(format!("control-plane-{n}.log")))?;
    let mut cp = tokio::process::Command::new(crate::mesh::binary("control-plane")?)
        .arg("--config-dir")
        .arg(&config)
        .args([
            "--xds-addr",
            &xds.to_string(),
            "--admin-addr",
            &admin.to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting the control plane")?;
    let pid = cp.id().context("control plane pid")?;
    let deadline = Instant::now() + Duration::from_secs(15);
    while !matches!(
        crate::http::get(&admin.to_string(), "/readyz").await,
        Ok((200, _))
    ) {
        if Instant::now() > deadline {
            bail!("control plane not ready; see {}", dir.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let base = rss_kib(pid);
    let shared = Arc::new(Shared::default());
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        tasks.push(if xds_v3 {
            tokio::spawn(v3::client(xds, i, shared.clone()))
        } else {
            tokio::spawn(sidecar(xds, i, shared.clone()))
        });
        if i % 100 == 99 {
            // Connect in waves, as sidecars of a rolling deployment would.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while (shared.ready.load(Ordering::Relaxed) as usize) < n {
        if let Some(k) = tasks.iter().position(|t| t.is_finished()) {
            let e = (&mut tasks[k]).await;
            bail!("simulated sidecar {k} stopped before it was configured: {e:?}");
        }
        if Instant::now() > deadline {
            bail!(
                "only {} of {n} simulated sidecars got their config within 120s",
                shared.ready.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let connect_s = t0.elapsed().as_secs_f64();
    // Memory is measured once every sidecar has reported twice, so that the
    // control plane holds what their reports make it keep.
    let interval = Duration::from_millis(shared.interval_ms.load(Ordering::Relaxed));
    let deadline = Instant::now() + interval * 3 + Duration::from_secs(30);
    while (shared.reports.load(Ordering::Relaxed) as usize) < 2 * n {
        if Instant::now() > deadline {
            bail!(
                "{} of {} load reports sent within {:?} (interval {interval:?})",
                shared.reports.load(Ordering::Relaxed),
                2 * n,
                interval * 3 + Duration::from_secs(30)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss = rss_kib(pid);
    // LOAD_AWARE's controller moves each cluster's weights from the mean
    // towards capacity for a few seconds: wait until every cluster has gone
    // SETTLED_SECS without a change (at most SETTLE_LIMIT_SECS), so that the
    // steady state is measured without that transient. Clusters settle on
    // their own: a quiet spell of all of them at once grows rarer with their
    // number, whatever the controller does.
    let weights_settled_s = if load_aware {
        let connected = t0 + Duration::from_secs_f64(connect_s);
        let limit = Instant::now() + Duration::from_secs(SETTLE_LIMIT_SECS);
        let mut settled: HashMap<String, Instant> = HashMap::new();
        loop {
            let now = Instant::now();
            let changed = shared
                .cluster_changed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            for (cluster, last) in &changed {
                let quiet = now.duration_since((*last).max(connected));
                if quiet >= Duration::from_secs(SETTLED_SECS) {
                    settled.entry(cluster.clone()).or_insert(*last);
                }
            }
            if !changed.is_empty() && settled.len() == changed.len() {
                let last = settled.values().max().copied().unwrap_or(connected);
                break Some(last.max(connected).duration_since(connected).as_secs_f64());
            }
            if now > limit {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    } else {
        None
    };
    // The steady state: every sidecar reporting, no change on disk.
    let (ticks0, reports0, eds0, bytes0) = (
        super::overhead::cpu_ticks(pid),
        shared.reports.load(Ordering::Relaxed),
        shared.eds_responses.load(Ordering::Relaxed),
        shared.eds_bytes.load(Ordering::Relaxed),
    );
    let steady = Instant::now();
    tokio::time::sleep(Duration::from_secs(STEADY_SECS)).await;
    let secs = steady.elapsed().as_secs_f64();
    let cpu_cores =
        (super::overhead::cpu_ticks(pid) - ticks0) as f64 / super::overhead::TICKS / secs;
    let reports_per_s = (shared.reports.load(Ordering::Relaxed) - reports0) as f64 / secs;
    let pushes_per_s =
        (shared.eds_responses.load(Ordering::Relaxed) - eds0) as f64 / secs / n as f64;
    let eds_kib_per_s =
        (shared.eds_bytes.load(Ordering::Relaxed) - bytes0) as f64 / 1024.0 / secs / n as f64;
    let mut lat = Vec::new();
    for c in 0..CHANGES {
        let want = endpoints + 1 + c;
        let start = Instant::now();
        crate::mesh::write_atomic(&svc, &service(0, want))?;
        let deadline = start + Duration::from_secs(60);
        loop {
            let got: Vec<Instant> = shared
                .acks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter(|(len, at)| *len == want && *at >= start)
                .map(|(_, t)| *t)
                .collect();
            if got.len() >= n {
                lat.extend(
                    got.iter()
                        .map(|t| t.duration_since(start).as_secs_f64() * 1000.0),
                );
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "change {c}: only {} of {n} sidecars ACKed within 60s",
                    got.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for t in &tasks {
        t.abort();
    }
    let _ = cp.start_kill();
    let _ = cp.wait().await;
    lat.sort_by(f64::total_cmp);
    let q = |q: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Ok(ScaleResult {
        sidecars: n,
        services,
        endpoints,
        load_aware,
        protocol: if xds_v3 { "xds-v3" } else { "minimesh" },
        connect_s,
        base_rss_mib: base / 1024.0,
        rss_mib: rss / 1024.0,
        kib_per_sidecar: (rss - base) / n as f64,
        report_interval_ms: interval.as_millis() as u64,
        reports_per_s,
        eds_pushes_per_sidecar_per_s: pushes_per_s,
        eds_kib_per_sidecar_per_s: eds_kib_per_s,
        weights_moved: shared.weights_moved.load(Ordering::Relaxed),
        weights_settled_s,
        cpu_cores,
        ack_p50_ms: q(0.5),
        ack_p99_ms: q(0.99),
        ack_max_ms: q(1.0),
        changes: CHANGES,
    })
}

/// Runs for each N; writes `control-plane.json` and `summary.txt` under `out`.
pub async fn run(
    out: &Path,
    sidecars: &[usize],
    network: Option<Ipv4Addr>,
    load_aware: bool,
    xds_v3: bool,
    endpoints: usize,
    services: usize,
) -> anyhow::Result<()> {
    let network = network.unwrap_or(Ipv4Addr::new(127, 0, 13, 0));
    if !network.is_loopback() {
        bail!("--network {network} is not in 127.0.0.0/8");
    }
    std::fs::create_dir_all(out)?;
    println!(
        "minimesh bench control-plane: {sidecars:?} simulated {} (each one HTTP/2 connection carrying a discovery and a load-report stream{}; all in this process), {} of {endpoints} endpoints{}, {}; 5 EndpointSlice changes each, each adding an endpoint to `backend`",
        if xds_v3 { "xDS v3 clients" } else { "sidecars" },
        if xds_v3 { ", as Envoy with deploy/envoy/bootstrap.yaml" } else { ", as a real sidecar" },
        match services {
            1 => "one service".to_string(),
            s => format!("{s} services"),
        },
        if services > 1 {
            format!(" (each sidecar gets them all and calls {})", CALLED.min(services))
        } else {
            String::new()
        },
        match (load_aware, services) {
            (true, 1) => "the service LOAD_AWARE (a load report a second from every sidecar, new weights pushed when they change)",
            (true, _) => "every service LOAD_AWARE (a load report a second from every sidecar, new weights pushed when they change)",
            (false, _) => "no rule (a load report every 10 s from every sidecar, the control plane's default)",
        }
    );
    let mut results = Vec::new();
    for &n in sidecars {
        let r = one(n, out, network, load_aware, xds_v3, endpoints, services)
            .await
            .with_context(|| format!("{n} sidecars"))?;
        let settled = match (load_aware, r.weights_settled_s) {
            (false, _) => String::new(),
            (true, Some(s)) => format!("weights settled {s:.1}s after; "),
            (true, None) => format!("weights still moving after {SETTLE_LIMIT_SECS}s; "),
        };
        let who = if xds_v3 { "xDS v3 clients" } else { "sidecars" };
        println!(
            "  {n:>6} {who}: connected in {:.1}s; {settled}RSS {:.1} -> {:.1} MiB ({:.1} KiB each); {:.0} reports/s, {:.2} pushes ({:.1} KiB) per client a second, {:.2} cores; change -> ACK p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            r.connect_s, r.base_rss_mib, r.rss_mib, r.kib_per_sidecar, r.reports_per_s, r.eds_pushes_per_sidecar_per_s, r.eds_kib_per_sidecar_per_s, r.cpu_cores, r.ack_p50_ms, r.ack_p99_ms, r.ack_max_ms
        );
        results.push(r);
    }
    let mut s = format!(
        "\n{:>8} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10}\n",
        "sidecars",
        "connect",
        "RSS",
        "per sidecar",
        "reports/s",
        "pushes/s",
        "push KiB/s",
        "CPU",
        "ACK p50",
        "ACK p99",
        "ACK max"
    );
    for r in &results {
        let _ = writeln!(
            s,
            "{:>8} {:>9.1}s {:>6.1} MiB {:>8.1} KiB {:>10.0} {:>10.2} {:>10.1} {:>7.2} {:>8.0}ms {:>8.0}ms {:>8.0}ms",
            r.sidecars,
            r.connect_s,
            r.rss_mib,
            r.kib_per_sidecar,
            r.reports_per_s,
            r.eds_pushes_per_sidecar_per_s,
            r.eds_kib_per_sidecar_per_s,
            r.cpu_cores,
            r.ack_p50_ms,
            r.ack_p99_ms,
            r.ack_max_ms
        );
    }
    let _ = writeln!(
        s,
        "(pushes/s, push KiB/s: endpoint pushes each sidecar received a second with nothing changing on disk, and the size of the endpoint assignments they carried; CPU: the control plane's, in cores, over those {STEADY_SECS} s)"
    );
    super::save(
        out,
        &s,
        "control-plane.json",
        &serde_json::json!({"runs": results}),
    )
}
