//! The discovery session rules with no transport, on paused time: requests
//! go in through a channel, responses come out of the session's stream, and
//! "nothing is sent" is checked by letting ten seconds of paused time pass,
//! which costs nothing and cannot be flaky.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use minimesh_proto::prost::Message;
use minimesh_proto::v1::{
    Cluster, DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    ErrorDetail, LbPolicy, Node,
};
use minimesh_proto::CLUSTER_TYPE;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::Status;

use super::metrics::Metrics;
use super::registry::Registry;
use super::server::Discovery;
use super::session::BoxStream;
use crate::cache::Cache;
use crate::translate::Resources;

/// Clusters `names`, each with `policy`.
fn clusters(policy: LbPolicy, names: &[&str]) -> Resources {
    let mut r = Resources::default();
    for n in names {
        r.clusters.insert(
            n.to_string(),
            Cluster {
                name: n.to_string(),
                policy: policy as i32,
                ..Default::default()
            },
        );
    }
    r
}

struct Mesh {
    cache: Cache,
    proxies: Arc<Registry>,
    discovery: Discovery,
}

fn mesh(first: Resources) -> Mesh {
    let cache = Cache::default();
    cache.update(&first);
    let proxies = Arc::new(Registry::default());
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let discovery = Discovery::new(cache.subscribe(), proxies.clone(), metrics);
    Mesh {
        cache,
        proxies,
        discovery,
    }
}

type Requests<T> = mpsc::UnboundedSender<Result<T, Status>>;

fn sotw(m: &Mesh) -> (Requests<DiscoveryRequest>, BoxStream<DiscoveryResponse>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let rx = UnboundedReceiverStream::new(rx);
    (tx, m.discovery.sotw(rx))
}

fn delta(
    m: &Mesh,
) -> (
    Requests<DeltaDiscoveryRequest>,
    BoxStream<DeltaDiscoveryResponse>,
) {
    let (tx, rx) = mpsc::unbounded_channel();
    let rx = UnboundedReceiverStream::new(rx);
    (tx, m.discovery.delta(rx))
}

fn node() -> Option<Node> {
    Some(Node {
        id: "a.default".into(),
        ..Default::default()
    })
}

async fn next<T>(s: &mut BoxStream<T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("a response within 10 s")
        .expect("stream open")
        .expect("no error")
}

async fn nothing<T: std::fmt::Debug>(s: &mut BoxStream<T>) {
    if let Ok(r) = tokio::time::timeout(Duration::from_secs(10), s.next()).await {
        panic!("expected nothing, got {r:?}");
    }
}

fn policies(r: &DiscoveryResponse) -> Vec<i32> {
    r.resources
        .iter()
        .map(|a| Cluster::decode(a.value.as_slice()).expect("cluster").policy)
        .collect()
}

/// The proxy-status entry of the one connected stream, for clusters.
fn status(m: &Mesh) -> serde_json::Value {
    let list = serde_json::to_value(m.proxies.list()).expect("json");
    list[0]["types"]["Cluster"].clone()
}

fn reply(
    r: &DiscoveryResponse,
    version: &str,
    error: Option<&str>,
) -> Result<DiscoveryRequest, Status> {
    Ok(DiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        version_info: version.into(),
        response_nonce: r.nonce.clone(),
        error_detail: error.map(|e| ErrorDetail {
            code: 3,
            message: e.into(),
        }),
        ..Default::default()
    })
}

