//! The load-report service: each sidecar's load-report stream (minimesh's
//! messages, and Envoy's through [`v3`]), authenticated reporters counted
//! under their proven identity, the interval the control plane asks for,
//! and on Kubernetes the passing of every report to the leader
//! ([`replicas`]). Reports go to the one [`Aggregator`].

pub mod metrics;
pub mod replicas;
pub mod v3;

use std::collections::VecDeque;
use std::sync::Arc;

use minimesh_proto::v1::load_reporting_service_server::LoadReportingService;
use minimesh_proto::v1::{LoadStatsRequest, LoadStatsResponse};
use prometheus_client::metrics::gauge::Gauge;
use tonic::Status;
use tracing::{debug, warn};

use crate::discovery::session::{drive, BoxStream, Session};
use crate::load::Aggregator;
use crate::load_aware::LoadAwareState;

/// The gauge of connected reporters (streams whose proxy has named itself),
/// registered on `registry` (the control plane's, prefixed `minimesh_`).
pub fn reporters(registry: &mut prometheus_client::registry::Registry) -> Gauge {
    let gauge = Gauge::default();
    registry.register(
        "load_reporters_connected",
        "Connected load-report streams (proxies reporting load)",
        gauge.clone(),
    );
    gauge
}

/// The load-report service.
#[derive(Clone)]
pub struct LoadReports {
    /// Where reports go.
    pub aggregator: Arc<Aggregator>,
    /// Holds the interval the control plane asks for.
    pub la: Arc<LoadAwareState>,
    /// Connected reporters (`minimesh_load_reporters_connected`).
    pub reporters: Gauge,
    /// On Kubernetes: every report is also passed here, for the leader
    /// ([`replicas::forward`]).
    pub forward: Option<tokio::sync::mpsc::Sender<LoadStatsRequest>>,
    /// The resources published: an authenticated reporter's reports count
    /// only on the clusters its namespace may see.
    pub published: tokio::sync::watch::Receiver<Arc<crate::cache::Snapshot>>,
}

#[tonic::async_trait]
impl LoadReportingService for LoadReports {
    type StreamLoadStatsStream = BoxStream<LoadStatsResponse>;

    async fn stream_load_stats(
        &self,
        request: tonic::Request<tonic::Streaming<LoadStatsRequest>>,
    ) -> Result<tonic::Response<Self::StreamLoadStatsStream>, Status> {
        let caller = crate::ca::streams::reporter(&request);
        let inbound = crate::ca::streams::checked(request, "load_reports");
        Ok(tonic::Response::new(self.open(inbound, caller)))
    }
}

impl LoadReports {
    /// A load-report stream reading the reports of `inbound` (minimesh's
    /// messages; [`v3`] converts Envoy's to them). With
    /// `caller` (the proven identity's voice, its pod or its service
    /// account, and its namespace), reports count under it whatever node id
    /// they name, so that one workload is one reporter however many streams
    /// it opens, and only on clusters its namespace may see.
    pub(crate) fn open<I>(
        &self,
        inbound: I,
        caller: Option<(String, String)>,
    ) -> BoxStream<LoadStatsResponse>
    where
        I: futures_util::Stream<Item = Result<LoadStatsRequest, Status>> + Send + Unpin + 'static,
    {
        let session = LoadSession {
            aggregator: self.aggregator.clone(),
            node: String::new(),
            reporter: caller.as_ref().map(|c| c.0.clone()),
            namespace: caller.map(|c| c.1),
            published: self.published.clone(),
            hidden_logged: false,
            node_message: None,
            forwarder: false,
            forward: self.forward.clone(),
            sent_interval: 0,
            reporters: self.reporters.clone(),
        };
        drive(session, inbound, self.la.report_interval_ms.subscribe())
    }
}

