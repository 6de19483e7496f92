//! Istio's Gateway: the hosts an ingress gateway serves, on which port, for
//! the gateway workloads its `selector` picks. A VirtualService bound to it
//! (`gateways: [name]`) routes those hosts; the gateway serves no other.
//! TLS termination and non-HTTP servers are refused, naming the field.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::kube::ObjectMeta;

/// The API versions a Gateway is read in (Istio's).
pub const GATEWAY_API_VERSIONS: [&str; 3] = [
    "networking.istio.io/v1",
    "networking.istio.io/v1beta1",
    "networking.istio.io/v1alpha3",
];

/// A Gateway as written.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gateway {
    /// `networking.istio.io/v1`, ...
    pub api_version: String,
    /// `Gateway`.
    pub kind: String,
    /// Name and namespace.
    pub metadata: ObjectMeta,
    /// What it serves.
    pub spec: GatewaySpec,
}

/// `spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewaySpec {
    /// The labels of the gateway workloads it applies to (empty: every
    /// gateway).
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// Its listeners.
    #[serde(default)]
    pub servers: Vec<Server>,
}

/// `spec.servers[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Server {
    /// The port.
    pub port: Port,
    /// The hosts served: `host`, `ns/host`, `./host`, `*/host`, `*`,
    /// `*.suffix`.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// A name for logs.
    #[serde(default)]
    pub name: Option<String>,
    /// Not implemented.
    #[serde(default)]
    pub tls: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub bind: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub default_endpoint: Option<Value>,
}

/// `spec.servers[].port`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Port {
    /// The number.
    pub number: u32,
    /// `HTTP`, `HTTP2`, `GRPC` (served); others refused.
    #[serde(default)]
    pub protocol: Option<String>,
    /// A name.
    #[serde(default)]
    pub name: Option<String>,
    /// The workload's port (Istio's; the gateway's own listener here).
    #[serde(default)]
    pub target_port: Option<u32>,
}

/// A Gateway minimesh applies: its selector and, per HTTP server, the port
/// and the host patterns it binds.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidGateway {
    /// The object as written.
    pub gateway: Gateway,
    /// The labels of the gateways it applies to.
    pub selector: BTreeMap<String, String>,
    /// (port, host pattern as `(namespace or *, host)`).
    pub binds: Vec<(u32, HostPattern)>,
}

/// A server's host: which VirtualServices may claim it, and the name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPattern {
    /// The namespace the VirtualService must be in; None: any.
    pub namespace: Option<String>,
    /// `*`, `*.suffix` or an exact name (lower case).
    pub host: String,
}

impl HostPattern {
    /// Whether a VirtualService in `namespace` may route `host` here.
    pub fn allows(&self, namespace: &str, host: &str) -> bool {
        if self.namespace.as_deref().is_some_and(|n| n != namespace) {
            return false;
        }
        let host = host.to_ascii_lowercase();
        match self.host.strip_prefix('*') {
            Some("") => true,
            Some(suffix) => host.ends_with(suffix) && host.len() > suffix.len(),
            None => host == self.host,
        }
    }
}

/// How the admin API's `/debug/config` lists a Gateway.
pub fn view(namespace: &str, name: &str, g: &ValidGateway) -> Value {
    serde_json::json!({
        "namespace": namespace,
        "name": name,
        "selector": g.selector,
        "servers": g.binds.iter().map(|(port, h)| {
            let ns = h.namespace.as_deref().unwrap_or("*");
            format!("{port} {ns}/{}", h.host)
        }).collect::<Vec<_>>(),
    })
}

/// Why a Gateway is refused: the field and the reason.
pub type Refusal = (String, String);

fn not_yet(field: String, what: &str) -> Refusal {
    (
        field,
        format!("{what} is not implemented yet; this Gateway is not applied"),
    )
}

