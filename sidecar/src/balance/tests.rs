//! Every policy on [`Fake`] endpoints: plain values, no sockets, and the
//! time passed to each pick.

use super::fake::Fake;
use super::*;

type Balancer = super::Balancer<Fake>;

fn eps(n: u8) -> Vec<(Arc<Fake>, u32)> {
    Fake::many(0, n)
}

fn table(b: &Balancer) -> *const () {
    // The picker's table, by address (tables are shared by clones).
    match &b.picker {
        Picker::RingHash(r) => r.id(),
        Picker::Maglev(m) => m.id(),
        _ => std::ptr::null(),
    }
}

#[test]
fn a_hash_table_is_reused_from_the_previous_balancer_built_from_the_same() {
    for (policy, size) in [(Policy::Maglev, 65537), (Policy::RingHash, 1024)] {
        let a = eps(3);
        let first = Balancer::new(policy, size, a.clone());
        let previous = first.hash_tables();
        assert_eq!(previous.len(), 1);
        // A config update rebuilding the balancer over the same endpoints
        // takes the table, and picks as the first.
        let again = Balancer::reusing(policy, size, a.clone(), &previous);
        assert_eq!(table(&first), table(&again), "{policy:?}");
        assert_eq!(owners(&first, 100), owners(&again, 100));
        // Another weight, size or endpoint set builds its own.
        let mut heavier = a.clone();
        heavier[0].1 = 2;
        let other = |eps, size| table(&Balancer::reusing(policy, size, eps, &previous));
        assert_ne!(other(heavier, size), table(&first));
        assert_ne!(other(a.clone(), size + 2), table(&first));
        assert_ne!(other(eps(4), size), table(&first));
        // Without a previous balancer, nothing is shared: another
        // cluster over the same endpoints has a table of its own.
        assert_ne!(
            table(&Balancer::new(policy, size, a.clone())),
            table(&first)
        );
        // A zoned balancer hands on both sides' tables.
        let zoned = Balancer::zoned(policy, size, eps(4), &[true, true, false, false], None);
        assert_eq!(zoned.hash_tables().len(), 2);
    }
    assert!(Balancer::new(Policy::RoundRobin, 0, eps(3))
        .hash_tables()
        .is_empty());
}

fn owners(b: &Balancer, keys: u64) -> Vec<SocketAddr> {
    (0..keys)
        .map(|k| {
            b.pick(
                Some(xxhash::xxh64(format!("user-{k}").as_bytes(), 0)),
                &[],
                1,
            )
            .map(|e| e.addr())
            .expect("endpoint")
        })
        .collect()
}

#[test]
fn hash_policies_spread_keys_and_remap_little_when_an_endpoint_goes() {
    for policy in [Policy::RingHash, Policy::Maglev] {
        let all = eps(5);
        let before = owners(&Balancer::new(policy, 0, all.clone()), 10_000);
        let removed = all[2].0.addr();
        let rest: Vec<_> = all
            .into_iter()
            .filter(|(e, _)| e.addr() != removed)
            .collect();
        let after = owners(&Balancer::new(policy, 0, rest), 10_000);
        let survivors = before.iter().filter(|a| **a != removed).count();
        let kept = before
            .iter()
            .zip(&after)
            .filter(|(b, a)| **b != removed && b == a)
            .count();
        let fraction = kept as f64 / survivors as f64;
        println!(
            "{}: {:.4} of surviving endpoints' keys stayed",
            policy.as_str(),
            fraction
        );
        match policy {
            Policy::RingHash => assert_eq!(kept, survivors),
            _ => assert!(fraction > 0.95, "{fraction}"),
        }
        // Even spread: 1,000 keys over 3 endpoints, each within ±20% of a third.
        let three = owners(&Balancer::new(policy, 0, eps(3)), 1000);
        for e in eps(3) {
            let share = three.iter().filter(|a| **a == e.0.addr()).count() as f64 / 1000.0;
            assert!(
                (share - 1.0 / 3.0).abs() < 0.2 / 3.0,
                "{}: {share}",
                policy.as_str()
            );
        }
    }
}

