//! The control plane's modules form layers: each names (through `crate::`
//! paths, in its non-test code) only modules of its own layer or below, and
//! no module reaches one that reaches back to it. A cycle is two concerns
//! that cannot be changed or tested apart; a back-import is the first step
//! of one.

#[path = "../../tests/support/module_graph.rs"]
mod module_graph;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, bottom first. `lib.rs` is above them all: the wiring.
const LAYERS: &[(&str, &[&str])] = &[
    // Rule, route and Kubernetes types and their parsing; the load view
    // (pure aggregation of reports).
    ("config", &["config", "load"]),
    // What the sources read, as one value; LOAD_AWARE's weights from the
    // load view.
    ("store", &["store", "load_aware"]),
    // The sources: files, the Kubernetes API (hands objects to the store,
    // writes the statuses it is given).
    ("sources", &["source"]),
    // The one route and cluster model, and every status it decides.
    ("translate", &["translate"]),
    // The model's encodings: Envoy's xDS v3 (minimesh's is the model's own
    // messages).
    ("encodings", &["xds_v3"]),
    // Both encodings per version and per namespace's view.
    ("cache", &["cache"]),
    // Who a caller is: the CA, tokens, the streams' checks.
    ("identity", &["ca"]),
    // The streams: discovery (minimesh's and Envoy's ADS), load reports.
    ("sessions", &["discovery", "lrs"]),
    // What listens: the gRPC port, admin, the webhooks.
    ("servers", &["grpc", "admin", "webhook"]),
    // Translation published to the cache and the admin views.
    ("publication", &["publish"]),
    // The flags of every module, and the fuzz targets' entry points.
    ("entry points", &["args", "fuzz"]),
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// What is wrong with `deps` as layers: a module not placed in a layer, a
/// name that is no module (an item of `lib.rs`, the wiring), a module naming
/// one above it, and every cycle.
fn violations(deps: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut found = Vec::new();
    for (module, names) in deps {
        let Some(layer) = layer_of(module) else {
            found.push(format!(
                "{module} is in no layer: place it in LAYERS (control-plane/tests/layers.rs)"
            ));
            continue;
        };
        for name in names {
            match layer_of(name) {
                None if !deps.contains_key(name) => found.push(format!(
                    "{module} names crate::{name}, an item of lib.rs (the wiring): move it to the module it belongs to"
                )),
                None => {}
                Some(l) if l > layer => found.push(format!(
                    "{module} ({}) names {name} ({}), a layer above it",
                    LAYERS[layer].0, LAYERS[l].0
                )),
                Some(_) => {}
            }
        }
    }
    found.extend(
        module_graph::cycles(deps)
            .into_iter()
            .map(|c| format!("cycle: {c}")),
    );
    found
}

#[test]
fn modules_name_only_their_layer_and_those_below_with_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let deps = module_graph::dependencies(&src);
    assert!(deps.contains_key("translate") && deps.contains_key("discovery"));
    // Grouped paths are read: publish names translate only as
    // `crate::{config, source, translate}`.
    assert!(
        deps["publish"].contains("translate"),
        "{:?}",
        deps["publish"]
    );
    let found = violations(&deps);
    assert!(
        found.is_empty(),
        "the control plane's layers:\n{}",
        found.join("\n")
    );
}

/// The reader and the check on a crate made up for the purpose: every kind
/// of back-import they must catch.
#[test]
fn a_back_import_fails_the_check() {
    let dir = std::env::temp_dir().join(format!("minimesh-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let write = |path: &str, text: &str| {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write(
        "lib.rs",
        "pub mod config;\npub mod translate;\npub struct Wiring;\n",
    );
    write("config.rs", "pub struct Rule;\n");
    write(
        "translate.rs",
        "use crate::config::Rule;\nmod model;\n#[cfg(test)]\nmod tests {\n    use crate::publish::X;\n}\n",
    );
    write("translate/model.rs", "pub struct Model;\n");
    let deps = module_graph::dependencies(&dir);
    assert!(violations(&deps).is_empty(), "{:?}", violations(&deps));

    // Below its test module, in a submodule's file, in a group, through an
    // item of lib.rs: each is found.
    write(
        "config.rs",
        "pub struct Rule;\n#[cfg(test)]\nmod tests {}\nuse crate::translate::model;\n",
    );
    let deps = module_graph::dependencies(&dir);
    assert_eq!(
        violations(&deps),
        [
            "config (config) names translate (translate), a layer above it",
            "cycle: config -> translate -> config",
            "cycle: translate -> config -> translate",
        ]
    );
    write("config.rs", "pub struct Rule;\n");
    write("config/kube.rs", "use crate::{store, Wiring};\n");
    write(
        "lib.rs",
        "pub mod config;\npub mod store;\npub mod translate;\npub struct Wiring;\n",
    );
    write("config.rs", "pub struct Rule;\npub mod kube;\n");
    write("store.rs", "pub struct Store;\n");
    let deps = module_graph::dependencies(&dir);
    assert_eq!(
        violations(&deps),
        [
            "config names crate::Wiring, an item of lib.rs (the wiring): move it to the module it belongs to",
            "config (config) names store (store), a layer above it",
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