/// A host name a client may send: letters, digits, `-`, `.`, and a leading
/// `*.` where patterns are allowed.
pub fn is_host_name(h: &str, pattern: bool) -> bool {
    let h = if pattern {
        h.strip_prefix("*.").unwrap_or(h)
    } else {
        h
    };
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// Checks `g` (of `namespace`) and reads what it binds.
pub fn validate(g: Gateway, namespace: &str) -> Result<ValidGateway, Refusal> {
    if g.spec.servers.is_empty() {
        return Err(("spec.servers".into(), "has no server".into()));
    }
    let mut binds = Vec::new();
    for (i, s) in g.spec.servers.iter().enumerate() {
        let at = format!("spec.servers[{i}]");
        if s.tls.is_some() {
            return Err(not_yet(format!("{at}.tls"), "TLS at the gateway"));
        }
        if s.bind.is_some() {
            return Err(not_yet(
                format!("{at}.bind"),
                "binding a server to an address",
            ));
        }
        if s.default_endpoint.is_some() {
            return Err(not_yet(
                format!("{at}.defaultEndpoint"),
                "a server's default endpoint",
            ));
        }
        let protocol = s.port.protocol.as_deref().unwrap_or("HTTP");
        if !["HTTP", "HTTP2", "GRPC"]
            .iter()
            .any(|p| protocol.eq_ignore_ascii_case(p))
        {
            return Err(not_yet(
                format!("{at}.port.protocol"),
                &format!("serving {protocol} (only HTTP, HTTP2 and GRPC)"),
            ));
        }
        if s.port.number == 0 || s.port.number > 65535 {
            return Err((
                format!("{at}.port.number"),
                format!("{} is not a port", s.port.number),
            ));
        }
        if s.hosts.is_empty() {
            return Err((format!("{at}.hosts"), "names no host".into()));
        }
        for (j, h) in s.hosts.iter().enumerate() {
            let f = format!("{at}.hosts[{j}]");
            let (ns, host) = match h.split_once('/') {
                Some(("*", host)) => (None, host),
                Some((".", host)) => (Some(namespace.to_string()), host),
                Some((ns, host)) => (Some(ns.to_string()), host),
                None => (None, h.as_str()),
            };
            if host != "*" && !is_host_name(host, true) {
                return Err((f, format!("{h:?} is not a host name, `*` or `*.suffix`")));
            }
            binds.push((
                s.port.number,
                HostPattern {
                    namespace: ns,
                    host: host.to_ascii_lowercase(),
                },
            ));
        }
    }
    Ok(ValidGateway {
        selector: g.spec.selector.clone(),
        gateway: g,
        binds,
    })
}

#[cfg(test)]
mod tests {
    use super::{validate, Gateway};

    fn gw(spec: &str) -> Result<super::ValidGateway, super::Refusal> {
        let text = format!(
            "apiVersion: networking.istio.io/v1beta1\nkind: Gateway\nmetadata: {{name: coolstore-gateway}}\nspec:\n{spec}"
        );
        let g: Gateway = serde_saphyr::from_str(&text).expect("YAML");
        validate(g, "istioinaction")
    }

    #[test]
    fn the_books_gateway_binds_its_host_on_port_80() {
        let g = gw("  selector: {istio: ingressgateway}\n  servers:\n  - port: {number: 80, name: http, protocol: HTTP}\n    hosts: [\"simple-web.istioinaction.io\"]\n")
            .expect("valid");
        assert_eq!(g.selector["istio"], "ingressgateway");
        let (port, host) = &g.binds[0];
        assert_eq!(*port, 80);
        assert!(host.allows("istioinaction", "Simple-Web.istioinaction.io"));
        assert!(host.allows("other", "simple-web.istioinaction.io"));
        assert!(!host.allows(
            "istioinaction",
            "simple-backend.istioinaction.svc.cluster.local"
        ));
        let g = gw("  servers:\n  - port: {number: 80}\n    hosts: [\"./*.example.com\"]\n")
            .expect("valid");
        let (_, host) = &g.binds[0];
        assert!(host.allows("istioinaction", "a.example.com"));
        assert!(!host.allows("other", "a.example.com"));
        assert!(!host.allows("istioinaction", "example.com"));
    }

    #[test]
    fn tls_and_other_protocols_are_refused_by_field() {
        let (f, r) = gw("  servers:\n  - port: {number: 443, protocol: HTTPS}\n    hosts: [a.example.com]\n    tls: {mode: SIMPLE}\n").unwrap_err();
        assert_eq!(
            (f.as_str(), r.as_str()),
            (
                "spec.servers[0].tls",
                "TLS at the gateway is not implemented yet; this Gateway is not applied"
            )
        );
        let (f, _) =
            gw("  servers:\n  - port: {number: 31400, protocol: TCP}\n    hosts: [\"*\"]\n")
                .unwrap_err();
        assert_eq!(f, "spec.servers[0].port.protocol");
        let (f, _) =
            gw("  servers:\n  - port: {number: 80}\n    hosts: [\"bad host\"]\n").unwrap_err();
        assert_eq!(f, "spec.servers[0].hosts[0]");
    }
}
