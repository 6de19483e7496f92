//! The `sidecar` binary's command line: every flag, its environment
//! variable, its default and its parser. `run` reads nothing else.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::app_probe;

/// Command-line flags of the `sidecar` binary.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "sidecar",
    version,
    about = "minimesh sidecar proxy (and ingress gateway with --mode gateway)"
)]
pub struct Args {
    /// `sidecar` (beside an app) or `gateway` (ingress for outside traffic).
    #[arg(long, env = "MINIMESH_MODE", default_value = "sidecar", value_parser = ["sidecar", "gateway"])]
    pub mode: String,
    /// Control plane discovery address: `http://` plaintext, `https://`
    /// TLS (the control plane's certificate checked against `--ca-root`).
    #[arg(
        long,
        env = "MINIMESH_XDS_ADDR",
        default_value = "http://127.0.0.1:15010"
    )]
    pub xds_addr: String,
    /// Proxy id; defaults to `<workload>.<namespace>`.
    #[arg(long, env = "MINIMESH_NODE_ID")]
    pub node_id: Option<String>,
    /// Workload (pod) name.
    #[arg(long, env = "POD_NAME", default_value = "workload")]
    pub workload: String,
    /// Namespace; short service names (`simple-backend`) resolve in it.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Zone of this workload (Kubernetes: its node's
    /// `topology.kubernetes.io/zone`), reported to the control plane. With
    /// it, clusters whose rule has outlier detection or health checks
    /// prefer endpoints of the same zone (the EndpointSlice's `zone`) and
    /// fail over to the others as those fail, as Istio's locality load
    /// balancing; empty turns that off.
    #[arg(long, env = "MINIMESH_ZONE", default_value = "")]
    pub zone: String,
    /// Outbound listener (the app's HTTP_PROXY, or the gateway's public address).
    #[arg(
        long,
        env = "MINIMESH_OUTBOUND_ADDR",
        default_value = "127.0.0.1:15001"
    )]
    pub outbound: SocketAddr,
    /// Inbound listener in front of the app (needs --app).
    #[arg(long, env = "MINIMESH_INBOUND_ADDR", requires = "app")]
    pub inbound: Option<SocketAddr>,
    /// Where the app listens, for the inbound listener.
    #[arg(long, env = "MINIMESH_APP_ADDR", requires = "inbound")]
    pub app: Option<SocketAddr>,
    /// Transparent capture, outbound: the outbound listener also takes the
    /// app's connections that the pod's capture rules (`sidecar
    /// init-capture`) redirect to it, and sends each where the app meant
    /// it to go: a Service address to its cluster, anything else through
    /// unchanged. A connection dialed to the listener itself is still
    /// served as an explicit proxy. See docs/capture.md.
    #[arg(long, env = "MINIMESH_CAPTURE")]
    pub capture: bool,
    /// Transparent capture, inbound: the listener the capture rules
    /// redirect callers' connections to (e.g. `0.0.0.0:15006`); each goes
    /// to the app on the port the caller dialed, at 127.0.0.1.
    #[arg(long, env = "MINIMESH_INBOUND_CAPTURE_ADDR")]
    pub inbound_capture: Option<SocketAddr>,
    /// How long a captured connection to a port of unknown protocol (no
    /// `appProtocol`, no protocol name prefix) may take to send its first
    /// bytes before it is proxied as opaque TCP (Linkerd's detect timeout:
    /// a protocol whose server speaks first waits this long once).
    #[arg(long, env = "MINIMESH_PROTOCOL_DETECT_TIMEOUT", default_value = "10s", value_parser = minimesh_proto::duration::parse_positive)]
    pub protocol_detect_timeout: Duration,
    /// The app's HTTP probes the admin port makes for the kubelet, JSON
    /// (set by the injector when it points the pod's probes at
    /// `/app-health/<container>/<livez|readyz|startupz>`): each admin path
    /// to the app's `{"port", "path", "httpHeaders"}`.
    #[arg(long, env = "MINIMESH_APP_PROBES", value_parser = app_probes)]
    pub app_probes: Option<app_probe::AppProbes>,
    /// What the inbound listeners do before the control plane has sent the
    /// AuthorizationPolicies: `refuse` (the default: 503, and the sidecar is
    /// not ready) or `allow` (every request, as with no policy: only for a
    /// sidecar run without a control plane, as `minimesh bench` does).
    #[arg(long, env = "MINIMESH_INBOUND_BEFORE_CONFIG", default_value = "refuse", value_parser = ["refuse", "allow"])]
    pub inbound_before_config: String,
    /// The HTTP version the inbound listener speaks to the app: `client`
    /// (the version the request arrived in: callers' sidecars speak HTTP/2
    /// only to ports declared gRPC or HTTP/2), `http1` or `http2`.
    #[arg(long, env = "MINIMESH_APP_PROTOCOL", default_value = "client", value_parser = parse_app_protocol)]
    pub app_protocol: minimesh_proto::v1::UpstreamProtocol,
    /// Admin listener (/healthz, /ready, /metrics, /debug/config).
    #[arg(long, env = "MINIMESH_ADMIN_ADDR", default_value = "127.0.0.1:15000")]
    pub admin: SocketAddr,
    /// The mesh's root certificate(s), PEM (`minimesh up` writes
    /// `.minimesh/ca/root-cert.pem`). With it, this sidecar gets a
    /// certificate from the control plane's CA (`--token-file` proves who
    /// it is), speaks mutual TLS to endpoints that run a sidecar, and its
    /// inbound listener takes mutual TLS (and plaintext too while the mode
    /// is PERMISSIVE). Unset: plaintext only.
    #[arg(long, env = "MINIMESH_CA_ROOT")]
    pub ca_root: Option<std::path::PathBuf>,
    /// The workload's token for the CA (Kubernetes: a projected service
    /// account token with audience `minimesh`), read at every renewal.
    #[arg(
        long,
        env = "MINIMESH_TOKEN_FILE",
        default_value = "/var/run/secrets/minimesh/token"
    )]
    pub token_file: std::path::PathBuf,
    /// The SPIFFE trust domain peers' certificates must name.
    #[arg(long, env = "MINIMESH_TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Serve the admin listener's `/debug/*` views to every caller. Off,
    /// they answer loopback callers only (`kubectl port-forward`, a shell
    /// in the pod) and 403 anyone else; `/healthz`, `/ready` and `/metrics`
    /// answer everyone (the kubelet's probes, Prometheus).
    #[arg(long, env = "MINIMESH_ADMIN_DEBUG")]
    pub admin_debug: bool,
    /// Extra host name for a service, `HOST=SERVICE.NAMESPACE` (repeatable), e.g.
    /// `simple-web.istioinaction.io=simple-web.default`. In gateway mode these
    /// (and `--default-route`) are the only hosts served: a Host naming an
    /// internal Service (`backend.default.svc.cluster.local`) is answered 404
    /// without reaching it. A static fallback for a gateway whose hosts no
    /// Gateway object gives (a cluster with neither Istio's nor the Gateway
    /// API's CRDs); `minimesh up` gives its ingress Gateway objects instead.
    #[arg(long = "route", env = "MINIMESH_ROUTES", value_delimiter = ',', value_parser = parse_alias)]
    pub routes: Vec<(String, String)>,
    /// The workload's labels, `KEY=VALUE` (repeatable; the injector sets
    /// the pod's, `minimesh up` `app=<service>` and its deployment's): the
    /// AuthorizationPolicies whose `selector` they match (every label of
    /// the selector, with its value) apply to its inbound listeners; in
    /// gateway mode, the Istio Gateways whose `selector` they match are the
    /// ones this gateway serves, with the VirtualServices bound to them
    /// (Istio's ingress gateway is `istio=ingressgateway`).
    #[arg(long = "labels", env = "MINIMESH_LABELS", value_delimiter = ',', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Service (`SERVICE.NAMESPACE`) for requests whose host matches nothing.
    #[arg(long, env = "MINIMESH_DEFAULT_ROUTE")]
    pub default_route: Option<String>,
    /// For source-IP hashing, take the caller from the first X-Forwarded-For
    /// hop (only behind a load balancer that sets it: clients can forge it).
    #[arg(long, env = "MINIMESH_TRUST_FORWARDED_FOR")]
    pub trust_forwarded_for: bool,
    /// Upstream TCP connect timeout.
    #[arg(long, env = "MINIMESH_CONNECT_TIMEOUT", default_value = "1s", value_parser = minimesh_proto::duration::parse_positive)]
    pub connect_timeout: Duration,
    /// How long a client connection may go without sending a complete
    /// request head before it is closed: an idle keep-alive connection, or
    /// a client sending its headers too slowly (HTTP/1.1; `0s`: never;
    /// closed within a quarter of a second after; on a new connection, the
    /// wait for its first byte and the wait for the rest of its first head
    /// are each bounded by it). The default, 75s, is nginx's keepalive_timeout. A client whose pool
    /// keeps idle connections longer (Go and hyper: 90s) sees them closed
    /// and opens new ones.
    /// Over HTTP/2 (and for a client whose first bytes do not tell its
    /// version yet, such as one that sent `P` and stopped), a connection
    /// with no request in flight for this long is closed too: GOAWAY, then
    /// dropped a quarter of a second later if it has not closed (nginx's
    /// `http2_idle_timeout`, which is its keepalive_timeout).
    #[arg(long, env = "MINIMESH_CLIENT_IDLE_TIMEOUT", default_value = "75s", value_parser = duration)]
    pub client_idle_timeout: Duration,
    /// How long a client's request body may go without sending any of
    /// itself (between two parts, as nginx's `client_body_timeout`, whose
    /// default this is) before the request fails: 408 when no response has
    /// started, the stream or connection reset otherwise; `0s`: never.
    #[arg(long, env = "MINIMESH_CLIENT_BODY_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub client_body_timeout: Duration,
    /// Most client connections each proxy listener (outbound, inbound,
    /// inbound capture) serves at once; a connection beyond it is accepted
    /// and closed at once, and counted
    /// (`minimesh_listener_connections_refused_total`). The default,
    /// 50000, is Envoy's suggested `max_downstream_connection` for an edge
    /// proxy; keep it under the process's descriptor limit.
    #[arg(long, env = "MINIMESH_MAX_CONNECTIONS", default_value_t = 50_000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Largest request head a client may send, in KiB: the request line
    /// and headers together over HTTP/1.1, the header list over HTTP/2
    /// (Envoy's `max_request_headers_kb`). A larger one is answered 431.
    #[arg(long, env = "MINIMESH_MAX_REQUEST_HEADERS_KB", default_value_t = 60,
          value_parser = clap::value_parser!(u32).range(8..=8192))]
    pub max_request_headers_kb: u32,
    /// Most header fields a client's HTTP/1.1 request may carry (Envoy's
    /// `max_headers_count`). More are answered 431.
    #[arg(long, env = "MINIMESH_MAX_REQUEST_HEADERS", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub max_request_headers: u32,
    /// Gateway mode: pass the mesh's own headers (`x-minimesh-endpoint`,
    /// `x-minimesh-error`, ...) and minimesh's detailed error reasons, which
    /// name pod addresses, to outside clients. Off, outside clients see
    /// neither, and an error says only what failed ("upstream timed out").
    /// For benchmarks and demos; never on a gateway the public reaches.
    #[arg(long, env = "MINIMESH_DEBUG_HEADERS")]
    pub debug_headers: bool,
    /// Event loops (threads) serving the proxy listeners, each on its own
    /// SO_REUSEPORT socket. Default: 1 in sidecar mode (one pod's traffic;
    /// the cheapest per request), one per core in gateway mode; 0 means one
    /// per core. Discovery, load reports and admin run on the first.
    #[arg(long, env = "MINIMESH_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// On SIGTERM, how long requests in flight may take to finish.
    #[arg(long, env = "MINIMESH_DRAIN", default_value = "5s", value_parser = duration)]
    pub drain: Duration,
    /// Largest discovery response accepted, in bytes (gRPC's usual 4 MiB
    /// holds about 70,000 endpoints; a larger response fails the stream and
    /// the last config stays in force).
    #[arg(long, env = "MINIMESH_XDS_MAX_MESSAGE_SIZE", default_value_t = DEFAULT_XDS_MAX_MESSAGE_SIZE,
          value_parser = clap::value_parser!(u32).range(1024..))]
    pub xds_max_message_size: u32,
}

