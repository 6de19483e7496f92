//! A per-thread xorshift64* generator: statistically fine for picking, a
//! couple of nanoseconds a call, and no shared state between threads.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};

thread_local! {
    static STATE: Cell<u64> = Cell::new(seed());
}

fn seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(&h as *const _ as usize);
    h.finish() | 1
}

/// The next random 64-bit value.
#[inline]
pub fn next() -> u64 {
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}

/// A uniform index below `n` (n > 0), by multiply-shift rather than modulo.
#[inline]
pub fn below(n: usize) -> usize {
    (((next() >> 32) * n as u64) >> 32) as usize
}
