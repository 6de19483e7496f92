//! The load view: every endpoint as all callers see it, aggregated from
//! their load reports over a sliding window, robust to a reporter that lies
//! (a median across reporters; counts clamped). Pure data: the streams that
//! feed it are [`crate::lrs`]'s.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use minimesh_proto::latency::Span;
use minimesh_proto::v1::LoadStatsRequest;
use serde_json::{json, Value};
use tokio::time::Instant;
use tracing::warn;

mod robust;

use robust::Counted;
pub use robust::{MIN_REPORTERS_FOR_MEDIAN, MIN_REPORTER_SAMPLES};

/// How long a reporter's highest sequence is kept after its last report: far longer than any reconnect that could send a
/// report again, and short enough that reporters and endpoints that are gone
/// (every rollout brings new pod names and addresses) do not pile up.
const SEEN_FOR: Duration = Duration::from_secs(300);
/// How often reports sweep out what nobody reports on any more.
const PRUNE_EVERY_SECS: u64 = 10;

/// A sidecar's sequence starts at its start time in milliseconds since the
/// epoch, times 1000, and grows by one an entry: one further ahead of the
/// clock than this (clocks skew) is a lie that would make the reporter's
/// next honest reports look counted already. Dropped as absurd.
const SEQUENCE_AHEAD: Duration = Duration::from_secs(600);

/// Counts above this in one report are absurd (a sidecar cannot send 10M
/// requests to one endpoint in an interval); such reports are dropped.
const MAX_COUNT: u64 = 10_000_000;

/// One second of one endpoint, summed over every reporting sidecar.
#[derive(Clone, Debug, Default)]
struct Second {
    second: u64,
    issued: u64,
    succeeded: u64,
    failed: u64,
    latency: Span,
    latency_sum_ms: f64,
    latency_count: u64,
}

/// One endpoint: per-second sums over the window, and each reporter's last
/// in-flight count, by the reporter's number ([`Reporter::id`]). Memory is
/// bounded by window seconds and reporters, not by the number of reports;
/// an endpoint holds its reporters' numbers, not their names (a popular
/// endpoint has thousands, looked up on every report: integers compare at
/// once where names sharing a prefix do not).
#[derive(Debug, Default)]
struct EndpointLoad {
    seconds: VecDeque<Second>,
    in_flight: BTreeMap<u64, (u64, Instant)>,
    /// Each reporter's own counts over the window, by its number: what
    /// LOAD_AWARE's robust inputs are taken from ([`Aggregator::endpoint_stats`]).
    by_reporter: BTreeMap<u64, VecDeque<Counted>>,
}

/// What the aggregator keeps of one reporter (node).
#[derive(Debug)]
struct Reporter {
    /// Its number, unique for the aggregator's life.
    id: u64,
    /// The highest sequence counted.
    highest: u64,
    /// When it last reported.
    at: Instant,
}

/// Cluster -> endpoint address -> load.
type Endpoints = BTreeMap<String, BTreeMap<String, EndpointLoad>>;

/// The aggregate view.
#[derive(Debug)]
pub struct Aggregator {
    window: Duration,
    start: Instant,
    endpoints: Mutex<Endpoints>,
    /// Per reporter (node, by name): its number, the highest sequence
    /// counted and when. A sidecar numbers every endpoint entry it sends
    /// from one counter that only grows (across reports, reconnects and
    /// restarts), so an entry at or below it was counted already. One entry
    /// per reporter, whatever the number of endpoints it reports on.
    seen: Mutex<HashMap<Box<str>, Reporter>>,
    /// The next reporter's number.
    next_id: std::sync::atomic::AtomicU64,
    /// The second (since `start`) at which a report next prunes.
    next_prune: std::sync::atomic::AtomicU64,
    /// Reports rejected as absurd.
    pub rejected: std::sync::atomic::AtomicU64,
}

struct Totals {
    issued: u64,
    succeeded: u64,
    failed: u64,
    latency: Span,
    latency_sum_ms: f64,
    latency_count: u64,
    in_flight: u64,
    reporters: usize,
}

impl Aggregator {
    /// A view over the last `window`.
    pub fn new(window: Duration) -> Self {
        Aggregator {
            window,
            start: Instant::now(),
            endpoints: Mutex::new(BTreeMap::new()),
            seen: Mutex::new(HashMap::new()),
            next_id: Default::default(),
            next_prune: Default::default(),
            rejected: Default::default(),
        }
    }

