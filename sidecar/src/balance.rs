//! Endpoint picking. A [`Balancer`] is built off the request path whenever a
//! cluster's endpoints or policy change (schedules, alias tables), and a pick
//! is then a few atomic loads and arithmetic: no lock, no allocation.

pub mod least_request;
pub mod maglev;
pub mod peak_ewma;
pub mod random;
pub mod ring_hash;
pub mod rng;
pub mod round_robin;
pub mod weighted;
pub mod xxhash;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::endpoint::EndpointState;

/// The policies (one type with the control plane's).
pub use minimesh_proto::Policy;

enum Picker {
    RoundRobin(round_robin::RoundRobin),
    Random(random::Random),
    LeastRequest(least_request::LeastRequest),
    RingHash(ring_hash::RingHash),
    Maglev(maglev::Maglev),
    PeakEwma,
}

/// What a hash table is built from: table size, endpoint keys, weights.
type TableKey = (u64, Vec<String>, Vec<u32>);

/// A ring or Maglev table a balancer holds, with what it was built from.
/// A config update rebuilds a changed cluster's balancer; a table (65,537
/// entries by default) whose size, endpoints and weights did not change is
/// taken from the cluster's previous balancer ([`Balancer::hash_tables`])
/// instead of built again. Nothing is shared through process-wide state, so
/// one cluster's (or one test's) tables never depend on another's.
#[derive(Clone)]
pub struct HashTable {
    key: TableKey,
    table: Table,
}

/// A hash table (a clone shares it).
#[derive(Clone)]
enum Table {
    Ring(ring_hash::RingHash),
    Maglev(maglev::Maglev),
}

/// The table built from `key`, one of `previous` if it was built from the
/// same, else a new one (off the request path: balancers are built on
/// config updates).
fn hash_table(previous: &[HashTable], key: TableKey, policy: Policy) -> (Picker, TableKey) {
    if let Some(t) = previous.iter().find(|t| t.key == key) {
        let picker = match &t.table {
            Table::Ring(r) => Picker::RingHash(r.clone()),
            Table::Maglev(m) => Picker::Maglev(m.clone()),
        };
        return (picker, key);
    }
    let picker = if policy == Policy::RingHash {
        Picker::RingHash(ring_hash::RingHash::new(&key.1, &key.2, key.0))
    } else {
        Picker::Maglev(maglev::Maglev::new(&key.1, &key.2, key.0))
    };
    (picker, key)
}

/// Slow start (Envoy semantics): an endpoint that joined `window` ago or
/// less is admitted with probability max(min, (age / window)^(1/aggression)).
#[derive(Clone, Copy, Debug)]
pub struct Warmup {
    /// Length of the slow-start window, ms.
    pub window_ms: u64,
    /// Starting share (0..1).
    pub min: f64,
    /// 1 / aggression.
    pub inv_aggression: f64,
}

/// The endpoints of a cluster that may receive traffic, and how to pick one.
pub struct Balancer {
    endpoints: Vec<Arc<EndpointState>>,
    picker: Picker,
    /// What the hash table was built from (hash policies only).
    table_key: Option<TableKey>,
    policy: Policy,
    warmup: Option<Warmup>,
    zones: Option<Box<Zones>>,
}

/// Shares in [`Zones`] are out of this.
const SHARE_SCALE: u32 = 1 << 16;

/// How often the local zone's share is recomputed from its endpoints'
/// health, at most.
const SHARE_REFRESH_MS: u64 = 20;

/// Zone failover (Envoy's priority levels with Istio's locality ordering,
/// one level): the caller's zone takes min(1, 1.4 × its healthy fraction)
/// of requests, as Envoy's overprovisioning factor, and the other zones the
/// rest. While all local endpoints are healthy no request leaves the zone;
/// as they fail, traffic moves out in proportion.
struct Zones {
    local: Balancer,
    remote: Balancer,
    /// Out of [`SHARE_SCALE`].
    local_share: AtomicU32,
    /// When `local_share` was computed ([`crate::clock::now_ms`]).
    computed_ms: AtomicU64,
}

impl Zones {
    #[inline]
    fn share(&self) -> u32 {
        let now = crate::clock::now_ms();
        if now.saturating_sub(self.computed_ms.load(Ordering::Relaxed)) < SHARE_REFRESH_MS {
            return self.local_share.load(Ordering::Relaxed);
        }
        let eps = &self.local.endpoints;
        let healthy = eps.iter().filter(|e| !e.is_failing()).count() as u64;
        let share = (healthy * 140 * SHARE_SCALE as u64 / (eps.len().max(1) as u64 * 100))
            .min(SHARE_SCALE as u64) as u32;
        self.local_share.store(share, Ordering::Relaxed);
        self.computed_ms.store(now, Ordering::Relaxed);
        share
    }

