//! Endpoint picking. A [`Balancer`] is built off the request path whenever a
//! cluster's endpoints or policy change (schedules, alias tables), and a pick
//! is then a few atomic loads and arithmetic: no lock, no allocation.
//!
//! Balancers know an endpoint only through [`Endpoint`] (its load, whether
//! it is skipped, when it joined, its latency estimate) and the time only as
//! the `now_ms` a pick is given: nothing here opens a socket or reads a
//! clock, so every policy is tested on plain values.

#[cfg(test)]
pub(crate) mod fake;
pub mod least_request;
pub mod maglev;
pub mod peak_ewma;
pub mod random;
pub mod ring_hash;
pub mod rng;
pub mod round_robin;
pub mod weighted;
pub mod xxhash;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// The policies (one type with the control plane's).
pub use minimesh_proto::Policy;

/// What a balancer reads of an endpoint.
pub trait Endpoint {
    /// Its address (the hash policies' key).
    fn addr(&self) -> SocketAddr;
    /// Requests in flight.
    fn active(&self) -> u32;
    /// Skipped at `now_ms`: backing off after a failure, ejected, or
    /// failing its health check.
    fn is_failing(&self, now_ms: u64) -> bool;
    /// When its backoff ends (when every endpoint is skipped, the one whose
    /// backoff ends first is tried).
    fn backoff_until_ms(&self) -> u64;
    /// When it joined its cluster, for slow start; 0: present from the start.
    fn joined_ms(&self) -> u64;
    /// PEAK_EWMA's estimate of its round-trip time.
    fn rtt(&self) -> &peak_ewma::Ewma;
}

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
pub struct Balancer<E> {
    endpoints: Vec<Arc<E>>,
    picker: Picker,
    /// What the hash table was built from (hash policies only).
    table_key: Option<TableKey>,
    policy: Policy,
    warmup: Option<Warmup>,
    zones: Option<Box<Zones<E>>>,
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
struct Zones<E> {
    local: Balancer<E>,
    remote: Balancer<E>,
    /// Out of [`SHARE_SCALE`].
    local_share: AtomicU32,
    /// When `local_share` was computed (a pick's `now_ms`).
    computed_ms: AtomicU64,
}

impl<E: Endpoint> Zones<E> {
    #[inline]
    fn share(&self, now: u64) -> u32 {
        if now.saturating_sub(self.computed_ms.load(Ordering::Relaxed)) < SHARE_REFRESH_MS {
            return self.local_share.load(Ordering::Relaxed);
        }
        let eps = &self.local.endpoints;
        let healthy = eps.iter().filter(|e| !e.is_failing(now)).count() as u64;
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
    fn pick(&self, hash: Option<u64>, avoid: &[Arc<E>], now_ms: u64) -> Option<&Arc<E>> {
        let retried_here = avoid
            .iter()
            .any(|a| self.local.endpoints.iter().any(|e| Arc::ptr_eq(e, a)));
        let local = !retried_here && {
            let share = self.share(now_ms);
            share >= SHARE_SCALE || (share > 0 && (rng::next() as u32 % SHARE_SCALE) < share)
        };
        let side = if local { &self.local } else { &self.remote };
        side.pick(hash, avoid, now_ms)
            .filter(|e| !e.is_failing(now_ms) && !avoided(avoid, e))
    }
}

impl<E: Endpoint> Balancer<E> {
    /// Builds a balancer over `(endpoint, weight)` pairs (weights >= 1).
    /// `table_size` is the minimum ring size (ring hash) or table size
    /// (Maglev); 0 takes Envoy's defaults (1024, 65537).
    pub fn new(policy: Policy, table_size: u64, endpoints: Vec<(Arc<E>, u32)>) -> Self {
        Balancer::reusing(policy, table_size, endpoints, &[])
    }

