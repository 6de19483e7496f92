//! The fake's reads: a list (label and field selectors, kubectl's Table)
//! a watch from a resourceVersion, ended at its `timeoutSeconds`; one
//! object.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::wire::{api_version, gone, json_response, label_match, status_response, watch_line};
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

    fn watch(
        &self,
        mut w: Watch,
        from: u64,
        plural: &str,
        ends: Option<Duration>,
    ) -> Response<Body> {
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        if let Some(after) = ends {
            // Dropping the watch's sender ends its stream: the response ends.
            let (inner, ending) = (self.inner.clone(), tx.downgrade());
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                if let Some(tx) = ending.upgrade() {
                    let mut inner = inner.lock().expect("lock");
                    inner.watches.retain(|w| !w.tx.same_channel(&tx));
                }
            });
        }
        w.tx = tx;
        let mut inner = self.inner.lock().expect("lock");
        inner.log.push(match &w.namespace {
            Some(ns) => format!("WATCH {plural} {from} in {ns}"),
            None => format!("WATCH {plural} {from}"),
        });
        if from < inner.compacted {
            let _ = w.tx.send(watch_line("ERROR", &gone(from, inner.compacted)));
        } else {
            for (rv, hc, kind, obj) in &inner.history {
                if *rv > from && w.selects(*hc, obj) {
                    let _ = w.tx.send(watch_line(kind, obj));
                }
            }
            inner.watches.push(w);
        }
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
            .map(|b| Ok::<_, Infallible>(Frame::data(b)));
        Response::builder()
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .expect("response")
    }

    /// GET of one object (or of its status subresource: the whole object
    /// too), or its Table for kubectl.
    pub(super) fn get_request(
        &self,
        c: usize,
        ns: Option<String>,
        name: &str,
        table: bool,
    ) -> Response<Body> {
        let plural = COLLECTIONS[c].2;
        let inner = self.inner.lock().expect("lock");
        match inner
            .objects
            .get(&(c, ns.unwrap_or_default(), name.to_string()))
        {
            Some(o) if table => json_response(
                StatusCode::OK,
                &kubectl::table(c, std::slice::from_ref(o), inner.rv),
            ),
            Some(o) => json_response(StatusCode::OK, o),
            None => status_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{plural} \"{name}\" not found"),
            ),
        }
    }
}