    /// A healthy endpoint of the zone the share sends this request to, or
    /// None (then the whole cluster is picked from). A retry after a failure
    /// in the caller's zone goes to the other zones (Istio's
    /// `retryRemoteLocalities`): when a zone dies, its endpoints are not yet
    /// marked failing and the share not yet recomputed, and retries that
    /// stayed in it could all land on dead endpoints.
    #[inline]
    fn pick(
        &self,
        hash: Option<u64>,
        avoid: Option<&Arc<EndpointState>>,
    ) -> Option<&Arc<EndpointState>> {
        let local = match avoid {
            Some(a) if self.local.endpoints.iter().any(|e| Arc::ptr_eq(e, a)) => false,
            _ => {
                let share = self.share();
                share >= SHARE_SCALE || (share > 0 && (rng::next() as u32 % SHARE_SCALE) < share)
            }
        };
        let side = if local { &self.local } else { &self.remote };
        side.pick(hash, avoid)
            .filter(|e| !e.is_failing() && !avoid.is_some_and(|a| Arc::ptr_eq(a, e)))
    }
}

impl Balancer {
    /// Builds a balancer over `(endpoint, weight)` pairs (weights >= 1).
    /// `table_size` is the minimum ring size (ring hash) or table size
    /// (Maglev); 0 takes Envoy's defaults (1024, 65537).
    pub fn new(
        policy: Policy,
        table_size: u64,
        endpoints: Vec<(Arc<EndpointState>, u32)>,
    ) -> Balancer {
        Balancer::reusing(policy, table_size, endpoints, &[])
    }

    /// [`Balancer::new`], taking a hash table from `previous` (the cluster's
    /// last balancer's [`Balancer::hash_tables`]) when one was built from
    /// the same size, endpoints and weights.
    pub fn reusing(
        policy: Policy,
        table_size: u64,
        endpoints: Vec<(Arc<EndpointState>, u32)>,
        previous: &[HashTable],
    ) -> Balancer {
        let weights: Vec<u32> = endpoints.iter().map(|(_, w)| (*w).max(1)).collect();
        let endpoints: Vec<Arc<EndpointState>> = endpoints.into_iter().map(|(e, _)| e).collect();
        let mut table_key = None;
        let picker = match policy {
            Policy::RoundRobin => Picker::RoundRobin(round_robin::RoundRobin::new(&weights)),
            Policy::Random => Picker::Random(random::Random::new(&weights)),
            Policy::LeastRequest | Policy::LoadAware => {
                Picker::LeastRequest(least_request::LeastRequest::new(&weights))
            }
            Policy::RingHash | Policy::Maglev => {
                let keys: Vec<String> = endpoints.iter().map(|e| e.addr.to_string()).collect();
                let default = if policy == Policy::RingHash {
                    1024
                } else {
                    65537
                };
                let size = if table_size == 0 { default } else { table_size };
                let (picker, key) = hash_table(previous, (size, keys, weights), policy);
                table_key = Some(key);
                picker
            }
            Policy::PeakEwma => Picker::PeakEwma,
        };
        Balancer {
            endpoints,
            picker,
            table_key,
            policy,
            warmup: None,
            zones: None,
        }
    }

    /// The hash tables this balancer holds (none but for the hash
    /// policies), for the next balancer of the cluster to reuse.
    pub fn hash_tables(&self) -> Vec<HashTable> {
        let mut out = Vec::new();
        let mut add = |b: &Balancer| {
            let table = match &b.picker {
                Picker::RingHash(r) => Table::Ring(r.clone()),
                Picker::Maglev(m) => Table::Maglev(m.clone()),
                _ => return,
            };
            if let Some(key) = &b.table_key {
                out.push(HashTable {
                    key: key.clone(),
                    table,
                });
            }
        };
        add(self);
        if let Some(z) = &self.zones {
            add(&z.local);
            add(&z.remote);
        }
        out
    }

    /// A balancer with zone failover: `policy` over the endpoints with
    /// `in_zone` set (the caller's zone) and over the others. Picks fall
    /// back to weighted random over all endpoints only when the zone a
    /// request was sent to has no healthy endpoint, so no third hash table
    /// is built for that. Without endpoints on both sides it is
    /// [`Balancer::new`].
    pub fn zoned(
        policy: Policy,
        table_size: u64,
        endpoints: Vec<(Arc<EndpointState>, u32)>,
        in_zone: &[bool],
        warmup: Option<Warmup>,
    ) -> Balancer {
        Balancer::zoned_reusing(policy, table_size, endpoints, in_zone, warmup, &[])
    }