/// Default of `--xds-max-message-size`: 64 MiB, about a million endpoints.
pub const DEFAULT_XDS_MAX_MESSAGE_SIZE: u32 = 64 << 20;

fn parse_app_protocol(s: &str) -> Result<minimesh_proto::v1::UpstreamProtocol, String> {
    use minimesh_proto::v1::UpstreamProtocol;
    match s {
        "client" => Ok(UpstreamProtocol::Client),
        "http1" => Ok(UpstreamProtocol::Http1),
        "http2" => Ok(UpstreamProtocol::Http2),
        _ => Err(format!("{s:?} is not one of client, http1, http2")),
    }
}

fn app_probes(s: &str) -> Result<app_probe::AppProbes, String> {
    app_probe::AppProbes::parse(s)
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

fn parse_alias(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((h, svc)) if !h.is_empty() && svc.contains('.') => {
            Ok((h.to_string(), svc.to_string()))
        }
        _ => Err(format!("{s:?} is not HOST=SERVICE.NAMESPACE")),
    }
}

/// Parses a flag's duration: minimesh's one grammar, where zero means
/// "never" for the flags that say so ([`minimesh_proto::duration`]).
pub fn duration(s: &str) -> Result<Duration, String> {
    minimesh_proto::duration::parse(s)
}
