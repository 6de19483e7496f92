//! Who may read an admin port's `/debug/*` views. They show every cluster
//! and endpoint a proxy or the control plane knows, which a workload may
//! not see for itself: by default only loopback callers are served (on
//! Kubernetes, `kubectl port-forward` and `kubectl exec` arrive there), and
//! health, readiness and metrics, which the kubelet and Prometheus read
//! from the pod address, to everyone.

use std::net::SocketAddr;

/// Prefix of the debug views.
pub const DEBUG_PREFIX: &str = "/debug/";

/// The answer's text when a debug view is refused to `peer`.
pub const DEBUG_REFUSED: &str = "minimesh: /debug/* is served to loopback callers only (kubectl port-forward, or a shell in the pod); start with --admin-debug to serve it to every caller\n";

/// True when `path` may be served to `peer`: anything but a debug view, a
/// debug view to a loopback caller, or every view with `--admin-debug`.
pub fn allowed(path: &str, peer: SocketAddr, debug_for_all: bool) -> bool {
    debug_for_all || !path.starts_with(DEBUG_PREFIX) || peer.ip().to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_views_go_to_loopback_callers_unless_opened_to_all() {
        let pod: SocketAddr = "10.1.2.3:40000".parse().unwrap_or(([0; 4], 0).into());
        let local: SocketAddr = "127.0.0.1:40000".parse().unwrap_or(([0; 4], 0).into());
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:1".parse().unwrap_or(([0; 4], 0).into());
        assert!(!allowed("/debug/config", pod, false));
        assert!(allowed("/metrics", pod, false));
        assert!(allowed("/ready", pod, false));
        assert!(allowed("/debug/config", local, false));
        assert!(allowed("/debug/endpoints", mapped, false));
        assert!(allowed("/debug/config", pod, true));
    }
}
