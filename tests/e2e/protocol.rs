//! Discovery protocol semantics, spoken by a raw gRPC client.

use std::time::Duration;

use minimesh_proto::prost::Message;
use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, DeltaDiscoveryRequest, DeltaDiscoveryResponse,
    DiscoveryRequest, DiscoveryResponse, ErrorDetail, LbPolicy, Node,
};
use minimesh_proto::{CLUSTER_TYPE, ENDPOINTS_TYPE};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::harness::*;

fn node() -> Option<Node> {
    Some(Node {
        id: "raw-client.default".into(),
        workload: "raw-client".into(),
        namespace: "default".into(),
        ..Default::default()
    })
}

async fn client(net: &Net) -> AggregatedDiscoveryServiceClient<tonic::transport::Channel> {
    AggregatedDiscoveryServiceClient::connect(format!("http://{}", net.cp_xds()))
        .await
        .expect("connect")
}

/// The next message of `s`, within 5 s.
pub(crate) async fn next<T>(s: &mut Streaming<T>) -> T {
    tokio::time::timeout(Duration::from_secs(5), s.message())
        .await
        .expect("response within 5s")
        .expect("stream ok")
        .expect("not closed")
}

async fn nothing<T: std::fmt::Debug>(s: &mut Streaming<T>, wait: Duration) {
    if let Ok(m) = tokio::time::timeout(wait, s.message()).await {
        panic!("expected no response, got {m:?}");
    }
}

fn policies(resp: &DiscoveryResponse) -> Vec<i32> {
    resp.resources
        .iter()
        .map(|a| Cluster::decode(a.value.as_slice()).expect("cluster").policy)
        .collect()
}

