//! Runs of load reports from a few sidecars through the aggregator and
//! LOAD_AWARE (`control-plane/src/fuzz/load_reports.rs`): no panic, every
//! figure finite, success ratios in [0, 1], weights within their bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_control_plane::fuzz::load_reports;

fuzz_target!(|data: &[u8]| load_reports::check(data));
