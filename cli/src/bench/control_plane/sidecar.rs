//! One simulated sidecar of `minimesh bench control-plane`: a discovery
//! stream that subscribes to every type and ACKs every response, and a
//! load-report stream with the reports a real sidecar would send, on one
//! HTTP/2 connection; and what they share with the bench.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use minimesh_proto::latency::Span;
use minimesh_proto::prost::Message as _;
use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
use minimesh_proto::v1::{
    ClusterLoadAssignment, ClusterStats, DiscoveryRequest, EndpointStats, LoadStatsRequest, Node,
};
use minimesh_proto::{CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use super::CHANGED_CLUSTER;

/// What the simulated sidecars share with the bench.
#[derive(Default)]
pub(super) struct Shared {
    /// (endpoints of [`CHANGED_CLUSTER`] in a sidecar's EDS, when it ACKed
    /// them), each time the number changed: an EndpointSlice change adds
    /// one endpoint.
    pub(super) acks: std::sync::Mutex<Vec<(usize, Instant)>>,
    /// Sidecars that got their first config.
    pub(super) ready: AtomicU64,
    /// Endpoint (EDS) responses received, by every sidecar.
    pub(super) eds_responses: AtomicU64,
    /// Bytes of the endpoint assignments in them.
    pub(super) eds_bytes: AtomicU64,
    /// Some assignment had endpoints of unequal weights.
    pub(super) weights_moved: std::sync::atomic::AtomicBool,
    /// When some sidecar last got new weights (or endpoints) for each
    /// cluster: each cluster's LOAD_AWARE controller settles on its own.
    pub(super) cluster_changed: std::sync::Mutex<HashMap<String, Instant>>,
    /// Load reports sent, by every sidecar.
    pub(super) reports: AtomicU64,
    /// The report interval the control plane asked for, ms.
    pub(super) interval_ms: AtomicU64,
}

/// Requests a second each simulated sidecar reports sending, split evenly
/// over the services it calls.
pub(super) const SIMULATED_RPS: f64 = 10.0;

/// Services each simulated sidecar calls (fewer when there are fewer).
pub(super) const CALLED: usize = 3;

/// The clusters sidecar `i` calls: [`CALLED`] neighbours in name order,
/// starting at its own index, so that every cluster has as many callers.
pub(super) fn calls(i: usize, endpoints: &HashMap<String, Vec<(String, u32)>>) -> Vec<String> {
    let mut names: Vec<&String> = endpoints.keys().collect();
    names.sort();
    let n = names.len();
    (0..CALLED.min(n))
        .map(|j| names[(i + j) % n].clone())
        .collect()
}

/// Capacity of the simulated endpoint at `address` (1, 2 or 3, from the last
/// octet; the same for every sidecar).
pub(super) fn capacity(address: &str) -> f64 {
    let octet = address
        .split(':')
        .next()
        .and_then(|ip| ip.rsplit('.').next())
        .and_then(|o| o.parse::<u64>().ok())
        .unwrap_or(1);
    ((octet + 2) % 3 + 1) as f64
}

/// One interval's report on one cluster, as a real sidecar sends it: every
/// endpoint it called in the interval, with made-up traffic: `rps` requests
/// a second split by the endpoints' weights; an endpoint's latency grows
/// with its share over its capacity, with ±10% noise, so LOAD_AWARE's
/// weights move every second as they would under real traffic. None when
/// nothing was called.
pub(super) fn cluster_report(
    cluster: &str,
    endpoints: &[(String, u32)],
    rps: f64,
    interval: Duration,
    sequence: &mut u64,
    rng: &mut u64,
) -> Option<ClusterStats> {
    let total_weight: f64 = endpoints
        .iter()
        .map(|(_, w)| f64::from(*w))
        .sum::<f64>()
        .max(1.0);
    let total_capacity: f64 = endpoints
        .iter()
        .map(|(a, _)| capacity(a))
        .sum::<f64>()
        .max(1.0);
    let secs = interval.as_secs_f64();
    let endpoint_stats = endpoints
        .iter()
        .filter_map(|(address, weight)| {
            let share = f64::from(*weight) / total_weight;
            let mut uniform = || {
                *rng ^= *rng << 13;
                *rng ^= *rng >> 7;
                *rng ^= *rng << 17;
                (*rng % 1_000_000) as f64 / 1_000_000.0
            };
            let latency_ms = 10.0
                * (1.0 + 2.0 * share * total_capacity / capacity(address))
                * (0.9 + 0.2 * uniform());
            // Rounded at random, so that small shares still add up.
            let issued = (rps * secs * share + uniform()).floor() as u64;
            // Each request's latency within ±5% of the endpoint's, as the
            // fine buckets of a real sidecar's report spread them.
            let mut latencies = Span::default();
            for _ in 0..issued {
                latencies.observe((latency_ms * (950.0 + 100.0 * uniform())) as u64);
            }
            // Requests in flight at the report, by Little's law, rounded at
            // random as a snapshot of a real count is (0 or 1 mostly, at these
            // rates): xDS v3 clients' reports carry no latency, and the
            // control plane reads it from this.
            let in_progress = (rps * share * latency_ms / 1000.0 + uniform()).floor() as u64;
            // As a real sidecar: an endpoint with nothing to count is left out.
            if issued == 0 && in_progress == 0 {
                return None;
            }
            *sequence += 1;
            Some(EndpointStats {
                address: address.clone(),
                requests_issued: issued,
                requests_succeeded: issued,
                requests_failed: 0,
                requests_in_progress: in_progress,
                latency_sum_ms: issued as f64 * latency_ms,
                latency_count: issued,
                sequence: *sequence,
                latency_first_bucket: latencies.first as u32,
                latency_buckets: latencies.counts,
            })
        })
        .collect::<Vec<_>>();
    (!endpoint_stats.is_empty()).then(|| ClusterStats {
        cluster_name: cluster.to_string(),
        endpoint_stats,
        load_report_interval_ms: interval.as_millis() as u64,
    })
}

/// A simulated client's load reports: the interval the control plane asked
/// for, a tick at it (each client at its own phase, as clients start at
/// different times), and the made-up traffic's state.
pub(super) struct Reporting {
    pub(super) interval: Duration,
    pub(super) tick: tokio::time::Interval,
    rng: u64,
    sequence: u64,
}

impl Reporting {
    /// Client `i`'s reports at the interval of `ms` milliseconds.
    pub(super) fn new(i: usize, ms: u64, shared: &Shared) -> Self {
        let rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (i as u64 + 1).wrapping_mul(0xff51_afd7_ed55_8ccd);
        let mut r = Reporting {
            interval: Duration::ZERO,
            tick: tokio::time::interval(Duration::from_secs(3600)),
            rng,
            sequence: 0,
        };
        r.set_interval(ms, shared);
        r
    }

    /// The control plane asked for reports every `ms` milliseconds.
    pub(super) fn set_interval(&mut self, ms: u64, shared: &Shared) {
        self.interval = Duration::from_millis(ms.clamp(100, 600_000));
        shared
            .interval_ms
            .store(self.interval.as_millis() as u64, Ordering::Relaxed);
        let phase = self.interval.mul_f64((self.rng % 1000) as f64 / 1000.0);
        self.tick = tokio::time::interval_at(Instant::now() + phase, self.interval);
        self.tick
            .set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }

    /// One interval's reports on the clusters `called`, or None when it
    /// calls none yet.
    pub(super) fn reports(
        &mut self,
        called: &[String],
        endpoints: &HashMap<String, Vec<(String, u32)>>,
    ) -> Option<Vec<ClusterStats>> {
        if called.is_empty() {
            return None;
        }
        let rps = SIMULATED_RPS / called.len() as f64;
        Some(
            called
                .iter()
                .filter_map(|c| {
                    let eps = endpoints.get(c)?;
                    cluster_report(
                        c,
                        eps,
                        rps,
                        self.interval,
                        &mut self.sequence,
                        &mut self.rng,
                    )
                })
                .collect(),
        )
    }
}

/// What a simulated client holds: its number, the endpoints it got by
/// cluster, and the clusters it calls.
pub(super) struct Held<'a> {
    pub(super) i: usize,
    pub(super) endpoints: &'a mut HashMap<String, Vec<(String, u32)>>,
    pub(super) called: &'a mut Vec<String>,
}

