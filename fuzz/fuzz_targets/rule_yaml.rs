//! Rule files through the control plane's parser, validation and
//! translation (`control-plane/src/fuzz/rule_yaml.rs`): no panic, and every
//! rule accepted is accepted again, resolved alike, once written back.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minimesh_control_plane::fuzz::rule_yaml;

fuzz_target!(|data: &[u8]| rule_yaml::check(data));
