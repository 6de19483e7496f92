//! The fake's reads: a list (label and field selectors, kubectl's Table)
//! and a watch from a resourceVersion, ended at its `timeoutSeconds`.

use std::collections::BTreeMap;
use std::time::Duration;

use http::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::wire::{api_version, json_response, label_match};
use super::{kubectl, Body, FakeKube, Watch, COLLECTIONS};

impl FakeKube {
    /// A watch of collection `c` (in `ns`; of the object `only`) from the
    /// query's resourceVersion.
    pub(super) fn watch_request(
        &self,
        c: usize,
        ns: Option<String>,
        only: Option<String>,
        query: &BTreeMap<String, String>,
    ) -> Response<Body> {
        let plural = COLLECTIONS[c].2;
        let from: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bookmarks = query
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true");
        // The real server ends a watch at its `timeoutSeconds`.
        let cap = self.watch_cap_ms.load(std::sync::atomic::Ordering::Relaxed);
        let ends = query
            .get("timeoutSeconds")
            .and_then(|t| t.parse::<u64>().ok())
            .map(|s| s * 1000)
            .into_iter()
            .chain((cap > 0).then_some(cap))
            .min()
            .map(Duration::from_millis);
        self.watch(
            Watch {
                c,
                tx: mpsc::unbounded_channel().0,
                bookmarks,
                namespace: ns,
                name: only,
                labels: query.get("labelSelector").cloned(),
            },
            from,
            plural,
            ends,
        )
    }

    /// A list of collection `c` (in `ns`; of the object `only`), as kubectl's
    /// Table when `table`.
    pub(super) fn list_request(
        &self,
        c: usize,
        ns: Option<String>,
        only: Option<String>,
        query: &BTreeMap<String, String>,
        table: bool,
    ) -> Response<Body> {
        let plural = COLLECTIONS[c].2;
        let mut inner = self.inner.lock().expect("lock");
        inner.log.push(match &ns {
            Some(ns) => format!("LIST {plural} in {ns}"),
            None => format!("LIST {plural}"),
        });
        let items: Vec<Value> = inner
            .objects
            .iter()
            .filter(|((oc, ons, oname), _)| {
                *oc == c
                    && ns.as_ref().is_none_or(|n| n == ons)
                    && only.as_ref().is_none_or(|n| n == oname)
            })
            .filter(|(_, o)| {
                query
                    .get("labelSelector")
                    .is_none_or(|l| label_match(l, &o["metadata"]["labels"]))
            })
            .map(|(_, o)| {
                let mut o = o.clone();
                // Built-in kinds' list items carry no apiVersion/kind.
                if COLLECTIONS[c].0 != "minimesh.io" {
                    if let Some(m) = o.as_object_mut() {
                        m.remove("apiVersion");
                        m.remove("kind");
                    }
                }
                o
            })
            .collect();
        if table {
            return json_response(StatusCode::OK, &kubectl::table(c, &items, inner.rv));
        }
        let (g, v, _, kind) = COLLECTIONS[c];
        json_response(
            StatusCode::OK,
            &json!({
                "apiVersion": api_version(g, v), "kind": format!("{kind}List"),
                "metadata": {"resourceVersion": inner.rv.to_string()},
                "items": items
            }),
        )
    }
}
