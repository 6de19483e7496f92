//! The local source: a directory of YAML files (multi-document), polled for
//! changes. Polling a small directory every 50 ms costs little, works on every
//! filesystem, and catches editors that replace files by renaming.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tracing::{info, warn};

use crate::config::parse::ObjectKey;
use crate::config::{parse_documents, ConfigError, Object};
use crate::store::Store;

/// How deep below the config directory files are read.
const MAX_DEPTH: usize = 4;
/// At most this many files are read; more is almost surely a wrong directory.
const MAX_FILES: usize = 10_000;

#[derive(Default)]
struct FileState {
    stamp: Option<(SystemTime, u64)>,
    good: Vec<(ObjectKey, Object)>,
    errors: Vec<ConfigError>,
    ignored: Vec<String>,
}

/// Reads a directory of config files into a [`Store`].
pub struct FileSource {
    dir: PathBuf,
    default_namespace: String,
    files: BTreeMap<PathBuf, FileState>,
}

impl FileSource {
    /// A source for `dir` (it need not exist yet).
    /// Objects without `metadata.namespace` are placed in `default_namespace`.
    pub fn new(dir: impl Into<PathBuf>, default_namespace: &str) -> Self {
        FileSource {
            dir: dir.into(),
            default_namespace: default_namespace.to_string(),
            files: BTreeMap::new(),
        }
    }

    /// Looks for changed, new and deleted files. Returns true when anything changed.
    pub fn scan(&mut self) -> bool {
        let mut seen = Vec::new();
        collect(&self.dir, 0, &mut seen);
        let mut changed = false;
        let seen_set: HashSet<&PathBuf> = seen.iter().map(|(p, _)| p).collect();
        let removed: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| !seen_set.contains(p))
            .cloned()
            .collect();
        for path in removed {
            info!(file = %path.display(), "config file removed");
            self.files.remove(&path);
            changed = true;
        }
        for (path, stamp) in seen {
            let state = self.files.entry(path.clone()).or_default();
            if state.stamp == Some(stamp) {
                continue;
            }
            state.stamp = Some(stamp);
            changed = true;
            reload(&path, state, &self.default_namespace);
        }
        changed
    }

    /// The store built from every file, in path order.
    pub fn store(&self) -> Store {
        let mut store = Store::default();
        for (path, state) in &self.files {
            for (key, object) in &state.good {
                store.insert(key.clone(), object.clone(), path);
            }
            store.errors.extend(state.errors.iter().cloned());
            store.warnings.extend(state.ignored.iter().cloned());
        }
        store
    }

    /// Scans every `interval` and publishes a new store on each change, until
    /// the receiver side is gone.
    pub async fn run(mut self, interval: Duration, tx: watch::Sender<Store>) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (changed, this) = tokio::task::spawn_blocking(move || {
                let changed = self.scan();
                (changed, self)
            })
            .await
            .expect("scan does not panic");
            self = this;
            if changed && tx.send(self.store()).is_err() {
                return;
            }
        }
    }
}

fn collect(dir: &Path, depth: usize, out: &mut Vec<(PathBuf, (SystemTime, u64))>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if out.len() >= MAX_FILES {
            return;
        }
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue; // editor swap files, our own temp files
        }
        let Ok(meta) = std::fs::metadata(&path) else {
            continue; // deleted between listing and stat
        };
        if meta.is_dir() {
            if depth < MAX_DEPTH {
                collect(&path, depth + 1, out);
            }
        } else if name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".json") {
            let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            out.push((path, (mtime, meta.len())));
        }
    }
}

fn reload(path: &Path, state: &mut FileState, default_namespace: &str) {
    let text = match std::fs::read(path) {
        Ok(bytes) if bytes.len() > crate::config::parse::MAX_FILE_BYTES => Err(format!(
            "file is {} bytes, more than the {} minimesh reads",
            bytes.len(),
            crate::config::parse::MAX_FILE_BYTES
        )),
        Ok(bytes) => String::from_utf8(bytes).map_err(|_| "file is not UTF-8".to_string()),
        Err(e) => Err(format!("cannot read: {e}")),
    };
    let parsed =
        text.and_then(|t| parse_documents(path, &t, default_namespace).map_err(|e| e.reason));
    state.errors.clear();
    state.ignored.clear();
    match parsed {
        Err(reason) => {
            let e = ConfigError {
                file: path.to_path_buf(),
                object: None,
                field: None,
                reason,
            };
            warn!("{e}; the file's previous good objects stay in force");
            state.errors.push(e);
        }
        Ok(parsed) => {
            let old = std::mem::take(&mut state.good);
            for doc in parsed.documents {
                match (doc.result, doc.key) {
                    (Ok(object), Some(key)) => state.good.push((key, object)),
                    (Ok(_), None) => {}
                    (Err(e), key) => {
                        let kept = key.and_then(|k| old.iter().find(|(ok, _)| *ok == k).cloned());
                        if kept.is_some() {
                            warn!("{e}; the previous good version stays in force");
                        } else {
                            warn!("{e}");
                        }
                        state.good.extend(kept);
                        state.errors.push(e);
                    }
                }
            }
            for note in &parsed.ignored {
                info!("{note}");
            }
            state.ignored = parsed.ignored;
            info!(file = %path.display(), objects = state.good.len(), errors = state.errors.len(), "config file loaded");
        }
    }
}
