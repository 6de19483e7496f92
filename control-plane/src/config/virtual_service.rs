//! Istio's VirtualService: its types as written, read into the route
//! model ([`super::route`]) by [`validate`]. What minimesh does not
//! implement (mirrors, CORS, delegation, TCP and TLS routes, `exportTo`,
//! Gateway binding, matches on source labels or gateways, ...) is refused
//! naming the field: nothing is ignored silently.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::crd::any_value;

use super::kube::ObjectMeta;
use super::route::HttpRoute as ModelRoute;

mod validate;
pub use validate::{check_regex, validate};

/// The API versions a VirtualService is read in (Istio's, as for
/// DestinationRules).
pub const VIRTUAL_SERVICE_API_VERSIONS: [&str; 3] = [
    "networking.istio.io/v1",
    "networking.istio.io/v1beta1",
    "networking.istio.io/v1alpha3",
];

/// The label `minimesh up` puts on the Gateway and VirtualServices it
/// makes of a topology's `ingress.hosts` (value: the topology's file): a
/// host that an applied VirtualService also routes at the same gateways is
/// the applied one's.
pub const FROM_TOPOLOGY: &str = "minimesh.io/from-topology";

/// A VirtualService as written.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualService {
    /// `networking.istio.io/v1`, `v1beta1` or `v1alpha3`.
    pub api_version: String,
    /// `VirtualService`.
    pub kind: String,
    /// Name and namespace.
    pub metadata: ObjectMeta,
    /// The routes.
    pub spec: VirtualServiceSpec,
}

/// `spec`: every field of Istio's; those minimesh does not implement are
/// read only to be refused by name. On Kubernetes it is also the spec of
/// the `minimesh.io/v1alpha1` CRD (`crds/`), generated from these types.
// Each print column repeats `type_ = "string"`: that is the attribute's shape.
#[allow(clippy::duplicated_attributes)]
#[derive(
    Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema, kube::CustomResource,
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[kube(
    group = "minimesh.io",
    version = "v1alpha1",
    kind = "VirtualService",
    root = "VirtualServiceResource",
    namespaced,
    shortname = "mvs",
    category = "minimesh",
    doc = "HTTP routes of Services and of Gateways' hosts: Istio's VirtualService spec, read into minimesh's route model (docs/routes.md).",
    printcolumn(name = "Gateways", type_ = "string", json_path = ".spec.gateways"),
    printcolumn(name = "Hosts", type_ = "string", json_path = ".spec.hosts"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct VirtualServiceSpec {
    /// The Services whose traffic the routes apply to.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// `mesh` (the sidecars; the default) or Gateways.
    #[serde(default)]
    pub gateways: Vec<String>,
    /// HTTP routes.
    #[serde(default)]
    pub http: Vec<HttpRoute>,
    /// TCP routes (not implemented).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub tcp: Option<Value>,
    /// TLS routes (not implemented).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub tls: Option<Value>,
    /// Namespaces that see it (not implemented).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub export_to: Option<Value>,
}

/// `spec.http[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRoute {
    /// A name for logs.
    #[serde(default)]
    pub name: Option<String>,
    /// Request matches (any of them).
    #[serde(default, rename = "match")]
    pub matches: Vec<HttpMatchRequest>,
    /// Where requests go.
    #[serde(default)]
    pub route: Vec<RouteDestination>,
    /// The time a request may take, e.g. `0.5s` (`0s`: none).
    #[serde(default)]
    pub timeout: Option<String>,
    /// Retries.
    #[serde(default)]
    pub retries: Option<HttpRetry>,
    /// Answer with a redirect.
    #[serde(default)]
    pub redirect: Option<HttpRedirect>,
    /// Answer with a status.
    #[serde(default)]
    pub direct_response: Option<DirectResponse>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub delegate: Option<Value>,
    /// The path and authority sent upstream.
    #[serde(default)]
    pub rewrite: Option<HttpRewrite>,
    /// Injected delays and aborts.
    #[serde(default)]
    pub fault: Option<HttpFault>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub mirror: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub mirrors: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub mirror_percentage: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub mirror_percent: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub cors_policy: Option<Value>,
    /// Header changes of every destination.
    #[serde(default)]
    pub headers: Option<Headers>,
}

/// `spec.http[].route[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteDestination {
    /// The Service (and port) requests go to.
    pub destination: Destination,
    /// Share of requests (one destination: may be unset).
    #[serde(default)]
    pub weight: Option<i64>,
    /// Header changes of this destination.
    #[serde(default)]
    pub headers: Option<Headers>,
}

/// `spec.http[].route[].destination`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Destination {
    /// A Service: `name`, `name.namespace`, `name.namespace.svc.cluster.local`.
    pub host: String,
    /// A subset its DestinationRule defines.
    #[serde(default)]
    pub subset: Option<String>,
    /// The Service port, when the Service has more than one.
    #[serde(default)]
    pub port: Option<PortSelector>,
}

/// `destination.port`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortSelector {
    /// The port number.
    pub number: u32,
}

/// `spec.http[].retries`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRetry {
    /// Retries after the first attempt (0: none; at most 10).
    #[serde(default)]
    pub attempts: Option<u32>,
    /// Time of each attempt, e.g. `1s`.
    #[serde(default)]
    pub per_try_timeout: Option<String>,
    /// When to retry: Istio's comma-separated conditions and status codes.
    #[serde(default)]
    pub retry_on: Option<String>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub retry_remote_localities: Option<Value>,
}