#[tokio::test(start_paused = true)]
async fn sotw_ack_nack_no_resend_after_nack_and_stale_nonces() {
    let m = mesh(clusters(LbPolicy::RoundRobin, &["a"]));
    let (tx, mut s) = sotw(&m);
    tx.send(Ok(DiscoveryRequest {
        node: node(),
        type_url: CLUSTER_TYPE.into(),
        ..Default::default()
    }))
    .expect("send");
    let first = next(&mut s).await;
    assert_eq!(policies(&first), vec![LbPolicy::RoundRobin as i32]);
    assert!(!first.nonce.is_empty() && !first.version_info.is_empty());

    // An ACK is recorded and answered with nothing.
    tx.send(reply(&first, &first.version_info, None))
        .expect("ack");
    nothing(&mut s).await;
    assert_eq!(status(&m)["acked"], first.version_info.as_str());

    // A change is pushed with a new version and nonce; a NACK of it keeps
    // the previous version, is recorded with its reason, and the rejected
    // version is not sent again.
    m.cache.update(&clusters(LbPolicy::Random, &["a"]));
    let second = next(&mut s).await;
    assert_eq!(policies(&second), vec![LbPolicy::Random as i32]);
    assert_ne!(second.version_info, first.version_info);
    assert_ne!(second.nonce, first.nonce);
    tx.send(reply(&second, &first.version_info, Some("no RANDOM here")))
        .expect("nack");
    nothing(&mut s).await;
    let st = status(&m);
    assert_eq!(st["acked"], first.version_info.as_str());
    assert_eq!(st["last_nack"]["version"], second.version_info.as_str());
    assert_eq!(st["last_nack"]["message"], "no RANDOM here");

    // A reply to an older response (a stale nonce) is ignored: not even
    // recorded as an ACK.
    tx.send(reply(&first, &second.version_info, None))
        .expect("stale");
    nothing(&mut s).await;
    assert_eq!(status(&m)["acked"], first.version_info.as_str());

    // The next change is a new version, and it is sent.
    m.cache.update(&clusters(LbPolicy::Maglev, &["a"]));
    let third = next(&mut s).await;
    assert_eq!(policies(&third), vec![LbPolicy::Maglev as i32]);
    tx.send(reply(&third, &third.version_info, None))
        .expect("ack");
    nothing(&mut s).await;
    assert_eq!(status(&m)["acked"], third.version_info.as_str());

    // An unknown type ends the stream with the reason.
    tx.send(Ok(DiscoveryRequest {
        type_url: "type.googleapis.com/minimesh.v1.Nope".into(),
        ..Default::default()
    }))
    .expect("send");
    let err = next_err(&mut s).await;
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(s.next().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn sotw_names_subscribe_to_what_they_name() {
    let m = mesh(clusters(LbPolicy::RoundRobin, &["a", "b"]));
    let (tx, mut s) = sotw(&m);
    tx.send(Ok(DiscoveryRequest {
        node: node(),
        type_url: CLUSTER_TYPE.into(),
        resource_names: vec!["b".into()],
        ..Default::default()
    }))
    .expect("send");
    let only_b = next(&mut s).await;
    assert_eq!(only_b.resources.len(), 1);
    // A state-of-the-world request names its whole subscription, the ACK
    // too (naming nothing would subscribe to everything).
    let mut ack = reply(&only_b, &only_b.version_info, None).expect("request");
    ack.resource_names = vec!["b".into()];
    tx.send(Ok(ack)).expect("ack");
    nothing(&mut s).await;
    // A change to a resource it did not name is not pushed.
    let mut changed = clusters(LbPolicy::RoundRobin, &["b"]);
    changed.clusters.insert(
        "a".into(),
        Cluster {
            name: "a".into(),
            policy: LbPolicy::Random as i32,
            ..Default::default()
        },
    );
    m.cache.update(&changed);
    nothing(&mut s).await;
}

fn subscribe(names: &[&str], unsubscribe: &[&str]) -> Result<DeltaDiscoveryRequest, Status> {
    Ok(DeltaDiscoveryRequest {
        node: node(),
        type_url: CLUSTER_TYPE.into(),
        resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    })
}

fn names(r: &DeltaDiscoveryResponse) -> Vec<&str> {
    r.resources.iter().map(|r| r.name.as_str()).collect()
}

fn delta_ack(r: &DeltaDiscoveryResponse) -> Result<DeltaDiscoveryRequest, Status> {
    Ok(DeltaDiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        response_nonce: r.nonce.clone(),
        ..Default::default()
    })
}

#[tokio::test(start_paused = true)]
async fn delta_subscribe_unsubscribe_and_removal() {
    let m = mesh(clusters(LbPolicy::RoundRobin, &["a", "b", "c"]));
    let (tx, mut s) = delta(&m);
    tx.send(subscribe(&["a"], &[])).expect("send");
    let first = next(&mut s).await;
    assert_eq!(names(&first), vec!["a"]);
    tx.send(delta_ack(&first)).expect("ack");
    nothing(&mut s).await;

    // Subscribing to one more sends only that one.
    tx.send(subscribe(&["b"], &[])).expect("send");
    let added = next(&mut s).await;
    assert_eq!(names(&added), vec!["b"]);
    assert!(added.removed_resources.is_empty());
    tx.send(delta_ack(&added)).expect("ack");

    // Unsubscribed: a change to it is not sent; a change to a subscribed
    // one is, alone.
    tx.send(subscribe(&[], &["a"])).expect("send");
    nothing(&mut s).await;
    let mut changed = clusters(LbPolicy::Random, &["a", "b"]);
    changed.clusters.insert(
        "c".into(),
        Cluster {
            name: "c".into(),
            policy: LbPolicy::RoundRobin as i32,
            ..Default::default()
        },
    );
    m.cache.update(&changed);
    let b_changed = next(&mut s).await;
    assert_eq!(names(&b_changed), vec!["b"]);
    tx.send(delta_ack(&b_changed)).expect("ack");

    // A subscribed resource that goes away is named as removed.
    m.cache.update(&clusters(LbPolicy::Random, &["a", "c"]));
    let removed = next(&mut s).await;
    assert!(removed.resources.is_empty());
    assert_eq!(removed.removed_resources, vec!["b".to_string()]);
}

#[tokio::test(start_paused = true)]
async fn a_request_over_the_limit_ends_the_stream_as_resource_exhausted() {
    let m = mesh(clusters(LbPolicy::RoundRobin, &["a"]));
    let (tx, mut s) = sotw(&m);
    tx.send(Err(Status::out_of_range(
        "Error, decoded message length too large: found 5 bytes, the limit is: 4 bytes",
    )))
    .expect("send");
    let err = next_err(&mut s).await;
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        err.message(),
        "Error, decoded message length too large: found 5 bytes, the limit is: 4 bytes"
    );
}

