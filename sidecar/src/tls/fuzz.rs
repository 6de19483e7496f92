//! A peer's identity read from its certificate, and secure naming's verdict
//! on it: arbitrary bytes as a DER certificate, and as a SPIFFE ID. The
//! entry point of the coverage-guided fuzz target
//! (`fuzz/fuzz_targets/spiffe.rs`) and of the corpus test. The properties:
//! no panic; an identity secure naming accepts for `default/backend` is
//! exactly that service account's in the trust domain, and one it accepts
//! for any service account is of the trust domain. Not part of the
//! sidecar's interface.

use super::{spiffe_id, Peer};

/// Checks one input; panics on a violated property.
pub fn check(data: &[u8]) {
    let backend = Peer::new(vec!["default/backend".into()]);
    let any = Peer::new(vec![]);
    let ids = [
        spiffe_id(data),
        std::str::from_utf8(data).ok().map(String::from),
    ];
    for id in ids.into_iter().flatten() {
        if backend.accepts(&id, "cluster.local") {
            assert_eq!(id, "spiffe://cluster.local/ns/default/sa/backend");
        }
        if any.accepts(&id, "cluster.local") {
            assert!(id.starts_with("spiffe://cluster.local/"), "{id}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_corpus_replays() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/spiffe");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).expect("corpus") {
            super::check(&std::fs::read(entry.expect("entry").path()).expect("read"));
            n += 1;
        }
        assert!(n > 0);
        // The seed certificate names backend's identity, which is accepted.
        let der = std::fs::read(dir.join("backend.der")).expect("seed");
        assert_eq!(
            super::spiffe_id(&der).as_deref(),
            Some("spiffe://cluster.local/ns/default/sa/backend")
        );
    }
}