/// NACKs `resp` ("test says no"), keeping the version of `good`.
async fn nack(
    tx: &mpsc::Sender<DiscoveryRequest>,
    good: &DiscoveryResponse,
    resp: &DiscoveryResponse,
) {
    tx.send(DiscoveryRequest {
        version_info: good.version_info.clone(),
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        error_detail: Some(ErrorDetail {
            code: 3,
            message: "test says no".into(),
        }),
        ..Default::default()
    })
    .await
    .expect("nack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_of_the_world_ack_nack_and_new_versions() {
    let net = Net::new(31);
    net.service("backend", &[1, 2]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let mut c = client(&net).await;
    let (tx, rx) = mpsc::channel(8);
    tx.send(DiscoveryRequest {
        node: node(),
        type_url: CLUSTER_TYPE.into(),
        ..Default::default()
    })
    .await
    .expect("send");
    let mut s = c
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let first = next(&mut s).await;
    assert_eq!(first.type_url, CLUSTER_TYPE);
    assert_eq!(policies(&first), vec![LbPolicy::RoundRobin as i32]);
    assert!(!first.nonce.is_empty() && !first.version_info.is_empty());

    // ACK: recorded in proxy-status.
    tx.send(DiscoveryRequest {
        version_info: first.version_info.clone(),
        type_url: CLUSTER_TYPE.into(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    })
    .await
    .expect("ack");
    let ps = wait_cp_json(&net, "/debug/proxies", |ps| {
        ps[0]["types"]["Cluster"]["acked"].is_string()
    })
    .await;
    assert_eq!(ps[0]["id"], "raw-client.default");
    assert_eq!(
        ps[0]["types"]["Cluster"]["acked"],
        first.version_info.as_str()
    );

    // A change gets a new version; NACK it.
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    let second = next(&mut s).await;
    assert_ne!(second.version_info, first.version_info);
    assert_eq!(policies(&second), vec![LbPolicy::Random as i32]);
    nack(&tx, &first, &second).await;
    // The NACKed version is not sent again.
    nothing(&mut s, Duration::from_millis(600)).await;
    let ps = get_json(net.cp_admin(), "/debug/proxies").await;
    assert_eq!(
        ps[0]["types"]["Cluster"]["last_nack"]["message"],
        "test says no"
    );
    assert_eq!(
        ps[0]["types"]["Cluster"]["last_nack"]["version"],
        second.version_info.as_str()
    );
    assert_eq!(
        ps[0]["types"]["Cluster"]["acked"],
        first.version_info.as_str()
    );

    // A stale nonce is ignored.
    tx.send(DiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        response_nonce: first.nonce.clone(),
        resource_names: vec!["x".into()],
        ..Default::default()
    })
    .await
    .expect("stale");
    nothing(&mut s, Duration::from_millis(300)).await;

    // The next change gets a new version.
    net.rule("rule.yaml", "backend", "simple: LEAST_REQUEST");
    let third = next(&mut s).await;
    assert_ne!(third.version_info, second.version_info);
    assert_eq!(policies(&third), vec![LbPolicy::LeastRequest as i32]);
    drop(tx);

    // A reconnecting client is resynced with the current state.
    let (tx2, rx2) = mpsc::channel(8);
    tx2.send(DiscoveryRequest {
        node: node(),
        version_info: first.version_info.clone(),
        type_url: CLUSTER_TYPE.into(),
        ..Default::default()
    })
    .await
    .expect("send");
    let mut s2 = c
        .stream_aggregated_resources(ReceiverStream::new(rx2))
        .await
        .expect("stream")
        .into_inner();
    let resync = next(&mut s2).await;
    assert_eq!(resync.version_info, third.version_info);
    assert_eq!(policies(&resync), vec![LbPolicy::LeastRequest as i32]);
    // The first stream ended when its client closed it: one stream left.
    connected_becomes(&net, 1).await;

    // An unknown type ends the stream with the reason; none is left.
    tx2.send(DiscoveryRequest {
        type_url: "type.googleapis.com/minimesh.v1.Nope".into(),
        ..Default::default()
    })
    .await
    .expect("send");
    let err = tokio::time::timeout(Duration::from_secs(5), s2.message())
        .await
        .expect("an answer within 5s")
        .expect_err("the stream fails");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        err.message(),
        "unknown type_url \"type.googleapis.com/minimesh.v1.Nope\"; this control plane serves type.googleapis.com/minimesh.v1.Cluster, type.googleapis.com/minimesh.v1.ClusterLoadAssignment, type.googleapis.com/minimesh.v1.Route, type.googleapis.com/minimesh.v1.PeerAuthentication, type.googleapis.com/minimesh.v1.Authorization"
    );
    connected_becomes(&net, 0).await;

    // A service the control plane does not have: UNIMPLEMENTED, with the path.
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", net.cp_xds()))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let err = grpc
        .unary::<Node, Node, _>(
            tonic::Request::new(Node::default()),
            http::uri::PathAndQuery::from_static("/minimesh.v1.Nope/Call"),
            minimesh_proto::Codec::default(),
        )
        .await
        .expect_err("no such service");
    assert_eq!(err.code(), tonic::Code::Unimplemented);
    assert_eq!(err.message(), "no service serves /minimesh.v1.Nope/Call");

    // A request over 4 MiB ends its stream with the size and the limit,
    // before the control plane holds it.
    let huge = DiscoveryRequest {
        node: node(),
        type_url: CLUSTER_TYPE.into(),
        resource_names: (0..50_000).map(|i| format!("{i:0>100}")).collect(),
        ..Default::default()
    };
    let len = minimesh_proto::prost::Message::encoded_len(&huge);
    let (tx3, rx3) = mpsc::channel(1);
    tx3.send(huge).await.expect("send");
    let mut s3 = c
        .stream_aggregated_resources(ReceiverStream::new(rx3))
        .await
        .expect("stream")
        .into_inner();
    let err = tokio::time::timeout(Duration::from_secs(5), s3.message())
        .await
        .expect("an answer within 5s")
        .expect_err("the stream fails");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        err.message(),
        format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: 4194304 bytes"
        )
    );
    connected_becomes(&net, 0).await;
}

/// (cluster, endpoints) of each assignment in an endpoints response.
fn assignments(resp: &DiscoveryResponse) -> Vec<(String, usize)> {
    resp.resources
        .iter()
        .map(|a| {
            let c = ClusterLoadAssignment::decode(a.value.as_slice()).expect("assignment");
            (
                c.cluster_name.replace(".default.svc.cluster.local:80", ""),
                c.endpoints.len(),
            )
        })
        .collect()
}

/// An endpoints stream; the node announces partial endpoints if `partial`.
async fn endpoints_stream(
    net: &Net,
    partial: bool,
) -> (mpsc::Sender<DiscoveryRequest>, Streaming<DiscoveryResponse>) {
    let (tx, rx) = mpsc::channel(8);
    let mut node = node().expect("node");
    if partial {
        node.client_features = vec![minimesh_proto::PARTIAL_ENDPOINTS.into()];
    }
    tx.send(DiscoveryRequest {
        node: Some(node),
        type_url: ENDPOINTS_TYPE.into(),
        ..Default::default()
    })
    .await
    .expect("send");
    let s = client(net)
        .await
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    (tx, s)
}

