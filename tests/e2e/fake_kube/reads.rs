//! The fake's reads: a list (label and field selectors, kubectl's Table)
//! a watch from a resourceVersion, ended at its `timeoutSeconds`; one
//! object.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::{Duration, Instant};

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
        let now = Instant::now();
        let deadline = ends.map(|e| now + e);
        self.watch(
            Watch {
                c,
                tx: mpsc::unbounded_channel().0,
                bookmarks,
                namespace: ns,
                name: only,
                labels: query.get("labelSelector").cloned(),
                next_bookmark: Watch::first_bookmark(now, self.bookmark_period(), deadline),
                bookmarked: 0,
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;

    use super::super::FakeKube;

    /// The events of a watch of Services (`query` added), each with when
    /// it came, until the server ends the watch.
    async fn watch_events(fake: &FakeKube, query: &str) -> Vec<(Duration, String)> {
        let stream = tokio::net::TcpStream::connect(fake.addr)
            .await
            .expect("connect");
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        let req = http::Request::get(format!(
            "/api/v1/namespaces/default/services?watch=true&resourceVersion=0&{query}"
        ))
        .header("host", "fake")
        .body(Empty::<Bytes>::new())
        .expect("request");
        let started = Instant::now();
        let mut body = send.send_request(req).await.expect("response").into_body();
        let mut events = Vec::new();
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.expect("frame").into_data() else {
                continue;
            };
            for line in String::from_utf8_lossy(&data).lines() {
                let v: serde_json::Value = serde_json::from_str(line).expect("an event");
                events.push((
                    started.elapsed(),
                    v["type"].as_str().unwrap_or("").to_string(),
                ));
            }
        }
        events.push((started.elapsed(), "END".into()));
        events
    }

    /// The API server's cadence (`cacheWatcher.nextBookmarkTime`): a watch
    /// that allows bookmarks gets one two seconds before its deadline,
    /// else about a minute apart; one that does not allow them gets none;
    /// the watch ends at its `timeoutSeconds`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bookmarks_come_two_seconds_before_the_deadline_and_a_minute_apart() {
        let fake = FakeKube::start(([127, 1, 151, 250], 6443).into()).await;
        // A fake whose period a test shortened (the real one is 60 s).
        let quick = FakeKube::start(([127, 1, 151, 251], 6443).into()).await;
        quick.bookmark_every(Duration::from_millis(700));
        let (near, without, far) = tokio::join!(
            watch_events(&fake, "allowWatchBookmarks=true&timeoutSeconds=3"),
            watch_events(&fake, "timeoutSeconds=3"),
            watch_events(&quick, "allowWatchBookmarks=true&timeoutSeconds=4"),
        );
        // Near its deadline: one, two seconds before it; then the end.
        let kinds: Vec<&str> = near.iter().map(|(_, k)| k.as_str()).collect();
        assert_eq!(kinds, ["BOOKMARK", "END"], "{near:?}");
        let (bookmark, end) = (near[0].0, near[1].0);
        assert!(
            bookmark >= Duration::from_millis(900) && bookmark < Duration::from_millis(2500),
            "the bookmark came {bookmark:?} into a 3 s watch"
        );
        assert!(
            end >= Duration::from_millis(2900) && end < Duration::from_secs(5),
            "the watch ended after {end:?}"
        );
        // Without `allowWatchBookmarks`: none.
        assert_eq!(without.len(), 1, "{without:?}");
        // Far from its deadline: one period after it opened, the next a
        // period later.
        let at: Vec<Duration> = far
            .iter()
            .filter(|(_, k)| k == "BOOKMARK")
            .map(|(t, _)| *t)
            .collect();
        assert!(at.len() >= 3, "{far:?}");
        assert!(
            at[0] >= Duration::from_millis(650) && at[1] - at[0] >= Duration::from_millis(650),
            "{at:?}"
        );
    }
}