impl Held<'_> {
    /// Takes an endpoints response (`bytes` of assignments, `got` by
    /// cluster) received at `now`, and records what the bench measures.
    pub(super) fn received(
        self,
        shared: &Shared,
        got: Vec<(String, Vec<(String, u32)>)>,
        bytes: u64,
        now: Instant,
    ) {
        shared.eds_responses.fetch_add(1, Ordering::Relaxed);
        shared.eds_bytes.fetch_add(bytes, Ordering::Relaxed);
        let size =
            |e: &HashMap<String, Vec<(String, u32)>>| e.get(CHANGED_CLUSTER).map_or(0, Vec::len);
        let (before, clusters) = (size(self.endpoints), self.endpoints.len());
        for (cluster, eps) in got {
            if eps.windows(2).any(|w| w[0].1 != w[1].1) {
                shared.weights_moved.store(true, Ordering::Relaxed);
            }
            if self.endpoints.get(&cluster) != Some(&eps) {
                shared
                    .cluster_changed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(cluster.clone(), now);
            }
            self.endpoints.insert(cluster, eps);
        }
        if self.endpoints.len() != clusters {
            *self.called = calls(self.i, self.endpoints);
        }
        if size(self.endpoints) != before {
            shared
                .acks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((size(self.endpoints), now));
        }
    }
}

