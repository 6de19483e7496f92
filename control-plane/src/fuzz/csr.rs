//! Certificate signing requests: arbitrary bytes as the PEM a workload
//! sends the CA. The properties: no panic; a request the CA signs gets a
//! certificate whose only name is the caller's proven identity, whatever
//! the request asks for.

use std::sync::OnceLock;
use std::time::Duration;

use crate::ca::{generate_root, Ca, Identity};

fn ca() -> &'static Ca {
    static CA: OnceLock<Ca> = OnceLock::new();
    CA.get_or_init(|| {
        let (root, key) = generate_root("cluster.local").expect("a root");
        Ca::from_pem(&root, &key, "cluster.local", Duration::from_secs(3600)).expect("the CA")
    })
}

/// Checks one input; panics on a violated property.
pub fn check(data: &[u8]) {
    let who = Identity {
        namespace: "default".into(),
        service_account: "backend".into(),
        pod: None,
    };
    if let Ok(issued) = ca().issue(&String::from_utf8_lossy(data), &who) {
        assert_eq!(
            issued.spiffe_id,
            "spiffe://cluster.local/ns/default/sa/backend"
        );
        assert!(issued.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_corpus_replays() {
        let corpus = super::super::corpus("csr");
        assert!(!corpus.is_empty());
        for input in corpus {
            super::check(&input);
        }
    }
}