#[test]
fn zone_failover_keeps_requests_in_the_zone_and_spills_as_it_fails() {
    use std::collections::HashMap;
    let all = eps(4);
    let in_zone = [true, true, false, false];
    let b = Balancer::zoned(Policy::RoundRobin, 0, all.clone(), &in_zone, None);
    assert_eq!(b.local_endpoints().map(<[_]>::len), Some(2));
    // The time each pick is given: share recomputations are driven by it.
    let now = std::cell::Cell::new(1u64);
    let count = |b: &Balancer, avoid: &[Arc<Fake>]| {
        let mut n: HashMap<SocketAddr, u32> = HashMap::new();
        for _ in 0..10_000 {
            *n.entry(b.pick(None, avoid, now.get()).expect("endpoint").addr())
                .or_default() += 1;
        }
        let get = |i: usize| n.get(&all[i].0.addr()).copied().unwrap_or(0);
        [get(0), get(1), get(2), get(3)]
    };
    let settle = || now.set(now.get() + SHARE_REFRESH_MS);
    // All healthy: the zone takes everything, round robin within it.
    assert_eq!(count(&b, &[]), [5000, 5000, 0, 0]);
    // A retry after a failure in the zone leaves it; one after a failure
    // elsewhere follows the share.
    assert_eq!(count(&b, &[all[0].0.clone()]), [0, 0, 5000, 5000]);
    assert_eq!(count(&b, &[all[2].0.clone()]), [5000, 5000, 0, 0]);
    // Half the zone ejected: it keeps 1.4 x 0.5 = 70%, the rest spills.
    let far = 1_000_000_000;
    let eject_until = |e: &Fake, ms| e.down_until_ms.store(ms, Ordering::Relaxed);
    eject_until(&all[0].0, far);
    settle();
    let [a, l, r1, r2] = count(&b, &[]);
    assert_eq!(a, 0, "an ejected endpoint takes nothing");
    assert!(
        (6700..=7300).contains(&l),
        "{l} of 10000 stayed in the zone"
    );
    assert_eq!(l + r1 + r2, 10_000);
    assert!(
        r1.abs_diff(r2) <= 1,
        "round robin over the other zone: {r1} {r2}"
    );
    // The whole zone ejected: everything goes to the other zone.
    eject_until(&all[1].0, far);
    settle();
    assert_eq!(count(&b, &[]), [0, 0, 5000, 5000]);
    // Recovered: back home.
    eject_until(&all[0].0, 0);
    eject_until(&all[1].0, 0);
    settle();
    assert_eq!(count(&b, &[]), [5000, 5000, 0, 0]);
    // No endpoint in the caller's zone, or all of them: no split.
    let none = Balancer::zoned(Policy::RoundRobin, 0, all.clone(), &[false; 4], None);
    assert!(none.local_endpoints().is_none());
    let hash = Balancer::zoned(Policy::Maglev, 0, all.clone(), &in_zone, None);
    assert!(hash.needs_hash());
    let owners: std::collections::HashSet<_> = (0..1000u64)
        .map(|k| {
            hash.pick(Some(xxhash::xxh64(&k.to_le_bytes(), 0)), &[], now.get())
                .expect("endpoint")
                .addr()
        })
        .collect();
    assert_eq!(
        owners,
        [all[0].0.addr(), all[1].0.addr()].into_iter().collect()
    );
}

#[test]
fn hash_policies_honour_weights() {
    for policy in [Policy::RingHash, Policy::Maglev] {
        let mut e = eps(2);
        e[0].1 = 3;
        let b = Balancer::new(policy, 0, e.clone());
        let o = owners(&b, 20_000);
        let share = o.iter().filter(|a| **a == e[0].0.addr()).count() as f64 / 20_000.0;
        assert!((share - 0.75).abs() < 0.05, "{}: {share}", policy.as_str());
    }
}

/// Picks per endpoint over `n` picks at `now`, a distinct hash key each.
fn counts(b: &Balancer, eps: &[(Arc<Fake>, u32)], n: u64, now: u64) -> Vec<u64> {
    let mut out = vec![0; eps.len()];
    for k in 0..n {
        let key = b.needs_hash().then(|| xxhash::xxh64(&k.to_le_bytes(), 7));
        let e = b.pick(key, &[], now).expect("endpoint");
        let i = eps.iter().position(|(x, _)| Arc::ptr_eq(x, e));
        out[i.expect("one of the cluster's")] += 1;
    }
    out
}

const EVERY_POLICY: [Policy; 7] = [
    Policy::RoundRobin,
    Policy::Random,
    Policy::LeastRequest,
    Policy::LoadAware,
    Policy::RingHash,
    Policy::Maglev,
    Policy::PeakEwma,
];

