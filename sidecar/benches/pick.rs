//! Pick cost per policy at 4, 100 and 10,000 endpoints, equal and unequal
//! weights, and with zone failover (half the endpoints in the caller's
//! zone), one thread. `cargo bench -p minimesh-sidecar --bench pick`.
//! Prints nanoseconds per pick (best of 5 runs of 2M picks).

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Instant;

use minimesh_sidecar::balance::Policy;
use minimesh_sidecar::endpoint::EndpointState;
use minimesh_sidecar::routing::Balancer;

const PICKS: u32 = 2_000_000;

fn balancer(policy: Policy, n: usize, weighted: bool) -> Balancer {
    let eps = (0..n)
        .map(|i| {
            let addr = SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 9090));
            let e = EndpointState::new(addr, format!("pod-{i}"));
            // Some load, so that least-request compares real numbers:
            // requests started and never ended.
            for _ in 0..i % 7 {
                std::mem::forget(e.start());
            }
            let w = if weighted { 1 + (i % 6) as u32 } else { 1 };
            (e, w)
        })
        .collect();
    Balancer::new(policy, 0, eps)
}

fn ns_per_pick(b: &Balancer) -> f64 {
    let mut best = f64::MAX;
    let now_ms = minimesh_sidecar::clock::now_ms();
    for _ in 0..5 {
        let start = Instant::now();
        for i in 0..PICKS {
            black_box(b.pick(
                Some(black_box(
                    0x9e37_79b9_7f4a_7c15u64.wrapping_mul(u64::from(i)),
                )),
                &[],
                black_box(now_ms),
            ));
        }
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(PICKS));
    }
    best
}

fn main() {
    println!(
        "{:<14} {:>9} {:>10} {:>12}",
        "policy", "endpoints", "weights", "ns/pick"
    );
    for policy in [
        Policy::RoundRobin,
        Policy::Random,
        Policy::LeastRequest,
        Policy::PeakEwma,
        Policy::RingHash,
        Policy::Maglev,
    ] {
        for n in [4, 100, 10_000] {
            for weighted in [false, true] {
                let b = balancer(policy, n, weighted);
                println!(
                    "{:<14} {:>9} {:>10} {:>12.1}",
                    policy.as_str(),
                    n,
                    if weighted { "unequal" } else { "equal" },
                    ns_per_pick(&b)
                );
            }
        }
    }
    // Zone failover: half the endpoints in the caller's zone, all healthy.
    for policy in [Policy::RoundRobin, Policy::LeastRequest, Policy::Maglev] {
        for n in [4, 100] {
            let flat = balancer(policy, n, false);
            let eps: Vec<_> = flat.endpoints().iter().map(|e| (e.clone(), 1)).collect();
            let in_zone: Vec<bool> = (0..n).map(|i| i % 2 == 0).collect();
            let b = Balancer::zoned(policy, 0, eps, &in_zone, None);
            println!(
                "{:<14} {:>9} {:>10} {:>12.1}",
                policy.as_str(),
                n,
                "zoned",
                ns_per_pick(&b)
            );
        }
    }
    let build = Instant::now();
    let weights: Vec<_> = (0..10_000).map(|i| 1 + (i % 100) as u32).collect();
    let eps: Vec<_> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            (
                EndpointState::new(
                    SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 1)),
                    String::new(),
                ),
                *w,
            )
        })
        .collect();
    black_box(Balancer::new(Policy::RoundRobin, 0, eps.clone()));
    println!(
        "weighted round-robin schedule build, 10,000 endpoints: {:?}",
        build.elapsed()
    );
    for (policy, size) in [
        (Policy::RingHash, 16),
        (Policy::RingHash, 1024),
        (Policy::Maglev, 65537),
        (Policy::Maglev, 1_000_003),
    ] {
        let build = Instant::now();
        black_box(Balancer::new(policy, size, eps.clone()));
        println!(
            "{} build, 10,000 weighted endpoints (1-100), size {size}: {:?}",
            policy.as_str(),
            build.elapsed()
        );
    }
    // A config update rebuilds a changed cluster's balancer; a hash table
    // whose endpoints, weights and size did not change is taken from the
    // cluster's previous balancer, not rebuilt.
    let ten = eps[..10].to_vec();
    let first = Instant::now();
    let live = Balancer::new(Policy::Maglev, 65537, ten.clone());
    let first = first.elapsed();
    let again = Instant::now();
    black_box(Balancer::reusing(
        Policy::Maglev,
        65537,
        ten,
        &live.hash_tables(),
    ));
    println!(
        "MAGLEV build, 10 endpoints, size 65537: {first:?}; again from the previous balancer's table (a config update that left the endpoints as they were): {:?}",
        again.elapsed()
    );
}
