//! One simulated xDS v3 client of `minimesh bench control-plane --xds-v3`:
//! what Envoy with `deploy/envoy/bootstrap.yaml` does on its one HTTP/2
//! connection to the control plane. An ADS state-of-the-world stream:
//! clusters (wildcard), the endpoints of every cluster it got (by name), the
//! outbound route configuration, each response ACKed; and an LRS stream
//! reporting per endpoint, as Envoy does when asked (no latency: Envoy's
//! reports carry none).

use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address::PortSpecifier, Address, Node as EnvoyNode, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint::HostIdentifier, ClusterLoadAssignment as EnvoyCla,
    ClusterStats as EnvoyClusterStats, UpstreamEndpointStats, UpstreamLocalityStats,
};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient as AdsClient;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest as EnvoyRequest;
use envoy_types::pb::envoy::service::load_stats::v3::load_reporting_service_client::LoadReportingServiceClient as LrsClient;
use envoy_types::pb::envoy::service::load_stats::v3::LoadStatsRequest as EnvoyReport;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use minimesh_proto::prost::Message as _;
use minimesh_proto::xds_v3;

use super::sidecar::Held;
use super::sidecar::Reporting;
use super::sidecar::Shared;
use anyhow::Context;
use minimesh_proto::v1::ClusterStats;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

