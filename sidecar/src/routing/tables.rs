//! What a build derives from the routes and the clusters built: the host
//! map (every name a service is called by, to its port's cluster) and the
//! fallback, a gateway's hosts, each port's compiled route table, and the
//! destination map of captured connections (service IP and port).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use minimesh_proto::v1::{Node, PortProtocol, Route};

use super::build::HostAliases;
use super::host_map::HostMap;
use super::routes::RouteTable;
use super::ClusterHandle;

/// The authorities of every route's service, each to the index (in name
/// order) of the cluster of its port, and the fallback's index.
pub(super) fn host_map(
    routes: &BTreeMap<String, Route>,
    clusters: &BTreeMap<String, Arc<ClusterHandle>>,
    node: &Node,
    aliases: &HostAliases,
) -> (HostMap, Option<u32>) {
    let index: HashMap<&str, u32> = clusters
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i as u32))
        .collect();
    let mut hosts = HostMap::default();
    let mut default_of = HashMap::new();
    for r in routes.values().filter(|r| r.gateway.is_empty()) {
        if aliases.only {
            // Only the default port's cluster, for the aliases to name.
            if let Some(&c) = r
                .ports
                .iter()
                .find(|pc| pc.port == r.default_port)
                .and_then(|pc| index.get(pc.cluster.as_str()))
            {
                default_of.insert(format!("{}.{}", r.service, r.namespace), c);
            }
            continue;
        }
        let mut names = vec![
            format!("{}.{}", r.service, r.namespace),
            format!("{}.{}.svc", r.service, r.namespace),
            format!("{}.{}.svc.cluster.local", r.service, r.namespace),
        ];
        if r.namespace == node.namespace {
            names.push(r.service.clone());
        }
        for pc in &r.ports {
            let Some(&c) = index.get(pc.cluster.as_str()) else {
                continue;
            };
            for n in &names {
                hosts.insert(format!("{n}:{}", pc.port), c);
                if pc.port == r.default_port {
                    hosts.insert(n.clone(), c);
                }
            }
            if pc.port == r.default_port {
                default_of.insert(format!("{}.{}", r.service, r.namespace), c);
            }
        }
    }
    for (alias, svc) in &aliases.aliases {
        if let Some(&c) = default_of.get(svc) {
            hosts.insert(alias.to_ascii_lowercase(), c);
            hosts
                .entry(format!("{}:80", alias.to_ascii_lowercase()))
                .or_insert(c);
        }
    }
    let fallback = aliases
        .fallback
        .as_ref()
        .and_then(|s| default_of.get(s).copied());
    (hosts, fallback)
}

/// The hosts of the Istio Gateways whose selector `aliases.labels` match
/// (a gateway's), each with its routes: tables past the clusters' indexes,
/// and their names in the host map (`host` and `host:port`).
pub(super) fn gateway_hosts(
    routes: &BTreeMap<String, Route>,
    clusters: &BTreeMap<String, Arc<ClusterHandle>>,
    aliases: &HostAliases,
    hosts: &mut HostMap,
    tables: &mut Vec<Option<RouteTable>>,
) {
    let index: HashMap<&str, u32> = clusters
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i as u32))
        .collect();
    let selected = |r: &Route| {
        r.gateway_selector
            .iter()
            .all(|(k, v)| aliases.labels.iter().any(|(lk, lv)| lk == k && lv == v))
    };
    for r in routes
        .values()
        .filter(|r| !r.gateway.is_empty() && selected(r))
    {
        let Some(pc) = r.ports.first() else {
            continue;
        };
        let Ok(t) = RouteTable::compile(&pc.http_routes, &|c| index.get(c).copied()) else {
            continue; // validated on receipt
        };
        tables.resize_with(tables.len().max(clusters.len()), || None);
        let i = tables.len() as u32;
        tables.push(Some(t));
        let host = r.service.to_ascii_lowercase();
        hosts.insert(format!("{host}:{}", pc.port), i);
        hosts.insert(host, i);
    }
}

/// Every port's HTTP routes, compiled, at the index of the port's cluster.
pub(super) fn route_tables(
    routes: &BTreeMap<String, Route>,
    clusters: &BTreeMap<String, Arc<ClusterHandle>>,
) -> Vec<Option<RouteTable>> {
    if routes
        .values()
        .all(|r| r.ports.iter().all(|p| p.http_routes.is_empty()))
    {
        return Vec::new();
    }
    let index: HashMap<&str, u32> = clusters
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i as u32))
        .collect();
    let mut tables: Vec<Option<RouteTable>> = (0..clusters.len()).map(|_| None).collect();
    for r in routes.values().filter(|r| r.gateway.is_empty()) {
        for pc in r.ports.iter().filter(|p| !p.http_routes.is_empty()) {
            let Some(&i) = index.get(pc.cluster.as_str()) else {
                continue;
            };
            // Validated on receipt (validate_route): compiles.
            if let Ok(t) = RouteTable::compile(&pc.http_routes, &|c| index.get(c).copied()) {
                tables[i as usize] = Some(t);
            }
        }
    }
    tables
}

/// Service addresses to cluster indexes (in name order) and port protocols.
pub(super) type DestinationMap = HashMap<SocketAddr, (u32, PortProtocol)>;

/// Every route's `<cluster IP>:<port>` to the index of that port's cluster.
pub(super) fn destination_map(
    routes: &BTreeMap<String, Route>,
    clusters: &BTreeMap<String, Arc<ClusterHandle>>,
) -> DestinationMap {
    let index: HashMap<&str, u32> = clusters
        .keys()
        .enumerate()
        .map(|(i, name)| (name.as_str(), i as u32))
        .collect();
    let mut map = DestinationMap::new();
    for r in routes.values() {
        let ips: Vec<std::net::IpAddr> = r
            .cluster_ips
            .iter()
            .filter_map(|ip| ip.parse().ok())
            .collect();
        for pc in &r.ports {
            let (Some(&c), Ok(port)) = (index.get(pc.cluster.as_str()), u16::try_from(pc.port))
            else {
                continue;
            };
            let kind = PortProtocol::try_from(pc.protocol).unwrap_or(PortProtocol::Detect);
            for ip in &ips {
                map.insert(SocketAddr::new(*ip, port), (c, kind));
            }
        }
    }
    map
}
