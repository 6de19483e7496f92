//! A coarse millisecond clock read with one atomic load, so that picks can
//! check "is this endpoint backing off" without a clock call per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

static NOW_MS: AtomicU64 = AtomicU64::new(1);
static START: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the process started, updated every millisecond or so.
#[inline]
pub fn now_ms() -> u64 {
    NOW_MS.load(Ordering::Relaxed)
}

/// Precise milliseconds since the process started (a clock call).
pub fn precise_ms() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// Starts the task that advances [`now_ms`]. Idempotent enough: a second
/// task only writes the same values.
pub fn start() {
    let _ = START.get_or_init(Instant::now);
    tokio::spawn(async {
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            NOW_MS.store(precise_ms(), Ordering::Relaxed);
        }
    });
}
