//! The control plane's modules form layers, each naming (through `crate::`
//! paths) only those below it:
//!
//! config (rule types, parsing) → store → translate (the one route and
//! cluster model) → encodings (minimesh, xDS v3) → cache → sessions
//! (discovery, load) → servers (grpc, admin, webhooks) → `lib.rs`, the wiring.
//!
//! No module reaches one that reaches back to it: a cycle is two concerns
//! that cannot be changed or tested apart.

#[path = "../../tests/support/module_graph.rs"]
mod module_graph;

use std::path::Path;

#[test]
fn no_module_depends_on_itself_through_others() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let deps = module_graph::dependencies(&src);
    for (m, d) in &deps {
        eprintln!("{m}: {d:?}");
    }
    assert!(deps.contains_key("translate") && deps.contains_key("discovery"));
    let cycles = module_graph::cycles(&deps);
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}