    fn window_secs(&self) -> u64 {
        self.window.as_secs().max(1)
    }

    /// Adds one report.
    pub fn add(&self, node: &str, req: &LoadStatsRequest) {
        self.add_at(node, req, Instant::now());
    }

    fn add_at(&self, node: &str, req: &LoadStatsRequest, now: Instant) {
        let second = now.duration_since(self.start).as_secs();
        let mut endpoints = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if second >= self.next_prune.load(std::sync::atomic::Ordering::Relaxed) {
            self.next_prune.store(
                second + PRUNE_EVERY_SECS,
                std::sync::atomic::Ordering::Relaxed,
            );
            let horizon = self.window.max(SEEN_FOR);
            seen.retain(|_, r| now.duration_since(r.at) <= horizon);
            self.forget_unreported(&mut endpoints, now);
        }
        let (id, counted) = match seen.get(node) {
            Some(r) => (r.id, r.highest),
            None => (
                self.next_id
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                0,
            ),
        };
        let mut highest = counted;
        let latest_sequence = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(u64::MAX, |d| {
                (d + SEQUENCE_AHEAD).as_millis() as u64 * 1000 + 999
            });
        for c in &req.cluster_stats {
            for e in &c.endpoint_stats {
                let sane = e.requests_issued <= MAX_COUNT
                    && e.requests_succeeded <= MAX_COUNT
                    && e.requests_failed <= MAX_COUNT
                    && e.requests_in_progress <= MAX_COUNT
                    && e.latency_count <= MAX_COUNT
                    && e.latency_sum_ms.is_finite()
                    && e.latency_sum_ms >= 0.0
                    && e.latency_sum_ms <= MAX_COUNT as f64 * 3_600_000.0
                    && Span::fits(e.latency_first_bucket as usize, &e.latency_buckets)
                    && e.latency_buckets.iter().all(|n| *n <= MAX_COUNT)
                    && e.sequence <= latest_sequence;
                if !sane {
                    self.rejected
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    warn!(
                        node,
                        cluster = c.cluster_name,
                        endpoint = e.address,
                        "absurd load report dropped"
                    );
                    continue;
                }
                if e.sequence != 0 {
                    if e.sequence <= counted {
                        continue; // already counted
                    }
                    highest = highest.max(e.sequence);
                }
                // Look up before inserting: no key is copied for an
                // endpoint already known.
                if !endpoints.contains_key(&c.cluster_name) {
                    endpoints.insert(c.cluster_name.clone(), BTreeMap::new());
                }
                let Some(cluster) = endpoints.get_mut(&c.cluster_name) else {
                    continue;
                };
                if !cluster.contains_key(&e.address) {
                    cluster.insert(e.address.clone(), EndpointLoad::default());
                }
                let Some(ep) = cluster.get_mut(&e.address) else {
                    continue;
                };
                if ep.seconds.back().is_none_or(|s| s.second != second) {
                    ep.seconds.push_back(Second {
                        second,
                        ..Default::default()
                    });
                    while ep.seconds.len() as u64 > self.window_secs() + 1 {
                        ep.seconds.pop_front();
                    }
                }
                if let Some(s) = ep.seconds.back_mut() {
                    s.issued += e.requests_issued;
                    s.succeeded += e.requests_succeeded;
                    s.failed += e.requests_failed;
                    s.latency_sum_ms += e.latency_sum_ms;
                    s.latency_count += e.latency_count;
                    s.latency
                        .add(e.latency_first_bucket as usize, &e.latency_buckets);
                }
                let mine = ep.by_reporter.entry(id).or_default();
                if mine.back().is_none_or(|c| c.second != second) {
                    mine.push_back(Counted {
                        second,
                        ..Default::default()
                    });
                    while mine.len() as u64 > self.window_secs() + 1 {
                        mine.pop_front();
                    }
                }
                if let Some(c) = mine.back_mut() {
                    c.succeeded += e.requests_succeeded;
                    c.failed += e.requests_failed;
                    c.latency_sum_ms += e.latency_sum_ms;
                    c.latency_count += e.latency_count;
                }
                ep.in_flight.insert(id, (e.requests_in_progress, now));
            }
        }
        match seen.get_mut(node) {
            Some(r) => (r.highest, r.at) = (highest, now),
            None => {
                seen.insert(
                    Box::from(node),
                    Reporter {
                        id,
                        highest,
                        at: now,
                    },
                );
            }
        }
    }

