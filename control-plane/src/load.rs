//! Load reporting: the server side of the load-report stream and the
//! aggregate view of every endpoint as all callers see it, over a sliding
//! window.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use minimesh_proto::v1::load_reporting_service_server::LoadReportingService;
use minimesh_proto::v1::{LoadStatsRequest, LoadStatsResponse};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, warn};

/// Latency bucket bounds (ms) of the reports' histograms, the sidecar's.
pub const LATENCY_BUCKET_BOUNDS_MS: [u64; 13] =
    [1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000];
/// Counts above this in one report are absurd (a sidecar cannot send 10M
/// requests to one endpoint in an interval); such reports are dropped.
const MAX_COUNT: u64 = 10_000_000;

#[derive(Clone, Debug)]
struct Sample {
    at: Instant,
    node: String,
    issued: u64,
    succeeded: u64,
    failed: u64,
    in_progress: u64,
    latency: Vec<u64>,
    latency_sum_ms: f64,
    latency_count: u64,
}

/// The aggregate view.
pub struct Aggregator {
    window: Duration,
    samples: Mutex<BTreeMap<(String, String), VecDeque<Sample>>>,
    /// Last sequence seen per (node, cluster, endpoint): repeats are dropped.
    seen: Mutex<BTreeMap<(String, String, String), u64>>,
    /// Reports rejected as absurd.
    pub rejected: std::sync::atomic::AtomicU64,
}

impl Aggregator {
    /// A view over the last `window`.
    pub fn new(window: Duration) -> Self {
        Aggregator {
            window,
            samples: Mutex::new(BTreeMap::new()),
            seen: Mutex::new(BTreeMap::new()),
            rejected: Default::default(),
        }
    }

    /// Adds one report.
    pub fn add(&self, node: &str, req: &LoadStatsRequest) {
        let now = Instant::now();
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        for c in &req.cluster_stats {
            for e in &c.endpoint_stats {
                let sane = e.requests_issued <= MAX_COUNT
                    && e.requests_succeeded <= e.requests_issued.max(MAX_COUNT)
                    && e.requests_failed <= MAX_COUNT
                    && e.requests_in_progress <= MAX_COUNT
                    && e.latency_sum_ms.is_finite()
                    && e.latency_sum_ms >= 0.0
                    && e.latency_histogram.len() <= LATENCY_BUCKET_BOUNDS_MS.len() + 1
                    && e.latency_histogram.iter().all(|n| *n <= MAX_COUNT);
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
                let key = (node.to_string(), c.cluster_name.clone(), e.address.clone());
                if e.sequence != 0 {
                    if seen.get(&key).is_some_and(|s| *s >= e.sequence) {
                        continue; // already counted
                    }
                    seen.insert(key, e.sequence);
                }
                samples
                    .entry((c.cluster_name.clone(), e.address.clone()))
                    .or_default()
                    .push_back(Sample {
                        at: now,
                        node: node.to_string(),
                        issued: e.requests_issued,
                        succeeded: e.requests_succeeded,
                        failed: e.requests_failed,
                        in_progress: e.requests_in_progress,
                        latency: e.latency_histogram.clone(),
                        latency_sum_ms: e.latency_sum_ms,
                        latency_count: e.latency_count.min(MAX_COUNT),
                    });
            }
        }
    }

    /// Per endpoint of `cluster` over the window: (requests, success ratio,
    /// mean latency in ms) — the inputs of LOAD_AWARE weights.
    pub fn endpoint_stats(&self, cluster: &str) -> BTreeMap<String, (u64, f64, f64)> {
        let now = Instant::now();
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = BTreeMap::new();
        for ((c, ep), q) in samples.range((cluster.to_string(), String::new())..) {
            if c != cluster {
                break;
            }
            let live = q.iter().filter(|s| now.duration_since(s.at) <= self.window);
            let (mut issued, mut ok, mut failed, mut sum, mut count) =
                (0u64, 0u64, 0u64, 0f64, 0u64);
            for s in live {
                issued += s.issued;
                ok += s.succeeded;
                failed += s.failed;
                sum += s.latency_sum_ms;
                count += s.latency_count;
            }
            let done = ok + failed;
            let success = if done > 0 {
                ok as f64 / done as f64
            } else {
                1.0
            };
            let mean = if count > 0 { sum / count as f64 } else { 0.0 };
            out.insert(ep.clone(), (issued, success, mean));
        }
        out
    }

