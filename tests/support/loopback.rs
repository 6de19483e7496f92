//! What a test's network is in both tiers: `127.1.N.0/24` on loopback
//! (`.254` the control plane: discovery on 15010, admin on 15014; a
//! workload's sidecar at `.host`, its app behind it) and the config
//! directory the control plane reads. Each tier's `Net` says where its
//! octet and directory are; the rest is here (each tier includes this file
//! as `crate::loopback`).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::views::poll_json;
use crate::yaml::{rule_yaml, service_yaml};

/// A test's loopback network and config directory.
pub trait Loopback {
    /// N of `127.1.N.0/24`.
    fn octet(&self) -> u8;

    /// The directory the control plane reads its config from.
    fn config(&self) -> PathBuf;

    fn ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, 1, self.octet(), host)
    }

    fn addr(&self, host: u8, port: u16) -> SocketAddr {
        SocketAddr::from((self.ip(host), port))
    }

    fn cp_admin(&self) -> SocketAddr {
        self.addr(254, 15014)
    }

    fn cp_xds(&self) -> SocketAddr {
        self.addr(254, 15010)
    }

    /// The control plane's flags: this network's config directory and
    /// addresses, then `extra`.
    fn control_plane_flags(&self, extra: &[&str]) -> Vec<String> {
        let mut flags = vec![
            "--config-dir".to_string(),
            self.config().display().to_string(),
            "--xds-addr".into(),
            self.cp_xds().to_string(),
            "--admin-addr".into(),
            self.cp_admin().to_string(),
        ];
        flags.extend(extra.iter().map(|s| s.to_string()));
        flags
    }

    /// The flags of a sidecar of workload `client-{host}` in `namespace`
    /// at .host (outbound :15001, admin :15000) taking its config from
    /// `xds` (`http://` or `https://`), then `extra`.
    fn sidecar_flags(&self, host: u8, xds: &str, namespace: &str, extra: &[&str]) -> Vec<String> {
        let mut flags = vec![
            "--xds-addr".to_string(),
            xds.to_string(),
            "--workload".into(),
            format!("client-{host}"),
            "--namespace".into(),
            namespace.into(),
            "--outbound".into(),
            self.addr(host, 15001).to_string(),
            "--admin".into(),
            self.addr(host, 15000).to_string(),
        ];
        flags.extend(extra.iter().map(|s| s.to_string()));
        flags
    }

    /// A sidecar's flags for an inbound listener at .host:9090 in front of
    /// the app at .host:8080.
    fn inbound_flags(&self, host: u8) -> [String; 4] {
        [
            "--inbound".into(),
            self.addr(host, 9090).to_string(),
            "--app".into(),
            self.addr(host, 8080).to_string(),
        ]
    }

    /// Writes `name` into the config directory atomically.
    fn write(&self, name: &str, text: &str) {
        let path = self.config().join(name);
        let tmp = self.config().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
    }

    fn remove(&self, name: &str) {
        std::fs::remove_file(self.config().join(name)).expect("remove");
    }

    /// Writes a Service `name` (port 80) and its EndpointSlice with
    /// endpoints at `hosts` (:9090).
    fn service(&self, name: &str, hosts: &[u8]) {
        let endpoints: Vec<_> = hosts
            .iter()
            .map(|h| (self.ip(*h), format!("{name}-{h}")))
            .collect();
        self.write(&format!("svc-{name}.yaml"), &service_yaml(name, &endpoints));
    }

    /// Writes a DestinationRule for `service` with this load balancer.
    fn rule(&self, file: &str, service: &str, load_balancer: &str) {
        self.write(file, &rule_yaml(service, load_balancer));
    }
}

/// Polls the control plane's /debug/config until `pred` holds (up to
/// 5 s); returns the config that matched.
pub async fn wait_cp_config(
    net: &impl Loopback,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    poll_cp_json(net, "/debug/config", Duration::from_secs(5), pred).await
}

/// Polls the control plane's admin `path` (JSON) until `pred` holds (up to
/// 10 s); returns the value that matched.
pub async fn wait_cp_json(
    net: &impl Loopback,
    path: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    poll_cp_json(net, path, Duration::from_secs(10), pred).await
}

/// Polls the control plane's admin `path` (JSON) until `pred` holds, up
/// to `within`; returns the value that matched.
pub async fn poll_cp_json(
    net: &impl Loopback,
    path: &str,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    poll_json(net.cp_admin(), path, within, pred).await
}

/// The weights of `backend`'s endpoints on hosts 1, 2 and 3 (0 for one not
/// listed), from a cluster entry of a control plane's /debug/endpoints or a
/// sidecar's /debug/config.
pub fn backend_weights(cluster: &serde_json::Value, net: &impl Loopback) -> Vec<u64> {
    crate::views::weights_of(cluster, (1..=3).map(|h| net.addr(h, 9090)))
}