    /// Drops each endpoint's reporters that have not reported within the
    /// window, and the endpoints left with none.
    fn forget_unreported(&self, endpoints: &mut Endpoints, now: Instant) {
        endpoints.retain(|_, cluster| {
            cluster.retain(|_, ep| {
                ep.in_flight
                    .retain(|_, (_, at)| now.duration_since(*at) <= self.window);
                let reporting = &ep.in_flight;
                ep.by_reporter.retain(|id, _| reporting.contains_key(id));
                !ep.in_flight.is_empty()
            });
            !cluster.is_empty()
        });
    }

    fn totals(&self, ep: &EndpointLoad, now: Instant) -> Totals {
        self.totals_over(ep, now, self.window_secs())
    }

    fn totals_over(&self, ep: &EndpointLoad, now: Instant, secs: u64) -> Totals {
        let current = now.duration_since(self.start).as_secs();
        let oldest = current.saturating_sub(secs.min(self.window_secs()));
        let mut t = Totals {
            issued: 0,
            succeeded: 0,
            failed: 0,
            latency: Span::default(),
            latency_sum_ms: 0.0,
            latency_count: 0,
            in_flight: 0,
            reporters: 0,
        };
        for s in ep.seconds.iter().filter(|s| in_window(s.second, oldest)) {
            t.issued += s.issued;
            t.succeeded += s.succeeded;
            t.failed += s.failed;
            t.latency_sum_ms += s.latency_sum_ms;
            t.latency_count += s.latency_count;
            t.latency.add(s.latency.first, &s.latency.counts);
        }
        for (n, at) in ep.in_flight.values() {
            if now.duration_since(*at) <= self.window {
                t.in_flight += n;
                t.reporters += 1;
            }
        }
        t
    }

    /// Per endpoint of `cluster` over the last `secs` seconds (at most the
    /// window): (requests, success ratio, mean latency in ms) — the inputs of
    /// LOAD_AWARE weights. Requests are pooled; the success ratio and the
    /// latency are the medians of the reporters' own (each resting on at
    /// least [`MIN_REPORTER_SAMPLES`] requests) once there are
    /// [`MIN_REPORTERS_FOR_MEDIAN`] of them, so that reporters that are
    /// fewer than half cannot move them outside what the others report; the
    /// pooled figures with fewer.
    pub fn endpoint_stats(&self, cluster: &str, secs: u64) -> BTreeMap<String, (u64, f64, f64)> {
        let now = Instant::now();
        let oldest = now
            .duration_since(self.start)
            .as_secs()
            .saturating_sub(secs.min(self.window_secs()));
        let endpoints = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = BTreeMap::new();
        for (ep, load) in endpoints.get(cluster).into_iter().flatten() {
            let t = self.totals_over(load, now, secs);
            let done = t.succeeded + t.failed;
            let success = if done > 0 {
                t.succeeded as f64 / done as f64
            } else {
                1.0
            };
            let mean = if t.latency_count > 0 {
                t.latency_sum_ms / t.latency_count as f64
            } else {
                0.0
            };
            let (median_mean, median_success) = robust::medians(&load.by_reporter, oldest);
            let mean = median_mean.unwrap_or(mean);
            let success = median_success.unwrap_or(success);
            out.insert(ep.clone(), (t.issued, success, mean));
        }
        out
    }

