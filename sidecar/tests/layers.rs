//! The sidecar's modules depend on each other one way: no module reaches,
//! through `crate::` paths, a module that reaches back to it. A cycle means
//! two concerns that cannot be changed or tested apart (a balancer that
//! knows pools, a pool that knows routing).

#[path = "../../tests/support/module_graph.rs"]
mod module_graph;

use std::path::Path;

#[test]
fn no_module_depends_on_itself_through_others() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let deps = module_graph::dependencies(&src);
    assert!(deps.contains_key("proxy") && deps.contains_key("balance"));
    // Read to the end: h1.rs names tls below its test-only module.
    assert!(deps["h1"].contains("tls"), "{:?}", deps["h1"]);
    let cycles = module_graph::cycles(&deps);
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}
