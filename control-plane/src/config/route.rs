//! The route model: what every front-end (Istio's VirtualService, the
//! Gateway API's HTTPRoute) is read into, validated, and what translation
//! turns into the routes sidecars, Envoy and gRPC clients are sent. A
//! Service port's routes are ordered; a request takes the first whose
//! match it meets.

use std::time::Duration;

/// One HTTP route.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HttpRoute {
    /// `<kind>/<namespace>/<name>/<route name or index>`.
    pub name: String,
    /// Any of these (none: every request).
    pub matches: Vec<RouteMatch>,
    /// What a matching request gets.
    pub action: RouteAction,
    /// The whole request's time (`Some(ZERO)`: none); None: the rule's.
    pub timeout: Option<Duration>,
    /// Retries; None: the rule's.
    pub retries: Option<RouteRetries>,
    /// Header changes on the request.
    pub request_headers: HeaderOps,
    /// Header changes on the response.
    pub response_headers: HeaderOps,
    /// The path and authority sent upstream.
    pub rewrite: Option<Rewrite>,
    /// Injected faults.
    pub fault: Option<Fault>,
}

/// A request match: every part must hold.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteMatch {
    /// The path.
    pub path: Option<StringMatch>,
    /// Headers (lower-case names).
    pub headers: Vec<HeaderMatch>,
    /// The method.
    pub method: Option<String>,
    /// Query parameters.
    pub query: Vec<(String, Option<StringMatch>)>,
    /// The Service port the request was sent to; None: any.
    pub port: Option<u32>,
}

/// How a string is matched.
#[derive(Clone, Debug, PartialEq)]
pub enum StringMatch {
    /// Equal.
    Exact(String),
    /// Starts with (Istio's `prefix`).
    Prefix(String),
    /// Whole path segments (the Gateway API's `PathPrefix`).
    PathPrefix(String),
    /// RE2, the whole value.
    Regex(String),
}

/// A header match.
#[derive(Clone, Debug, PartialEq)]
pub struct HeaderMatch {
    /// Lower case.
    pub name: String,
    /// None: present.
    pub value: Option<StringMatch>,
    /// Holds when the header does not match (Istio's `withoutHeaders`).
    pub invert: bool,
}

/// What a matching request gets.
#[derive(Clone, Debug, PartialEq)]
pub enum RouteAction {
    /// Forwarded to one backend, picked by weight.
    Forward(Vec<Backend>),
    /// A redirect.
    Redirect(Redirect),
    /// This status, no body.
    Direct(u16),
}

impl Default for RouteAction {
    fn default() -> RouteAction {
        RouteAction::Forward(Vec::new())
    }
}

/// One weighted backend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Backend {
    /// The Service (name, namespace).
    pub service: (String, String),
    /// Its port; None: its only port, or the port the request came to.
    pub port: Option<u32>,
    /// A DestinationRule subset of it.
    pub subset: Option<String>,
    /// Share of requests.
    pub weight: u32,
    /// Header changes of this backend.
    pub request_headers: HeaderOps,
    /// Header changes of this backend's responses.
    pub response_headers: HeaderOps,
}

/// Header changes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeaderOps {
    /// Replace.
    pub set: Vec<(String, String)>,
    /// Append.
    pub add: Vec<(String, String)>,
    /// Remove.
    pub remove: Vec<String>,
}

impl HeaderOps {
    /// True when there is nothing to change.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

/// A redirect.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Redirect {
    /// `http` or `https`.
    pub scheme: Option<String>,
    /// The host.
    pub host: Option<String>,
    /// The port.
    pub port: Option<u32>,
    /// The whole path.
    pub path: Option<String>,
    /// Replaces what the prefix match matched.
    pub prefix: Option<String>,
    /// 301, 302, 303, 307 or 308.
    pub status: u16,
}

/// A rewrite.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Rewrite {
    /// Replaces what the prefix match matched (the whole path after an
    /// exact match).
    pub prefix: Option<String>,
    /// Replaces the whole path.
    pub path: Option<String>,
    /// Replaces the authority.
    pub authority: Option<String>,
}

