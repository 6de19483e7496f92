//! LOAD_AWARE's robust inputs: each reporter's own counts for an endpoint,
//! and the medians across reporters of their latency and success ratio, so
//! that reporters fewer than half cannot move them outside what the others
//! report (see [`super::Aggregator::endpoint_stats`]).

use std::collections::{BTreeMap, VecDeque};

/// One reporter's counts for one endpoint in one second.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Counted {
    pub(super) second: u64,
    pub(super) succeeded: u64,
    pub(super) failed: u64,
    pub(super) latency_sum_ms: f64,
    pub(super) latency_count: u64,
}

/// A reporter's mean latency and success ratio for an endpoint count in
/// the robust view once they rest on this many requests in the window.
pub const MIN_REPORTER_SAMPLES: u64 = 5;
/// With at least this many such reporters, an endpoint's latency and
/// success ratio are their medians; with fewer, the pooled figures (two
/// reporters cannot outvote one another).
pub const MIN_REPORTERS_FOR_MEDIAN: usize = 3;

/// The median of `v` (empty: None).
fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

/// The medians of the reporters' mean latency and success ratio over the
/// seconds after `oldest`, each when enough reporters rest on enough
/// requests; None otherwise (the caller keeps the pooled figure).
pub(super) fn medians(
    by_reporter: &BTreeMap<u64, VecDeque<Counted>>,
    oldest: u64,
) -> (Option<f64>, Option<f64>) {
    let (mut means, mut successes) = (Vec::new(), Vec::new());
    for seconds in by_reporter.values() {
        let mut c = Counted::default();
        for s in seconds
            .iter()
            .filter(|s| super::in_window(s.second, oldest))
        {
            c.succeeded += s.succeeded;
            c.failed += s.failed;
            c.latency_sum_ms += s.latency_sum_ms;
            c.latency_count += s.latency_count;
        }
        if c.latency_count >= MIN_REPORTER_SAMPLES {
            means.push(c.latency_sum_ms / c.latency_count as f64);
        }
        let done = c.succeeded + c.failed;
        if done >= MIN_REPORTER_SAMPLES {
            successes.push(c.succeeded as f64 / done as f64);
        }
    }
    let enough = |v: &mut Vec<f64>| {
        (v.len() >= MIN_REPORTERS_FOR_MEDIAN)
            .then(|| median(v))
            .flatten()
    };
    (enough(&mut means), enough(&mut successes))
}
