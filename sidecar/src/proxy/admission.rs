//! A cluster's `connectionPool` limits on requests and retries in flight.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::routing::ClusterHandle;

/// One request counted against a cluster's `max_requests`.
pub struct InflightGuard(Arc<std::sync::atomic::AtomicU32>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a request against the cluster's limit; None when it is full.
pub(crate) fn admit(cluster: &ClusterHandle) -> Result<Option<InflightGuard>, u32> {
    if cluster.max_requests == 0 {
        return Ok(None);
    }
    if cluster.inflight.fetch_add(1, Ordering::Relaxed) >= cluster.max_requests {
        cluster.inflight.fetch_sub(1, Ordering::Relaxed);
        return Err(cluster.max_requests);
    }
    Ok(Some(InflightGuard(cluster.inflight.clone())))
}

/// Counts a retry against the cluster's `max_retries`; Err when it is full.
pub(crate) fn admit_retry(cluster: &ClusterHandle) -> Result<Option<InflightGuard>, u32> {
    if cluster.max_retries == 0 {
        return Ok(None);
    }
    let n = &cluster.retries_inflight;
    if n.fetch_add(1, Ordering::Relaxed) >= cluster.max_retries {
        n.fetch_sub(1, Ordering::Relaxed);
        return Err(cluster.max_retries);
    }
    Ok(Some(InflightGuard(n.clone())))
}
