//! `envoy.service.load_stats.v3.LoadReportingService`: Envoy's and gRPC's
//! load reports, converted to minimesh's and counted by the same aggregator
//! as the sidecars' (so they show in `minimesh top` and feed LOAD_AWARE).
//!
//! Two differences from a sidecar's report, both handled here:
//!
//! - **Granularity.** Envoy reports each endpoint when asked
//!   (`report_endpoint_granularity`, which this server sets); gRPC reports
//!   per locality only. [`super::endpoints`] puts each endpoint of a
//!   weighted or LOAD_AWARE cluster in a locality of its own whose
//!   `sub_zone` is its address, so such a locality's load is that
//!   endpoint's. A locality of several endpoints (equal weights under gRPC)
//!   cannot be split among them and is not counted per endpoint.
//! - **Latency.** Neither reports latency. An endpoint's mean latency is
//!   estimated by Little's law: requests in flight at the end of the
//!   interval (Envoy's and gRPC's `total_requests_in_progress`) times the
//!   interval is the time requests spent in it, over the requests that
//!   completed. That is what LOAD_AWARE weighs.

use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::core::v3::{address, Address};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterStats;
use envoy_types::pb::envoy::service::load_stats::v3::{LoadStatsRequest, LoadStatsResponse};
use futures_util::{Stream, StreamExt};
use minimesh_proto::v1;
use tonic::Status;

use super::LoadReports;
use crate::discovery::session::BoxStream;
use crate::xds_v3::{millis, to_millis, wire};

/// A load-report stream reading the reports of `inbound`. Mounted on the
/// discovery port by [`super::server`].
pub fn stream<I>(
    reports: &LoadReports,
    inbound: I,
    caller: Option<crate::ca::streams::Authenticated>,
) -> BoxStream<LoadStatsResponse>
where
    I: Stream<Item = Result<LoadStatsRequest, Status>> + Send + Unpin + 'static,
{
    let reporter = caller
        .as_ref()
        .map(|c| (c.who.reporter(), c.who.namespace.clone()));
    let inbound = crate::ca::streams::check(caller, inbound.map(|r| r.map(report)), "load_reports");
    Box::pin(reports.open(inbound, reporter).map(|r| {
        r.map(|r| LoadStatsResponse {
            clusters: r.clusters,
            send_all_clusters: r.send_all_clusters,
            load_reporting_interval: Some(millis(r.load_reporting_interval_ms)),
            report_endpoint_granularity: true,
        })
    }))
}

/// An Envoy or gRPC load report as minimesh's.
pub fn report(r: LoadStatsRequest) -> v1::LoadStatsRequest {
    v1::LoadStatsRequest {
        node: r.node.as_ref().map(wire::node),
        cluster_stats: r.cluster_stats.into_iter().map(cluster).collect(),
    }
}

fn cluster(c: ClusterStats) -> v1::ClusterStats {
    let interval_ms = c.load_report_interval.as_ref().map_or(0, to_millis);
    let mut endpoint_stats = Vec::new();
    for l in c.upstream_locality_stats {
        if !l.upstream_endpoint_stats.is_empty() {
            for e in l.upstream_endpoint_stats {
                let Some(address) = e.address.as_ref().and_then(address_of) else {
                    continue;
                };
                endpoint_stats.push(endpoint(
                    address,
                    Counts {
                        issued: e.total_issued_requests,
                        succeeded: e.total_successful_requests,
                        failed: e.total_error_requests,
                        in_progress: e.total_requests_in_progress,
                    },
                    interval_ms,
                ));
            }
            continue;
        }
        let sub_zone = l.locality.map(|l| l.sub_zone).unwrap_or_default();
        if let Ok(addr) = sub_zone.parse::<SocketAddr>() {
            endpoint_stats.push(endpoint(
                addr.to_string(),
                Counts {
                    issued: l.total_issued_requests,
                    succeeded: l.total_successful_requests,
                    failed: l.total_error_requests,
                    in_progress: l.total_requests_in_progress,
                },
                interval_ms,
            ));
        }
    }
    v1::ClusterStats {
        cluster_name: c.cluster_name,
        endpoint_stats,
        load_report_interval_ms: interval_ms,
    }
}

struct Counts {
    issued: u64,
    succeeded: u64,
    failed: u64,
    in_progress: u64,
}

fn endpoint(address: String, c: Counts, interval_ms: u64) -> v1::EndpointStats {
    v1::EndpointStats {
        address,
        requests_issued: c.issued,
        requests_succeeded: c.succeeded,
        requests_failed: c.failed,
        requests_in_progress: c.in_progress,
        // Little's law (see the module doc).
        latency_sum_ms: c.in_progress as f64 * interval_ms as f64,
        latency_count: c.succeeded.saturating_add(c.failed),
        ..Default::default()
    }
}

/// `ip:port` of a socket address, as minimesh names endpoints; None for
/// anything else (a name, a port past 65535: no endpoint of the mesh).
fn address_of(a: &Address) -> Option<String> {
    match a.address.as_ref()? {
        address::Address::SocketAddress(s) => {
            let port = match s.port_specifier {
                Some(envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(p)) => p,
                _ => return None,
            };
            let ip: IpAddr = s.address.parse().ok()?;
            Some(SocketAddr::new(ip, u16::try_from(port).ok()?).to_string())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Locality;
    use envoy_types::pb::envoy::config::endpoint::v3::UpstreamLocalityStats;

    fn locality(
        sub_zone: &str,
        issued: u64,
        ok: u64,
        err: u64,
        in_progress: u64,
    ) -> UpstreamLocalityStats {
        UpstreamLocalityStats {
            locality: Some(Locality {
                sub_zone: sub_zone.into(),
                ..Default::default()
            }),
            total_issued_requests: issued,
            total_successful_requests: ok,
            total_error_requests: err,
            total_requests_in_progress: in_progress,
            ..Default::default()
        }
    }

    #[test]
    fn a_grpc_report_per_locality_is_a_report_per_endpoint() {
        let r = report(LoadStatsRequest {
            node: None,
            cluster_stats: vec![ClusterStats {
                cluster_name: "echo.default.svc.cluster.local:50051".into(),
                upstream_locality_stats: vec![
                    locality("127.0.0.1:7001", 100, 98, 2, 5),
                    // Several endpoints share it: not one endpoint's load.
                    locality("", 50, 50, 0, 0),
                ],
                load_report_interval: Some(millis(1000)),
                ..Default::default()
            }],
        });
        let c = &r.cluster_stats[0];
        assert_eq!(c.load_report_interval_ms, 1000);
        assert_eq!(c.endpoint_stats.len(), 1);
        let e = &c.endpoint_stats[0];
        assert_eq!(e.address, "127.0.0.1:7001");
        assert_eq!(
            (e.requests_issued, e.requests_succeeded, e.requests_failed),
            (100, 98, 2)
        );
        // 5 in flight over 1 s, 100 completed: 50 ms each on average.
        assert_eq!(e.latency_sum_ms / e.latency_count as f64, 50.0);
    }
}