/// One simulated sidecar: subscribes to every type, ACKs each response,
/// records when the number of endpoints it holds changed, and reports load
/// at the interval the control plane asks for, as a real sidecar does.
pub(super) async fn sidecar(addr: SocketAddr, i: usize, shared: Arc<Shared>) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = AggregatedDiscoveryServiceClient::new(channel.clone());
    let (tx, rx) = mpsc::channel(8);
    let node = Node {
        id: format!("sim-{i}.default"),
        workload: format!("sim-{i}"),
        namespace: "default".into(),
        // As a real sidecar: endpoints responses may carry only what changed.
        client_features: vec![minimesh_proto::PARTIAL_ENDPOINTS.to_string()],
        ..Default::default()
    };
    // The load-report stream, on the same connection.
    let (lrs_tx, lrs_rx) = mpsc::channel(1);
    lrs_tx
        .send(LoadStatsRequest {
            node: Some(node.clone()),
            cluster_stats: vec![],
        })
        .await?;
    let mut lrs = LoadReportingServiceClient::new(channel)
        .stream_load_stats(ReceiverStream::new(lrs_rx))
        .await?
        .into_inner();
    let first = lrs
        .message()
        .await?
        .context("the load-report stream ended before naming an interval")?;
    let mut reporting = Reporting::new(i, first.load_reporting_interval_ms, &shared);
    for (k, t) in [CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE]
        .into_iter()
        .enumerate()
    {
        tx.send(DiscoveryRequest {
            node: (k == 0).then(|| node.clone()),
            type_url: t.into(),
            ..Default::default()
        })
        .await?;
    }
    let mut stream = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut responses = 0;
    // Endpoints by cluster; the clusters this sidecar calls.
    let mut endpoints: HashMap<String, Vec<(String, u32)>> = HashMap::new();
    let mut called: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            resp = stream.message() => {
                let Some(resp) = resp? else { return Ok(()) };
                tx.send(DiscoveryRequest {
                    version_info: resp.version_info.clone(),
                    type_url: resp.type_url.clone(),
                    response_nonce: resp.nonce.clone(),
                    ..Default::default()
                })
                .await?;
                let now = Instant::now();
                if resp.type_url == ENDPOINTS_TYPE {
                    let mut bytes = 0;
                    let mut got = Vec::new();
                    for r in &resp.resources {
                        bytes += r.value.len() as u64;
                        let cla = ClusterLoadAssignment::decode(r.value.as_slice())?;
                        let eps: Vec<(String, u32)> = cla
                            .endpoints
                            .into_iter()
                            .map(|e| (e.address, e.weight.max(1)))
                            .collect();
                        got.push((cla.cluster_name, eps));
                    }
                    let held = Held { i, endpoints: &mut endpoints, called: &mut called };
                    held.received(&shared, got, bytes, now);
                }
                responses += 1;
                if responses == 3 {
                    shared.ready.fetch_add(1, Ordering::Relaxed);
                }
            }
            msg = lrs.message() => match msg? {
                Some(m) => reporting.set_interval(m.load_reporting_interval_ms, &shared),
                None => return Ok(()),
            },
            _ = reporting.tick.tick() => {
                if let Some(cluster_stats) = reporting.reports(&called, &endpoints) {
                    lrs_tx.send(LoadStatsRequest { node: None, cluster_stats }).await?;
                    shared.reports.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Seconds over which the control plane's CPU is measured, with every
/// sidecar connected and reporting and nothing changing.
pub(super) const STEADY_SECS: u64 = 10;
