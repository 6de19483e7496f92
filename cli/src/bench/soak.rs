//! `minimesh bench soak --minutes N`: the demo mesh (ingress -> simple-web ->
//! simple-backend, mutual TLS) under a steady load for N minutes while it
//! churns: a simple-backend replica killed (SIGKILL) every 30 s and started
//! again, the simple-backend rule changed every 10 s, every certificate
//! renewed on a short lifetime. It reports the failed requests, and the
//! resident memory and open file descriptors of every process over time,
//! and fails on a failed request or on growth after the warm-up.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::time::Instant;

use super::drive::{self, Live, Target};
use crate::apply::{apply_file, wait_rule};
use crate::mesh::{Mesh, RestartAfter, UpArgs};

/// What a soak is told.
pub struct SoakArgs {
    /// How long the load runs.
    pub duration: Duration,
    /// Requests per second through the ingress.
    pub qps: f64,
    /// Workload certificates' lifetime (each is renewed at half of it).
    pub cert_ttl: Duration,
}

/// How often a replica is killed.
const KILL_EVERY: Duration = Duration::from_secs(30);
/// How often the rule changes.
const RULE_EVERY: Duration = Duration::from_secs(10);
/// The shortest run whose growth is judged: a shorter one is still filling
/// its connection pools (and its kills' reconnections weigh more).
const JUDGE_GROWTH_FROM: Duration = Duration::from_secs(600);
/// How often every process is measured.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);
/// The most a process may grow after the warm-up (resident memory and file
/// descriptors alike).
const MAX_GROWTH: f64 = 0.10;
/// File descriptors a process may gain beyond [`MAX_GROWTH`] (connections
/// open or closed at the moment of a sample: a kill makes callers dial anew).
const FD_SLACK: f64 = 8.0;

const POLICIES: [&str; 3] = ["ROUND_ROBIN", "LEAST_REQUEST", "RANDOM"];

/// One measurement of a process.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Sample {
    at_s: u64,
    rss_kib: u64,
    fds: u64,
}

/// Runs the soak; Err when it failed (a failed request, a process that grew).
pub async fn run(
    home: &Path,
    out: &Path,
    args: &SoakArgs,
    network: Option<std::net::Ipv4Addr>,
    ingress: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let up = UpArgs {
        topology: "examples/local/topology.yaml".into(),
        network,
        ingress,
        sidecar_worker_threads: None,
        restart_after: RestartAfter(Some(Duration::from_secs(2))),
        workload_cert_ttl: Some(args.cert_ttl),
        capture: false,
    };
    let mut mesh = Mesh::start(&home.join("bench"), &up)
        .await
        .context("starting the soak's mesh")?;
    let result = soak(&mut mesh, out, args).await;
    mesh.stop().await;
    result
}