    /// [`Balancer::zoned`], reusing `previous` hash tables as
    /// [`Balancer::reusing`] does.
    pub fn zoned_reusing(
        policy: Policy,
        table_size: u64,
        endpoints: Vec<(Arc<EndpointState>, u32)>,
        in_zone: &[bool],
        warmup: Option<Warmup>,
        previous: &[HashTable],
    ) -> Balancer {
        let local_count = in_zone.iter().filter(|l| **l).count();
        if local_count == 0 || local_count == endpoints.len() || in_zone.len() != endpoints.len() {
            return Balancer::reusing(policy, table_size, endpoints, previous).with_warmup(warmup);
        }
        let (local, remote): (Vec<_>, Vec<_>) = endpoints
            .iter()
            .cloned()
            .zip(in_zone)
            .partition(|(_, local)| **local);
        let side = |v: Vec<((Arc<EndpointState>, u32), &bool)>| {
            let eps = v.into_iter().map(|(e, _)| e).collect();
            Balancer::reusing(policy, table_size, eps, previous).with_warmup(warmup)
        };
        let zones = Zones {
            local: side(local),
            remote: side(remote),
            local_share: AtomicU32::new(SHARE_SCALE),
            computed_ms: AtomicU64::new(crate::clock::now_ms()),
        };
        let mut all = Balancer::new(Policy::Random, 0, endpoints).with_warmup(warmup);
        all.policy = policy;
        all.zones = Some(Box::new(zones));
        all
    }

    /// The endpoints of the caller's zone, when zone failover is on.
    pub fn local_endpoints(&self) -> Option<&[Arc<EndpointState>]> {
        self.zones.as_ref().map(|z| z.local.endpoints.as_slice())
    }

    /// Enables slow start for newly joined endpoints.
    pub fn with_warmup(mut self, warmup: Option<Warmup>) -> Balancer {
        self.warmup = warmup;
        self
    }