#[test]
fn every_policy_follows_weights_and_skips_what_it_must() {
    let now = 1_000;
    for policy in EVERY_POLICY {
        let mut eps = Fake::many(0, 3);
        eps[0].1 = 2;
        let b = Balancer::new(policy, 0, eps.clone());
        let n = 20_000;
        let c = counts(&b, &eps, n, now);
        assert_eq!(c.iter().sum::<u64>(), n);
        // Weights 2:1:1. PEAK_EWMA weighs by latency and load, not weight:
        // with neither, an even split. The least-request policies draw two
        // by weight and the one with less load per weight wins: idle, the
        // heavier wins every pair it is in.
        let want = match policy {
            Policy::PeakEwma => [1.0 / 3.0; 3],
            Policy::LeastRequest | Policy::LoadAware => [0.8, 0.1, 0.1],
            _ => [0.5, 0.25, 0.25],
        };
        for (got, want) in c.iter().zip(want) {
            let share = *got as f64 / n as f64;
            assert!((share - want).abs() < 0.03, "{policy:?}: {c:?}");
        }
        // An endpoint backing off takes nothing until its backoff ends.
        eps[0].0.down_until_ms.store(now + 1, Ordering::Relaxed);
        let c = counts(&b, &eps, 3_000, now);
        assert_eq!(c[0], 0, "{policy:?}: {c:?}");
        assert!(counts(&b, &eps, 3_000, now + 1)[0] > 0, "{policy:?}");
        // A retry avoids the endpoint it failed on, and a third attempt
        // both endpoints tried before it.
        for avoid in [
            vec![eps[1].0.clone()],
            vec![eps[1].0.clone(), eps[0].0.clone()],
        ] {
            for _ in 0..1_000 {
                let e = b.pick(Some(7), &avoid, now).expect("endpoint");
                assert!(!avoid.iter().any(|a| Arc::ptr_eq(e, a)), "{policy:?}");
            }
        }
        // Every endpoint tried: one of them again rather than none.
        let all: Vec<_> = eps.iter().map(|(e, _)| e.clone()).collect();
        assert!(b.pick(Some(7), &all, now).is_some(), "{policy:?}");
        // Every endpoint skipped: the one whose backoff ends first is
        // tried rather than none.
        for (i, (e, _)) in eps.iter().enumerate() {
            e.down_until_ms
                .store(now + 100 - i as u64, Ordering::Relaxed);
        }
        let e = b
            .pick(Some(7), &[], now)
            .expect("an endpoint in panic mode");
        assert!(Arc::ptr_eq(e, &eps[2].0), "{policy:?}");
        let none = Balancer::new(policy, 0, Vec::new());
        assert!(none.pick(Some(7), &[], now).is_none(), "{policy:?}");
    }
}

#[test]
fn load_counts_for_the_policies_that_read_it() {
    let now = 1_000;
    for policy in [Policy::LeastRequest, Policy::LoadAware, Policy::PeakEwma] {
        let eps = Fake::many(0, 3);
        eps[0].0.active.store(20, Ordering::Relaxed);
        let b = Balancer::new(policy, 0, eps.clone());
        let c = counts(&b, &eps, 10_000, now);
        // Two choices: the busy endpoint wins no draw.
        assert_eq!(c[0], 0, "{policy:?}: {c:?}");
    }
}