async fn soak(mesh: &mut Mesh, out: &Path, args: &SoakArgs) -> anyhow::Result<()> {
    let state = mesh.state.clone();
    let ingress = state.ingress.context("the demo topology has an ingress")?;
    let web: Vec<_> = state
        .pods
        .iter()
        .filter(|p| p.service == "simple-web")
        .map(|p| p.ip)
        .collect();
    let victim = state
        .pods
        .iter()
        .rfind(|p| p.service == "simple-backend")
        .context("the demo topology has simple-backend")?
        .name
        .clone();
    let names: Vec<String> = state.pids.keys().cloned().collect();
    let warmup = (args.duration / 6).min(Duration::from_secs(300));
    println!(
        "minimesh bench soak: {:?} at {} requests/s through {ingress}; {victim} killed every {KILL_EVERY:?}, the simple-backend rule changed every {RULE_EVERY:?}, certificates lasting {:?}; growth measured after {warmup:?}",
        args.duration, args.qps, args.cert_ttl
    );
    let target = Target {
        addr: ingress,
        host: "simple-web.istioinaction.io".into(),
        path: "/".into(),
        backends: Arc::new(web),
        timeout: Duration::from_secs(10),
    };
    let live = Arc::new(Live::default());
    let start = Instant::now();
    // fortio-like: each connection sends on its own schedule, one request at
    // a time; the demo's calls take up to ~200 ms, so a connection per 4
    // requests a second keeps the rate.
    let connections = ((args.qps / 4.0).ceil() as u32).max(8);
    let load = tokio::spawn(drive::fixed(
        target,
        start,
        args.duration,
        args.qps,
        connections,
        true,
        live.clone(),
    ));

    let mut samples: BTreeMap<String, Vec<Sample>> = BTreeMap::new();
    let (mut kills, mut rules) = (0u32, 0u32);
    let (mut next_kill, mut next_rule, mut next_sample) =
        (start + KILL_EVERY, start + RULE_EVERY, start);
    let end = start + args.duration;
    let rule_file = out.join("simple-backend-rule.yaml");
    // A progress line in place on a terminal; one a minute in a log.
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut next_line = 0u64;
    while Instant::now() < end {
        let now = Instant::now();
        if now >= next_sample {
            let at_s = now.duration_since(start).as_secs();
            for name in &names {
                if let Some(s) = mesh.pid(name).and_then(|pid| measure(pid, at_s)) {
                    samples.entry(name.clone()).or_default().push(s);
                }
            }
            next_sample += SAMPLE_EVERY;
        }
        if now >= next_kill {
            // A crash: the mesh's retries and outlier detection cover it,
            // and `supervise` plays the kubelet and the endpoint controller.
            for p in [format!("{victim}.app"), format!("{victim}.sidecar")] {
                let _ = mesh.signal(&p, "KILL");
            }
            kills += 1;
            next_kill += KILL_EVERY;
        }
        if now >= next_rule {
            let policy = POLICIES[rules as usize % POLICIES.len()];
            std::fs::write(
                &rule_file,
                format!("apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: simple-backend-soak\n  namespace: istioinaction\nspec:\n  host: simple-backend\n  trafficPolicy:\n    loadBalancer:\n      simple: {policy}\n"),
            )?;
            for r in apply_file(&mesh.state, &rule_file)? {
                wait_rule(&mesh.state, &r.key, &r.policy).await?;
            }
            rules += 1;
            next_rule += RULE_EVERY;
        }
        mesh.supervise().await?;
        let elapsed = now.duration_since(start).as_secs();
        if tty || elapsed >= next_line {
            let done = live.requests.load(std::sync::atomic::Ordering::Relaxed);
            let failed = live.errors.load(std::sync::atomic::Ordering::Relaxed);
            let line = format!("  {elapsed:>5} s: {done} requests, {failed} failed, {kills} kills, {rules} rule changes");
            if tty {
                eprint!("\r{line}   ");
            } else {
                eprintln!("{line}");
                next_line += 60;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    if tty {
        eprintln!();
    }
    let (results, reasons) = load.await.context("the load")?;
    let requests = results.len();
    let failed: Vec<_> = results.iter().filter(|s| s.status != 200).collect();
    let issued = certificates_issued(&state.control_plane_admin.to_string()).await;

    let mut text = String::new();
    let _ = writeln!(
        text,
        "soak: {:?}, {requests} requests ({:.0}/s of {} asked), {} failed; {kills} kills of {victim}, {rules} rule changes, {issued} certificates issued (lifetime {:?})",
        args.duration,
        requests as f64 / args.duration.as_secs_f64(),
        args.qps,
        failed.len(),
        args.cert_ttl
    );
    for (reason, n) in &reasons {
        let _ = writeln!(text, "  failure: {reason} x{n}");
    }
    let _ = writeln!(
        text,
        "\n{:<28} {:>10} {:>10} {:>8} {:>6} {:>6} {:>8}",
        "process", "RSS before", "RSS after", "RSS", "fds", "fds", "verdict"
    );
    let _ = writeln!(
        text,
        "(the most of each in the first and in the second half of the run after the warm-up)"
    );
    let mut grew = Vec::new();
    for (name, s) in &samples {
        let restarted = name.starts_with(&format!("{victim}."));
        let Some(g) = Growth::of(s, warmup) else {
            continue;
        };
        let verdict = if restarted {
            "restarted"
        } else if g.grew() {
            grew.push(name.clone());
            "GREW"
        } else {
            "flat"
        };
        let _ = writeln!(
            text,
            "{:<28} {:>7} KiB {:>7} KiB {:>+7.1}% {:>6} {:>6} {:>8}",
            name,
            g.first.rss_kib,
            g.last.rss_kib,
            g.rss() * 100.0,
            g.first.fds,
            g.last.fds,
            verdict
        );
    }
    if args.duration < JUDGE_GROWTH_FROM {
        let _ = writeln!(
            text,
            "(growth is judged on runs of {} minutes or more; this one's is shown, not judged)",
            JUDGE_GROWTH_FROM.as_secs() / 60
        );
    }
    print!("{text}");
    std::fs::write(out.join("summary.txt"), &text)?;
    let json = serde_json::json!({
        "duration_s": args.duration.as_secs(),
        "qps": args.qps,
        "requests": requests,
        "failed": failed.len(),
        "kills": kills,
        "rule_changes": rules,
        "certificates_issued": issued,
        "cert_ttl_s": args.cert_ttl.as_secs(),
        "warmup_s": warmup.as_secs(),
        "samples": samples,
    });
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("results: {0}/summary.txt, {0}/results.json", out.display());
    if !failed.is_empty() {
        bail!(
            "soak failed: {} of {requests} requests failed",
            failed.len()
        );
    }
    if !grew.is_empty() && args.duration >= JUDGE_GROWTH_FROM {
        bail!("soak failed: grew after the warm-up: {}", grew.join(", "));
    }
    if kills == 0 || rules == 0 {
        bail!("soak too short to churn: run at least a minute");
    }
    Ok(())
}

/// Resident memory and open file descriptors of `pid`, from /proc.
fn measure(pid: u32, at_s: u64) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some(Sample { at_s, rss_kib, fds })
}

/// How a process grew over a run: the most resident memory and file
/// descriptors it had in the first half after the warm-up, and in the
/// second. A leak keeps growing, so the second half's peak passes the
/// first's; churn (connections dialed anew after a kill) peaks in both.
#[derive(Debug)]
struct Growth {
    first: Sample,
    last: Sample,
}

impl Growth {
    fn of(samples: &[Sample], warmup: Duration) -> Option<Growth> {
        let after: Vec<Sample> = samples
            .iter()
            .filter(|x| Duration::from_secs(x.at_s) >= warmup)
            .copied()
            .collect();
        if after.len() < 2 {
            return None;
        }
        let (a, b) = after.split_at(after.len() / 2);
        let peak = |s: &[Sample]| Sample {
            at_s: s.last().map_or(0, |x| x.at_s),
            rss_kib: s.iter().map(|x| x.rss_kib).max().unwrap_or(0),
            fds: s.iter().map(|x| x.fds).max().unwrap_or(0),
        };
        Some(Growth {
            first: peak(a),
            last: peak(b),
        })
    }

    /// The change of resident memory, as a fraction.
    fn rss(&self) -> f64 {
        if self.first.rss_kib == 0 {
            return 0.0;
        }
        self.last.rss_kib as f64 / self.first.rss_kib as f64 - 1.0
    }

    fn grew(&self) -> bool {
        self.rss() > MAX_GROWTH
            || self.last.fds as f64 > self.first.fds as f64 * (1.0 + MAX_GROWTH) + FD_SLACK
    }
}

/// The control plane's count of certificates issued.
async fn certificates_issued(admin: &str) -> u64 {
    let Ok((_, body)) = crate::http::get(admin, "/metrics").await else {
        return 0;
    };
    body.lines()
        .find_map(|l| l.strip_prefix("minimesh_certificates_issued_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(rss: &[u64], fds: &[u64]) -> Vec<Sample> {
        rss.iter()
            .zip(fds)
            .enumerate()
            .map(|(i, (r, f))| Sample {
                at_s: i as u64 * 10,
                rss_kib: *r,
                fds: *f,
            })
            .collect()
    }

    #[test]
    fn churn_is_flat_and_a_leak_grows() {
        let warmup = Duration::from_secs(20);
        // Before the warm-up anything goes; then peaks come and go.
        let churn = run(
            &[5000, 9000, 10000, 10400, 10100, 10500, 10200, 10300],
            &[10, 20, 23, 31, 24, 30, 25, 29],
        );
        let g = Growth::of(&churn, warmup).expect("samples");
        assert!(!g.grew(), "{g:?}");
        let leak = run(
            &[5000, 9000, 10000, 10500, 11000, 11500, 12000, 12500],
            &[10, 20, 23, 24, 25, 26, 27, 28],
        );
        assert!(Growth::of(&leak, warmup).expect("samples").grew());
        let fds = run(&[10000; 8], &[10, 20, 23, 25, 30, 40, 50, 60]);
        assert!(Growth::of(&fds, warmup).expect("samples").grew());
    }
}
