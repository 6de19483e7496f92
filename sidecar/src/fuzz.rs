//! Entry points of the sidecar's coverage-guided fuzz targets that drive
//! more than one module (`fuzz/fuzz_targets/`), and of the tests that
//! replay their corpora. Above every other module: nothing depends on it.
//! Not part of the sidecar's interface.

pub mod request_path;
