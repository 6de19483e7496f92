//! The one-sidecar path set against each peer round by round: ratios and
//! differences measured in the same round, their medians, and in how many
//! rounds the sidecar was ahead or even.

use serde::Serialize;

use super::rounds::median;
use super::PathResult;

/// One sidecar against a peer, round by round: both measured in the same
/// round, minutes apart at most, so a change in the machine's load between
/// rounds cancels out of each ratio.
#[derive(Debug, Clone, Serialize)]
pub struct Paired {
    /// The peer (`nginx`, `haproxy`).
    pub peer: String,
    /// Sidecar max RPS / peer max RPS, per round.
    pub max_rps_ratio: Vec<f64>,
    /// Sidecar p50 - peer p50 at the fixed rate, per round, ms (negative:
    /// the sidecar added less).
    pub p50_diff_ms: Vec<f64>,
    /// Sidecar p99 - peer p99 at the fixed rate, per round, ms.
    pub p99_diff_ms: Vec<f64>,
    /// Sidecar CPU / peer CPU per request at the fixed rate, per round
    /// (empty when either has no CPU figure).
    pub cpu_ratio: Vec<f64>,
    /// Sidecar CPU / peer CPU per request at saturation, per round.
    pub cpu_saturated_ratio: Vec<f64>,
}

/// The one-sidecar path against every peer path in `results`.
pub(super) fn paired(results: &[PathResult]) -> Vec<Paired> {
    let Some(sidecar) = results.iter().find(|r| r.path.starts_with("one sidecar")) else {
        return Vec::new();
    };
    let per_round = |a: &[f64], b: &[f64], f: fn(f64, f64) -> f64| -> Vec<f64> {
        a.iter().zip(b).map(|(x, y)| f(*x, *y)).collect()
    };
    let pair = |ours: &PathResult, theirs: &PathResult, peer: String| Paired {
        peer,
        max_rps_ratio: per_round(&ours.max_rps_rounds, &theirs.max_rps_rounds, |s, p| {
            s / p.max(1.0)
        }),
        p50_diff_ms: per_round(&ours.p50_ms_rounds, &theirs.p50_ms_rounds, |s, p| s - p),
        p99_diff_ms: per_round(&ours.p99_ms_rounds, &theirs.p99_ms_rounds, |s, p| s - p),
        cpu_ratio: per_round(
            &ours.cpu_s_per_1000_rounds,
            &theirs.cpu_s_per_1000_rounds,
            |s, p| s / p.max(1e-9),
        ),
        cpu_saturated_ratio: per_round(
            &ours.cpu_us_per_request_saturated_rounds,
            &theirs.cpu_us_per_request_saturated_rounds,
            |s, p| s / p.max(1e-9),
        ),
    };
    let peers: Vec<&PathResult> = results
        .iter()
        .filter(|r| r.path.ends_with("(-> app)") && !r.path.starts_with("one sidecar"))
        .collect();
    let name = |peer: &PathResult| peer.path.trim_end_matches(" (-> app)").to_string();
    let mut out: Vec<Paired> = peers.iter().map(|p| pair(sidecar, p, name(p))).collect();
    // The gateway against the same peers: "<peer>, gateway".
    if let Some(gateway) = results.iter().find(|r| r.path == GATEWAY) {
        out.extend(
            peers
                .iter()
                .map(|p| pair(gateway, p, format!("{}, gateway", name(p)))),
        );
    }
    // With --mtls: the sidecar pair over mutual TLS against nginx's.
    let find = |name: &str| results.iter().find(|r| r.path == name);
    if let (Some(ours), Some(theirs)) = (find(MTLS_PAIR), find(NGINX_MTLS_PAIR)) {
        out.push(pair(ours, theirs, NGINX_MTLS_PAIR.to_string()));
    }
    out
}

/// The ingress gateway straight to the app (not a peer: its name does not
/// end in "(-> app)").
pub(super) const GATEWAY: &str = "gateway (ingress -> app)";
/// The sidecar pair over mutual TLS (`--mtls`).
pub(super) const MTLS_PAIR: &str = "sidecar pair, mutual TLS";
/// nginx's pair over mutual TLS (`--mtls`, nginx installed).
pub(super) const NGINX_MTLS_PAIR: &str = "nginx pair, mutual TLS";

/// A line of per-round values, their median, and in how many rounds the
/// sidecar was ahead of the peer or even (`better`).
pub(super) fn paired_line(
    values: &[f64],
    better: fn(f64) -> bool,
    show: fn(f64) -> String,
) -> String {
    let list: Vec<String> = values.iter().map(|v| show(*v)).collect();
    let wins = values.iter().filter(|v| better(**v)).count();
    format!(
        "{} (median {}; the sidecar ahead or even in {wins} of {})",
        list.join(" "),
        show(median(values.to_vec())),
        values.len()
    )
}
