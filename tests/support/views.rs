//! Reading a mesh's debug views (`/debug/config` of a sidecar or the
//! control plane), shared by the end-to-end and in-process tiers (each
//! includes it as `crate::views`).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

use crate::client::get_json;
use crate::yaml::NS;

/// Waits until `pred` holds on the sidecar's /debug/config (up to `within`);
/// returns how long it took.
pub async fn wait_sidecar(
    admin: SocketAddr,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let v = get_json(admin, "/debug/config").await;
        if pred(&v) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "sidecar config never matched within {within:?}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls an admin server's `path` (JSON) at `admin` until `pred` holds,
/// up to `within`; returns the value that matched.
pub async fn poll_json(
    admin: SocketAddr,
    path: &str,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = get_json(admin, path).await;
        if pred(&v) {
            return v;
        }
        assert!(
            start.elapsed() < within,
            "{admin}{path} never matched within {within:?}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The policy of `cluster` in a sidecar's /debug/config.
pub fn policy_of(v: &serde_json::Value, service: &str) -> String {
    v["clusters"][format!("{service}.{NS}.svc.cluster.local:80")]["policy"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Endpoint addresses of `service` in a sidecar's /debug/config.
pub fn endpoints_of(v: &serde_json::Value, service: &str) -> Vec<String> {
    v["clusters"][format!("{service}.{NS}.svc.cluster.local:80")]["endpoints"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["address"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The weights of the endpoints at `addrs` (0 for one not listed), from a
/// cluster entry of a control plane's /debug/endpoints or a sidecar's
/// /debug/config (both list `endpoints` with `address` and `weight`).
pub fn weights_of(
    cluster: &serde_json::Value,
    addrs: impl IntoIterator<Item = SocketAddr>,
) -> Vec<u64> {
    let eps = cluster["endpoints"].as_array().cloned().unwrap_or_default();
    addrs
        .into_iter()
        .map(|a| {
            let a = a.to_string();
            eps.iter()
                .find(|e| e["address"] == a.as_str())
                .and_then(|e| e["weight"].as_u64())
                .unwrap_or(0)
        })
        .collect()
}
