//! Load reports: arbitrary bytes read as a run of reports from a few
//! sidecars about a few endpoints (every field, sequence numbers and
//! latency histograms included, from the bytes), added to the aggregator,
//! then read back as the admin view, the metrics' view and LOAD_AWARE's
//! inputs and weights. The properties: no panic; every figure finite;
//! success ratios within [0, 1]; weights within LOAD_AWARE's bounds.

use std::collections::BTreeMap;
use std::time::Duration;

use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest};

use crate::load::Aggregator;
use crate::load_aware::{next_weights, MAX_WEIGHT};

/// The clusters reports are about.
const CLUSTERS: [&str; 2] = [
    "a.default.svc.cluster.local:80",
    "b.default.svc.cluster.local:80",
];

/// Reads bytes a few at a time, zeros once they run out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }

    fn u16(&mut self) -> u64 {
        u64::from(u16::from_le_bytes([self.u8(), self.u8()]))
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(std::array::from_fn(|_| self.u8()))
    }
}

/// Checks one input; panics on a violated property.
pub fn check(data: &[u8]) {
    let agg = Aggregator::new(Duration::from_secs(10));
    let mut b = Bytes(data);
    while !b.0.is_empty() {
        let node = format!("sidecar-{}", b.u8() % 4);
        let cluster = CLUSTERS[usize::from(b.u8() % 2)];
        let endpoints = (0..b.u8() % 4)
            .map(|_| {
                let wide = b.u8() & 1 == 1;
                let count = |b: &mut Bytes| if wide { b.u64() } else { b.u16() };
                EndpointStats {
                    address: format!("10.0.0.{}:9090", b.u8() % 4),
                    requests_issued: count(&mut b),
                    requests_succeeded: count(&mut b),
                    requests_failed: count(&mut b),
                    requests_in_progress: count(&mut b),
                    latency_sum_ms: f64::from_bits(if wide { b.u64() } else { b.u16() << 40 }),
                    latency_count: count(&mut b),
                    sequence: b.u16(),
                    latency_first_bucket: u32::from(b.u8()),
                    latency_buckets: (0..b.u8() % 8).map(|_| b.u16()).collect(),
                }
            })
            .collect();
        agg.add(
            &node,
            &LoadStatsRequest {
                node: None,
                cluster_stats: vec![ClusterStats {
                    cluster_name: cluster.into(),
                    endpoint_stats: endpoints,
                    load_report_interval_ms: 1000,
                }],
            },
        );
    }
    let eps: Vec<String> = (0..4).map(|i| format!("10.0.0.{i}:9090")).collect();
    let known: BTreeMap<String, Vec<String>> = CLUSTERS
        .iter()
        .map(|c| (c.to_string(), eps.clone()))
        .collect();
    let view = agg.view(&known);
    assert!(
        !serde_json::to_string(&view).expect("json").contains("NaN"),
        "{view}"
    );
    for cluster in CLUSTERS {
        for (ep, (_, success, mean)) in agg.endpoint_stats(cluster, 2) {
            assert!((0.0..=1.0).contains(&success), "{ep}: success {success}");
            assert!(mean.is_finite() && mean >= 0.0, "{ep}: mean {mean}");
        }
        let weights = next_weights(&agg, cluster, &eps, None);
        for (ep, w) in &weights {
            assert!((1.0..=MAX_WEIGHT).contains(&f64::from(*w)), "{ep}: {w}");
        }
        let again = next_weights(&agg, cluster, &eps, Some(&weights));
        assert_eq!(again.len(), eps.len());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fuzz_corpus_holds() {
        let corpus = super::super::corpus("load_reports");
        assert!(corpus.len() >= 3);
        for data in corpus {
            super::check(&data);
        }
    }
}