/// `spec.http[].match[]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpMatchRequest {
    /// A name for logs.
    #[serde(default)]
    pub name: Option<String>,
    /// The path.
    #[serde(default)]
    pub uri: Option<StringMatch>,
    /// The method.
    #[serde(default)]
    pub method: Option<StringMatch>,
    /// Headers (names lower case; `{}`: present).
    #[serde(default)]
    pub headers: BTreeMap<String, StringMatch>,
    /// Headers that must not match.
    #[serde(default)]
    pub without_headers: BTreeMap<String, StringMatch>,
    /// Query parameters.
    #[serde(default)]
    pub query_params: BTreeMap<String, StringMatch>,
    /// The Service port.
    #[serde(default)]
    pub port: Option<u32>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub scheme: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub authority: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub source_labels: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub gateways: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub ignore_uri_case: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub source_namespace: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub stat_prefix: Option<Value>,
}

/// Istio's `StringMatch`: one of `exact`, `prefix`, `regex` (none: present).
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StringMatch {
    /// Equal.
    #[serde(default)]
    pub exact: Option<String>,
    /// Starts with.
    #[serde(default)]
    pub prefix: Option<String>,
    /// RE2, the whole value.
    #[serde(default)]
    pub regex: Option<String>,
}

/// `headers` of a route or destination.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Headers {
    /// Changes on the request.
    #[serde(default)]
    pub request: Option<HeaderOperations>,
    /// Changes on the response.
    #[serde(default)]
    pub response: Option<HeaderOperations>,
}

/// `set`, `add`, `remove`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HeaderOperations {
    /// Replace.
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    /// Append.
    #[serde(default)]
    pub add: BTreeMap<String, String>,
    /// Remove.
    #[serde(default)]
    pub remove: Vec<String>,
}

/// `rewrite`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRewrite {
    /// Replaces the part the `uri` prefix match matched (the whole path otherwise).
    #[serde(default)]
    pub uri: Option<String>,
    /// Replaces the authority.
    #[serde(default)]
    pub authority: Option<String>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub uri_regex_rewrite: Option<Value>,
}

/// `redirect`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HttpRedirect {
    /// Replaces the path.
    #[serde(default)]
    pub uri: Option<String>,
    /// Replaces the authority.
    #[serde(default)]
    pub authority: Option<String>,
    /// The port.
    #[serde(default)]
    pub port: Option<u32>,
    /// `http` or `https`.
    #[serde(default)]
    pub scheme: Option<String>,
    /// 301 (the default), 302, 303, 307 or 308.
    #[serde(default)]
    pub redirect_code: Option<u32>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub derive_port: Option<Value>,
}

/// `directResponse`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DirectResponse {
    /// The status.
    pub status: u32,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub body: Option<Value>,
}

/// `fault`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpFault {
    /// Delays.
    #[serde(default)]
    pub delay: Option<FaultDelay>,
    /// Aborts.
    #[serde(default)]
    pub abort: Option<FaultAbort>,
}

/// `fault.delay`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultDelay {
    /// How long.
    #[serde(default)]
    pub fixed_delay: Option<String>,
    /// Share of requests (unset: all).
    #[serde(default)]
    pub percentage: Option<Percent>,
    /// Share of requests, the old integer field.
    #[serde(default)]
    pub percent: Option<i64>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub exponential_delay: Option<Value>,
}

/// `fault.abort`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultAbort {
    /// The status.
    #[serde(default)]
    pub http_status: Option<u32>,
    /// Share of requests (unset: all).
    #[serde(default)]
    pub percentage: Option<Percent>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub grpc_status: Option<Value>,
    /// Not implemented.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_value")]
    pub http2_error: Option<Value>,
}

/// `{value: 12.5}`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Percent {
    /// 0 to 100.
    #[serde(default)]
    pub value: f64,
}

/// A VirtualService minimesh applies: the Services it routes and its routes.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidVirtualService {
    /// The object as written.
    pub virtual_service: VirtualService,
    /// The Services whose callers' sidecars it routes (its hosts, when it
    /// applies to `mesh`): (name, namespace).
    pub services: Vec<(String, String)>,
    /// The Gateways it is bound to: (namespace, name).
    pub gateways: Vec<(String, String)>,
    /// The hosts it routes at those Gateways (lower case).
    pub gateway_hosts: Vec<String>,
    /// Its routes, in order.
    pub routes: Vec<ModelRoute>,
}

/// How the admin API's `/debug/config` lists an applied VirtualService
/// (`namespace/name`): its Services and routes.
pub fn view(namespace: &str, name: &str, v: &ValidVirtualService) -> Value {
    let routes: Vec<Value> = v.routes.iter().map(super::route::view).collect();
    serde_json::json!({
        "namespace": namespace,
        "name": name,
        "services": v.services.iter().map(|s| format!("{}.{}", s.0, s.1)).collect::<Vec<_>>(),
        "gateways": v.gateways.iter().map(|g| format!("{}/{}", g.0, g.1)).collect::<Vec<_>>(),
        "gateway_hosts": v.gateway_hosts,
        "routes": routes,
    })
}
