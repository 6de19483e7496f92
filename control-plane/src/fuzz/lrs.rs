//! Envoy's and gRPC's load reports (xDS v3 LRS): arbitrary bytes decoded as
//! a run of `envoy.service.load_stats.v3.LoadStatsRequest`s (each a
//! length byte and that many bytes of protobuf), converted to minimesh's
//! reports as the LRS service converts them, and added to the aggregator.
//! The properties: no panic; a converted report names only endpoint
//! addresses that parse as `ip:port`; the aggregate view stays finite.

use std::collections::BTreeMap;
use std::time::Duration;

use envoy_types::pb::envoy::service::load_stats::v3::LoadStatsRequest;
use minimesh_proto::prost::Message;

use crate::load::Aggregator;
use crate::lrs::v3::report;

/// Checks one input; panics on a violated property.
pub fn check(data: &[u8]) {
    let agg = Aggregator::new(Duration::from_secs(10));
    let mut rest = data;
    let mut clusters: BTreeMap<String, Vec<String>> = BTreeMap::new();
    while let Some((&len, tail)) = rest.split_first() {
        let (chunk, after) = tail.split_at(usize::from(len).min(tail.len()));
        rest = after;
        let Ok(envoy) = LoadStatsRequest::decode(chunk) else {
            continue;
        };
        let converted = report(envoy);
        for c in &converted.cluster_stats {
            for e in &c.endpoint_stats {
                assert!(
                    e.address.parse::<std::net::SocketAddr>().is_ok(),
                    "{:?} is no ip:port",
                    e.address
                );
                clusters
                    .entry(c.cluster_name.clone())
                    .or_default()
                    .push(e.address.clone());
            }
        }
        agg.add("envoy-0.default", &converted);
    }
    let view = agg.view(&clusters);
    assert!(
        !serde_json::to_string(&view).expect("json").contains("NaN"),
        "{view}"
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_corpus_replays() {
        let corpus = super::super::corpus("lrs");
        assert!(!corpus.is_empty());
        for input in corpus {
            super::check(&input);
        }
    }
}
