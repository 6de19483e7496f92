//! The discovery port under the HTTP/2 "rapid reset" attack (CVE-2023-44487):
//! a client that opens streams and resets them at once, a thousand in a
//! burst, is disconnected by h2's own limits, while a sidecar connected
//! beside it goes on receiving its pushes.

use std::time::{Duration, Instant};

use minimesh_proto::prost::Message;
use minimesh_proto::v1::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use minimesh_proto::v1::{Cluster, DiscoveryRequest, DiscoveryResponse, LbPolicy, Node};
use minimesh_proto::CLUSTER_TYPE;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::harness::*;

const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const CANCEL: u32 = 0x8;
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// One HTTP/2 frame (RFC 9113 §4.1).
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// The policies in a clusters response.
fn policies(resp: &DiscoveryResponse) -> Vec<i32> {
    resp.resources
        .iter()
        .map(|a| Cluster::decode(a.value.as_slice()).expect("cluster").policy)
        .collect()
}

async fn next(pushes: &mut tonic::Streaming<DiscoveryResponse>) -> DiscoveryResponse {
    tokio::time::timeout(Duration::from_secs(10), pushes.message())
        .await
        .expect("a push within 10 s")
        .expect("stream ok")
        .expect("stream open")
}

#[tokio::test]
async fn a_thousand_rapid_resets_close_that_connection_and_no_other() {
    let net = Net::new(34);
    net.service("backend", &[1, 2]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;

    // A well-behaved sidecar's discovery stream, configured and ACKed.
    let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{}", net.cp_xds()))
        .await
        .expect("connect");
    let (tx, rx) = mpsc::channel(8);
    let request = |version: String, nonce: String| DiscoveryRequest {
        node: Some(Node {
            id: "bystander.default".into(),
            ..Default::default()
        }),
        type_url: CLUSTER_TYPE.into(),
        version_info: version,
        response_nonce: nonce,
        ..Default::default()
    };
    tx.send(request(String::new(), String::new()))
        .await
        .expect("send");
    let mut pushes = client
        .stream_aggregated_resources(ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let first = next(&mut pushes).await;
    assert_eq!(policies(&first), vec![LbPolicy::RoundRobin as i32]);
    tx.send(request(first.version_info.clone(), first.nonce.clone()))
        .await
        .expect("ack");
    connected_becomes(&net, 1).await;

    // The attacker: 1,000 streams, each opened (POST / over http, from
    // HPACK's static table) and cancelled at once, sent in one burst.
    let mut attack = TcpStream::connect(net.cp_xds()).await.expect("connect");
    let mut burst = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    burst.extend(frame(SETTINGS, 0, 0, &[]));
    for i in 0..1000u32 {
        let id = 2 * i + 1;
        burst.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            id,
            &[0x83, 0x86, 0x84],
        ));
        burst.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    let started = Instant::now();
    // The server may close before it has read everything: a failed write
    // is one way of being disconnected.
    let _ = attack.write_all(&burst).await;

    // What the server says before it closes: a GOAWAY telling the client
    // to calm down, then the end of the connection.
    let mut received = Vec::new();
    let mut buf = [0u8; 16 << 10];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), attack.read(&mut buf)).await {
            Err(_) => panic!(
                "the attacker's connection was still open after 10 s ({} bytes received)",
                received.len()
            ),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "closed only after {:?}",
        started.elapsed()
    );
    let mut goaway = None;
    let mut at = 0;
    while received.len() >= at + 9 {
        let len =
            u32::from_be_bytes([0, received[at], received[at + 1], received[at + 2]]) as usize;
        let kind = received[at + 3];
        let payload = &received[(at + 9).min(received.len())..(at + 9 + len).min(received.len())];
        if kind == GOAWAY && payload.len() >= 8 {
            goaway = Some(u32::from_be_bytes([
                payload[4], payload[5], payload[6], payload[7],
            ]));
        }
        at += 9 + len;
    }
    assert_eq!(
        goaway,
        Some(ENHANCE_YOUR_CALM),
        "the attacker should be told GOAWAY(ENHANCE_YOUR_CALM)"
    );

    // The bystander is unaffected: still connected, and a change reaches it.
    connected_becomes(&net, 1).await;
    net.rule("rule.yaml", "backend", "simple: RANDOM");
    let pushed = next(&mut pushes).await;
    assert_eq!(policies(&pushed), vec![LbPolicy::Random as i32]);
    tx.send(request(pushed.version_info.clone(), pushed.nonce.clone()))
        .await
        .expect("ack");
}
