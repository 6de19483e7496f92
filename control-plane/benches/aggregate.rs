//! Aggregation cost: 1,000 sidecars each reporting 100 endpoints every
//! second, on one core. `cargo bench -p minimesh-control-plane --bench aggregate`.
//! Prints how long one second's worth of reports takes to fold in (the share
//! of a core it needs), the view's cost, and the process's peak RSS.

use std::time::Instant;

use minimesh_control_plane::load::Aggregator;
use minimesh_proto::v1::{ClusterStats, EndpointStats, LoadStatsRequest};

const SIDECARS: usize = 1000;
const ENDPOINTS: usize = 100;

fn report(seq: u64) -> LoadStatsRequest {
    LoadStatsRequest {
        node: None,
        cluster_stats: vec![ClusterStats {
            cluster_name: "backend.default.svc.cluster.local:80".into(),
            endpoint_stats: (0..ENDPOINTS)
                .map(|i| EndpointStats {
                    address: format!("10.0.{}.{}:9090", i / 250, i % 250),
                    requests_issued: 10,
                    requests_succeeded: 10,
                    requests_in_progress: 1,
                    latency_sum_ms: 200.0,
                    latency_count: 10,
                    latency_first_bucket: minimesh_proto::latency::bucket(19_000) as u32,
                    latency_buckets: vec![3, 0, 4, 3],
                    sequence: seq,
                    ..Default::default()
                })
                .collect(),
            load_report_interval_ms: 1000,
        }],
    }
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let agg = Aggregator::new(std::time::Duration::from_secs(10));
    let nodes: Vec<String> = (0..SIDECARS)
        .map(|i| format!("sidecar-{i}.default"))
        .collect();
    let mut best = f64::MAX;
    for round in 1..=5u64 {
        let req = report(round);
        let start = Instant::now();
        for n in &nodes {
            agg.add(n, &req);
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    let start = Instant::now();
    let view = agg.view(&Default::default());
    let view_cost = start.elapsed();
    assert!(view["clusters"]["backend.default.svc.cluster.local:80"]
        .as_object()
        .is_some_and(|m| m.len() == ENDPOINTS));
    println!(
        "{SIDECARS} sidecars x {ENDPOINTS} endpoints: one second of reports folds in in {:.1} ms ({:.1}% of one core; {:.0} endpoint reports/s at most); view {:?}; peak RSS {} MiB",
        best * 1000.0,
        best * 100.0,
        (SIDECARS * ENDPOINTS) as f64 / best,
        view_cost,
        rss_kb() / 1024
    );
}