/// Injected faults.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fault {
    /// Delay: share of requests in percent, and by how long.
    pub delay: Option<(f64, Duration)>,
    /// Abort: share of requests in percent, and the status.
    pub abort: Option<(f64, u16)>,
}

/// Retries as a route sets them; what it leaves unset stays as the
/// DestinationRule (or the default) has it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteRetries {
    /// Retries after the first attempt.
    pub attempts: Option<u32>,
    /// Time of each attempt.
    pub per_try_timeout: Option<Duration>,
    /// `retryOn` bits and the status codes it names.
    pub retry_on: Option<(u32, Vec<u32>)>,
}

impl HttpRoute {
    /// True when the route only sets the timeout and retries of every
    /// request to its own Service's port: what a DestinationRule's own
    /// `timeout` and `retries` say, so it is sent as the cluster's settings
    /// (understood by every client), not as a route. Its backend's `port`,
    /// when set, is the one port it applies to.
    pub fn is_plain(&self, service: &(String, String)) -> bool {
        let RouteAction::Forward(backends) = &self.action else {
            return false;
        };
        self.matches.is_empty()
            && self.request_headers.is_empty()
            && self.response_headers.is_empty()
            && self.rewrite.is_none()
            && self.fault.is_none()
            && matches!(backends.as_slice(), [b] if b.service == *service
                && b.subset.is_none()
                && b.request_headers.is_empty()
                && b.response_headers.is_empty())
    }
}

impl StringMatch {
    /// As written in docs and `/debug/config`: `exact:/a`, `prefix:/a`, ...
    pub fn describe(&self) -> String {
        match self {
            StringMatch::Exact(s) => format!("exact:{s}"),
            StringMatch::Prefix(s) => format!("prefix:{s}"),
            StringMatch::PathPrefix(s) => format!("pathPrefix:{s}"),
            StringMatch::Regex(s) => format!("regex:{s}"),
        }
    }
}

/// A route as `/debug/config` and `minimesh get routes` show it.
pub fn view(r: &HttpRoute) -> serde_json::Value {
    let matches: Vec<serde_json::Value> = r
        .matches
        .iter()
        .map(|m| {
            serde_json::json!({
                "path": m.path.as_ref().map(StringMatch::describe),
                "method": m.method,
                "headers": m.headers.iter().map(|h| {
                    let v = h.value.as_ref().map_or("present".to_string(), StringMatch::describe);
                    format!("{}{}={v}", if h.invert { "!" } else { "" }, h.name)
                }).collect::<Vec<_>>(),
                "query": m.query.iter().map(|(n, v)| {
                    format!("{n}={}", v.as_ref().map_or("present".to_string(), StringMatch::describe))
                }).collect::<Vec<_>>(),
                "port": m.port,
            })
        })
        .collect();
    let action = match &r.action {
        RouteAction::Forward(backends) => serde_json::json!({
            "backends": backends.iter().map(|b| serde_json::json!({
                "service": format!("{}.{}", b.service.0, b.service.1),
                "port": b.port,
                "subset": b.subset,
                "weight": b.weight,
            })).collect::<Vec<_>>(),
        }),
        RouteAction::Redirect(rd) => serde_json::json!({"redirect": {
            "scheme": rd.scheme, "host": rd.host, "port": rd.port,
            "path": rd.path, "prefix": rd.prefix, "status": rd.status,
        }}),
        RouteAction::Direct(s) => serde_json::json!({"direct_status": s}),
    };
    serde_json::json!({
        "name": r.name,
        "matches": matches,
        "action": action,
        "timeout_ms": r.timeout.map(|t| t.as_millis() as u64),
        "retry_attempts": r.retries.as_ref().and_then(|x| x.attempts),
        "per_try_timeout_ms": r.retries.as_ref().and_then(|x| x.per_try_timeout).map(|t| t.as_millis() as u64),
        "fault": r.fault.as_ref().map(|f| serde_json::json!({
            "delay_percent": f.delay.map(|d| d.0),
            "delay_ms": f.delay.map(|d| d.1.as_millis() as u64),
            "abort_percent": f.abort.map(|a| a.0),
            "abort_status": f.abort.map(|a| a.1),
        })),
    })
}