/// One sidecar's load-report stream: the first report names the node, and
/// the control plane answers with the interval it wants, again whenever
/// that changes.
struct LoadSession {
    aggregator: Arc<Aggregator>,
    node: String,
    /// Whom the reports count as (the caller's proven identity), when the
    /// call was authenticated; else the node id.
    reporter: Option<String>,
    /// The caller's proven namespace: its reports count only on clusters
    /// published to it.
    namespace: Option<String>,
    published: tokio::sync::watch::Receiver<Arc<crate::cache::Snapshot>>,
    /// A report on a cluster hidden from the caller was logged.
    hidden_logged: bool,
    /// The node as the first report named it (forwarded reports carry it).
    node_message: Option<minimesh_proto::v1::Node>,
    /// This stream is another replica passing on its sidecars' reports.
    forwarder: bool,
    forward: Option<tokio::sync::mpsc::Sender<LoadStatsRequest>>,
    sent_interval: u64,
    /// Counts this stream from its first report (which names the node) to
    /// its end.
    reporters: Gauge,
}

impl LoadSession {
    fn send_interval(&mut self, interval: u64, out: &mut VecDeque<LoadStatsResponse>) {
        if !self.node.is_empty() && interval != self.sent_interval {
            self.sent_interval = interval;
            out.push_back(LoadStatsResponse {
                clusters: vec![],
                send_all_clusters: true,
                load_reporting_interval_ms: interval,
            });
        }
    }
}

impl Session for LoadSession {
    type Request = LoadStatsRequest;
    type Response = LoadStatsResponse;
    type Watched = u64;

    fn on_request(
        &mut self,
        req: LoadStatsRequest,
        interval: &u64,
        out: &mut VecDeque<LoadStatsResponse>,
    ) -> Result<(), Status> {
        if self.node.is_empty() {
            match &req.node {
                Some(n) if !n.id.is_empty() => {
                    self.forwarder = n.id.starts_with(minimesh_proto::FORWARDER_NODE_PREFIX);
                    self.node = match (&self.reporter, self.forwarder) {
                        (Some(r), false) => r.clone(),
                        _ => n.id.clone(),
                    };
                    if !self.forwarder {
                        self.reporters.inc();
                        // Passed on under the name it counts as here.
                        let mut named = n.clone();
                        named.id = self.node.clone();
                        self.node_message = Some(named);
                    }
                }
                _ => {
                    return Err(Status::invalid_argument(
                        "the first load report must name its node",
                    ))
                }
            }
            self.send_interval(*interval, out);
        }
        if self.forwarder {
            // Another replica's: each report names its sidecar.
            if let Some(node) = req.node.as_ref().filter(|n| !n.id.is_empty()) {
                if !node.id.starts_with(minimesh_proto::FORWARDER_NODE_PREFIX) {
                    self.aggregator.add(&node.id, &req);
                }
            }
            return Ok(());
        }
        // Only what the caller's namespace may see (a Service's exportTo).
        let mut req = req;
        if let Some(ns) = &self.namespace {
            let published = self.published.borrow().clone();
            let visible = |name: &str| {
                [
                    minimesh_proto::CLUSTER_TYPE,
                    minimesh_proto::xds_v3::CLUSTER_TYPE,
                ]
                .iter()
                .filter_map(|t| published.types.get(t))
                .any(|t| t.get_for(name, Some(ns)).is_some())
            };
            let before = req.cluster_stats.len();
            req.cluster_stats.retain(|c| visible(&c.cluster_name));
            if req.cluster_stats.len() < before && !self.hidden_logged {
                self.hidden_logged = true;
                warn!(
                    node = self.node,
                    namespace = ns,
                    "load reports on clusters namespace {ns} is not sent (unknown, or not exported to it) are dropped (logged once per stream)"
                );
            }
        }
        // The first report may carry load too (Envoy's and gRPC's may).
        self.aggregator.add(&self.node, &req);
        if let Some(forward) = &self.forward {
            if !req.cluster_stats.is_empty() {
                let mut passed = req;
                passed.node = self.node_message.clone();
                // Full (the leader unreachable for a while): dropped; the
                // leader misses it, the weights it computes hold meanwhile.
                if forward.try_send(passed).is_err() {
                    debug!(
                        node = self.node,
                        "load report not passed to the leader: queue full"
                    );
                }
            }
        }
        Ok(())
    }

    fn on_change(&mut self, interval: &u64, out: &mut VecDeque<LoadStatsResponse>) {
        self.send_interval(*interval, out);
    }

    fn on_end(&mut self) {
        if !self.node.is_empty() && !self.forwarder {
            self.reporters.dec();
        }
        debug!(node = self.node, "load-report stream ended");
    }
}
