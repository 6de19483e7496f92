//! Runs of decoded discovery requests into one stream's session, with the
//! config published between them (`control-plane/src/fuzz/discovery.rs`):
//! no panic, responses only of served types, growing nonces, no name twice.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_control_plane::fuzz::discovery;

fuzz_target!(|data: &[u8]| {
    discovery::check(data);
});
