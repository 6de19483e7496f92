//! A coarse millisecond clock read with one atomic load, so that picks can
//! check "is this endpoint backing off" without a clock call each. The
//! request path advances it ([`advance`], with the clock reads it makes
//! anyway to time each request); nothing ticks while the sidecar is idle, so
//! an idle sidecar costs no CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use tokio::time::Instant;

static NOW_MS: AtomicU64 = AtomicU64::new(1);
static START: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the process started, as of the last [`tick`].
#[inline]
pub fn now_ms() -> u64 {
    NOW_MS.load(Ordering::Relaxed)
}

/// Precise milliseconds since the process started (a clock call).
pub fn precise_ms() -> u64 {
    ms_at(Instant::now())
}

fn ms_at(t: Instant) -> u64 {
    t.saturating_duration_since(*START.get_or_init(Instant::now))
        .as_millis() as u64
        + 1
}

/// Advances [`now_ms`] to the present and returns it; called as each
/// request starts and where a fresh time matters (latency observations).
#[inline]
pub fn tick() -> u64 {
    advance(Instant::now())
}

/// [`tick`] with a time already read (`Instant::now()` a moment ago), for a
/// caller that needs the `Instant` too: one clock call, not two.
#[inline]
pub fn advance(now: Instant) -> u64 {
    let now = ms_at(now);
    // A plain store, at most once a millisecond: no read-modify-write on a
    // line every event loop shares, per request.
    if now > NOW_MS.load(Ordering::Relaxed) {
        NOW_MS.store(now, Ordering::Relaxed);
    }
    now
}

/// Sets the clock's origin.
pub fn start() {
    let _ = START.get_or_init(Instant::now);
    tick();
}
