//! The Gateway API's `Gateway`: its listeners, when its class is
//! minimesh's.

use serde::Deserialize;
use serde_json::Value;

use super::{not_yet, Refusal, GATEWAY_CLASS};
use crate::config::gateway::is_host_name;
use crate::config::kube::ObjectMeta;

/// `Gateway` (the Gateway API's).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gateway {
    /// `gateway.networking.k8s.io/v1`.
    pub api_version: String,
    /// `Gateway`.
    pub kind: String,
    /// Name, namespace.
    pub metadata: ObjectMeta,
    /// Its class and listeners.
    pub spec: GatewaySpec,
}

/// `Gateway.spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewaySpec {
    /// `minimesh` for minimesh's; others are another controller's.
    pub gateway_class_name: String,
    /// Its listeners.
    #[serde(default)]
    pub listeners: Vec<Listener>,
    /// Not implemented.
    #[serde(default)]
    pub addresses: Option<Value>,
    /// Not implemented.
    #[serde(default)]
    pub infrastructure: Option<Value>,
}

/// `spec.listeners[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Listener {
    /// Its name (routes' `sectionName`).
    pub name: String,
    /// Hosts it takes: exact or `*.suffix`; none: any.
    #[serde(default)]
    pub hostname: Option<String>,
    /// The port.
    pub port: u32,
    /// `HTTP` (others refused).
    pub protocol: String,
    /// Not implemented.
    #[serde(default)]
    pub tls: Option<Value>,
    /// Which namespaces' routes may attach: `Same` (default) or `All`.
    #[serde(default)]
    pub allowed_routes: Option<AllowedRoutes>,
}

/// `allowedRoutes`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedRoutes {
    /// `from`.
    #[serde(default)]
    pub namespaces: Option<RouteNamespaces>,
    /// Not implemented (HTTPRoute only).
    #[serde(default)]
    pub kinds: Option<Value>,
}

/// `allowedRoutes.namespaces`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteNamespaces {
    /// `Same`, `All` (`Selector` refused).
    #[serde(default)]
    pub from: Option<String>,
    /// Not implemented.
    #[serde(default)]
    pub selector: Option<Value>,
}

/// A Gateway minimesh serves.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidGateway {
    /// Its listeners: (name, port, hostname pattern or None, all namespaces).
    pub listeners: Vec<(String, u32, Option<String>, bool)>,
}

/// Checks a Gateway of class `minimesh` (`Ok(None)`: another class's).
pub fn validate_gateway(g: &Gateway) -> Result<Option<ValidGateway>, Refusal> {
    if g.spec.gateway_class_name != GATEWAY_CLASS {
        return Ok(None);
    }
    let k = "Gateway";
    if g.spec.addresses.is_some() {
        return Err(not_yet("spec.addresses".into(), "requesting addresses", k));
    }
    if g.spec.infrastructure.is_some() {
        return Err(not_yet(
            "spec.infrastructure".into(),
            "infrastructure settings",
            k,
        ));
    }
    let mut listeners = Vec::new();
    for (i, l) in g.spec.listeners.iter().enumerate() {
        let at = format!("spec.listeners[{i}]");
        if l.protocol != "HTTP" {
            return Err(not_yet(
                format!("{at}.protocol"),
                &format!("serving {}", l.protocol),
                k,
            ));
        }
        if l.tls.is_some() {
            return Err(not_yet(format!("{at}.tls"), "TLS at the gateway", k));
        }
        if l.port == 0 || l.port > 65535 {
            return Err((format!("{at}.port"), format!("{} is not a port", l.port)));
        }
        if let Some(h) = l.hostname.as_deref().filter(|h| !is_host_name(h, true)) {
            return Err((
                format!("{at}.hostname"),
                format!("{h:?} is not a host name or *.suffix"),
            ));
        }
        let all = match l
            .allowed_routes
            .as_ref()
            .and_then(|a| a.namespaces.as_ref())
        {
            None => false,
            Some(n) if n.selector.is_some() => {
                return Err(not_yet(
                    format!("{at}.allowedRoutes.namespaces.selector"),
                    "selecting namespaces by label",
                    k,
                ))
            }
            Some(n) => match n.from.as_deref() {
                None | Some("Same") => false,
                Some("All") => true,
                Some(other) => {
                    return Err(not_yet(
                        format!("{at}.allowedRoutes.namespaces.from"),
                        &format!("allowing routes from {other:?}"),
                        k,
                    ))
                }
            },
        };
        listeners.push((
            l.name.clone(),
            l.port,
            l.hostname.as_ref().map(|h| h.to_ascii_lowercase()),
            all,
        ));
    }
    Ok(Some(ValidGateway { listeners }))
}