    /// True when `e` may take this request under slow start.
    #[inline]
    fn warm(&self, e: &EndpointState) -> bool {
        let Some(w) = &self.warmup else { return true };
        let joined = e.joined_ms.load(std::sync::atomic::Ordering::Relaxed);
        let age = crate::clock::now_ms().saturating_sub(joined);
        if joined == 0 || age >= w.window_ms {
            return true;
        }
        let factor = (age as f64 / w.window_ms as f64)
            .powf(w.inv_aggression)
            .max(w.min);
        (rng::next() >> 11) as f64 / (1u64 << 53) as f64 <= factor
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The endpoints, in config order.
    pub fn endpoints(&self) -> &[Arc<EndpointState>] {
        &self.endpoints
    }

    /// True when picks need the request's hash key.
    pub fn needs_hash(&self) -> bool {
        matches!(self.policy, Policy::RingHash | Policy::Maglev)
    }

    /// Picks an endpoint, skipping ones that are backing off after a connect
    /// failure and `avoid` (the endpoint a retry just failed on) when any
    /// other can serve. None only when there are no endpoints. `hash` is the
    /// request's key for the hash policies; without one they pick at random
    /// (the request is served, just not sticky).
    #[inline]
    pub fn pick(
        &self,
        hash: Option<u64>,
        avoid: Option<&Arc<EndpointState>>,
    ) -> Option<&Arc<EndpointState>> {
        if let Some(z) = &self.zones {
            if let Some(e) = z.pick(hash, avoid) {
                return Some(e);
            }
        }
        let n = self.endpoints.len();
        if n == 0 {
            return None;
        }
        let usable =
            |e: &Arc<EndpointState>| !e.is_failing() && !avoid.is_some_and(|a| Arc::ptr_eq(a, e));
        let mut first = None;
        for step in 0..3 {
            let i = self.pick_index(hash, step);
            let e = &self.endpoints[i];
            if usable(e) && self.warm(e) {
                return Some(e);
            }
            first.get_or_insert(i);
        }
        self.pick_slow(first.unwrap_or(0), avoid)
    }

    #[inline]
    fn pick_index(&self, hash: Option<u64>, step: usize) -> usize {
        match (&self.picker, hash) {
            (Picker::RoundRobin(p), _) => p.pick(),
            (Picker::Random(p), _) => p.pick(),
            (Picker::LeastRequest(p), _) => p.pick(&self.endpoints),
            (Picker::PeakEwma, _) => peak_ewma::PeakEwma::pick(&self.endpoints),
            (Picker::RingHash(r), Some(h)) => r.pick(h, step),
            (Picker::Maglev(m), Some(h)) => m.pick(h, step),
            (Picker::RingHash(_) | Picker::Maglev(_), None) => rng::below(self.endpoints.len()),
        }
    }

    #[cold]
    fn pick_slow(
        &self,
        fallback: usize,
        avoid: Option<&Arc<EndpointState>>,
    ) -> Option<&Arc<EndpointState>> {
        let n = self.endpoints.len();
        let start = rng::below(n);
        let not_avoided = |e: &&Arc<EndpointState>| !avoid.is_some_and(|a| Arc::ptr_eq(a, e));
        let rotated = || (0..n).map(|k| &self.endpoints[(start + k) % n]);
        rotated()
            .filter(not_avoided)
            .find(|e| !e.is_failing())
            // Every endpoint is failing: try the one failing the shortest
            // rather than fail the request without trying (panic mode).
            .or_else(|| {
                rotated()
                    .filter(not_avoided)
                    .min_by_key(|e| e.fail_until_ms.load(std::sync::atomic::Ordering::Relaxed))
            })
            .or(Some(&self.endpoints[fallback]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::time::Duration;

    fn eps(n: u8) -> Vec<(Arc<EndpointState>, u32)> {
        eps_in(0, n)
    }

    /// `n` endpoints in 10.`net`.0.0/24.
    fn eps_in(net: u8, n: u8) -> Vec<(Arc<EndpointState>, u32)> {
        (1..=n)
            .map(|i| {
                (
                    EndpointState::new(SocketAddr::from(([10, net, 0, i], 9090)), format!("p{i}")),
                    1,
                )
            })
            .collect()
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
                b.pick(Some(xxhash::xxh64(format!("user-{k}").as_bytes(), 0)), None)
                    .map(|e| e.addr)
                    .expect("endpoint")
            })
            .collect()
    }

    #[test]
    fn hash_policies_spread_keys_and_remap_little_when_an_endpoint_goes() {
        for policy in [Policy::RingHash, Policy::Maglev] {
            let all = eps(5);
            let before = owners(&Balancer::new(policy, 0, all.clone()), 10_000);
            let removed = all[2].0.addr;
            let rest: Vec<_> = all.into_iter().filter(|(e, _)| e.addr != removed).collect();
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
                let share = three.iter().filter(|a| **a == e.0.addr).count() as f64 / 1000.0;
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
        let count = |b: &Balancer, avoid: Option<&Arc<EndpointState>>| {
            let mut n: HashMap<SocketAddr, u32> = HashMap::new();
            for _ in 0..10_000 {
                *n.entry(b.pick(None, avoid).expect("endpoint").addr)
                    .or_default() += 1;
            }
            let get = |i: usize| n.get(&all[i].0.addr).copied().unwrap_or(0);
            [get(0), get(1), get(2), get(3)]
        };
        let settle = || {
            std::thread::sleep(Duration::from_millis(SHARE_REFRESH_MS + 5));
            crate::clock::tick();
        };
        // All healthy: the zone takes everything, round robin within it.
        assert_eq!(count(&b, None), [5000, 5000, 0, 0]);
        // A retry after a failure in the zone leaves it; one after a failure
        // elsewhere follows the share.
        assert_eq!(count(&b, Some(&all[0].0)), [0, 0, 5000, 5000]);
        assert_eq!(count(&b, Some(&all[2].0)), [5000, 5000, 0, 0]);
        // Half the zone ejected: it keeps 1.4 x 0.5 = 70%, the rest spills.
        let far = crate::clock::now_ms() + 1_000_000;
        all[0].0.outlier.eject_until(far);
        settle();
        let [a, l, r1, r2] = count(&b, None);
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
        all[1].0.outlier.eject_until(far);
        settle();
        assert_eq!(count(&b, None), [0, 0, 5000, 5000]);
        // Recovered: back home.
        all[0].0.outlier.eject_until(0);
        all[1].0.outlier.eject_until(0);
        settle();
        assert_eq!(count(&b, None), [5000, 5000, 0, 0]);
        // No endpoint in the caller's zone, or all of them: no split.
        let none = Balancer::zoned(Policy::RoundRobin, 0, all.clone(), &[false; 4], None);
        assert!(none.local_endpoints().is_none());
        let hash = Balancer::zoned(Policy::Maglev, 0, all.clone(), &in_zone, None);
        assert!(hash.needs_hash());
        let owners: std::collections::HashSet<_> = (0..1000u64)
            .map(|k| {
                hash.pick(Some(xxhash::xxh64(&k.to_le_bytes(), 0)), None)
                    .expect("endpoint")
                    .addr
            })
            .collect();
        assert_eq!(owners, [all[0].0.addr, all[1].0.addr].into_iter().collect());
    }

    #[test]
    fn hash_policies_honour_weights() {
        for policy in [Policy::RingHash, Policy::Maglev] {
            let mut e = eps(2);
            e[0].1 = 3;
            let b = Balancer::new(policy, 0, e.clone());
            let o = owners(&b, 20_000);
            let share = o.iter().filter(|a| **a == e[0].0.addr).count() as f64 / 20_000.0;
            assert!((share - 0.75).abs() < 0.05, "{}: {share}", policy.as_str());
        }
    }
}