async fn next_err<T: std::fmt::Debug>(s: &mut BoxStream<T>) -> Status {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("an answer")
        .expect("an item")
        .expect_err("an error")
}

/// A proxy of `ns`.
fn node_in(ns: &str) -> Option<Node> {
    Some(Node {
        id: format!("a.{ns}"),
        namespace: ns.into(),
        ..Default::default()
    })
}

#[tokio::test(start_paused = true)]
async fn services_exported_to_some_namespaces_reach_only_their_proxies_by_either_protocol() {
    let names = ["web.a.svc.cluster.local:80", "web.b.svc.cluster.local:80"];
    let mut r = clusters(LbPolicy::RoundRobin, &names);
    r.exported
        .insert("web.a".into(), Arc::from(vec!["a".to_string()]));
    let m = mesh(r.clone());
    let cluster_names = |resources: &[minimesh_proto::prost_types::Any]| -> Vec<String> {
        resources
            .iter()
            .map(|a| Cluster::decode(a.value.as_slice()).expect("cluster").name)
            .collect()
    };

    // State of the world: a proxy of b gets web.b only; one of a both,
    // with a version of its own.
    let (tx_b, mut s_b) = sotw(&m);
    let (tx_a, mut s_a) = sotw(&m);
    for (tx, ns) in [(&tx_b, "b"), (&tx_a, "a")] {
        tx.send(Ok(DiscoveryRequest {
            node: node_in(ns),
            type_url: CLUSTER_TYPE.into(),
            ..Default::default()
        }))
        .expect("send");
    }
    let (rb, ra) = (next(&mut s_b).await, next(&mut s_a).await);
    assert_eq!(cluster_names(&rb.resources), [names[1]]);
    assert_eq!(cluster_names(&ra.resources), names);
    assert_ne!(rb.version_info, ra.version_info);

    // Delta: the same view; exported everywhere, b gets web.a added, and
    // once restricted again, removed.
    let (tx, mut s) = delta(&m);
    tx.send(Ok(DeltaDiscoveryRequest {
        node: node_in("b"),
        type_url: CLUSTER_TYPE.into(),
        ..Default::default()
    }))
    .expect("send");
    let first = next(&mut s).await;
    let got: Vec<&str> = first.resources.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(got, [names[1]]);
    let ack = |resp: &DeltaDiscoveryResponse| {
        Ok(DeltaDiscoveryRequest {
            type_url: CLUSTER_TYPE.into(),
            response_nonce: resp.nonce.clone(),
            ..Default::default()
        })
    };
    tx.send(ack(&first)).expect("ack");
    let mut open = r.clone();
    open.exported.clear();
    m.cache.update(&open);
    let added = next(&mut s).await;
    let got: Vec<&str> = added.resources.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(got, [names[0]]);
    assert!(added.removed_resources.is_empty());
    tx.send(ack(&added)).expect("ack");
    m.cache.update(&r);
    let removed = next(&mut s).await;
    assert!(removed.resources.is_empty());
    assert_eq!(removed.removed_resources, [names[0]]);
}

