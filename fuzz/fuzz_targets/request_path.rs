//! A client's bytes through a listener's request path, as a gateway's edge
//! or a sidecar's inbound listener serves them, to an app and back
//! (`minimesh_sidecar::fuzz::request_path`): HTTP/1.1 heads and bodies, HTTP/2
//! prior knowledge, the sniffing of the two, authorities, hop-by-hop and
//! mesh headers, authorization. The first byte picks the listener (even:
//! the edge). The properties, in `fuzz::request_path::check`: no panic; the
//! connection closed after the client's end; no hop-by-hop header, no
//! client's mesh header through the edge and no denied path reaches the
//! app; the app's mesh headers and a 5xx reason's address never reach the
//! client.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_sidecar::fuzz::request_path as fuzz;

fuzz_target!(|data: &[u8]| {
    let _ = fuzz::check(data);
});
