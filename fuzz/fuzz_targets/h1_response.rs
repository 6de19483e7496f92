//! The sidecar's upstream HTTP/1.1 response reader (`sidecar/src/h1.rs`:
//! head parser, Content-Length / chunked / until-close body decoder,
//! trailers) on arbitrary bytes. The first byte picks the read size (1-64)
//! and whether the request was a HEAD; the rest is what the "server" sent.
//! The property (`h1::fuzz::check`): no panic, no wait on bytes already
//! there, and the same result whether the bytes come in one read, one at a
//! time, or in reads of the chosen size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_sidecar::h1::fuzz;

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let _ = fuzz::check(rest, usize::from(first % 64) + 1, first & 0x80 != 0);
});