    /// The view: per cluster, per endpoint. `known` lists every endpoint of
    /// every cluster in the config: sidecars report only the endpoints they
    /// called, so one nobody called (an ejected one, say) is listed from
    /// here, with nothing counted and no reporter.
    pub fn view(&self, known: &BTreeMap<String, Vec<String>>) -> Value {
        let now = Instant::now();
        let mut endpoints = self.endpoints.lock().unwrap_or_else(|e| e.into_inner());
        let window = self.window.as_secs_f64();
        self.forget_unreported(&mut endpoints, now);
        let mut out: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
        let mut totals: BTreeMap<String, u64> = BTreeMap::new();
        for (cluster, ep, load) in endpoints
            .iter()
            .flat_map(|(c, eps)| eps.iter().map(move |(ep, load)| (c, ep, load)))
        {
            let t = self.totals(load, now);
            *totals.entry(cluster.clone()).or_default() += t.issued;
            let done = t.succeeded + t.failed;
            out.entry(cluster.clone()).or_default().insert(
                ep.clone(),
                json!({
                    "rps": t.issued as f64 / window,
                    "requests": t.issued,
                    "succeeded": t.succeeded,
                    "failed": t.failed,
                    "success_ratio": if done > 0 { t.succeeded as f64 / done as f64 } else { 1.0 },
                    "in_flight": t.in_flight,
                    "p50_ms": quantile(&t.latency, 0.5),
                    "p95_ms": quantile(&t.latency, 0.95),
                    "p99_ms": quantile(&t.latency, 0.99),
                    "reporters": t.reporters,
                }),
            );
        }
        for (cluster, eps) in known {
            let listed = out.entry(cluster.clone()).or_default();
            for ep in eps {
                listed.entry(ep.clone()).or_insert_with(|| {
                    json!({
                        "rps": 0.0,
                        "requests": 0,
                        "succeeded": 0,
                        "failed": 0,
                        "success_ratio": 1.0,
                        "in_flight": 0,
                        "p50_ms": null,
                        "p95_ms": null,
                        "p99_ms": null,
                        "reporters": 0,
                    })
                });
            }
        }
        for (cluster, eps) in out.iter_mut() {
            let total = totals.get(cluster).copied().unwrap_or(0).max(1) as f64;
            for v in eps.values_mut() {
                let share = v["requests"].as_u64().unwrap_or(0) as f64 / total;
                v["share"] = json!(share);
            }
        }
        json!({"window_seconds": window, "clusters": out})
    }
}

/// Quantile `q` of `latency` in milliseconds, rounded to a microsecond
/// (within 1.6% of the real value: [`minimesh_proto::latency`]); null
/// without samples.
fn quantile(latency: &Span, q: f64) -> Value {
    match latency.quantile(q) {
        Some(us) => json!((us / 1000.0 * 1000.0).round() / 1000.0),
        None => Value::Null,
    }
}

