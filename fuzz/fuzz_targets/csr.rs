//! Certificate signing requests to the mesh's CA
//! (`control-plane/src/fuzz/csr.rs`): no panic, a signed certificate names
//! the caller's proven identity only.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_control_plane::fuzz::csr;

fuzz_target!(|data: &[u8]| {
    csr::check(data);
});
