//! The Kubernetes Gateway API (`gateway.networking.k8s.io/v1`): `HTTPRoute`
//! read into the route model, attached to a Service (mesh traffic, as
//! GAMMA defines) or to a `Gateway` (the ingress) of class `minimesh`.
//! What minimesh does not implement (mirrors, CORS, extension filters,
//! backend filters, other kinds of backends and parents) is refused,
//! naming the field.

mod gateway;
mod http_route;
mod validate;

pub use gateway::{
    validate_gateway, AllowedRoutes, Gateway, GatewaySpec, Listener, RouteNamespaces, ValidGateway,
};
pub use http_route::{
    BackendRef, Filter, HeaderModifier, HttpRoute, HttpRouteSpec, Match, NameValue, NamedMatch,
    ParentRef, PathModifier, RequestRedirect, Rule, Timeouts, TypedValue, UrlRewrite,
};
pub use validate::{validate_route, Parent, Precedence, ValidHttpRoute};

/// The API versions read.
pub const GATEWAY_API_VERSIONS: [&str; 2] = [
    "gateway.networking.k8s.io/v1",
    "gateway.networking.k8s.io/v1beta1",
];

/// The GatewayClass whose Gateways minimesh's gateways serve.
pub const GATEWAY_CLASS: &str = "minimesh";

/// The label a gateway carries (`--labels`) to serve the Gateway API
/// Gateway of that name (in its namespace), as Istio's deployed gateways.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

/// Why an object is refused: the field and the reason.
pub type Refusal = (String, String);

fn not_yet(field: String, what: &str, kind: &str) -> Refusal {
    (
        field,
        format!("{what} is not implemented yet; this {kind} is not applied"),
    )
}
