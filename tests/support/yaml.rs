//! The Kubernetes objects the tests write into a control plane's config
//! directory, shared by the end-to-end and in-process tiers (each includes
//! it as `crate::yaml`).

use std::net::Ipv4Addr;

/// The namespace of every object a test writes unless it says otherwise.
pub const NS: &str = "default";

pub fn service_yaml(name: &str, endpoints: &[(Ipv4Addr, String)]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NS}\nspec:\n  ports:\n  - name: http\n    port: 80\n    targetPort: 9090\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-abc\n  namespace: {NS}\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\nports:\n- name: http\n  port: 9090\nendpoints:\n"
    );
    if endpoints.is_empty() {
        y.push_str("[]\n");
    }
    for (ip, pod) in endpoints {
        y.push_str(&endpoint_yaml(*ip, pod, None));
    }
    y
}

/// One ready EndpointSlice endpoint, optionally in a zone.
pub fn endpoint_yaml(ip: Ipv4Addr, pod: &str, zone: Option<&str>) -> String {
    let zone = zone.map(|z| format!("  zone: {z}\n")).unwrap_or_default();
    format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: {pod}}}\n{zone}")
}

/// A DestinationRule `{service}-dr` for `service` with this `loadBalancer`
/// (YAML lines, indented under it).
pub fn rule_yaml(service: &str, load_balancer: &str) -> String {
    format!(
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: {service}-dr\nspec:\n  host: {service}\n  trafficPolicy:\n    loadBalancer:\n{}\n",
        load_balancer.lines().map(|l| format!("      {l}")).collect::<Vec<_>>().join("\n")
    )
}
