//! The fake's storage: objects by collection, namespace and name at a
//! resourceVersion, the history a watch resumes from, and the open watches
//! each change and bookmark reaches.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::wire::{api_version, label_match, watch_line};
use super::{FakeKube, COLLECTIONS};

/// An open watch: what it selects, where its event lines go.
pub(super) struct Watch {
    pub(super) c: usize,
    pub(super) tx: mpsc::UnboundedSender<Bytes>,
    pub(super) bookmarks: bool,
    /// Only this namespace's objects (a namespaced watch).
    pub(super) namespace: Option<String>,
    /// Only the object of this name (`fieldSelector=metadata.name=...`).
    pub(super) name: Option<String>,
    /// Only objects whose labels match (`labelSelector`).
    pub(super) labels: Option<String>,
    /// When its next BOOKMARK is due: a bookmark period after the last
    /// one, or two seconds before its deadline if sooner (the API server's
    /// `cacheWatcher.nextBookmarkTime`).
    pub(super) next_bookmark: Instant,
    /// The resourceVersion of the last BOOKMARK it was sent (0: none yet).
    pub(super) bookmarked: u64,
}

impl Watch {
    /// The first BOOKMARK's time of a watch opened at `now`, as the real
    /// server schedules it: `every` later (about a minute there), or two
    /// seconds before the watch's deadline if that is sooner, so that the
    /// client has a current resourceVersion to watch again from.
    pub(super) fn first_bookmark(
        now: Instant,
        every: Duration,
        deadline: Option<Instant>,
    ) -> Instant {
        let heartbeat = now + every;
        match deadline.map(|d| d.checked_sub(Duration::from_secs(2)).unwrap_or(now)) {
            Some(before_deadline) if before_deadline < heartbeat => before_deadline,
            _ => heartbeat,
        }
    }

    pub(super) fn selects(&self, c: usize, obj: &Value) -> bool {
        self.c == c
            && self
                .namespace
                .as_ref()
                .is_none_or(|n| obj["metadata"]["namespace"] == *n.as_str())
            && self
                .name
                .as_ref()
                .is_none_or(|n| obj["metadata"]["name"] == *n.as_str())
            && self
                .labels
                .as_ref()
                .is_none_or(|l| label_match(l, &obj["metadata"]["labels"]))
    }
}

#[derive(Default)]
pub(super) struct Inner {
    pub(super) rv: u64,
    /// Watches from a resourceVersion older than this get 410 Expired.
    pub(super) compacted: u64,
    /// (collection, namespace, name) -> object.
    pub(super) objects: BTreeMap<(usize, String, String), Value>,
    /// Every change: (resourceVersion, collection, event type, object).
    pub(super) history: Vec<(u64, usize, &'static str, Value)>,
    /// Open watches.
    pub(super) watches: Vec<Watch>,
    /// "LIST plural", "WATCH plural rv", "PATCH-STATUS name", … in order.
    pub(super) log: Vec<String>,
}

impl Inner {
    /// Stores (or, for DELETED, removes) an object at a new resourceVersion
    /// and tells the watches of its collection.
    pub(super) fn commit(
        &mut self,
        key: (usize, String, String),
        event: &'static str,
        mut obj: Value,
    ) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = self.rv.to_string().into();
        let (g, v, _, kind) = COLLECTIONS[key.0];
        obj["apiVersion"] = api_version(g, v).into();
        obj["kind"] = kind.into();
        if kind == "EndpointSlice" {
            // As the real API server writes an empty list of its Go types
            // (no omitempty on these fields): `null`, not `[]`.
            for field in ["endpoints", "ports"] {
                if obj[field].as_array().is_none_or(Vec::is_empty) {
                    obj[field] = Value::Null;
                }
            }
        }
        let previous = if event == "DELETED" {
            self.objects.remove(&key)
        } else {
            self.objects.insert(key.clone(), obj.clone())
        };
        self.history.push((self.rv, key.0, event, obj.clone()));
        // A change that takes an object into or out of a watch's selection
        // reaches that watch as ADDED or DELETED, as from the watch cache.
        self.watches.retain(|w| {
            let now = w.selects(key.0, &obj);
            let before = previous.as_ref().is_some_and(|p| w.selects(key.0, p));
            let seen = match (event, before, now) {
                ("MODIFIED", true, false) => "DELETED",
                ("MODIFIED", false, true) => "ADDED",
                (_, _, true) => event,
                _ => return !w.tx.is_closed(),
            };
            w.tx.send(watch_line(seen, &obj)).is_ok()
        });
        obj
    }
}

impl FakeKube {
    /// A BOOKMARK at the current resourceVersion to every watch that
    /// asked for them and is due one (see [`Watch::first_bookmark`]; the
    /// next one is a period later); closed watches are dropped.
    pub(super) fn bookmark(&self) {
        let every = self.bookmark_period();
        let now = Instant::now();
        let mut inner = self.inner.lock().expect("lock");
        let rv = inner.rv;
        inner.watches.retain_mut(|w| {
            if !w.bookmarks || now < w.next_bookmark {
                return !w.tx.is_closed();
            }
            w.next_bookmark = now + every;
            w.bookmarked = rv;
            let (g, v, _, kind) = COLLECTIONS[w.c];
            let obj = json!({
                "apiVersion": api_version(g, v), "kind": kind,
                "metadata": {"resourceVersion": rv.to_string()}
            });
            w.tx.send(watch_line("BOOKMARK", &obj)).is_ok()
        });
    }
}
