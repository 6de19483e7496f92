//! `minimesh bench control-plane`: how many sidecars one control plane
//! holds and how fast a change reaches them all. N simulated sidecars, all in
//! this process, each do what a real sidecar does on its one TCP (HTTP/2)
//! connection: a discovery stream that subscribes to every type and ACKs
//! every response, and a load-report stream. We measure the control
//! plane's memory per connected sidecar (RSS from /proc) and the time from
//! an EndpointSlice change on disk to each sidecar's ACK of it (p50, p99,
//! max), over several changes.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
use minimesh_proto::v1::{DiscoveryRequest, LoadStatsRequest, Node};
use minimesh_proto::{CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE};
use serde::Serialize;
use tokio::sync::{mpsc, Mutex};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

/// Figures for one N.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleResult {
    /// Simulated sidecars connected.
    pub sidecars: usize,
    /// Time to connect them all and deliver their first config, s.
    pub connect_s: f64,
    /// Control plane RSS with no sidecar, MiB.
    pub base_rss_mib: f64,
    /// Control plane RSS with all of them, MiB.
    pub rss_mib: f64,
    /// (rss - base) / sidecars, KiB.
    pub kib_per_sidecar: f64,
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

fn slice(endpoints: usize) -> String {
    let mut y = String::from(
        "apiVersion: v1\nkind: Service\nmetadata: {name: backend, namespace: default}\nspec:\n  ports: [{name: http, port: 80, targetPort: 9090}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: backend-abc\n  namespace: default\n  labels: {kubernetes.io/service-name: backend}\naddressType: IPv4\nports: [{name: http, port: 9090}]\nendpoints:\n",
    );
    for i in 0..endpoints {
        let _ = writeln!(
            y,
            "- addresses: [\"10.1.{}.{}\"]\n  conditions: {{ready: true}}",
            i / 250,
            i % 250 + 1
        );
    }
    y
}

/// One simulated sidecar: subscribes to every type, ACKs each response, and
/// records when it ACKed each endpoints version.
async fn sidecar(
    addr: SocketAddr,
    i: usize,
    acks: Arc<Mutex<Vec<(String, Instant)>>>,
    ready: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel.clone());
    let (tx, rx) = mpsc::channel(8);
    let node = Node {
        id: format!("sim-{i}.default"),
        workload: format!("sim-{i}"),
        namespace: "default".into(),
        ..Default::default()
    };
    // The load-report stream, on the same connection; kept open, silent
    // (this sidecar sends no traffic).
    let (lrs_tx, lrs_rx) = mpsc::channel(1);
    lrs_tx
        .send(LoadStatsRequest {
            node: Some(node.clone()),
            cluster_stats: vec![],
        })
        .await?;
    let mut lrs = LoadReportingServiceClient::new(channel)
        .stream_load_stats(ReceiverStream::new(lrs_rx))
        .await?
        .into_inner();
    let _interval = lrs.message().await?;
    for (k, t) in [CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE]
        .into_iter()
        .enumerate()
    {
        tx.send(DiscoveryRequest {
            node: (k == 0).then(|| node.clone()),
            type_url: t.into(),
            ..Default::default()
        })
        .await?;
    }
    let mut stream = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut first = 0;
    while let Some(resp) = stream.message().await? {
        tx.send(DiscoveryRequest {
            version_info: resp.version_info.clone(),
            type_url: resp.type_url.clone(),
            response_nonce: resp.nonce.clone(),
            ..Default::default()
        })
        .await?;
        let now = Instant::now();
        if resp.type_url == ENDPOINTS_TYPE {
            acks.lock().await.push((resp.version_info, now));
        }
        first += 1;
        if first == 3 {
            ready.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

async fn one(
    n: usize,
    dir: &Path,
    changes: usize,
    network: Ipv4Addr,
) -> anyhow::Result<ScaleResult> {
    let config = dir.join("config");
    let _ = std::fs::remove_dir_all(&config);
    std::fs::create_dir_all(&config)?;
    let svc = config.join("backend.yaml");
    crate::mesh::write_atomic(&svc, &slice(3))?;
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
    let acks = Arc::new(Mutex::new(Vec::with_capacity(n * (changes + 1))));
    let ready = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        tasks.push(tokio::spawn(sidecar(xds, i, acks.clone(), ready.clone())));
        if i % 100 == 99 {
            // Connect in waves, as sidecars of a rolling deployment would.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while (ready.load(Ordering::Relaxed) as usize) < n {
        if Instant::now() > deadline {
            bail!(
                "only {} of {n} simulated sidecars got their config within 120s",
                ready.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let connect_s = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss = rss_kib(pid);
    let mut lat = Vec::new();
    for c in 0..changes {
        let before: std::collections::HashSet<String> =
            acks.lock().await.iter().map(|(v, _)| v.clone()).collect();
        let start = Instant::now();
        crate::mesh::write_atomic(&svc, &slice(4 + c))?;
        let deadline = start + Duration::from_secs(60);
        loop {
            let got: Vec<Instant> = acks
                .lock()
                .await
                .iter()
                .filter(|(v, _)| !before.contains(v))
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
        connect_s,
        base_rss_mib: base / 1024.0,
        rss_mib: rss / 1024.0,
        kib_per_sidecar: (rss - base) / n as f64,
        ack_p50_ms: q(0.5),
        ack_p99_ms: q(0.99),
        ack_max_ms: q(1.0),
        changes,
    })
}

/// Runs for each N; writes `control-plane.json` and `summary.txt` under `out`.
pub async fn run(out: &Path, sidecars: &[usize], network: Option<Ipv4Addr>) -> anyhow::Result<()> {
    let network = network.unwrap_or(Ipv4Addr::new(127, 0, 13, 0));
    if !network.is_loopback() {
        bail!("--network {network} is not in 127.0.0.0/8");
    }
    std::fs::create_dir_all(out)?;
    println!(
        "minimesh bench control-plane: {sidecars:?} simulated sidecars (each one HTTP/2 connection carrying a discovery and a load-report stream, as a real sidecar; all in this process), 5 EndpointSlice changes each"
    );
    let mut results = Vec::new();
    for &n in sidecars {
        let r = one(n, out, 5, network)
            .await
            .with_context(|| format!("{n} sidecars"))?;
        println!(
            "  {n:>6} sidecars: connected in {:.1}s; RSS {:.1} -> {:.1} MiB ({:.1} KiB per sidecar); change -> ACK p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            r.connect_s, r.base_rss_mib, r.rss_mib, r.kib_per_sidecar, r.ack_p50_ms, r.ack_p99_ms, r.ack_max_ms
        );
        results.push(r);
    }
    let mut s = format!(
        "\n{:>8} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10}\n",
        "sidecars", "connect", "RSS", "per sidecar", "ACK p50", "ACK p99", "ACK max"
    );
    for r in &results {
        let _ = writeln!(
            s,
            "{:>8} {:>9.1}s {:>6.1} MiB {:>8.1} KiB {:>8.0}ms {:>8.0}ms {:>8.0}ms",
            r.sidecars,
            r.connect_s,
            r.rss_mib,
            r.kib_per_sidecar,
            r.ack_p50_ms,
            r.ack_p99_ms,
            r.ack_max_ms
        );
    }
    super::save(
        out,
        &s,
        "control-plane.json",
        &serde_json::json!({"runs": results}),
    )
}
