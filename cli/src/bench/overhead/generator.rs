//! What sends the load in `minimesh bench overhead`: the built-in driver or
//! oha, at a fixed rate or as fast as it goes, and one measured pass of a
//! path.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::time::Instant;

use super::drive::{Live, Target};
use super::{drive, peers, usage, PathResult, TICKS};

/// What sends the load.
#[derive(Debug, Clone)]
pub enum Generator {
    /// The bench's own driver.
    BuiltIn,
    /// oha (`cargo install oha`), at this path.
    Oha(PathBuf),
}

impl Generator {
    /// `auto`, `oha` or `built-in`, as the flag says.
    pub fn choose(flag: &str) -> anyhow::Result<Generator> {
        let oha = peers::find("oha").or_else(|| {
            let home = std::env::var_os("CARGO_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
            Some(home.join("bin").join("oha")).filter(|p| p.is_file())
        });
        match (flag, oha) {
            ("built-in", _) => Ok(Generator::BuiltIn),
            (_, Some(p)) => Ok(Generator::Oha(p)),
            ("oha", None) => bail!(
                "--load-generator oha: oha is not installed (cargo install oha), nor in PATH or ~/.cargo/bin"
            ),
            _ => Ok(Generator::BuiltIn),
        }
    }

    /// How results name it.
    pub fn name(&self) -> String {
        match self {
            Generator::BuiltIn => "built-in".into(),
            Generator::Oha(p) => format!("oha ({})", p.display()),
        }
    }
}

/// One oha run: latency quantiles (ms), requests, errors, requests per second.
pub(super) struct OhaRun {
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) requests: u64,
    pub(super) errors: u64,
    pub(super) rps: f64,
}

