//! What a bench run measured and how it is shown: the k6-style summary per
//! run, the side-by-side table per scenario, JSON, and a self-contained HTML
//! report (inline SVG, opens offline).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::json;

use super::drive::{Sample, UNKNOWN};
use super::scenario::Scenario;
use crate::mesh::Pod;

mod html;
pub use html::html;

/// An injected failure as it happened.
#[derive(Debug, Clone, Serialize)]
pub struct EventRecord {
    /// Seconds from the start of the load.
    pub at_s: f64,
    /// kill, stop, cont, errors, recover.
    pub action: &'static str,
    /// The pod.
    pub pod: String,
    /// The signal was delivered.
    pub done: bool,
}

/// Latency figures in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    /// Mean.
    pub avg: f64,
    /// Fastest.
    pub min: f64,
    /// Median.
    pub med: f64,
    /// 75th percentile.
    pub p75: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Slowest.
    pub max: f64,
}

impl Latency {
    /// Figures of latencies in microseconds.
    pub fn of(mut us: Vec<u32>) -> Latency {
        if us.is_empty() {
            return Latency::default();
        }
        us.sort_unstable();
        let q = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
        Latency {
            avg: us.iter().map(|v| *v as f64).sum::<f64>() / us.len() as f64 / 1000.0,
            min: q(0.0),
            med: q(0.5),
            p75: q(0.75),
            p90: q(0.9),
            p95: q(0.95),
            p99: q(0.99),
            p999: q(0.999),
            max: q(1.0),
        }
    }
}

/// One backend of the compared service in one run.
#[derive(Debug, Clone, Serialize)]
pub struct BackendResult {
    /// Pod name.
    pub pod: String,
    /// Pod address.
    pub address: String,
    /// Successful requests it served.
    pub requests: u64,
    /// Its share of the successful requests.
    pub share: f64,
    /// p95 of the requests it served, ms.
    pub p95_ms: f64,
    /// Most requests in flight to it at once, as the client saw them (each
    /// on its own upstream connection: the active connections users compare).
    pub peak_active: u32,
}

/// One second of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Second {
    /// Seconds from the start.
    pub t: u32,
    /// Requests sent in that second that completed.
    pub requests: u64,
    /// Of which failed.
    pub errors: u64,
    /// Their p95, ms.
    pub p95_ms: f64,
    /// Successful requests per backend.
    pub served: Vec<u64>,
    /// Most requests in flight per backend during that second.
    pub active: Vec<u32>,
}

/// Everything one policy's run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// Policy name.
    pub policy: String,
    /// `minimesh`, `nginx` or `haproxy`.
    pub kind: &'static str,
    /// Requests completed.
    pub requests: u64,
    /// Failed requests (non-2xx, transport error, timeout).
    pub errors: u64,
    /// Failures by status; 0 = transport error or timeout.
    pub errors_by_status: BTreeMap<u16, u64>,
    /// Failures by reason (`x-minimesh-error`, transport error, timeout).
    pub errors_by_reason: BTreeMap<String, u64>,
    /// Requests per second over the load.
    pub rps: f64,
    /// Latency of every request, failed ones included (as k6's http_req_duration).
    pub latency_ms: Latency,
    /// Per backend.
    pub backends: Vec<BackendResult>,
    /// Successful responses whose backend could not be named.
    pub unattributed: u64,
    /// Time a pick took in the proxies that called the service.
    pub pick: Option<Pick>,
    /// Injected failures.
    pub events: Vec<EventRecord>,
    /// Per second.
    pub timeline: Vec<Second>,
}

impl RunResult {
    /// Share (%) and peak active requests of each backend, as table cells.
    fn per_backend(&self) -> (Vec<String>, Vec<String>) {
        self.backends
            .iter()
            .map(|b| (format!("{:.0}", b.share * 100.0), b.peak_active.to_string()))
            .unzip()
    }