/// Waits until the control plane has taken `acks` ACKs and `nacks` NACKs
/// of endpoints `version` (from /debug/proxies), so that what a test
/// changes next reaches streams that answered.
async fn answered(net: &Net, version: &str, acks: usize, nacks: usize) {
    wait_cp_json(net, "/debug/proxies", |ps| {
        let types = ps
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| &p["types"]["ClusterLoadAssignment"]);
        let acked = types.clone().filter(|t| t["acked"] == version).count();
        let nacked = types
            .filter(|t| t["last_nack"]["version"] == version)
            .count();
        acked >= acks && nacked >= nacks
    })
    .await;
}

async fn ack(tx: &mpsc::Sender<DiscoveryRequest>, resp: &DiscoveryResponse) {
    tx.send(DiscoveryRequest {
        version_info: resp.version_info.clone(),
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        ..Default::default()
    })
    .await
    .expect("ack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_responses_carry_only_what_changed_to_a_client_that_keeps_the_rest() {
    let net = Net::new(33);
    net.service("a", &[1, 2]);
    net.service("b", &[3]);
    net.service("c", &[4]);
    let _cp = net.control_plane().await;
    let (ptx, mut partial) = endpoints_stream(&net, true).await;
    let (ftx, mut full) = endpoints_stream(&net, false).await;
    let all = vec![("a".to_string(), 2), ("b".into(), 1), ("c".into(), 1)];
    // The first response is the whole set, for both.
    let p1 = next(&mut partial).await;
    let f1 = next(&mut full).await;
    assert_eq!(assignments(&p1), all);
    assert_eq!(assignments(&f1), all);
    ack(&ptx, &p1).await;
    ack(&ftx, &f1).await;
    answered(&net, &p1.version_info, 2, 0).await;

    // One service changes: the partial client gets its assignment alone,
    // under the same version as the whole set.
    net.service("b", &[3, 5]);
    let p2 = next(&mut partial).await;
    let f2 = next(&mut full).await;
    assert_eq!(assignments(&p2), vec![("b".to_string(), 2)]);
    assert_eq!(
        assignments(&f2),
        vec![("a".to_string(), 2), ("b".into(), 2), ("c".into(), 1)]
    );
    assert_eq!(p2.version_info, f2.version_info);
    // NACKed: the next response carries that change again, with the new one.
    nack(&ptx, &p1, &p2).await;
    ack(&ftx, &f2).await;
    answered(&net, &p2.version_info, 1, 1).await;
    net.service("c", &[4, 6]);
    let p3 = next(&mut partial).await;
    assert_eq!(
        assignments(&p3),
        vec![("b".to_string(), 2), ("c".into(), 2)]
    );
    assert_eq!(assignments(&next(&mut full).await).len(), 3);
    ack(&ptx, &p3).await;
    answered(&net, &p3.version_info, 1, 0).await;

    // A service goes: its cluster goes, and the client drops the assignment
    // with it; the endpoints response names nothing new.
    net.remove("svc-c.yaml");
    let p4 = next(&mut partial).await;
    assert_eq!(assignments(&p4), vec![]);
    assert_ne!(p4.version_info, p3.version_info);
    ack(&ptx, &p4).await;

    // A reconnecting client gets the whole set again.
    drop((ptx, partial));
    let (_ptx, mut again) = endpoints_stream(&net, true).await;
    let p5 = next(&mut again).await;
    assert_eq!(
        assignments(&p5),
        vec![("a".to_string(), 2), ("b".into(), 2)]
    );
    assert_eq!(p5.version_info, p4.version_info);
}

fn names(r: &DeltaDiscoveryResponse) -> Vec<String> {
    r.resources.iter().map(|r| r.name.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_subscribe_unsubscribe_removal_and_reconnect() {
    let net = Net::new(32);
    net.service("alpha", &[1]);
    net.service("beta", &[2]);
    let _cp = net.control_plane().await;
    let alpha = "alpha.default.svc.cluster.local:80".to_string();
    let beta = "beta.default.svc.cluster.local:80".to_string();
    let mut c = client(&net).await;
    let (tx, rx) = mpsc::channel(8);
    tx.send(DeltaDiscoveryRequest {
        node: node(),
        type_url: ENDPOINTS_TYPE.into(),
        resource_names_subscribe: vec![alpha.clone()],
        ..Default::default()
    })
    .await
    .expect("send");
    let mut s = c
        .delta_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let r1 = next(&mut s).await;
    assert_eq!(names(&r1), vec![alpha.clone()]);
    let ack = |nonce: String| DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE.into(),
        response_nonce: nonce,
        ..Default::default()
    };
    tx.send(ack(r1.nonce.clone())).await.expect("ack");

    // A change to an unsubscribed resource sends nothing.
    net.service("beta", &[2, 3]);
    nothing(&mut s, Duration::from_millis(500)).await;

    // Subscribe to beta: only beta arrives.
    tx.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE.into(),
        resource_names_subscribe: vec![beta.clone()],
        ..Default::default()
    })
    .await
    .expect("sub");
    let r2 = next(&mut s).await;
    assert_eq!(names(&r2), vec![beta.clone()]);
    assert!(r2.removed_resources.is_empty());
    tx.send(ack(r2.nonce.clone())).await.expect("ack");

    // Only the changed resource is sent.
    net.service("alpha", &[1, 4]);
    let r3 = next(&mut s).await;
    assert_eq!(names(&r3), vec![alpha.clone()]);
    tx.send(ack(r3.nonce.clone())).await.expect("ack");

    // Deleting the service removes it.
    net.remove("svc-beta.yaml");
    let r4 = next(&mut s).await;
    assert!(r4.resources.is_empty());
    assert_eq!(r4.removed_resources, vec![beta.clone()]);
    tx.send(ack(r4.nonce.clone())).await.expect("ack");

    // Unsubscribe alpha: changes to it no longer arrive.
    tx.send(DeltaDiscoveryRequest {
        type_url: ENDPOINTS_TYPE.into(),
        resource_names_unsubscribe: vec![alpha.clone()],
        ..Default::default()
    })
    .await
    .expect("unsub");
    net.service("alpha", &[1]);
    nothing(&mut s, Duration::from_millis(500)).await;
    drop(tx);

    // Reconnect with what the client has: only what differs is sent.
    let have = r3.resources[0].version.clone();
    let (tx2, rx2) = mpsc::channel(8);
    tx2.send(DeltaDiscoveryRequest {
        node: node(),
        type_url: ENDPOINTS_TYPE.into(),
        resource_names_subscribe: vec!["*".into()],
        initial_resource_versions: [(alpha.clone(), have), (beta.clone(), "gone".into())]
            .into_iter()
            .collect(),
        ..Default::default()
    })
    .await
    .expect("send");
    let mut s2 = c
        .delta_aggregated_resources(ReceiverStream::new(rx2))
        .await
        .expect("stream")
        .into_inner();
    let r5 = next(&mut s2).await;
    // alpha changed since (back to one endpoint), beta is gone.
    assert_eq!(names(&r5), vec![alpha.clone()]);
    assert_eq!(r5.removed_resources, vec![beta]);

    // Subscriptions are kept even to names that do not exist, so a stream
    // may hold only so many: past the limit it fails with the reason.
    for batch in 0..2 {
        let names: Vec<String> = (0..60_000)
            .map(|i| format!("svc-{batch}-{i}.default.svc.cluster.local:80"))
            .collect();
        tx2.send(DeltaDiscoveryRequest {
            type_url: ENDPOINTS_TYPE.into(),
            resource_names_subscribe: names,
            ..Default::default()
        })
        .await
        .expect("sub");
    }
    let err = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Err(e) = s2.message().await {
                return e;
            }
        }
    })
    .await
    .expect("an answer within 10s");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        err.message(),
        format!("more than 100000 resource names of type {ENDPOINTS_TYPE} on one stream")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_over_the_sidecars_size_limit_is_named_with_the_flag_to_raise() {
    let net = Net::new(96);
    // 60 endpoints: an endpoints response of about 2.3 KB.
    let hosts: Vec<u8> = (1..=60).collect();
    net.service("backend", &hosts);
    let _cp = net.control_plane().await;
    let args: Vec<String> = [
        "--xds-addr",
        &format!("http://{}", net.cp_xds()),
        "--workload",
        "client-100",
        "--namespace",
        NS,
        "--outbound",
        &net.addr(100, 15001).to_string(),
        "--admin",
        &net.addr(100, 15000).to_string(),
        "--xds-max-message-size",
        "1024",
    ]
    .map(String::from)
    .to_vec();
    let small = net.spawn("sidecar-100", "sidecar", &args, &[]);
    let want = "a discovery response is larger than --xds-max-message-size; raise it (MINIMESH_XDS_MAX_MESSAGE_SIZE); keeping the last config";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(&small.log).unwrap_or_default();
        if log.contains(want) {
            assert!(log.contains("the limit is: 1024 bytes"), "{log}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Without every type it never became ready; with the default limit the
    // same config is served.
    let (status, _, _) = get(net.addr(100, 15000), "localhost", "/ready")
        .await
        .expect("admin");
    assert_ne!(status, 200);
    let _default = net.sidecar(101, &[]).await;
    let config = get_json(net.addr(101, 15000), "/debug/config")
        .await
        .to_string();
    let served = hosts
        .iter()
        .filter(|h| config.contains(&format!("\"{}:9090\"", net.ip(**h))))
        .count();
    assert_eq!(served, hosts.len(), "{config}");
}