/// Runs oha for `duration` over `connections`, at `rate` when given
/// (with its coordinated-omission correction) or as fast as it can.
pub(super) async fn oha(
    bin: &Path,
    target: &Target,
    duration: Duration,
    connections: usize,
    rate: Option<f64>,
) -> anyhow::Result<OhaRun> {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args(["--no-tui", "--output-format", "json", "-c"])
        .arg(connections.to_string())
        .arg("-z")
        .arg(format!("{}ms", duration.as_millis()))
        .args(["--host", &target.host])
        .arg("-t")
        .arg(format!("{}ms", target.timeout.as_millis()));
    if let Some(q) = rate {
        cmd.arg("-q").arg(q.to_string()).arg("--latency-correction");
    }
    cmd.arg(format!("http://{}{}", target.addr, target.path));
    let out = cmd.output().await.context("running oha")?;
    if !out.status.success() {
        bail!(
            "oha failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("reading oha's JSON output")?;
    // Requests oha itself cut off when -z ran out are not failures.
    let count = |m: &serde_json::Value| -> u64 {
        m.as_object()
            .map(|o| {
                o.iter()
                    .filter(|(k, _)| !k.contains("aborted due to deadline"))
                    .filter_map(|(_, n)| n.as_u64())
                    .sum()
            })
            .unwrap_or(0)
    };
    let codes = v["statusCodeDistribution"].as_object();
    let ok: u64 = codes
        .map(|o| {
            o.iter()
                .filter(|(k, _)| k.starts_with('2'))
                .filter_map(|(_, n)| n.as_u64())
                .sum()
        })
        .unwrap_or(0);
    let all = count(&v["statusCodeDistribution"]);
    let errors = all - ok + count(&v["errorDistribution"]);
    let ms = |k: &str| v["latencyPercentiles"][k].as_f64().unwrap_or(0.0) * 1000.0;
    Ok(OhaRun {
        p50_ms: ms("p50"),
        p99_ms: ms("p99"),
        requests: all + count(&v["errorDistribution"]),
        errors,
        rps: v["summary"]["requestsPerSec"].as_f64().unwrap_or(0.0),
    })
}

/// The fixed-rate part of a measurement.
pub(super) struct Fixed {
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) requests: u64,
    pub(super) errors: u64,
}

impl Generator {
    /// `rate` requests a second over 10 connections for `duration`.
    async fn fixed(&self, target: &Target, rate: f64, duration: Duration) -> anyhow::Result<Fixed> {
        match self {
            Generator::Oha(bin) => {
                let r = oha(bin, target, duration, 10, Some(rate)).await?;
                Ok(Fixed {
                    p50_ms: r.p50_ms,
                    p99_ms: r.p99_ms,
                    requests: r.requests,
                    errors: r.errors,
                })
            }
            Generator::BuiltIn => {
                let live = Arc::new(Live::default());
                let (samples, _) = drive::fixed(
                    target.clone(),
                    Instant::now(),
                    duration,
                    rate,
                    10,
                    true,
                    live,
                )
                .await;
                let lat = crate::bench::report::Latency::of(
                    samples.iter().map(|s| s.latency_us).collect(),
                );
                Ok(Fixed {
                    p50_ms: lat.med,
                    p99_ms: lat.p99,
                    requests: samples.len() as u64,
                    errors: samples
                        .iter()
                        .filter(|s| !(200..300).contains(&s.status))
                        .count() as u64,
                })
            }
        }
    }

    /// Requests a second over 64 connections with no pause, for
    /// `duration`, and the requests made.
    async fn saturate(&self, target: &Target, duration: Duration) -> anyhow::Result<(f64, u64)> {
        match self {
            Generator::Oha(bin) => {
                let r = oha(bin, target, duration, 64, None).await?;
                Ok((r.rps, r.requests))
            }
            Generator::BuiltIn => {
                let t0 = Instant::now();
                let (sat, _) =
                    drive::saturate(target.clone(), t0, duration, 64, Arc::new(Live::default()))
                        .await;
                Ok((
                    sat.len() as f64 / t0.elapsed().as_secs_f64(),
                    sat.len() as u64,
                ))
            }
        }
    }
}

pub(super) async fn measure(
    name: &str,
    target: Target,
    pids: &[u32],
    rate: f64,
    duration: Duration,
    generator: &Generator,
) -> anyhow::Result<PathResult> {
    // Warm the connections and the proxies' pools.
    generator
        .fixed(&target, rate, Duration::from_millis(500))
        .await?;
    let before: Vec<_> = pids.iter().map(|p| usage(*p)).collect();
    let fixed = generator.fixed(&target, rate, duration).await?;
    let after: Vec<_> = pids.iter().map(|p| usage(*p)).collect();
    let (max_rps, saturated) = generator.saturate(&target, duration).await?;
    let end: Vec<_> = pids.iter().map(|p| usage(*p)).collect();
    let spent = |from: &[(u64, u64)], to: &[(u64, u64)]| -> u64 {
        from.iter()
            .zip(to)
            .map(|(b, a)| a.0.saturating_sub(b.0))
            .sum()
    };
    let ticks = spent(&before, &after);
    let ticks_saturated = spent(&after, &end);
    let rss: u64 = after.iter().map(|a| a.1).sum();
    Ok(PathResult {
        path: name.to_string(),
        p50_ms: fixed.p50_ms,
        p99_ms: fixed.p99_ms,
        added_p50_ms: 0.0,
        added_p99_ms: 0.0,
        errors: fixed.errors,
        max_rps,
        cpu_s_per_1000: (!pids.is_empty())
            .then(|| ticks as f64 / TICKS / (fixed.requests.max(1) as f64 / 1000.0)),
        cpu_us_per_request_saturated: (!pids.is_empty())
            .then(|| ticks_saturated as f64 / TICKS * 1e6 / saturated.max(1) as f64),
        peak_rss_mib: (!pids.is_empty()).then(|| rss as f64 / 1024.0),
        peak_rss_overall_mib: (!pids.is_empty()).then(|| rss as f64 / 1024.0),
        max_rps_rounds: vec![max_rps],
        p50_ms_rounds: vec![fixed.p50_ms],
        p99_ms_rounds: vec![fixed.p99_ms],
        // Filled from each round's figure when the rounds are combined.
        cpu_s_per_1000_rounds: Vec::new(),
        cpu_us_per_request_saturated_rounds: Vec::new(),
    })
}