    /// Folds the samples and observations of one run.
    pub fn new(
        policy: &str,
        scenario: &Scenario,
        kind: &'static str,
        (samples, errors_by_reason): (Vec<Sample>, BTreeMap<String, u64>),
        pods: &[Pod],
        events: Vec<EventRecord>,
        pick: Option<Pick>,
    ) -> RunResult {
        let ok = |s: &Sample| (200..300).contains(&s.status);
        let n = pods.len();
        let mut errors_by_status = BTreeMap::new();
        let mut per_backend: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut unattributed = 0;
        for s in &samples {
            if !ok(s) {
                *errors_by_status.entry(s.status).or_insert(0u64) += 1;
            } else if s.backend == UNKNOWN || s.backend as usize >= n {
                unattributed += 1;
            } else {
                per_backend[s.backend as usize].push(s.latency_us);
            }
        }
        let served: u64 = per_backend.iter().map(|v| v.len() as u64).sum();
        let secs = scenario.duration.as_secs_f64().ceil().max(1.0) as usize;
        let (peak, active) = active_from(&samples, n, secs);
        let backends = pods
            .iter()
            .zip(per_backend)
            .zip(&peak)
            .map(|((pod, lat), peak)| BackendResult {
                pod: pod.name.clone(),
                address: pod.ip.to_string(),
                requests: lat.len() as u64,
                share: lat.len() as f64 / served.max(1) as f64,
                p95_ms: Latency::of(lat).p95,
                peak_active: *peak,
            })
            .collect();
        let mut timeline: Vec<Second> = active
            .into_iter()
            .enumerate()
            .map(|(t, active)| Second {
                t: t as u32,
                requests: 0,
                errors: 0,
                p95_ms: 0.0,
                served: vec![0; n],
                active,
            })
            .collect();
        let mut lat_by_sec: Vec<Vec<u32>> = vec![Vec::new(); secs];
        for s in &samples {
            let t = (s.start_ms / 1000) as usize;
            let Some(sec) = timeline.get_mut(t) else {
                continue;
            };
            sec.requests += 1;
            if !ok(s) {
                sec.errors += 1;
            } else if (s.backend as usize) < n {
                sec.served[s.backend as usize] += 1;
            }
            lat_by_sec[t].push(s.latency_us);
        }
        for (sec, lat) in timeline.iter_mut().zip(lat_by_sec) {
            sec.p95_ms = Latency::of(lat).p95;
        }
        let requests = samples.len() as u64;
        let errors = errors_by_status.values().sum();
        RunResult {
            policy: policy.to_string(),
            kind,
            requests,
            errors,
            errors_by_status,
            errors_by_reason,
            rps: requests as f64 / scenario.duration.as_secs_f64().max(1e-9),
            latency_ms: Latency::of(samples.iter().map(|s| s.latency_us).collect()),
            backends,
            unattributed,
            pick,
            events,
            timeline,
        }
    }
}

/// Requests in flight per backend as the client saw them, from the
/// samples: the peak over the run and the peak within each second. Every
/// request holds its own upstream connection while in flight, so these are
/// the active connections per server users compare balancers by.
fn active_from(samples: &[Sample], n: usize, secs: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut edges: Vec<(u64, i32, usize)> = Vec::with_capacity(samples.len() * 2);
    for s in samples {
        if (s.backend as usize) < n {
            let start = u64::from(s.start_ms) * 1000;
            edges.push((start, 1, s.backend as usize));
            edges.push((start + u64::from(s.latency_us), -1, s.backend as usize));
        }
    }
    // Ends before starts at the same instant.
    edges.sort_unstable();
    let mut level = vec![0i64; n];
    let mut peak = vec![0u32; n];
    let mut per_sec = vec![vec![0u32; n]; secs];
    let mut sec = 0usize;
    for (t, d, b) in edges {
        let now = (t / 1_000_000) as usize;
        while sec < now.min(secs) {
            // Seconds crossed carry the level they started with.
            sec += 1;
            if let Some(row) = per_sec.get_mut(sec) {
                for (m, l) in row.iter_mut().zip(&level) {
                    *m = (*m).max(*l as u32);
                }
            }
        }
        level[b] += i64::from(d);
        let l = level[b].max(0) as u32;
        peak[b] = peak[b].max(l);
        if let Some(row) = per_sec.get_mut(now) {
            row[b] = row[b].max(l);
        }
    }
    (peak, per_sec)
}

/// Pick durations of one run, from the proxies' histograms.
#[derive(Debug, Clone, Serialize)]
pub struct Pick {
    /// Bucket bound holding the median, ns.
    pub p50_ns: f64,
    /// Bucket bound holding the 99th percentile, ns (f64::INFINITY: above the last).
    pub p99_ns: f64,
    /// Mean, ns: includes the picks a busy machine preempted, so it is
    /// far above the median.
    pub mean_ns: f64,
}

