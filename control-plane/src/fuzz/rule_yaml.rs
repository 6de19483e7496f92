//! Rule files: arbitrary bytes through the parser and validation of a
//! config file (what `minimesh apply`, the files source and, per object,
//! the Kubernetes source and the webhook run), then through translation.
//! The properties: no panic (and nothing allocated without bound: the
//! parser's budget), and every rule accepted is accepted again, resolved
//! alike, when written back as JSON, which is how the leader records the
//! last good version in a rule's status (`status.lastGood`).

use std::path::Path;

use crate::config::parse::{parse_documents, parse_object};
use crate::config::Object;
use crate::store::Store;

/// Checks one input; panics on a violated property.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new("fuzz.yaml");
    let Ok(parsed) = parse_documents(file, text, "default") else {
        return;
    };
    let mut store = Store::default();
    for doc in parsed.documents {
        let (Some(key), Ok(object)) = (doc.key, doc.result) else {
            continue;
        };
        if let Object::Rule(rule) = &object {
            let written = serde_json::to_value(&rule.rule).expect("a rule serialises");
            let again = parse_object(file, written.clone(), "default")
                .expect("a rule written back is a document");
            match again.result {
                Ok(Object::Rule(back)) => assert_eq!(
                    back.resolved, rule.resolved,
                    "resolved differently once written back: {written}"
                ),
                other => panic!("an accepted rule, written back, is refused: {other:?}\n{written}"),
            }
        }
        store.insert(key, object, &file.to_path_buf());
    }
    let _ = crate::translate::translate(&store, &Default::default());
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_fuzz_corpus_holds() {
        let corpus = super::super::corpus("rule_yaml");
        assert!(corpus.len() >= 5);
        for data in corpus {
            super::check(&data);
        }
    }
}
