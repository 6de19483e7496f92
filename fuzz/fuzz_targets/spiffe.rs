//! A peer certificate's SPIFFE ID and secure naming's verdict on it
//! (`sidecar/src/tls/fuzz.rs`): no panic, only the expected identity
//! accepted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_sidecar::tls::fuzz;

fuzz_target!(|data: &[u8]| {
    fuzz::check(data);
});