/// Pick durations for `cluster` over every proxy's
/// `minimesh_pick_duration_seconds` histogram.
pub async fn pick(proxies: &[String], cluster: &str) -> Option<Pick> {
    let (mut sum, mut count) = (0.0, 0.0);
    let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
    let label = format!("cluster=\"{cluster}\"");
    for p in proxies {
        let Ok((200, text)) = crate::http::get(p, "/metrics").await else {
            continue;
        };
        for line in text.lines().filter(|l| l.contains(&label)) {
            let value = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            if line.starts_with("minimesh_pick_duration_seconds_sum{") {
                sum += value;
            } else if line.starts_with("minimesh_pick_duration_seconds_count{") {
                count += value;
            } else if line.starts_with("minimesh_pick_duration_seconds_bucket{") {
                let le = line
                    .split("le=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .unwrap_or("+Inf");
                // Bounds in whole nanoseconds, +Inf last.
                let ns = le
                    .parse::<f64>()
                    .map_or(u64::MAX, |s| (s * 1e9).round() as u64);
                *buckets.entry(ns).or_default() += value;
            }
        }
    }
    if count <= 0.0 {
        return None;
    }
    let at = |q: f64| {
        buckets
            .iter()
            .find(|(_, c)| **c >= count * q)
            .map_or(f64::INFINITY, |(ns, _)| {
                if *ns == u64::MAX {
                    f64::INFINITY
                } else {
                    *ns as f64
                }
            })
    };
    Some(Pick {
        p50_ns: at(0.5),
        p99_ns: at(0.99),
        mean_ns: sum / count * 1e9,
    })
}

fn dots(name: &str) -> String {
    format!("{name}{}", ".".repeat(32usize.saturating_sub(name.len())))
}

fn ms(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.2}s", v / 1000.0)
    } else {
        format!("{v:.1}ms")
    }
}

/// A k6-style end-of-test summary of one run.
pub fn k6_summary(scenario: &Scenario, r: &RunResult) -> String {
    let mut s = String::new();
    let l = &r.latency_ms;
    let _ = writeln!(s, "\n  scenario: {}  policy: {}", scenario.name, r.policy);
    let _ = writeln!(
        s,
        "     {}: {:<8} {:.1}/s",
        dots("http_reqs"),
        r.requests,
        r.rps
    );
    let _ = writeln!(
        s,
        "     {}: {:.2}%  {} out of {}{}",
        dots("http_req_failed"),
        r.errors as f64 * 100.0 / r.requests.max(1) as f64,
        r.errors,
        r.requests,
        if r.errors_by_status.is_empty() {
            String::new()
        } else {
            format!(
                "  by status (0 = transport/timeout): {:?}",
                r.errors_by_status
            )
        }
    );
    let _ = writeln!(
        s,
        "     {}: avg={} min={} med={} max={} p(90)={} p(95)={} p(99)={}",
        dots("http_req_duration"),
        ms(l.avg),
        ms(l.min),
        ms(l.med),
        ms(l.max),
        ms(l.p90),
        ms(l.p95),
        ms(l.p99)
    );
    for (why, n) in &r.errors_by_reason {
        let _ = writeln!(s, "     {}: {n:<6} {why}", dots("  failed because"));
    }
    if let Some(p) = &r.pick {
        let _ = writeln!(
            s,
            "     {}: p(50)<={:.0}ns p(99)<={:.0}ns avg={:.0}ns",
            dots("pick_duration"),
            p.p50_ns,
            p.p99_ns,
            p.mean_ns
        );
    }
    for b in &r.backends {
        let _ = writeln!(
            s,
            "     {}: share {:>5.1}%  requests {:<7} p(95)={:<9} peak active {}",
            dots(&format!("backend {}", b.pod)),
            b.share * 100.0,
            b.requests,
            ms(b.p95_ms),
            b.peak_active
        );
    }
    for e in &r.events {
        let _ = writeln!(
            s,
            "     {}: {} {} at {:.1}s{}",
            dots("event"),
            e.action,
            e.pod,
            e.at_s,
            if e.done { "" } else { " (FAILED to deliver)" }
        );
    }
    s
}

/// The runs of a scenario side by side.
pub fn side_by_side(scenario: &Scenario, runs: &[RunResult]) -> String {
    let mut s = String::new();
    let pods: Vec<String> = runs
        .first()
        .map(|r| r.backends.iter().map(|b| b.pod.clone()).collect())
        .unwrap_or_default();
    let _ = writeln!(s, "\n{} — {}", scenario.name, scenario.description);
    let _ = writeln!(
        s,
        "{:<32} {:>9} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {:<16} {:<16} {:>7}",
        "policy",
        "requests",
        "rps",
        "failed",
        "avg",
        "med",
        "p90",
        "p95",
        "p99",
        "max",
        "share %",
        "peak active",
        "pick p50"
    );
    for r in runs {
        let l = &r.latency_ms;
        let (share, peak) = r.per_backend();
        let _ = writeln!(
            s,
            "{:<32} {:>9} {:>8.1} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {:<16} {:<16} {:>7}",
            r.policy,
            r.requests,
            r.rps,
            r.errors,
            ms(l.avg),
            ms(l.med),
            ms(l.p90),
            ms(l.p95),
            ms(l.p99),
            ms(l.max),
            share.join("/"),
            peak.join("/"),
            r.pick
                .as_ref()
                .map_or("-".into(), |p| format!("<={:.0}ns", p.p50_ns))
        );
    }
    let _ = writeln!(
        s,
        "(shares and peak active per backend: {})",
        pods.join(", ")
    );
    s
}

