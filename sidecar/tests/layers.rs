//! The sidecar's modules depend on each other one way: no module reaches,
//! through `crate::` paths, a module that reaches back to it. A cycle means
//! two concerns that cannot be changed or tested apart (a balancer that
//! knows pools, a pool that knows routing).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module -> the modules its non-test code names with `crate::`.
fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let top = rel
                .components()
                .next()
                .and_then(|c| c.as_os_str().to_str())
                .expect("name")
                .trim_end_matches(".rs")
                .to_string();
            if top == "lib" {
                continue; // the wiring: it names every module
            }
            let text = std::fs::read_to_string(&path).expect("read");
            // Test modules may use anything.
            let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or("");
            let names = deps.entry(top.clone()).or_default();
            for part in code.split("crate::").skip(1) {
                let name: String = part
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != top {
                    names.insert(name);
                }
            }
        }
    }
    deps
}

/// A path from `from` back to `to`, if any.
fn path(
    deps: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if from == to {
        return Some(vec![to.to_string()]);
    }
    if !seen.insert(from.to_string()) {
        return None;
    }
    for next in deps.get(from).into_iter().flatten() {
        if let Some(mut p) = path(deps, next, to, seen) {
            p.insert(0, from.to_string());
            return Some(p);
        }
    }
    None
}

#[test]
fn no_module_depends_on_itself_through_others() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let deps = dependencies(&src);
    assert!(deps.contains_key("proxy") && deps.contains_key("balance"));
    for (module, names) in &deps {
        for next in names {
            if let Some(cycle) = path(&deps, next, module, &mut BTreeSet::new()) {
                panic!("{module} -> {}", cycle.join(" -> "));
            }
        }
    }
}
