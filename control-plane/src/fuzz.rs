//! The entry points of the control plane's coverage-guided fuzz targets
//! (`fuzz/fuzz_targets/`) and of the tests that replay their corpora. Not
//! part of the control plane's interface.

pub mod admission;
pub mod csr;
pub mod discovery;
pub mod load_reports;
pub mod lrs;
pub mod rule_yaml;

/// Every file of the corpus of fuzz target `target`, for the replay tests.
#[cfg(test)]
pub(crate) fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| std::fs::read(e.expect("entry").path()).expect("read"))
        .collect()
}