/// Whether second `s` (since the aggregator's start) is in a window whose
/// oldest second is `oldest` (the first second belongs while it is the
/// oldest there is).
pub(crate) fn in_window(s: u64, oldest: u64) -> bool {
    s > oldest || (s == oldest && oldest == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimesh_proto::v1::{ClusterStats, EndpointStats};

    fn report(endpoint: &str, sequence: u64) -> LoadStatsRequest {
        LoadStatsRequest {
            node: None,
            cluster_stats: vec![ClusterStats {
                cluster_name: "backend.ns".into(),
                endpoint_stats: vec![EndpointStats {
                    address: endpoint.into(),
                    requests_issued: 5,
                    requests_succeeded: 5,
                    sequence,
                    ..Default::default()
                }],
                load_report_interval_ms: 1000,
            }],
        }
    }

    /// A report of 5 requests at `latency_ms` each.
    fn timed(endpoint: &str, sequence: u64, latency_ms: u64) -> LoadStatsRequest {
        let mut r = report(endpoint, sequence);
        let e = &mut r.cluster_stats[0].endpoint_stats[0];
        e.latency_count = 5;
        e.latency_sum_ms = 5.0 * latency_ms as f64;
        e.latency_first_bucket = minimesh_proto::latency::bucket(latency_ms * 1000) as u32;
        e.latency_buckets = vec![5];
        r
    }

    #[tokio::test(start_paused = true)]
    async fn the_view_counts_the_window_and_reads_percentiles_from_fine_buckets() {
        let a = Aggregator::new(Duration::from_secs(10));
        let known = BTreeMap::new();
        let at = |a: &Aggregator| {
            let v = a.view(&known);
            v["clusters"]["backend.ns"]["10.0.0.1:80"].clone()
        };
        a.add("caller", &timed("10.0.0.1:80", 1, 40));
        tokio::time::advance(Duration::from_secs(5)).await;
        a.add("caller", &timed("10.0.0.1:80", 2, 150));
        let v = at(&a);
        assert_eq!(v["requests"], 10, "{v}");
        // Half the samples at 40 ms, half at 150: the median is the 5th of
        // 10, at 40 ms, the p99 at 150 ms, each within 1.6%.
        let p50 = v["p50_ms"].as_f64().expect("p50");
        let p99 = v["p99_ms"].as_f64().expect("p99");
        assert!((p50 - 40.0).abs() <= 0.016 * 40.0, "{p50}");
        assert!((p99 - 150.0).abs() <= 0.016 * 150.0, "{p99}");
        // Six seconds on, the first report's second has left the window.
        tokio::time::advance(Duration::from_secs(6)).await;
        let v = at(&a);
        assert_eq!(v["requests"], 5, "{v}");
        assert!((v["p50_ms"].as_f64().expect("p50") - 150.0).abs() <= 2.4);
        // Once the reporter has been silent for a whole window, the
        // endpoint is gone from the view.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(at(&a).is_null(), "{}", a.view(&known));
    }

    fn sizes(a: &Aggregator) -> (usize, usize, usize) {
        let endpoints = a.endpoints.lock().unwrap();
        let loads = || endpoints.values().flat_map(|c| c.values());
        let reporters = loads().map(|e| e.in_flight.len()).sum();
        (loads().count(), reporters, a.seen.lock().unwrap().len())
    }

    #[test]
    fn reporters_and_endpoints_that_are_gone_are_forgotten() {
        let a = Aggregator::new(Duration::from_secs(10));
        let t0 = Instant::now();
        // A rollout's worth of callers and endpoints, each reporting once;
        // one caller keeps reporting on one endpoint that stays.
        for i in 0..1000 {
            let endpoint = format!("10.0.{}.{}:8080", i / 250, i % 250);
            a.add_at(&format!("caller-{i}"), &report(&endpoint, 7), t0);
        }
        a.add_at("steady", &report("10.9.9.9:8080", 1), t0);
        assert_eq!(sizes(&a), (1001, 1001, 1001));
        // A repeat moments later is recognized, and not counted.
        let t1 = t0 + Duration::from_secs(5);
        a.add_at("caller-0", &report("10.0.0.0:8080", 7), t1);
        let before: u64 = a.endpoints.lock().unwrap()["backend.ns"]["10.0.0.0:8080"]
            .seconds
            .iter()
            .map(|s| s.issued)
            .sum();
        assert_eq!(before, 5);
        // Past SEEN_FOR, the quiet endpoints, reporters and sequences are
        // gone; the steady pair stays.
        let t2 = t0 + SEEN_FOR + Duration::from_secs(30);
        a.add_at("steady", &report("10.9.9.9:8080", 2), t2);
        assert_eq!(sizes(&a), (1, 1, 1));
        // And what is kept still counts: 5 requests in this second.
        let stats = a.endpoint_stats("backend.ns", 10);
        assert_eq!(stats.len(), 1);
        assert_eq!(stats["10.9.9.9:8080"].0, 5);
    }

    #[test]
    fn a_reporter_costs_one_sequence_entry_whatever_it_reports_on() {
        let a = Aggregator::new(Duration::from_secs(10));
        let t0 = Instant::now();
        // One sidecar, 100 endpoints in one report, numbered from its one
        // counter as the sidecar does.
        let mut req = report("10.0.0.0:8080", 0);
        req.cluster_stats[0].endpoint_stats = (0..100u64)
            .map(|i| EndpointStats {
                address: format!("10.0.1.{i}:8080"),
                requests_issued: 5,
                requests_succeeded: 5,
                sequence: 1_000 + i,
                ..Default::default()
            })
            .collect();
        a.add_at("caller.default", &req, t0);
        assert_eq!(sizes(&a), (100, 100, 1));
        // Every endpoint knows the reporter by its one number.
        let id = a.seen.lock().unwrap()["caller.default"].id;
        let endpoints = a.endpoints.lock().unwrap();
        let ids: Vec<u64> = endpoints["backend.ns"]
            .values()
            .flat_map(|e| e.in_flight.keys().copied())
            .collect();
        assert_eq!(ids, vec![id; 100]);
        drop(endpoints);
        // The same report again, or any entry numbered at or below the
        // highest counted, is not counted; the next one is.
        a.add_at("caller.default", &req, t0);
        a.add_at("caller.default", &report("10.0.1.7:8080", 1_050), t0);
        a.add_at("caller.default", &report("10.0.1.8:8080", 1_100), t0);
        let stats = a.endpoint_stats("backend.ns", 10);
        assert_eq!(stats["10.0.1.7:8080"].0, 5);
        assert_eq!(stats["10.0.1.8:8080"].0, 10);
    }
}