#[tokio::test(start_paused = true)]
async fn a_namespace_with_rules_of_its_own_gets_its_view_by_either_protocol() {
    let names = ["web.a.svc.cluster.local:80", "web.b.svc.cluster.local:80"];
    let mut r = clusters(LbPolicy::RoundRobin, &names);
    // Callers in `a` get web.b by their own rule (RANDOM), and a subset
    // cluster no one else has; they lack nothing else.
    let mut view = r.clone();
    view.clusters.get_mut(names[1]).expect("cluster").policy = LbPolicy::Random as i32;
    let subset = "web.b.svc.cluster.local:80|v1";
    view.clusters.insert(
        subset.into(),
        Cluster {
            name: subset.into(),
            ..Default::default()
        },
    );
    r.scoped.insert("a".into(), view);
    let m = mesh(r.clone());
    let policies = |resources: &[minimesh_proto::prost_types::Any]| -> Vec<(String, i32)> {
        resources
            .iter()
            .map(|a| {
                let c = Cluster::decode(a.value.as_slice()).expect("cluster");
                (c.name, c.policy)
            })
            .collect()
    };
    let (rr, random) = (LbPolicy::RoundRobin as i32, LbPolicy::Random as i32);
    let (tx_b, mut s_b) = sotw(&m);
    let (tx_a, mut s_a) = sotw(&m);
    for (tx, ns) in [(&tx_b, "b"), (&tx_a, "a")] {
        tx.send(Ok(DiscoveryRequest {
            node: node_in(ns),
            type_url: CLUSTER_TYPE.into(),
            ..Default::default()
        }))
        .expect("send");
    }
    let (rb, ra) = (next(&mut s_b).await, next(&mut s_a).await);
    assert_eq!(
        policies(&rb.resources),
        [(names[0].to_string(), rr), (names[1].to_string(), rr)]
    );
    assert_eq!(
        policies(&ra.resources),
        [
            (names[0].to_string(), rr),
            (names[1].to_string(), random),
            (subset.to_string(), 0)
        ]
    );
    assert_ne!(rb.version_info, ra.version_info);

    // Delta: a's view; once the rule is gone, web.b's default comes back
    // and the subset is removed; b is told nothing.
    let (tx, mut s) = delta(&m);
    tx.send(Ok(DeltaDiscoveryRequest {
        node: node_in("a"),
        type_url: CLUSTER_TYPE.into(),
        ..Default::default()
    }))
    .expect("send");
    let first = next(&mut s).await;
    let got: Vec<&str> = first.resources.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(got, [names[0], names[1], subset]);
    tx.send(Ok(DeltaDiscoveryRequest {
        type_url: CLUSTER_TYPE.into(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    }))
    .expect("ack");
    let mut plain = r.clone();
    plain.scoped.clear();
    m.cache.update(&plain);
    let back = next(&mut s).await;
    let anys: Vec<_> = back
        .resources
        .iter()
        .filter_map(|x| x.resource.clone())
        .collect();
    assert_eq!(policies(&anys), [(names[1].to_string(), rr)]);
    assert_eq!(back.removed_resources, [subset]);
    // The version b's proxies see did not move.
    let snap = m.cache.current();
    let ts = snap.get(CLUSTER_TYPE).expect("clusters");
    assert_eq!(ts.version_for(Some("b")), rb.version_info);
}
