//! What sidecars are told about mutual TLS: which endpoints run a sidecar
//! (callers speak mTLS to those), and each namespace's PeerAuthentication.

use std::collections::{BTreeMap, BTreeSet};

use minimesh_proto::v1::{Endpoint, PeerAuthentication};

use crate::config::rule::TlsMode;
use crate::config::security::ROOT_NAMESPACE;
use crate::store::Store;

/// Where the pods that run a sidecar take connections through it: each
/// one's inbound listener, and the captured ports of those whose
/// connections are captured.
#[derive(Default)]
pub struct Meshed<'a> {
    listeners: BTreeSet<(&'a str, u16)>,
    captured: BTreeMap<&'a str, minimesh_proto::capture::CaptureSettings>,
    /// The identity (`namespace/service account`) of the pod at each address.
    accounts: BTreeMap<&'a str, String>,
}

impl Meshed<'_> {
    /// True when a connection to `ip:port` reaches a sidecar.
    pub fn contains(&self, ip: &str, port: u16) -> bool {
        self.listeners.contains(&(ip, port))
            || self
                .captured
                .get(ip)
                .is_some_and(|c| c.captures_inbound(port))
    }
}

/// Where the store's meshed pods take connections through their sidecars.
pub fn meshed_ips(store: &Store) -> Meshed<'_> {
    let mut m = Meshed::default();
    for p in store.pods.values().filter(|p| p.meshed()) {
        let capture = p.capture();
        let account = p.service_account();
        for ip in p.ips() {
            m.accounts.insert(ip, account.clone());
            m.listeners.insert((ip, p.inbound_port()));
            if let Some(c) = &capture {
                m.captured.insert(ip, c.clone());
            }
        }
    }
    m
}

/// Marks the endpoints callers speak mutual TLS to: by the rule's
/// `tls.mode`, or (none) those that reach a sidecar (an endpoint on another
/// port of a pod whose connections are not captured is its app's own);
/// and, for secure naming, the identity of the meshed pod behind each.
pub fn mark_meshed(endpoints: &mut [Endpoint], meshed: &Meshed<'_>, mode: TlsMode) {
    for e in endpoints {
        let Some((ip, port)) = e.address.rsplit_once(':') else {
            continue;
        };
        let ip = ip.trim_start_matches('[').trim_end_matches(']');
        e.mtls = match mode {
            TlsMode::Disable => false,
            TlsMode::IstioMutual => true,
            TlsMode::Auto => port.parse().is_ok_and(|port| meshed.contains(ip, port)),
        };
        e.service_accounts = match (e.mtls, meshed.accounts.get(ip)) {
            (true, Some(a)) => vec![a.clone()],
            _ => vec![],
        };
    }
}

/// The PeerAuthentication resources, by namespace: each namespace's, and
/// the root namespace's marked mesh-wide.
pub fn peer_authentications(store: &Store) -> BTreeMap<String, PeerAuthentication> {
    store
        .peer_auth
        .iter()
        .map(|(key, (_, mode))| {
            (
                key.namespace.clone(),
                PeerAuthentication {
                    namespace: key.namespace.clone(),
                    mode: *mode as i32,
                    mesh_wide: key.namespace == ROOT_NAMESPACE,
                },
            )
        })
        .collect()
}
