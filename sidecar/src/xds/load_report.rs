//! The load-report client: every interval the control plane asks for, the
//! counts of each endpoint called since the previous report (issued,
//! succeeded, failed, in progress, latency histogram); an endpoint with
//! nothing to count is left out, so a report grows with what this sidecar
//! calls, not with the mesh. Each report is sent once, with a
//! sequence number that keeps increasing across reconnects and restarts, so
//! the control plane never counts one twice; losing the control plane loses
//! at most one interval of counts and never affects requests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest, Node};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, info};

use crate::balance::rng;
use crate::routing::Routing;

/// Sends load reports to the control plane.
pub struct LoadReporter {
    /// `http://host:port` of the control plane.
    pub address: String,
    /// The connection to the control plane, shared with discovery.
    pub channel: tonic::transport::Channel,
    /// This proxy.
    pub node: Node,
    /// Where the endpoints and their counters are.
    pub routing: Arc<ArcSwap<Routing>>,
    /// The workload's token (`--token-file`), sent when the file exists.
    pub token_file: std::path::PathBuf,
}

#[derive(Default, Clone)]
struct Last {
    in_progress: u64,
    issued: u64,
    succeeded: u64,
    failed: u64,
    latency_us: u64,
}

impl LoadReporter {
    /// Runs forever, reconnecting with jittered backoff.
    pub async fn run(self) {
        let mut last: HashMap<(String, String), Last> = HashMap::new();
        // Milliseconds since the epoch at start, times 1000: later than any
        // sequence an earlier run of this sidecar sent.
        let mut sequence = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_millis() as u64)
            * 1000;
        let mut backoff = Duration::from_millis(500);
        loop {
            match self.session(&mut last, &mut sequence).await {
                Ok(()) => backoff = Duration::from_millis(500),
                Err(e) => debug!(error = %e, "load-report stream failed"),
            }
            let half = backoff.as_millis() as u64 / 2;
            tokio::time::sleep(Duration::from_millis(half + rng::next() % (half + 1))).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }

    async fn session(
        &self,
        last: &mut HashMap<(String, String), Last>,
        sequence: &mut u64,
    ) -> anyhow::Result<()> {
        let mut client = LoadReportingServiceClient::new(self.channel.clone());
        let (tx, rx) = mpsc::channel(4);
        tx.send(LoadStatsRequest {
            node: Some(self.node.clone()),
            cluster_stats: vec![],
        })
        .await?;
        let mut inbound = client
            .stream_load_stats({
                let mut req = tonic::Request::new(ReceiverStream::new(rx));
                crate::identity::authorize(&mut req, &self.token_file);
                req
            })
            .await?
            .into_inner();
        let Some(first) = inbound.message().await? else {
            return Ok(());
        };
        let mut interval =
            Duration::from_millis(first.load_reporting_interval_ms.clamp(100, 600_000));
        info!(?interval, "reporting load");
        // Counts since before this session belong to no interval: start afresh.
        collect(&self.routing.load(), last, sequence, interval);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {
                    let stats = collect(&self.routing.load(), last, sequence, interval);
                    tx.send(LoadStatsRequest { node: None, cluster_stats: stats }).await?;
                }
                msg = inbound.message() => match msg? {
                    Some(m) => interval = Duration::from_millis(m.load_reporting_interval_ms.clamp(100, 600_000)),
                    None => return Ok(()),
                },
            }
        }
    }
}

