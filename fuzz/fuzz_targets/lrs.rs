//! Envoy's and gRPC's load reports, converted and aggregated
//! (`control-plane/src/fuzz/lrs.rs`): no panic, only `ip:port` endpoints,
//! a finite view.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_control_plane::fuzz::lrs;

fuzz_target!(|data: &[u8]| {
    lrs::check(data);
});
