//! The Kubernetes kinds minimesh reads for endpoints: `v1` Service and
//! `discovery.k8s.io/v1` EndpointSlice. Only the fields minimesh uses are
//! typed; the rest of a real object is ignored, as kubectl would round-trip it.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

/// A list, map or object the API server may send as `null`, read as empty:
/// an EndpointSlice of a Service with no ready pod (scaled to zero, and
/// briefly in every rollout) comes with `"endpoints": null` and
/// `"ports": null`, as the API server's Go types write an empty list.
fn null_as_empty<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `metadata` of any object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// Object name.
    #[serde(default)]
    pub name: String,
    /// Namespace; empty means `default`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Labels.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations (a Service's `networking.istio.io/exportTo` is read).
    #[serde(
        default,
        deserialize_with = "null_as_empty",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub annotations: BTreeMap<String, String>,
    /// Bumped by the API server on every spec change; 0 locally.
    #[serde(default)]
    pub generation: Option<i64>,
    /// When the API server created it (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<String>,
}

/// Resolves a rule host to (service, namespace): `name` (in the rule's
/// namespace), `name.ns`, `name.ns.svc`, `name.ns.svc.cluster.local`.
pub fn resolve_host(host: &str, rule_namespace: &str) -> Option<(String, String)> {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let parts: Vec<&str> = host.split('.').collect();
    match parts.as_slice() {
        [name] => Some((name.to_string(), rule_namespace.to_string())),
        [name, ns] | [name, ns, "svc"] | [name, ns, "svc", "cluster", "local"] => {
            Some((name.to_string(), ns.to_string()))
        }
        _ => None,
    }
}

/// A Kubernetes `Service`: the ports callers address.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Service {
    /// Object metadata.
    pub metadata: ObjectMeta,
    /// The service spec.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub spec: ServiceSpec,
}

/// `Service.spec` (the fields minimesh uses).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    /// Ports of the service.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub ports: Vec<ServicePort>,
    /// The virtual IP callers connect to (`None` for a headless Service).
    #[serde(default, rename = "clusterIP", skip_serializing_if = "Option::is_none")]
    pub cluster_ip: Option<String>,
    /// Every cluster IP of a dual-stack Service (the first is `clusterIP`).
    #[serde(
        default,
        rename = "clusterIPs",
        deserialize_with = "null_as_empty",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub cluster_ips: Vec<String>,
}

impl ServiceSpec {
    /// The Service's cluster IPs that are addresses (not `None`, headless),
    /// `clusterIP` first, without repeats.
    pub fn virtual_ips(&self) -> Vec<std::net::IpAddr> {
        let mut ips: Vec<std::net::IpAddr> = Vec::new();
        for ip in self.cluster_ip.iter().chain(&self.cluster_ips) {
            if let Ok(ip) = ip.parse() {
                if !ips.contains(&ip) {
                    ips.push(ip);
                }
            }
        }
        ips
    }
}

/// One port of a Service.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    /// Port name; matches the EndpointSlice port of the same name.
    #[serde(default)]
    pub name: Option<String>,
    /// The port callers use.
    pub port: u16,
    /// The pod port (number or name); informational, EndpointSlices carry the real one.
    #[serde(default)]
    pub target_port: Option<serde_json::Value>,
    /// TCP, UDP or SCTP; only TCP is proxied.
    #[serde(default)]
    pub protocol: Option<String>,
    /// The application protocol (`grpc`, `http2`, `kubernetes.io/h2c`, …);
    /// it decides the HTTP version sidecars speak to the endpoints.
    #[serde(default)]
    pub app_protocol: Option<String>,
}

/// A `discovery.k8s.io/v1` EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    /// Object metadata; `labels["kubernetes.io/service-name"]` names the Service.
    pub metadata: ObjectMeta,
    /// IPv4, IPv6 or FQDN.
    #[serde(default)]
    pub address_type: Option<String>,
    /// The endpoints.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub endpoints: Vec<SliceEndpoint>,
    /// Ports every endpoint of the slice serves.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub ports: Vec<SlicePort>,
}

/// Label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

impl EndpointSlice {
    /// The Service this slice belongs to.
    pub fn service_name(&self) -> Option<&str> {
        self.metadata
            .labels
            .get(SERVICE_NAME_LABEL)
            .map(String::as_str)
    }
}

/// One endpoint (usually a pod) of a slice.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceEndpoint {
    /// Addresses of the endpoint; the first is used.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub addresses: Vec<String>,
    /// Ready / serving / terminating.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub conditions: Conditions,
    /// The pod behind the endpoint.
    #[serde(default)]
    pub target_ref: Option<TargetRef>,
    /// Locality zone.
    #[serde(default)]
    pub zone: Option<String>,
    /// Node the pod runs on.
    #[serde(default)]
    pub node_name: Option<String>,
}

/// Endpoint conditions; an unset condition means true for `ready` and
/// `serving`, false for `terminating`, as the Kubernetes API defines.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct Conditions {
    /// Ready to receive new traffic.
    #[serde(default)]
    pub ready: Option<bool>,
    /// Serving (may be terminating).
    #[serde(default)]
    pub serving: Option<bool>,
    /// Shutting down.
    #[serde(default)]
    pub terminating: Option<bool>,
}

/// Reference to the object behind an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct TargetRef {
    /// Usually `Pod`.
    #[serde(default)]
    pub kind: Option<String>,
    /// Object name.
    #[serde(default)]
    pub name: String,
    /// Object namespace.
    #[serde(default)]
    pub namespace: Option<String>,
}

/// A port of an EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct SlicePort {
    /// Matches the Service port name.
    #[serde(default)]
    pub name: Option<String>,
    /// The port endpoints listen on.
    #[serde(default)]
    pub port: Option<u16>,
    /// Protocol.
    #[serde(default)]
    pub protocol: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_slice_from_the_api_server_reads_as_empty() {
        // As the API server sends a slice whose Service has no ready pod.
        let slice: EndpointSlice = serde_json::from_str(
            r#"{"metadata": {"name": "b-abc", "namespace": "default", "labels": null},
                "addressType": "IPv4", "endpoints": null, "ports": null}"#,
        )
        .expect("null lists are empty");
        assert!(slice.endpoints.is_empty() && slice.ports.is_empty());
        let svc: Service =
            serde_json::from_str(r#"{"metadata": {"name": "b"}, "spec": {"ports": null}}"#)
                .expect("null ports are none");
        assert!(svc.spec.ports.is_empty());
    }
}
