//! Readiness: waiting for a process's HTTP port, for every proxy to ACK
//! the control plane's current config, and for the endpoints it published.

use std::time::Duration;

use anyhow::bail;

use super::{Mesh, MeshState};
use crate::http;

pub(super) async fn wait_http(
    addr: &str,
    path: &str,
    timeout: Duration,
    mesh: &mut Mesh,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = http::get(addr, path).await {
            return Ok(());
        }
        if let Some(exit) = mesh.exited() {
            bail!("{exit}");
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{addr}{path} not ready after {timeout:?}; logs are in {}",
                mesh.home.join("logs").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every proxy of the mesh is connected and has ACKed the
/// control plane's current version of every type.
pub async fn wait_converged(state: &MeshState, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let admin = state.control_plane_admin.to_string();
    let mut last;
    loop {
        match (
            http::get_json(&admin, "/debug/versions").await,
            http::get_json(&admin, "/debug/proxies").await,
        ) {
            (Ok(versions), Ok(v)) => {
                let proxies = v.as_array().cloned().unwrap_or_default();
                // A sidecar subscribes to PeerAuthentications by name (its
                // namespace's and the mesh-wide one), so the version it gets
                // is of those alone, never the type's: there, in sync is
                // having ACKed what it was last sent.
                let in_sync = |p: &serde_json::Value, ty: &str, version: &serde_json::Value| {
                    let t = &p["types"][ty];
                    match ty {
                        "PeerAuthentication" => !t["acked"].is_null() && t["acked"] == t["sent"],
                        _ => t["acked"] == *version,
                    }
                };
                let synced = proxies
                    .iter()
                    .filter(|p| {
                        versions.as_object().is_some_and(|vs| {
                            vs.iter().all(|(ty, version)| in_sync(p, ty, version))
                        })
                    })
                    .count();
                if proxies.len() >= state.proxies() && synced == proxies.len() {
                    return Ok(());
                }
                last = format!("{synced} of {} proxies in sync", state.proxies());
            }
            (Err(e), _) | (_, Err(e)) => last = e.to_string(),
        }
        if tokio::time::Instant::now() > deadline {
            bail!("mesh did not converge within {timeout:?}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until the control plane has published `expected` endpoints in all.
pub(super) async fn wait_endpoints(
    state: &MeshState,
    expected: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let admin = state.control_plane_admin.to_string();
    loop {
        let v = http::get_json(&admin, "/debug/endpoints").await?;
        let n: usize = v
            .as_object()
            .map(|m| {
                m.values()
                    .map(|c| c["endpoints"].as_array().map_or(0, Vec::len))
                    .sum()
            })
            .unwrap_or(0);
        if n >= expected {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the control plane published {n} of {expected} endpoints within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