    /// The view: per cluster, per endpoint.
    pub fn view(&self) -> Value {
        let now = Instant::now();
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let window = self.window.as_secs_f64();
        let mut out: BTreeMap<String, BTreeMap<String, Value>> = BTreeMap::new();
        let mut totals: BTreeMap<String, u64> = BTreeMap::new();
        samples.retain(|_, q| {
            while q
                .front()
                .is_some_and(|s| now.duration_since(s.at) > self.window)
            {
                q.pop_front();
            }
            !q.is_empty()
        });
        for ((cluster, ep), q) in samples.iter() {
            let issued: u64 = q.iter().map(|s| s.issued).sum();
            let succeeded: u64 = q.iter().map(|s| s.succeeded).sum();
            let failed: u64 = q.iter().map(|s| s.failed).sum();
            // In flight: the latest report of each node.
            let mut latest: BTreeMap<&str, u64> = BTreeMap::new();
            for s in q {
                latest.insert(&s.node, s.in_progress);
            }
            let mut hist = vec![0u64; LATENCY_BUCKET_BOUNDS_MS.len() + 1];
            for s in q {
                for (i, n) in s.latency.iter().enumerate() {
                    hist[i] += n;
                }
            }
            *totals.entry(cluster.clone()).or_default() += issued;
            let done = succeeded + failed;
            out.entry(cluster.clone()).or_default().insert(
                ep.clone(),
                json!({
                    "rps": issued as f64 / window,
                    "requests": issued,
                    "success_ratio": if done > 0 { succeeded as f64 / done as f64 } else { 1.0 },
                    "in_flight": latest.values().sum::<u64>(),
                    "p50_ms": quantile(&hist, 0.5),
                    "p95_ms": quantile(&hist, 0.95),
                    "p99_ms": quantile(&hist, 0.99),
                    "reporters": latest.len(),
                }),
            );
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

/// Upper bound (ms) of the bucket holding quantile `q`; null without samples.
fn quantile(hist: &[u64], q: f64) -> Value {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return Value::Null;
    }
    let target = (total as f64 * q).ceil() as u64;
    let mut acc = 0;
    for (i, n) in hist.iter().enumerate() {
        acc += n;
        if acc >= target {
            return json!(LATENCY_BUCKET_BOUNDS_MS.get(i).copied().unwrap_or(u64::MAX));
        }
    }
    Value::Null
}

/// The load-report service.
#[derive(Clone)]
pub struct LoadReports {
    /// Where reports go.
    pub aggregator: Arc<Aggregator>,
    /// Holds the interval the control plane asks for.
    pub la: Arc<crate::LoadAwareState>,
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl LoadReportingService for LoadReports {
    type StreamLoadStatsStream = BoxStream<LoadStatsResponse>;

    async fn stream_load_stats(
        &self,
        request: Request<Streaming<LoadStatsRequest>>,
    ) -> Result<Response<Self::StreamLoadStatsStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(2);
        let aggregator = self.aggregator.clone();
        let la = self.la.clone();
        tokio::spawn(async move {
            let mut node = String::new();
            let mut sent_interval = 0;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                let interval = la
                    .report_interval_ms
                    .load(std::sync::atomic::Ordering::Relaxed);
                if !node.is_empty() && interval != sent_interval {
                    sent_interval = interval;
                    let resp = LoadStatsResponse {
                        clusters: vec![],
                        send_all_clusters: true,
                        load_reporting_interval_ms: interval,
                    };
                    if tx.send(Ok(resp)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    _ = tick.tick() => continue,
                    msg = inbound.message() => {
                        let Ok(Some(req)) = msg else { break };
                        if node.is_empty() {
                            match &req.node {
                                Some(n) if !n.id.is_empty() => node = n.id.clone(),
                                _ => {
                                    let _ = tx.send(Err(Status::invalid_argument("the first load report must name its node"))).await;
                                    return;
                                }
                            }
                            continue; // the interval is sent at the top of the loop
                        }
                        aggregator.add(&node, &req);
                    }
                }
            }
            debug!(node, "load-report stream ended");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