/// The machine-readable results.
pub fn json(scenario: &Scenario, scale: f64, runs: &[RunResult]) -> serde_json::Value {
    json!({
        "scenario": scenario.name,
        "description": scenario.description,
        "file": scenario.file.display().to_string(),
        "scale": scale,
        "duration_s": scenario.duration.as_secs_f64(),
        "peak_users": scenario.peak_users(),
        "load_generator": "built-in",
        "runs": runs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn scenario() -> Scenario {
        let file =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/bench/lb-lab-failure.yaml");
        Scenario::load(&file, 0.05).expect("the shipped scenario")
    }

    /// A run of ten seconds over two backends, `s1` killed at 4 s.
    fn run(policy: &str, errors: u64) -> RunResult {
        let timeline = (0..10)
            .map(|t| Second {
                t,
                requests: 100,
                errors: if t == 4 { errors } else { 0 },
                p95_ms: 50.0 + f64::from(t),
                served: vec![50, 50],
                active: vec![3, 4],
            })
            .collect();
        RunResult {
            policy: policy.to_string(),
            kind: "minimesh",
            requests: 1000,
            errors,
            errors_by_status: BTreeMap::new(),
            errors_by_reason: BTreeMap::new(),
            rps: 100.0,
            latency_ms: Latency::default(),
            backends: ["s1", "s2"]
                .iter()
                .map(|p| BackendResult {
                    pod: p.to_string(),
                    address: "127.0.0.1".into(),
                    requests: 500,
                    share: 0.5,
                    p95_ms: 55.0,
                    peak_active: 4,
                })
                .collect(),
            unattributed: 0,
            pick: None,
            events: vec![EventRecord {
                at_s: 4.0,
                action: "kill",
                pod: "s1".into(),
                done: true,
            }],
            timeline,
        }
    }

    /// The part of `html` from `from` to the next `</section>`.
    fn section<'a>(html: &'a str, from: &str) -> &'a str {
        let start = html
            .find(from)
            .unwrap_or_else(|| panic!("no {from} in {html}"));
        let rest = &html[start..];
        &rest[..rest.find("</section>").expect("section ends")]
    }

    #[test]
    fn the_report_compares_every_run_on_one_chart_and_marks_the_kill() {
        let html = html(
            &scenario(),
            &[run("RING_HASH <x-user>", 0), run("nginx", 7)],
        );
        let every = section(&html, "<h2>Every run</h2>");
        // p95, requests and (since a run failed some) errors: one line per
        // run, named (escaped) in its tooltip and the legend.
        assert_eq!(every.matches("<figure>").count(), 3, "{every}");
        assert_eq!(every.matches("<polyline").count(), 6, "{every}");
        assert_eq!(
            every
                .matches("<title>RING_HASH &lt;x-user&gt;</title>")
                .count(),
            3
        );
        assert!(every.contains("&#9632; nginx</span>"), "{every}");
        // Ten seconds, ten points; the kill at 4 s of 9 is 4/9 of the way
        // across the 600 px after the 40 px axis.
        let line = &every[every.find("points=\"").expect("points") + 8..];
        let points = &line[..line.find('"').expect("end")];
        assert_eq!(points.split(' ').count(), 10, "{points}");
        assert_eq!(
            every.matches("class=\"mark\" x1=\"306.7\"").count(),
            3,
            "{every}"
        );
        assert_eq!(every.matches(">kill s1</text>").count(), 3);
        // Each run's own four charts carry the mark too.
        let own = section(&html, "<h2>nginx</h2>");
        assert_eq!(own.matches("<figure>").count(), 4, "{own}");
        assert_eq!(own.matches("class=\"mark\"").count(), 4, "{own}");
    }

    #[test]
    fn no_errors_chart_when_nothing_failed_and_no_overview_for_one_run() {
        let html = html(&scenario(), &[run("A", 0), run("B", 0)]);
        let every = section(&html, "<h2>Every run</h2>");
        assert_eq!(every.matches("<figure>").count(), 2, "{every}");
        assert!(!every.contains("errors per second"), "{every}");
        let one = super::html(&scenario(), &[run("A", 0)]);
        assert!(!one.contains("Every run"), "{one}");
    }
}