fn collect(
    routing: &Routing,
    last: &mut HashMap<(String, String), Last>,
    sequence: &mut u64,
    interval: Duration,
) -> Vec<ClusterStats> {
    let mut out = Vec::new();
    for (name, c) in &routing.clusters {
        let mut eps = Vec::new();
        for e in c.balancer.endpoints() {
            let k = e.counters();
            let now = Last {
                in_progress: u64::from(e.active()),
                issued: k.issued(),
                succeeded: k.succeeded(),
                failed: k.failed(),
                latency_us: k.latency_sum_us(),
            };
            let prev = last
                .insert((name.clone(), e.addr.to_string()), now.clone())
                .unwrap_or_default();
            // An endpoint this sidecar did not call says nothing: left out,
            // so that reports grow with what a sidecar calls, not with the
            // mesh. Unless it had requests in flight last time: the control
            // plane hears that they ended.
            if now.issued == prev.issued
                && now.succeeded == prev.succeeded
                && now.failed == prev.failed
                && now.in_progress == 0
                && prev.in_progress == 0
            {
                continue;
            }
            *sequence += 1;
            let (latency_first_bucket, latency_buckets) = k.drain_latency();
            eps.push(EndpointStats {
                address: e.addr.to_string(),
                requests_issued: now.issued.saturating_sub(prev.issued),
                requests_succeeded: now.succeeded.saturating_sub(prev.succeeded),
                requests_failed: now.failed.saturating_sub(prev.failed),
                requests_in_progress: now.in_progress,
                latency_sum_ms: now.latency_us.saturating_sub(prev.latency_us) as f64 / 1000.0,
                latency_count: now.succeeded.saturating_sub(prev.succeeded)
                    + now.failed.saturating_sub(prev.failed),
                sequence: *sequence,
                latency_first_bucket,
                latency_buckets,
            });
        }
        if eps.is_empty() {
            continue;
        }
        out.push(ClusterStats {
            cluster_name: name.clone(),
            endpoint_stats: eps,
            load_report_interval_ms: interval.as_millis() as u64,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolSettings;
    use crate::routing::{HostAliases, Resources};
    use minimesh_proto::v1::{Cluster, ClusterLoadAssignment, Endpoint, LbPolicy};

    fn reported(stats: &[ClusterStats]) -> Vec<(String, u64, u64, u64)> {
        stats
            .iter()
            .flat_map(|c| c.endpoint_stats.iter())
            .map(|e| {
                (
                    e.address.clone(),
                    e.requests_issued,
                    e.requests_succeeded,
                    e.requests_in_progress,
                )
            })
            .collect()
    }

    #[test]
    fn an_endpoint_is_reported_while_called_and_once_after_its_last_request_ends() {
        let mut resources = Resources::default();
        let names = ["called", "idle"];
        resources.set_clusters(names.map(|name| Cluster {
            name: name.into(),
            service: name.into(),
            namespace: "default".into(),
            port: 80,
            policy: LbPolicy::RoundRobin as i32,
            ..Default::default()
        }));
        resources.set_endpoints(names.map(|name| {
            ClusterLoadAssignment {
                cluster_name: name.into(),
                endpoints: ["10.0.0.1:80", "10.0.0.2:80"]
                    .map(|a| Endpoint {
                        address: a.into(),
                        weight: 1,
                        ..Default::default()
                    })
                    .to_vec(),
            }
        }));
        let defaults = PoolSettings {
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(60),
            max_requests_per_connection: 0,
            max_connection_ms: 0,
            max_streams: 0,
        };
        let routing = resources.build(&Node::default(), &HostAliases::default(), &defaults);
        let (mut last, mut sequence) = (HashMap::new(), 0);
        let interval = Duration::from_secs(1);
        let mut collect = || collect(&routing, &mut last, &mut sequence, interval);
        // Nothing called: nothing to say, not even the clusters.
        assert!(collect().is_empty());
        // A request starts on one endpoint, then ends.
        let e = &routing.clusters["called"].balancer.endpoints()[0];
        let addr = e.addr.to_string();
        let request = e.start();
        let stats = collect();
        assert_eq!(stats.len(), 1);
        assert_eq!(stats[0].cluster_name, "called");
        assert_eq!(reported(&stats), vec![(addr.clone(), 1, 0, 1)]);
        drop(request);
        e.counters().count_response(false, 1_000);
        assert_eq!(reported(&collect()), vec![(addr.clone(), 0, 1, 0)]);
        assert!(collect().is_empty());
        // A request still in flight keeps it reported; once it is gone the
        // report says so, once.
        let request = e.start();
        assert_eq!(reported(&collect()), vec![(addr.clone(), 1, 0, 1)]);
        assert_eq!(reported(&collect()), vec![(addr.clone(), 0, 0, 1)]);
        drop(request);
        assert_eq!(reported(&collect()), vec![(addr.clone(), 0, 0, 0)]);
        assert!(collect().is_empty());
        // Every entry is numbered from the one counter.
        assert_eq!(sequence, 5);
    }
}
