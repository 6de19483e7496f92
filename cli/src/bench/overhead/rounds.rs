//! Rounds: every path measured once a round, the paths taking turns, and
//! each path's rounds combined into one result (medians, and every round's
//! figures kept for the round-by-round comparisons of [`super::paired`]).

use std::time::Duration;

use super::drive::Target;
use super::generator::{measure, Generator};
use super::PathResult;

/// Measures every path `rounds` times, the paths taking turns within each
/// round, so that a slow drift of the machine's load (it is shared) falls on
/// all of them alike; each figure is the median of its rounds (peak RSS: the
/// highest), and every round's top rate is kept.
pub(super) async fn rounds_of(
    specs: &[(String, Target, Vec<u32>)],
    rounds: usize,
    rate: f64,
    duration: Duration,
    generator: &Generator,
) -> anyhow::Result<Vec<PathResult>> {
    let mut by_path: Vec<Vec<PathResult>> = vec![Vec::new(); specs.len()];
    for round in 0..rounds {
        if rounds > 1 {
            println!("  round {} of {rounds}", round + 1);
        }
        for (i, (name, target, pids)) in specs.iter().enumerate() {
            by_path[i].push(measure(name, target.clone(), pids, rate, duration, generator).await?);
        }
    }
    Ok(by_path.into_iter().map(combine).collect())
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One path's rounds as one result.
fn combine(rounds: Vec<PathResult>) -> PathResult {
    let of = |f: fn(&PathResult) -> f64| median(rounds.iter().map(f).collect());
    let opt = |f: fn(&PathResult) -> Option<f64>| {
        let v: Vec<f64> = rounds.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(v))
    };
    PathResult {
        path: rounds.first().map(|r| r.path.clone()).unwrap_or_default(),
        p50_ms: of(|r| r.p50_ms),
        p99_ms: of(|r| r.p99_ms),
        added_p50_ms: 0.0,
        added_p99_ms: 0.0,
        errors: rounds.iter().map(|r| r.errors).sum(),
        max_rps: of(|r| r.max_rps),
        cpu_s_per_1000: opt(|r| r.cpu_s_per_1000),
        cpu_us_per_request_saturated: opt(|r| r.cpu_us_per_request_saturated),
        // The first round's: at the fixed rate, before any saturation (the
        // high-water mark keeps the saturated rounds' peak after them).
        peak_rss_mib: rounds.first().and_then(|r| r.peak_rss_mib),
        peak_rss_overall_mib: rounds
            .iter()
            .filter_map(|r| r.peak_rss_mib)
            .reduce(f64::max),
        max_rps_rounds: rounds.iter().map(|r| r.max_rps).collect(),
        p50_ms_rounds: rounds.iter().map(|r| r.p50_ms).collect(),
        p99_ms_rounds: rounds.iter().map(|r| r.p99_ms).collect(),
        cpu_s_per_1000_rounds: rounds.iter().filter_map(|r| r.cpu_s_per_1000).collect(),
        cpu_us_per_request_saturated_rounds: rounds
            .iter()
            .filter_map(|r| r.cpu_us_per_request_saturated)
            .collect(),
    }
}
