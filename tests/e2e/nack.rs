//! The sidecar against a scripted control plane: a resource it cannot use is
//! NACKed with the reason and the last good config stays.

use std::time::Duration;

use minimesh_proto::v1::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, DeltaDiscoveryRequest, DeltaDiscoveryResponse,
    DiscoveryRequest, DiscoveryResponse, Endpoint, HealthStatus, LbPolicy, PortCluster, Route,
};
use minimesh_proto::{to_any, AUTHZ_TYPE, CLUSTER_TYPE, ENDPOINTS_TYPE, ROUTE_TYPE};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::harness::*;

const CLUSTER: &str = "backend.default.svc.cluster.local:80";

struct Scripted {
    backend: String,
    nacks: mpsc::Sender<String>,
}

type Out<T> = std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<T, Status>> + Send>>;

fn cluster(policy: i32) -> Cluster {
    Cluster {
        name: CLUSTER.into(),
        service: "backend".into(),
        namespace: "default".into(),
        port: 80,
        policy,
        retry_attempts: 2,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Scripted {
    type StreamAggregatedResourcesStream = Out<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = Out<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        req: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let backend = self.backend.clone();
        let nacks = self.nacks.clone();
        tokio::spawn(async move {
            let resp = |t: &str, v: &str, any| {
                Ok(DiscoveryResponse {
                    version_info: v.into(),
                    resources: vec![any],
                    type_url: t.into(),
                    nonce: v.into(),
                })
            };
            let mut sent_bad = false;
            let mut acked = 0;
            while let Ok(Some(r)) = inbound.message().await {
                match (r.type_url.as_str(), r.response_nonce.is_empty()) {
                    (CLUSTER_TYPE, true) => {
                        let _ = tx
                            .send(resp(
                                CLUSTER_TYPE,
                                "1",
                                to_any(CLUSTER_TYPE, &cluster(LbPolicy::RoundRobin as i32)),
                            ))
                            .await;
                    }
                    (ENDPOINTS_TYPE, true) => {
                        let cla = ClusterLoadAssignment {
                            cluster_name: CLUSTER.into(),
                            endpoints: vec![Endpoint {
                                address: backend.clone(),
                                weight: 1,
                                health: HealthStatus::Healthy as i32,
                                ..Default::default()
                            }],
                        };
                        let _ = tx
                            .send(resp(ENDPOINTS_TYPE, "1", to_any(ENDPOINTS_TYPE, &cla)))
                            .await;
                    }
                    (ROUTE_TYPE, true) => {
                        let route = Route {
                            service: "backend".into(),
                            namespace: "default".into(),
                            ports: vec![PortCluster {
                                port: 80,
                                cluster: CLUSTER.into(),
                                ..Default::default()
                            }],
                            default_port: 80,
                            ..Default::default()
                        };
                        let _ = tx
                            .send(resp(ROUTE_TYPE, "1", to_any(ROUTE_TYPE, &route)))
                            .await;
                    }
                    // No AuthorizationPolicy: an empty list (what the
                    // sidecar waits for before it is ready).
                    (AUTHZ_TYPE, true) => {
                        let _ = tx
                            .send(Ok(DiscoveryResponse {
                                version_info: "1".into(),
                                resources: vec![],
                                type_url: AUTHZ_TYPE.into(),
                                nonce: "1".into(),
                            }))
                            .await;
                    }
                    (_, false) => {
                        if let Some(e) = r.error_detail {
                            let _ = nacks
                                .send(format!("{} {} {}", r.type_url, r.version_info, e.message))
                                .await;
                        } else {
                            acked += 1;
                        }
                        if acked == 4 && !sent_bad {
                            sent_bad = true;
                            // A policy number this sidecar does not know (a newer control plane).
                            let _ = tx
                                .send(resp(CLUSTER_TYPE, "2", to_any(CLUSTER_TYPE, &cluster(99))))
                                .await;
                        }
                    }
                    _ => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("not scripted"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_nacks_what_it_cannot_use_and_keeps_the_last_good_config() {
    let net = Net::new(26);
    let _b1 = net.backend(1, &[]).await;
    let (nacks_tx, mut nacks) = mpsc::channel(4);
    let listener = tokio::net::TcpListener::bind(net.cp_xds())
        .await
        .expect("bind");
    let svc = Scripted {
        backend: net.addr(1, 9090).to_string(),
        nacks: nacks_tx,
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AggregatedDiscoveryServiceServer::new(svc))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let _sc = net.sidecar(100, &[]).await;
    let nack = tokio::time::timeout(Duration::from_secs(5), nacks.recv())
        .await
        .expect("a NACK within 5 s")
        .expect("nack");
    assert_eq!(
        nack,
        format!(
            "{CLUSTER_TYPE} 1 cluster {CLUSTER}: unknown policy number 99 (a newer control plane?)"
        )
    );
    let v = get_json(net.addr(100, 15000), "/debug/config").await;
    assert_eq!(policy_of(&v, "backend"), "ROUND_ROBIN");
    let (status, _, _) = get(net.addr(100, 15001), "backend", "/")
        .await
        .expect("request");
    assert_eq!(status, 200);
}