#[test]
fn peak_ewma_shuns_a_slow_endpoint_until_it_answers_fast_again() {
    let eps = Fake::many(0, 3);
    let b = Balancer::new(Policy::PeakEwma, 0, eps.clone());
    let ms = |t: u64| t * 1000; // µs
    let now = 10_000;
    eps[0].0.rtt.observe(1_000_000.0, 0, ms(now));
    eps[1].0.rtt.observe(10_000.0, 0, ms(now));
    eps[2].0.rtt.observe(12_000.0, 0, ms(now));
    let c = counts(&b, &eps, 10_000, now);
    assert_eq!(c[0], 0, "a 1 s endpoint beside 10 ms ones: {c:?}");
    // With nothing known of how they bear load, busy fast endpoints are
    // priced as if they queued: 30 in flight × 10 ms is still less than
    // 1 s ...
    eps[1].0.active.store(30, Ordering::Relaxed);
    eps[2].0.active.store(30, Ordering::Relaxed);
    assert_eq!(counts(&b, &eps, 10_000, now)[0], 0);
    // ... 100 in flight each is not: the slow endpoint takes its share.
    eps[1].0.active.store(100, Ordering::Relaxed);
    eps[2].0.active.store(100, Ordering::Relaxed);
    assert!(counts(&b, &eps, 10_000, now)[0] > 0);
    // A fast answer after a quiet spell brings it back at once: the peak
    // decays with the time since the last sample.
    for (e, _) in &eps[1..] {
        e.active.store(0, Ordering::Relaxed);
    }
    let later = now + 60_000;
    eps[0].0.rtt.observe(5_000.0, 0, ms(later));
    eps[1].0.rtt.observe(10_000.0, 0, ms(later));
    eps[2].0.rtt.observe(12_000.0, 0, ms(later));
    let c = counts(&b, &eps, 10_000, later);
    assert!(c[0] > 3_000, "recovered: {c:?}");
}

#[test]
fn peak_ewma_learns_whether_an_endpoint_queues() {
    let ms = |t: u64| t * 1000; // µs
    let now = 10_000;
    // Two fast endpoints that serve side by side (10 ms whatever is in
    // flight) and a slow one (1 s).
    let eps = Fake::many(0, 3);
    eps[0].0.rtt.observe(1_000_000.0, 0, ms(now));
    for i in 0..64u32 {
        for (e, _) in &eps[1..] {
            e.rtt
                .observe(10_000.0 + f64::from(i % 3) * 100.0, i % 8, ms(now));
        }
    }
    let fit = eps[1].0.rtt.fit().expect("a fit");
    assert!(fit.per_request < 100.0, "{fit:?}");
    // However busy they are, the slow endpoint is never the better choice.
    eps[1].0.active.store(100, Ordering::Relaxed);
    eps[2].0.active.store(100, Ordering::Relaxed);
    let b = Balancer::new(Policy::PeakEwma, 0, eps.clone());
    let c = counts(&b, &eps, 10_000, now);
    assert_eq!(c[0], 0, "the slow endpoint was sent requests: {c:?}");

    // An endpoint that queues (each request ahead adds its 10 ms service
    // time) beside one that answers in 40 ms side by side.
    let eps = Fake::many(0, 2);
    for i in 0..64u32 {
        let k = i % 8;
        eps[0]
            .0
            .rtt
            .observe(10_000.0 * f64::from(k + 1), k, ms(now));
        eps[1].0.rtt.observe(40_000.0, k, ms(now));
    }
    let fit = eps[0].0.rtt.fit().expect("a fit");
    assert!(
        (fit.per_request - 10_000.0).abs() < 1_000.0 && (fit.base - 10_000.0).abs() < 2_000.0,
        "{fit:?}"
    );
    let b = Balancer::new(Policy::PeakEwma, 0, eps.clone());
    // Idle, its queue is empty: it is the faster one.
    assert_eq!(counts(&b, &eps, 1_000, now), [1_000, 0]);
    // With 10 ahead it is priced by its queue.
    eps[0].0.active.store(10, Ordering::Relaxed);
    eps[1].0.active.store(10, Ordering::Relaxed);
    assert_eq!(counts(&b, &eps, 1_000, now), [0, 1_000]);
}

#[test]
fn slow_start_admits_a_new_endpoint_gradually() {
    let eps = Fake::many(0, 2);
    let joined = 50_000;
    eps[1].0.joined_ms.store(joined, Ordering::Relaxed);
    let warmup = Warmup {
        window_ms: 10_000,
        min: 0.1,
        inv_aggression: 1.0,
    };
    let b = Balancer::new(Policy::Random, 0, eps.clone()).with_warmup(Some(warmup));
    let share = |age: u64| counts(&b, &eps, 20_000, joined + age)[1] as f64 / 20_000.0;
    let (new, half, warm) = (share(0), share(5_000), share(10_000));
    assert!(
        new < 0.2 && new < half && half < warm,
        "{new} {half} {warm}"
    );
    assert!((warm - 0.5).abs() < 0.03, "{warm}");
    // An endpoint present from the start (joined 0) is warm at once.
    eps[1].0.joined_ms.store(0, Ordering::Relaxed);
    assert!((share(0) - 0.5).abs() < 0.03);
}
