//! `minimesh demo`: the seed walkthrough as one command. Brings the demo
//! mesh up, applies each example rule in turn, drives a fixed-rate load
//! through the ingress, and prints each policy's share per replica, latency
//! percentiles and errors.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::apply::{apply_file, wait_rule};
use crate::load::{self, LoadSpec};
use crate::mesh::{print_summary, wait_converged, Mesh, UpArgs};

/// `minimesh demo` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Topology file.
    #[arg(long, default_value = "examples/local/topology.yaml")]
    pub topology: PathBuf,
    /// Rule files, applied in turn.
    #[arg(long = "rule", default_values = [
        "examples/rules/simple-backend-dr-rr.yaml",
        "examples/rules/simple-backend-dr-random.yaml",
        "examples/rules/simple-backend-dr-least-request.yaml",
    ])]
    pub rules: Vec<PathBuf>,
    /// Requests per second through the ingress.
    #[arg(long, default_value_t = 100.0)]
    pub qps: f64,
    /// Connections, each with one request in flight at most: enough for
    /// --qps at the demo's ~150 ms (20 carry about 130 a second).
    #[arg(long, default_value_t = 20)]
    pub connections: usize,
    /// Load duration per rule.
    #[arg(long, default_value = "10s", value_parser = minimesh_control_plane::duration)]
    pub duration: Duration,
    /// Host header sent to the ingress.
    #[arg(long, default_value = "simple-web.istioinaction.io")]
    pub host: String,
    /// Override the topology's /24 network; an ingress listening inside the
    /// topology's network moves with it.
    #[arg(long)]
    pub network: Option<Ipv4Addr>,
    /// Override the ingress listener.
    #[arg(long)]
    pub ingress: Option<SocketAddr>,
}

/// `minimesh demo`.
pub async fn run(home: PathBuf, args: DemoArgs) -> anyhow::Result<()> {
    for f in std::iter::once(&args.topology).chain(&args.rules) {
        if !f.is_file() {
            bail!("{} not found: run the demo from the repository root, or pass --topology and --rule", f.display());
        }
    }
    println!("minimesh demo: bringing up {} ...", args.topology.display());
    let up = UpArgs {
        topology: args.topology.clone(),
        network: args.network,
        ingress: args.ingress,
        sidecar_worker_threads: None,
        restart_after: crate::mesh::RestartAfter(None),
        workload_cert_ttl: None,
        capture: false,
    };
    let mesh = Mesh::start(&home, &up).await?;
    print_summary(&mesh.state);
    let result = policies(&mesh, &args).await;
    mesh.stop().await;
    result
}

async fn policies(mesh: &Mesh, args: &DemoArgs) -> anyhow::Result<()> {
    let ingress = mesh
        .state
        .ingress
        .context("the demo topology needs an ingress")?;
    let mut summary = Vec::new();
    for rule in &args.rules {
        let applied = apply_file(&mesh.state, rule)?;
        for r in &applied {
            wait_rule(&mesh.state, &r.key, &r.policy).await?;
        }
        wait_converged(&mesh.state, Duration::from_secs(10)).await?;
        let policy = applied
            .first()
            .map_or_else(|| "?".to_string(), |r| r.policy.clone());
        println!(
            "\n== {} ({policy}): {} qps over {} connections for {:?} through http://{ingress} (Host: {})",
            rule.display(),
            args.qps,
            args.connections,
            args.duration,
            args.host
        );
        let spec = LoadSpec {
            target: ingress,
            host: args.host.clone(),
            path: "/".into(),
            connections: args.connections,
            qps: args.qps,
            duration: args.duration,
            jitter: true,
            timeout: Duration::from_secs(10),
        };
        let r = load::run(&spec, load::upstream_backend).await;
        let total = r.total().max(1);
        for (label, n) in &r.by_label {
            println!(
                "  {label:<44} {n:>6}  {:>5.1}%",
                *n as f64 * 100.0 / total as f64
            );
        }
        let rate = r.total() as f64 / args.duration.as_secs_f64();
        println!(
            "  requests {}  ({rate:.1}/s)  errors {}  p50 {:.1} ms  p90 {:.1} ms  p99 {:.1} ms",
            r.total(),
            r.errors,
            r.quantile_ms(0.5),
            r.quantile_ms(0.9),
            r.quantile_ms(0.99)
        );
        if rate < 0.9 * args.qps {
            println!(
                "  (short of {} qps: {} connections, one request in flight each, carry at most {:.0}/s at this p50; raise --connections)",
                args.qps,
                args.connections,
                args.connections as f64 * 1000.0 / r.quantile_ms(0.5).max(0.001)
            );
        }
        if !r.error_codes.is_empty() {
            println!("  failures by status (0 = transport): {:?}", r.error_codes);
        }
        summary.push((policy, r));
    }
    println!(
        "\n{:<16} {:>9} {:>7} {:>9} {:>9} {:>9}",
        "POLICY", "REQUESTS", "ERRORS", "P50 ms", "P90 ms", "P99 ms"
    );
    for (p, r) in &summary {
        println!(
            "{p:<16} {:>9} {:>7} {:>9.1} {:>9.1} {:>9.1}",
            r.total(),
            r.errors,
            r.quantile_ms(0.5),
            r.quantile_ms(0.9),
            r.quantile_ms(0.99)
        );
    }
    Ok(())
}
