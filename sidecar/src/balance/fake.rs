//! An endpoint made of plain values, for the balancers' unit tests: what a
//! pick reads, set directly, with no state, pool or clock behind it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::peak_ewma::Ewma;
use super::Endpoint;

/// A test endpoint.
#[derive(Debug, Default)]
pub struct Fake {
    addr: Option<SocketAddr>,
    /// Requests in flight.
    pub active: AtomicU32,
    /// Skipped until this time (ms).
    pub down_until_ms: AtomicU64,
    /// Skipped at any time (a failing health check).
    pub down: AtomicBool,
    /// Joined its cluster at (ms); 0: from the start.
    pub joined_ms: AtomicU64,
    /// Its latency estimate.
    pub rtt: Ewma,
}

impl Fake {
    /// An endpoint at 10.`net`.0.`host`:9090.
    pub fn at(net: u8, host: u8) -> Arc<Fake> {
        Arc::new(Fake {
            addr: Some(SocketAddr::from(([10, net, 0, host], 9090))),
            ..Default::default()
        })
    }

    /// `n` endpoints in 10.`net`.0.0/24, each of weight 1.
    pub fn many(net: u8, n: u8) -> Vec<(Arc<Fake>, u32)> {
        (1..=n).map(|i| (Fake::at(net, i), 1)).collect()
    }

    /// With `n` requests in flight.
    pub fn with_active(self: Arc<Self>, n: u32) -> Arc<Self> {
        self.active.store(n, Ordering::Relaxed);
        self
    }
}

impl Endpoint for Fake {
    fn addr(&self) -> SocketAddr {
        self.addr.unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    }
    fn active(&self) -> u32 {
        self.active.load(Ordering::Relaxed)
    }
    fn is_failing(&self, now_ms: u64) -> bool {
        self.down.load(Ordering::Relaxed) || self.down_until_ms.load(Ordering::Relaxed) > now_ms
    }
    fn backoff_until_ms(&self) -> u64 {
        self.down_until_ms.load(Ordering::Relaxed)
    }
    fn joined_ms(&self) -> u64 {
        self.joined_ms.load(Ordering::Relaxed)
    }
    fn rtt(&self) -> &Ewma {
        &self.rtt
    }
}