    /// [`Balancer::new`], taking a hash table from `previous` (the cluster's
    /// last balancer's [`Balancer::hash_tables`]) when one was built from
    /// the same size, endpoints and weights.
    pub fn reusing(
        policy: Policy,
        table_size: u64,
        endpoints: Vec<(Arc<E>, u32)>,
        previous: &[HashTable],
    ) -> Self {
        let weights: Vec<u32> = endpoints.iter().map(|(_, w)| (*w).max(1)).collect();
        let endpoints: Vec<Arc<E>> = endpoints.into_iter().map(|(e, _)| e).collect();
        let mut table_key = None;
        let picker = match policy {
            Policy::RoundRobin => Picker::RoundRobin(round_robin::RoundRobin::new(&weights)),
            Policy::Random => Picker::Random(random::Random::new(&weights)),
            Policy::LeastRequest | Policy::LoadAware => {
                Picker::LeastRequest(least_request::LeastRequest::new(&weights))
            }
            Policy::RingHash | Policy::Maglev => {
                let keys: Vec<String> = endpoints.iter().map(|e| e.addr().to_string()).collect();
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
        let mut add = |b: &Balancer<E>| {
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
        endpoints: Vec<(Arc<E>, u32)>,
        in_zone: &[bool],
        warmup: Option<Warmup>,
    ) -> Self {
        Balancer::zoned_reusing(policy, table_size, endpoints, in_zone, warmup, &[])
    }

    /// [`Balancer::zoned`], reusing `previous` hash tables as
    /// [`Balancer::reusing`] does.
    pub fn zoned_reusing(
        policy: Policy,
        table_size: u64,
        endpoints: Vec<(Arc<E>, u32)>,
        in_zone: &[bool],
        warmup: Option<Warmup>,
        previous: &[HashTable],
    ) -> Self {
        let local_count = in_zone.iter().filter(|l| **l).count();
        if local_count == 0 || local_count == endpoints.len() || in_zone.len() != endpoints.len() {
            return Balancer::reusing(policy, table_size, endpoints, previous).with_warmup(warmup);
        }
        let (local, remote): (Vec<_>, Vec<_>) = endpoints
            .iter()
            .cloned()
            .zip(in_zone)
            .partition(|(_, local)| **local);
        let side = |v: Vec<((Arc<E>, u32), &bool)>| {
            let eps = v.into_iter().map(|(e, _)| e).collect();
            Balancer::reusing(policy, table_size, eps, previous).with_warmup(warmup)
        };
        let zones = Zones {
            local: side(local),
            remote: side(remote),
            local_share: AtomicU32::new(SHARE_SCALE),
            // Computed at the first pick.
            computed_ms: AtomicU64::new(0),
        };
        let mut all = Balancer::new(Policy::Random, 0, endpoints).with_warmup(warmup);
        all.policy = policy;
        all.zones = Some(Box::new(zones));
        all
    }

    /// The endpoints of the caller's zone, when zone failover is on.
    pub fn local_endpoints(&self) -> Option<&[Arc<E>]> {
        self.zones.as_ref().map(|z| z.local.endpoints.as_slice())
    }

    /// Enables slow start for newly joined endpoints.
    pub fn with_warmup(mut self, warmup: Option<Warmup>) -> Self {
        self.warmup = warmup;
        self
    }

    /// True when `e` may take this request under slow start.
    #[inline]
    fn warm(&self, e: &E, now_ms: u64) -> bool {
        let Some(w) = &self.warmup else { return true };
        let joined = e.joined_ms();
        let age = now_ms.saturating_sub(joined);
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
    pub fn endpoints(&self) -> &[Arc<E>] {
        &self.endpoints
    }

    /// True when picks need the request's hash key.
    pub fn needs_hash(&self) -> bool {
        matches!(self.policy, Policy::RingHash | Policy::Maglev)
    }

    /// Picks an endpoint, skipping ones that are backing off after a connect
    /// failure and those in `avoid` (the endpoints a retry's request already
    /// failed on, as Envoy's `previous_hosts` retry predicate) when any other
    /// can serve. None only when there are no endpoints. `hash` is the
    /// request's key for the hash policies; without one they pick at random
    /// (the request is served, just not sticky). `now_ms` is the sidecar
    /// clock's milliseconds (its coarse `now_ms` on the request path).
    #[inline]
    pub fn pick(&self, hash: Option<u64>, avoid: &[Arc<E>], now_ms: u64) -> Option<&Arc<E>> {
        if let Some(z) = &self.zones {
            if let Some(e) = z.pick(hash, avoid, now_ms) {
                return Some(e);
            }
        }
        let n = self.endpoints.len();
        if n == 0 {
            return None;
        }
        let usable = |e: &Arc<E>| !e.is_failing(now_ms) && !avoided(avoid, e);
        let mut first = None;
        for step in 0..3 {
            let i = self.pick_index(hash, step, now_ms);
            let e = &self.endpoints[i];
            if usable(e) && self.warm(e, now_ms) {
                return Some(e);
            }
            first.get_or_insert(i);
        }
        self.pick_slow(first.unwrap_or(0), avoid, now_ms)
    }

    #[inline]
    fn pick_index(&self, hash: Option<u64>, step: usize, now_ms: u64) -> usize {
        match (&self.picker, hash) {
            (Picker::RoundRobin(p), _) => p.pick(),
            (Picker::Random(p), _) => p.pick(),
            (Picker::LeastRequest(p), _) => p.pick(&self.endpoints),
            (Picker::PeakEwma, _) => peak_ewma::PeakEwma::pick(&self.endpoints, now_ms * 1000),
            (Picker::RingHash(r), Some(h)) => r.pick(h, step),
            (Picker::Maglev(m), Some(h)) => m.pick(h, step),
            (Picker::RingHash(_) | Picker::Maglev(_), None) => rng::below(self.endpoints.len()),
        }
    }

    #[cold]
    fn pick_slow(&self, fallback: usize, avoid: &[Arc<E>], now_ms: u64) -> Option<&Arc<E>> {
        let n = self.endpoints.len();
        let start = rng::below(n);
        let not_avoided = |e: &&Arc<E>| !avoided(avoid, e);
        let rotated = || (0..n).map(|k| &self.endpoints[(start + k) % n]);
        rotated()
            .filter(not_avoided)
            .find(|e| !e.is_failing(now_ms))
            // Every endpoint is failing: try the one failing the shortest
            // rather than fail the request without trying (panic mode).
            .or_else(|| {
                rotated()
                    .filter(not_avoided)
                    .min_by_key(|e| e.backoff_until_ms())
            })
            .or(Some(&self.endpoints[fallback]))
    }
}

/// True when `e` is one of `avoid` (by identity: the same endpoint of this
/// balancer, not an equal address of another).
#[inline]
fn avoided<E>(avoid: &[Arc<E>], e: &Arc<E>) -> bool {
    avoid.iter().any(|a| Arc::ptr_eq(a, e))
}

#[cfg(test)]
mod tests;
