//! Discovery streams: arbitrary bytes read as a run of decoded requests
//! (state of the world or delta; minimesh's envelopes and types, or Envoy's
//! xDS v3 envelopes converted as the ADS server converts them, node metadata
//! included; any nonce, version, names, node, error detail) into one
//! stream's session, with the config published again between requests. The
//! properties: no panic; every response is of a type the stream serves;
//! nonces only grow; a response of resources names each at most once; and
//! a v3 response encoded in Envoy's envelope decodes to the same type,
//! nonce and resources.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures_util::{FutureExt, StreamExt};
use minimesh_proto::prost::Message;
use minimesh_proto::v1::{
    Cluster, ClusterLoadAssignment, DeltaDiscoveryRequest, DiscoveryRequest, Endpoint, LbPolicy,
    Route,
};
use minimesh_proto::{xds_v3, ALL_TYPES};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest as EnvoyDelta, DeltaDiscoveryResponse as EnvoyDeltaResponse,
    DiscoveryRequest as EnvoyRequest, DiscoveryResponse as EnvoyResponse,
};

use crate::cache::Cache;
use crate::discovery::metrics::Metrics;
use crate::discovery::registry::Registry;
use crate::discovery::server::Discovery;
use crate::translate::Resources;
use crate::xds_v3::wire;

/// A config of `n` services (0-3), the first exported to namespace `a` only.
fn config(n: u8, policy: LbPolicy) -> Resources {
    let mut r = Resources::default();
    for i in 0..n % 4 {
        let name = format!("s{i}.ns.svc.cluster.local:80");
        r.clusters.insert(
            name.clone(),
            Cluster {
                name: name.clone(),
                service: format!("s{i}"),
                namespace: "ns".into(),
                port: 80,
                policy: policy as i32,
                ..Default::default()
            },
        );
        r.endpoints.insert(
            name.clone(),
            ClusterLoadAssignment {
                cluster_name: name.clone(),
                endpoints: vec![Endpoint {
                    address: format!("10.0.0.{i}:9090"),
                    weight: 1,
                    ..Default::default()
                }],
            },
        );
        r.routes.insert(
            format!("s{i}.ns"),
            Route {
                service: format!("s{i}"),
                namespace: "ns".into(),
                ..Default::default()
            },
        );
    }
    r.exported
        .insert("s0.ns".into(), Arc::from(vec!["a".to_string()]));
    r
}

/// Checks one input; panics on a violated property. Returns how many
/// responses the stream sent.
pub fn check(data: &[u8]) -> usize {
    let Some((&first, mut rest)) = data.split_first() else {
        return 0;
    };
    let cache = Cache::default();
    cache.update(&config(first >> 4, LbPolicy::RoundRobin));
    let mut registry = prometheus_client::registry::Registry::default();
    let discovery = Discovery::new(
        cache.subscribe(),
        Arc::new(Registry::default()),
        Arc::new(Metrics::new(&mut registry)),
    );
    let delta = first & 1 == 1;
    let v3 = first & 2 == 2;
    let served: BTreeSet<&str> = if v3 {
        xds_v3::ALL_TYPES.into_iter().collect()
    } else {
        ALL_TYPES.into_iter().collect()
    };
    // Each request: a length byte, then that many bytes of its encoding;
    // a length byte of 0 publishes another config instead.
    let mut requests = Vec::new();
    while let Some((&len, tail)) = rest.split_first() {
        let n = usize::from(len).min(tail.len());
        requests.push(&tail[..n]);
        rest = &tail[n..];
    }
    let mut last_nonce = 0u64;
    let mut responses = 0;
    let mut seen = |type_url: &str, nonce: &str, names: Vec<String>| {
        responses += 1;
        assert!(served.contains(type_url), "a response of type {type_url}");
        let n: u64 = nonce.parse().expect("a numeric nonce");
        assert!(n > last_nonce, "nonce {n} after {last_nonce}");
        last_nonce = n;
        let unique: BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "a name twice: {names:?}");
    };
    if delta {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = UnboundedReceiverStream::new(rx);
        let mut out = if v3 {
            discovery.delta_v3(rx)
        } else {
            discovery.delta(rx)
        };
        for (i, bytes) in requests.into_iter().enumerate() {
            if bytes.is_empty() {
                cache.update(&config(i as u8, LbPolicy::LeastRequest));
            } else if v3 {
                if let Ok(req) = EnvoyDelta::decode(bytes) {
                    let _ = tx.send(Ok(wire::delta_request(req)));
                }
            } else if let Ok(req) = DeltaDiscoveryRequest::decode(bytes) {
                let _ = tx.send(Ok(req));
            }
            while let Some(Some(item)) = out.next().now_or_never() {
                let Ok(r) = item else { break };
                if v3 {
                    let names: Vec<String> = r.resources.iter().map(|x| x.name.clone()).collect();
                    let sent = wire::delta_response(r.clone()).encode_to_vec();
                    let back = EnvoyDeltaResponse::decode(sent.as_slice()).expect("decodes");
                    assert_eq!((&back.type_url, &back.nonce), (&r.type_url, &r.nonce));
                    let got: Vec<String> = back.resources.into_iter().map(|x| x.name).collect();
                    assert_eq!(got, names);
                }
                seen(
                    &r.type_url,
                    &r.nonce,
                    r.resources.into_iter().map(|x| x.name).collect(),
                );
            }
        }
    } else {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = UnboundedReceiverStream::new(rx);
        let mut out = if v3 {
            discovery.sotw_v3(rx)
        } else {
            discovery.sotw(rx)
        };
        for (i, bytes) in requests.into_iter().enumerate() {
            if bytes.is_empty() {
                cache.update(&config(i as u8, LbPolicy::LeastRequest));
            } else if v3 {
                if let Ok(req) = EnvoyRequest::decode(bytes) {
                    let _ = tx.send(Ok(wire::sotw_request(req)));
                }
            } else if let Ok(req) = DiscoveryRequest::decode(bytes) {
                let _ = tx.send(Ok(req));
            }
            while let Some(Some(item)) = out.next().now_or_never() {
                let Ok(r) = item else { break };
                if v3 {
                    let sent = wire::sotw_response(r.clone()).encode_to_vec();
                    let back = EnvoyResponse::decode(sent.as_slice()).expect("decodes");
                    assert_eq!(
                        (&back.type_url, &back.nonce, back.resources.len()),
                        (&r.type_url, &r.nonce, r.resources.len())
                    );
                }
                seen(&r.type_url, &r.nonce, Vec::new());
            }
        }
    }
    responses
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fuzz_corpus_holds() {
        let corpus = super::super::corpus("discovery");
        assert!(corpus.len() >= 3);
        let sent: Vec<usize> = corpus.iter().map(|d| super::check(d)).collect();
        // The seeds get answers (a first request, an ACK's follow-up, a push
        // after a republication), not only refusals.
        assert!(sent.iter().filter(|n| **n >= 2).count() >= 2, "{sent:?}");
    }

    #[test]
    fn envoy_envelopes_with_node_metadata_are_answered() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/discovery/");
        for seed in ["envoy-v3-node-metadata.bin", "envoy-v3-delta.bin"] {
            let data = std::fs::read(format!("{dir}{seed}")).expect(seed);
            // The first request's answer, and the one after republication.
            assert!(super::check(&data) >= 2, "{seed}");
        }
    }
}
