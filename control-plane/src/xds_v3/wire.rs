//! Envoy's discovery envelopes to and from minimesh's. The two protocols
//! carry the same fields (minimesh's was modelled on Envoy's), so a v3
//! stream is a minimesh stream whose requests and responses are converted
//! at the edge: the resources inside are already Envoy's (the cache holds
//! them encoded), and are moved, not copied.

use envoy_types::pb::envoy::config::core::v3::Node as EnvoyNode;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::{value::Kind, Any};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use minimesh_proto::prost_types;
use minimesh_proto::v1;

/// Who an Envoy or gRPC client says it is. The id and locality are xDS's
/// own; the workload, namespace and address come from the node metadata
/// keys Istio's proxies and proxyless bootstraps use (`NAME` or
/// `WORKLOAD_NAME`, `NAMESPACE`, `INSTANCE_IPS`), the workload otherwise
/// from the node's `cluster` (the service it belongs to).
pub fn node(n: &EnvoyNode) -> v1::Node {
    let meta = |key: &str| {
        n.metadata
            .as_ref()
            .and_then(|m| m.fields.get(key))
            .and_then(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
    };
    v1::Node {
        id: n.id.clone(),
        workload: meta("WORKLOAD_NAME")
            .or_else(|| meta("NAME"))
            .unwrap_or_else(|| n.cluster.clone()),
        namespace: meta("NAMESPACE").unwrap_or_default(),
        address: meta("INSTANCE_IPS")
            .map(|ips| ips.split(',').next().unwrap_or_default().to_string())
            .unwrap_or_default(),
        zone: n
            .locality
            .as_ref()
            .map(|l| l.zone.clone())
            .unwrap_or_default(),
        // Envoy's client features are not minimesh's (no v3 client keeps
        // endpoint assignments a state-of-the-world response leaves out).
        client_features: vec![],
    }
}

fn error_detail(s: RpcStatus) -> v1::ErrorDetail {
    v1::ErrorDetail {
        code: s.code,
        message: s.message,
    }
}

fn any(a: prost_types::Any) -> Any {
    Any {
        type_url: a.type_url,
        value: a.value,
    }
}

/// A state-of-the-world request as minimesh's.
pub fn sotw_request(r: DiscoveryRequest) -> v1::DiscoveryRequest {
    v1::DiscoveryRequest {
        version_info: r.version_info,
        node: r.node.as_ref().map(node),
        resource_names: r.resource_names,
        type_url: r.type_url,
        response_nonce: r.response_nonce,
        error_detail: r.error_detail.map(error_detail),
    }
}

/// A state-of-the-world response as Envoy's.
pub fn sotw_response(r: v1::DiscoveryResponse) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: r.version_info,
        resources: r.resources.into_iter().map(any).collect(),
        type_url: r.type_url,
        nonce: r.nonce,
        ..Default::default()
    }
}

/// An incremental request as minimesh's.
pub fn delta_request(r: DeltaDiscoveryRequest) -> v1::DeltaDiscoveryRequest {
    v1::DeltaDiscoveryRequest {
        node: r.node.as_ref().map(node),
        type_url: r.type_url,
        resource_names_subscribe: r.resource_names_subscribe,
        resource_names_unsubscribe: r.resource_names_unsubscribe,
        initial_resource_versions: r.initial_resource_versions,
        response_nonce: r.response_nonce,
        error_detail: r.error_detail.map(error_detail),
    }
}

/// An incremental response as Envoy's.
pub fn delta_response(r: v1::DeltaDiscoveryResponse) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        system_version_info: r.system_version_info,
        resources: r
            .resources
            .into_iter()
            .map(|res| Resource {
                name: res.name,
                version: res.version,
                resource: res.resource.map(any),
                ..Default::default()
            })
            .collect(),
        type_url: r.type_url,
        removed_resources: r.removed_resources,
        nonce: r.nonce,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::Locality;
    use envoy_types::pb::google::protobuf::{Struct, Value};

    #[test]
    fn a_proxyless_node_is_named_from_its_metadata() {
        let s = |v: &str| Value {
            kind: Some(Kind::StringValue(v.into())),
        };
        let n = EnvoyNode {
            id: "client-1".into(),
            cluster: "checkout".into(),
            metadata: Some(Struct {
                fields: [
                    ("NAMESPACE".to_string(), s("shop")),
                    ("INSTANCE_IPS".to_string(), s("10.1.2.3,fd00::3")),
                ]
                .into_iter()
                .collect(),
            }),
            locality: Some(Locality {
                zone: "zone-a".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let got = node(&n);
        assert_eq!(
            (
                got.id.as_str(),
                got.workload.as_str(),
                got.namespace.as_str()
            ),
            ("client-1", "checkout", "shop")
        );
        assert_eq!(
            (got.address.as_str(), got.zone.as_str()),
            ("10.1.2.3", "zone-a")
        );
    }
}
