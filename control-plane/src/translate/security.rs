//! What sidecars are told about mutual TLS: which endpoints run a sidecar
//! (callers speak mTLS to those), and each namespace's PeerAuthentication.

use std::collections::{BTreeMap, BTreeSet};

use minimesh_proto::v1::{Endpoint, PeerAuthentication};

use crate::config::rule::TlsMode;
use crate::config::security::ROOT_NAMESPACE;
use crate::store::Store;

/// The sidecar inbound listeners (address, port) of every pod that runs a
/// sidecar.
pub fn meshed_ips(store: &Store) -> BTreeSet<(&str, u16)> {
    store
        .pods
        .values()
        .filter(|p| p.meshed())
        .flat_map(|p| p.ips().map(move |ip| (ip, p.inbound_port())))
        .collect()
}

/// Marks the endpoints callers speak mutual TLS to: by the rule's
/// `tls.mode`, or (none) those that are a sidecar's inbound listener (an
/// endpoint on another port of the pod is its app's own).
pub fn mark_meshed(endpoints: &mut [Endpoint], meshed: &BTreeSet<(&str, u16)>, mode: TlsMode) {
    for e in endpoints {
        match mode {
            TlsMode::Disable => {
                e.mtls = false;
                continue;
            }
            TlsMode::IstioMutual => {
                e.mtls = true;
                continue;
            }
            TlsMode::Auto => {}
        }
        let Some((ip, port)) = e.address.rsplit_once(':') else {
            continue;
        };
        let ip = ip.trim_start_matches('[').trim_end_matches(']');
        e.mtls = port.parse().is_ok_and(|port| meshed.contains(&(ip, port)));
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