/// The simulated Envoy `i`: subscribes, ACKs, records when the number of
/// endpoints it holds changed, and reports load at the interval asked.
pub(super) async fn client(addr: SocketAddr, i: usize, shared: Arc<Shared>) -> anyhow::Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let node = EnvoyNode {
        id: format!("sim-envoy-{i}"),
        cluster: "sim".into(),
        ..Default::default()
    };
    let (lrs_tx, lrs_rx) = mpsc::channel(1);
    lrs_tx
        .send(EnvoyReport {
            node: Some(node.clone()),
            cluster_stats: vec![],
        })
        .await?;
    let mut lrs = LrsClient::new(channel.clone())
        .stream_load_stats(ReceiverStream::new(lrs_rx))
        .await?
        .into_inner();
    let first = lrs
        .message()
        .await?
        .context("the load-report stream ended before naming an interval")?;
    let millis = |d: Option<PbDuration>| {
        let d = d.unwrap_or_default();
        d.seconds.max(0) as u64 * 1000 + d.nanos.max(0) as u64 / 1_000_000
    };
    let mut reporting = Reporting::new(i, millis(first.load_reporting_interval), &shared);

    let (tx, rx) = mpsc::channel(8);
    tx.send(EnvoyRequest {
        node: Some(node),
        type_url: xds_v3::CLUSTER_TYPE.into(),
        ..Default::default()
    })
    .await?;
    let outbound = vec![xds_v3::OUTBOUND_ROUTE_CONFIG.to_string()];
    tx.send(EnvoyRequest {
        type_url: xds_v3::ROUTE_CONFIG_TYPE.into(),
        resource_names: outbound.clone(),
        ..Default::default()
    })
    .await?;
    let mut stream = AdsClient::new(channel)
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await?
        .into_inner();
    // Cluster names subscribed to for endpoints (sorted), and the types
    // received at least once (ready at three).
    let mut eds_names: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let mut endpoints: HashMap<String, Vec<(String, u32)>> = HashMap::new();
    let mut called: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            resp = stream.message() => {
                let Some(resp) = resp? else { return Ok(()) };
                let now = Instant::now();
                // A state-of-the-world ACK names the resources again (an
                // empty list would be a wildcard).
                let names = match resp.type_url.as_str() {
                    xds_v3::ENDPOINTS_TYPE => eds_names.clone(),
                    xds_v3::ROUTE_CONFIG_TYPE => outbound.clone(),
                    _ => vec![],
                };
                tx.send(EnvoyRequest {
                    version_info: resp.version_info.clone(),
                    type_url: resp.type_url.clone(),
                    response_nonce: resp.nonce.clone(),
                    resource_names: names,
                    ..Default::default()
                })
                .await?;
                match resp.type_url.as_str() {
                    xds_v3::CLUSTER_TYPE => {
                        let mut names: Vec<String> = resp
                            .resources
                            .iter()
                            .filter_map(|a| {
                                envoy_types::pb::envoy::config::cluster::v3::Cluster::decode(a.value.as_slice())
                                    .ok()
                                    .map(|c| c.name)
                            })
                            .collect();
                        names.sort();
                        if names != eds_names {
                            eds_names = names;
                            tx.send(EnvoyRequest {
                                type_url: xds_v3::ENDPOINTS_TYPE.into(),
                                resource_names: eds_names.clone(),
                                ..Default::default()
                            })
                            .await?;
                        }
                    }
                    xds_v3::ENDPOINTS_TYPE => {
                        let mut bytes = 0;
                        let mut got = Vec::new();
                        for a in &resp.resources {
                            bytes += a.value.len() as u64;
                            let cla = EnvoyCla::decode(a.value.as_slice())?;
                            got.push((cla.cluster_name.clone(), flatten(&cla)));
                        }
                        Held { i, endpoints: &mut endpoints, called: &mut called }
                            .received(&shared, got, bytes, now);
                    }
                    _ => {}
                }
                if !seen.contains(&resp.type_url) {
                    seen.push(resp.type_url.clone());
                    if seen.len() == 3 {
                        shared.ready.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            msg = lrs.message() => match msg? {
                Some(m) => reporting.set_interval(millis(m.load_reporting_interval), &shared),
                None => return Ok(()),
            },
            _ = reporting.tick.tick() => {
                if let Some(reports) = reporting.reports(&called, &endpoints) {
                    let interval = reporting.interval;
                    let cluster_stats = reports.into_iter().map(|c| as_envoys(c, interval)).collect();
                    lrs_tx.send(EnvoyReport { node: None, cluster_stats }).await?;
                    shared.reports.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Every endpoint of an assignment, whatever its locality: (`ip:port`, weight).
fn flatten(cla: &EnvoyCla) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for l in &cla.endpoints {
        for e in &l.lb_endpoints {
            let Some(HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                continue;
            };
            let Some(Address {
                address: Some(address::Address::SocketAddress(s)),
            }) = &ep.address
            else {
                continue;
            };
            let Some(PortSpecifier::PortValue(port)) = s.port_specifier else {
                continue;
            };
            let weight = e
                .load_balancing_weight
                .as_ref()
                .map_or(1, |w| w.value.max(1));
            out.push((format!("{}:{port}", s.address), weight));
        }
    }
    out
}

/// A report as Envoy sends it: per endpoint, counts only.
fn as_envoys(c: ClusterStats, interval: Duration) -> EnvoyClusterStats {
    let upstream_endpoint_stats = c
        .endpoint_stats
        .into_iter()
        .map(|e| {
            let (ip, port) = e
                .address
                .rsplit_once(':')
                .unwrap_or((e.address.as_str(), "0"));
            UpstreamEndpointStats {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: ip.to_string(),
                        port_specifier: Some(PortSpecifier::PortValue(port.parse().unwrap_or(0))),
                        ..Default::default()
                    })),
                }),
                total_issued_requests: e.requests_issued,
                total_successful_requests: e.requests_succeeded,
                total_error_requests: e.requests_failed,
                total_requests_in_progress: e.requests_in_progress,
                ..Default::default()
            }
        })
        .collect();
    EnvoyClusterStats {
        cluster_name: c.cluster_name,
        upstream_locality_stats: vec![UpstreamLocalityStats {
            upstream_endpoint_stats,
            ..Default::default()
        }],
        load_report_interval: Some(PbDuration {
            seconds: interval.as_secs() as i64,
            nanos: interval.subsec_nanos() as i32,
        }),
        ..Default::default()
    }
}
