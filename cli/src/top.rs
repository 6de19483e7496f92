//! `minimesh top`: the control plane's aggregated load view, per service and
//! endpoint, refreshed every second (like `linkerd viz top`).

use std::path::PathBuf;
use std::time::Duration;

use crate::http::get_json;
use crate::mesh::MeshState;

/// `minimesh top` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct TopArgs {
    /// Print one table and exit.
    #[arg(long)]
    pub once: bool,
    /// Refresh interval.
    #[arg(long, default_value = "1s", value_parser = minimesh_control_plane::duration)]
    pub interval: Duration,
    /// Admin address of the control plane to ask (host:port), for one not
    /// started by `minimesh up`; default: the local mesh's, from --home.
    #[arg(long, env = "MINIMESH_CONTROL_PLANE_ADMIN")]
    pub control_plane_admin: Option<std::net::SocketAddr>,
}

/// Renders the view as a table.
pub fn render(view: &serde_json::Value, endpoints: &serde_json::Value) -> String {
    let mut out = format!(
        "{:<44} {:<22} {:>7} {:>8} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7}\n",
        "CLUSTER",
        "ENDPOINT",
        "SHARE",
        "RPS",
        "SUCCESS",
        "P50",
        "P95",
        "P99",
        "IN-FLIGHT",
        "WEIGHT"
    );
    let ms = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), millis);
    for (cluster, eps) in view["clusters"].as_object().into_iter().flatten() {
        for (ep, s) in eps.as_object().into_iter().flatten() {
            let weight = endpoints[cluster]["endpoints"]
                .as_array()
                .and_then(|a| a.iter().find(|e| e["address"] == ep.as_str()))
                .map_or("-".to_string(), |e| e["weight"].to_string());
            out.push_str(&format!(
                "{cluster:<44} {ep:<22} {:>6.1}% {:>8.1} {:>8.2}% {:>7} {:>7} {:>7} {:>9} {:>7}\n",
                s["share"].as_f64().unwrap_or(0.0) * 100.0,
                s["rps"].as_f64().unwrap_or(0.0),
                s["success_ratio"].as_f64().unwrap_or(0.0) * 100.0,
                ms(&s["p50_ms"]),
                ms(&s["p95_ms"]),
                ms(&s["p99_ms"]),
                s["in_flight"],
                weight
            ));
        }
    }
    out
}

/// `minimesh top`.
pub async fn run(home: PathBuf, args: TopArgs) -> anyhow::Result<()> {
    let admin = crate::get::admin_addr(&home, args.control_plane_admin)?;
    let name = match args.control_plane_admin {
        Some(a) => format!("control plane {a}"),
        None => MeshState::load(&home)?.name,
    };
    // Watched once, so that Ctrl-C while a view is fetched is not lost.
    let stop = minimesh_control_plane::shutdown_signal();
    tokio::pin!(stop);
    loop {
        let view = get_json(&admin, "/debug/load").await?;
        let endpoints = get_json(&admin, "/debug/endpoints").await?;
        let table = render(&view, &endpoints);
        if args.once {
            print!("{table}");
            return Ok(());
        }
        // Clear the screen and home the cursor, as top does.
        print!(
            "\x1b[2J\x1b[H{} over the last {}s\n\n{table}",
            name, view["window_seconds"]
        );
        tokio::select! {
            _ = tokio::time::sleep(args.interval) => {}
            _ = &mut stop => return Ok(()),
        }
    }
}

/// A latency as `top` prints it: three significant figures at most
/// (`0.482ms`, `12.3ms`, `152ms`), as precise as the control plane's
/// percentiles are (within 1.6%).
fn millis(ms: f64) -> String {
    if ms < 1.0 {
        format!("{ms:.3}ms")
    } else if ms < 10.0 {
        format!("{ms:.2}ms")
    } else if ms < 100.0 {
        format!("{ms:.1}ms")
    } else {
        format!("{ms:.0}ms")
    }
}
