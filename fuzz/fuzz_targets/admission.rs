//! The webhooks' AdmissionReview decoding (`control-plane/src/fuzz/admission.rs`):
//! no panic, a non-review refused, an answer for the request's own uid.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_control_plane::fuzz::admission;

fuzz_target!(|data: &[u8]| {
    admission::check(data);
});
