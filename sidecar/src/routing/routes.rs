//! HTTP routes: a Service port's ordered routes (from a VirtualService or
//! an HTTPRoute, translated by the control plane into one model), compiled
//! once per config into a table the request path walks. A request takes
//! the first route whose match it meets; the route says where it goes (a
//! cluster picked by weight), or answers it (a redirect, a fixed status),
//! and what changes on the way (headers, path, authority, timeouts,
//! retries, injected faults).

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use minimesh_proto::v1::{self, string_match::Kind};

use crate::retry::Conditions;

/// The most routes one Service port may have, and the most matches,
/// headers and destinations one route may have: config is bounded as any
/// other input.
pub const MAX_ROUTES: usize = 1024;
const MAX_PARTS: usize = 64;
/// Up to this many header names, a request's headers are scanned for the
/// one a match names rather than looked up (see `Match::find`).
const FEW_HEADERS: usize = 8;
/// The compiled size a route's regular expression may take.
const REGEX_SIZE_LIMIT: usize = 1 << 16;

/// A Service port's routes, in order.
#[derive(Debug)]
pub struct RouteTable {
    routes: Box<[Arc<RouteEntry>]>,
    /// Every match of every route, in order, by what its path must start
    /// with: walked first, in one contiguous array, so that a request is
    /// turned away from most routes by one comparison, without reaching
    /// the route itself.
    gates: Box<[Gate]>,
}

/// One match of one route, as the first look at a request sees it.
#[derive(Debug)]
struct Gate {
    /// The route's index in `routes`.
    route: u32,
    /// The match's index in the route's matches; `u32::MAX` for a route
    /// with none (every request).
    index: u32,
    /// What the path starts with (empty: anything).
    lit: Box<str>,
    /// The path is `lit` exactly.
    exact: bool,
}

/// One route, compiled.
#[derive(Debug)]
pub struct RouteEntry {
    /// `<kind>/<namespace>/<name>[/<route>]`, for logs and errors.
    pub name: Arc<str>,
    matches: Box<[Match]>,
    /// What a matching request gets.
    pub action: Action,
    /// The whole request's time, when the route sets it (inner None: no limit).
    pub timeout: Option<Option<Duration>>,
    /// Retries, when the route sets them.
    pub retry: Option<RouteRetry>,
    /// Header changes on the request, before any destination's own.
    pub request_headers: HeaderOps,
    /// Header changes on the response, before any destination's own.
    pub response_headers: HeaderOps,
    /// The path and authority sent upstream.
    pub rewrite: Option<Rewrite>,
    /// Injected faults.
    pub fault: Option<Fault>,
}

/// What a matching request gets.
#[derive(Debug)]
pub enum Action {
    /// Forwarded to one of these, picked by weight.
    Forward(Box<[Destination]>),
    /// Answered with a redirect.
    Redirect(Redirect),
    /// Answered with this status and no body.
    Direct(StatusCode),
}

/// One weighted destination of a route.
#[derive(Debug)]
pub struct Destination {
    /// The cluster's index in the routing table's clusters; None for a
    /// cluster the sidecar was not sent (its share is answered 503, as
    /// Istio's "no cluster" and the Gateway API's invalid backend).
    pub cluster: Option<u32>,
    /// Cumulative weight up to and including this one.
    upto: u64,
    /// Header changes on the request, after the route's.
    pub request_headers: HeaderOps,
    /// Header changes on the response, after the route's.
    pub response_headers: HeaderOps,
}

/// Retries a route sets.
#[derive(Debug)]
pub struct RouteRetry {
    /// Retries after the first attempt.
    pub attempts: u32,
    /// Each attempt's time; None: the cluster's.
    pub per_try_timeout: Option<Duration>,
    /// When to retry; None: the cluster's.
    pub retry_on: Option<Conditions>,
}

/// Header changes.
#[derive(Debug, Default)]
pub struct HeaderOps {
    set: Box<[(HeaderName, HeaderValue)]>,
    add: Box<[(HeaderName, HeaderValue)]>,
    remove: Box<[HeaderName]>,
}

/// A redirect.
#[derive(Debug)]
pub struct Redirect {
    scheme: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    path: Option<String>,
    prefix: Option<String>,
    status: StatusCode,
}

/// A rewrite of what is sent upstream.
#[derive(Debug)]
pub struct Rewrite {
    prefix: Option<String>,
    path: Option<String>,
    /// The authority sent upstream.
    pub authority: Option<HeaderValue>,
}

/// Injected faults.
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// Share of requests delayed, out of 1,000,000.
    delay_ppm: u32,
    delay: Duration,
    /// Share of requests aborted, out of 1,000,000.
    abort_ppm: u32,
    abort: StatusCode,
}

#[derive(Debug)]
struct Match {
    path: Option<StrMatch>,
    headers: Box<[(HeaderName, Option<StrMatch>, bool)]>,
    method: Option<Method>,
    query: Box<[(String, Option<StrMatch>)]>,
}

#[derive(Debug)]
enum StrMatch {
    Exact(Box<str>),
    Prefix(Box<str>),
    /// Whole path segments; stored without a trailing `/` (except `/`).
    PathPrefix(Box<str>),
    /// The regex, and a literal every match starts with (checked first:
    /// most values a route does not take fail there, for a fraction of
    /// the regex's own cost).
    Regex(Regex, Box<str>),
}

/// The literal text every match of `pattern` (RE2 syntax) starts with:
/// its leading characters up to the first that is not a plain literal,
/// less a last one a quantifier applies to; nothing for a pattern with an
/// alternation or flags anywhere (conservative: a shorter prefix only
/// costs the regex a call).
fn literal_prefix(pattern: &str) -> &str {
    if pattern.contains('|') || pattern.starts_with("(?") {
        return "";
    }
    let meta = |c: char| "\\.+*?()[]{}^$".contains(c);
    let end = pattern.find(meta).unwrap_or(pattern.len());
    let lit = &pattern[..end];
    match pattern[end..].chars().next() {
        // The last literal character may occur zero times.
        Some('?' | '*' | '{') => match lit.char_indices().last() {
            Some((i, _)) => &lit[..i],
            None => "",
        },
        _ => lit,
    }
}

/// A route's regular expression, matched against a whole value: a dense
/// DFA where one fits in [`DFA_SIZE_LIMIT`] (a match walks the value's
/// bytes through a table, no cache to take), else the regex crate's lazy
/// DFA.
#[derive(Debug)]
enum Regex {
    Dense(Box<regex_automata::dfa::dense::DFA<Vec<u32>>>),
    Lazy(regex::Regex),
}

/// The most memory one route regex's dense DFA may take.
const DFA_SIZE_LIMIT: usize = 1 << 18;

impl Regex {
    fn new(pattern: &str) -> Result<Regex, String> {
        use regex_automata::dfa::dense;
        let whole = format!("^(?:{pattern})$");
        // The lazy one first: its errors are the ones users know, and it
        // bounds what the dense one is built from.
        let lazy = regex::RegexBuilder::new(&whole)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map_err(|e| e.to_string())?;
        let dense = dense::Builder::new()
            .configure(
                dense::DFA::config()
                    .dfa_size_limit(Some(DFA_SIZE_LIMIT))
                    .determinize_size_limit(Some(DFA_SIZE_LIMIT))
                    .start_kind(regex_automata::dfa::StartKind::Anchored),
            )
            .build(&whole);
        Ok(match dense {
            Ok(d) => Regex::Dense(Box::new(d)),
            Err(_) => Regex::Lazy(lazy),
        })
    }

    #[inline]
    fn is_match(&self, s: &str) -> bool {
        use regex_automata::dfa::Automaton;
        match self {
            Regex::Dense(d) => {
                let input = regex_automata::Input::new(s)
                    .anchored(regex_automata::Anchored::Yes)
                    .earliest(true);
                matches!(d.try_search_fwd(&input), Ok(Some(_)))
            }
            Regex::Lazy(r) => r.is_match(s),
        }
    }
}

/// `s` starts with `p`. Paths share their first byte (`/`): the last byte
/// of `p` is compared first, which rejects most other paths without a
/// call to `memcmp`.
#[inline]
fn starts_with(s: &str, p: &str) -> bool {
    let (s, p) = (s.as_bytes(), p.as_bytes());
    match p.len() {
        0 => true,
        n => s.len() >= n && s[n - 1] == p[n - 1] && s[..n] == *p,
    }
}

/// What the path match of the route a request took matched: the part a
/// prefix rewrite replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matched {
    /// A prefix of this many bytes.
    Prefix(usize),
    /// The whole path.
    Whole,
}

impl StrMatch {
    fn compile(m: &v1::StringMatch, field: &str) -> Result<StrMatch, String> {
        Ok(match m.kind.as_ref() {
            None => return Err(format!("{field}: no exact, prefix or regex")),
            Some(Kind::Exact(s)) => StrMatch::Exact(s.as_str().into()),
            Some(Kind::Prefix(s)) => StrMatch::Prefix(s.as_str().into()),
            Some(Kind::PathPrefix(s)) => {
                let s = match s.trim_end_matches('/') {
                    "" => "/",
                    t => t,
                };
                StrMatch::PathPrefix(s.into())
            }
            Some(Kind::Regex(r)) => StrMatch::Regex(
                Regex::new(r).map_err(|e| format!("{field}: regex {r:?}: {e}"))?,
                literal_prefix(r).into(),
            ),
        })
    }

    /// Whether `s` matches, and what of it.
    #[inline]
    fn find(&self, s: &str) -> Option<Matched> {
        match self {
            StrMatch::Exact(e) => {
                (s.len() == e.len() && starts_with(s, e)).then_some(Matched::Whole)
            }
            StrMatch::Prefix(p) => starts_with(s, p).then_some(Matched::Prefix(p.len())),
            StrMatch::PathPrefix(p) => {
                if !starts_with(s, p) {
                    return None;
                }
                // `/` is kept as is (it matches every path); any other
                // prefix ends at a segment's end.
                let whole = p.len() == 1 || matches!(s.as_bytes().get(p.len()), None | Some(b'/'));
                whole.then_some(Matched::Prefix(p.len()))
            }
            StrMatch::Regex(r, lit) => {
                (starts_with(s, lit) && r.is_match(s)).then_some(Matched::Whole)
            }
        }
    }
}

impl Match {
    fn compile(m: &v1::RouteMatch, field: &str) -> Result<Match, String> {
        if m.headers.len() > MAX_PARTS || m.query.len() > MAX_PARTS {
            return Err(format!(
                "{field}: more than {MAX_PARTS} header or query matches"
            ));
        }
        let path = m
            .path
            .as_ref()
            .map(|p| StrMatch::compile(p, &format!("{field}.path")))
            .transpose()?;
        let mut headers = Vec::with_capacity(m.headers.len());
        for (i, h) in m.headers.iter().enumerate() {
            let f = format!("{field}.headers[{i}]");
            let name = HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| format!("{f}: {:?} is not a header name", h.name))?;
            let value = h
                .value
                .as_ref()
                .map(|v| StrMatch::compile(v, &f))
                .transpose()?;
            headers.push((name, value, h.invert));
        }
        let method = match m.method.as_str() {
            "" => None,
            s => Some(
                Method::from_bytes(s.as_bytes())
                    .map_err(|_| format!("{field}.method: {s:?} is not a method"))?,
            ),
        };
        let mut query = Vec::with_capacity(m.query.len());
        for (i, q) in m.query.iter().enumerate() {
            let f = format!("{field}.query[{i}]");
            let value = q
                .value
                .as_ref()
                .map(|v| StrMatch::compile(v, &f))
                .transpose()?;
            query.push((q.name.clone(), value));
        }
        Ok(Match {
            path,
            headers: headers.into(),
            method,
            query: query.into(),
        })
    }

    /// Whether the request meets this match, and what its path match matched.
    #[inline]
    fn find(&self, req: &RequestView<'_>) -> Option<Matched> {
        if let Some(m) = &self.method {
            if m != req.method {
                return None;
            }
        }
        let matched = match &self.path {
            Some(p) => p.find(req.path)?,
            None => Matched::Prefix(0),
        };
        for (name, value, invert) in self.headers.iter() {
            let meets = |h: &HeaderValue| match value {
                None => true,
                Some(v) => h.to_str().is_ok_and(|s| v.find(s).is_some()),
            };
            // Most requests carry a few headers: comparing each name (by
            // length first) costs less than hashing the one looked for.
            let found = if req.headers.keys_len() <= FEW_HEADERS {
                req.headers.iter().any(|(k, h)| k == name && meets(h))
            } else {
                req.headers.get_all(name).iter().any(meets)
            };
            if found == *invert {
                return None;
            }
        }
        for (name, value) in self.query.iter() {
            let found = req.query.is_some_and(|q| {
                q.split('&').any(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    k == name && value.as_ref().is_none_or(|m| m.find(v).is_some())
                })
            });
            if !found {
                return None;
            }
        }
        Some(matched)
    }
}

/// The parts of a request a route matches on.
pub struct RequestView<'a> {
    /// The method.
    pub method: &'a Method,
    /// The path, without the query.
    pub path: &'a str,
    /// The query, without `?`.
    pub query: Option<&'a str>,
    /// The headers.
    pub headers: &'a HeaderMap,
}

impl RouteTable {
    /// Compiles a port's routes; `cluster_index` finds a cluster's index by
    /// name (None: the route goes nowhere; its requests get 503). The
    /// error names the route and field.
    pub fn compile(
        routes: &[v1::HttpRoute],
        cluster_index: &dyn Fn(&str) -> Option<u32>,
    ) -> Result<RouteTable, String> {
        if routes.len() > MAX_ROUTES {
            return Err(format!("{} routes, more than {MAX_ROUTES}", routes.len()));
        }
        let routes = routes
            .iter()
            .enumerate()
            .map(|(i, r)| {
                RouteEntry::compile(r, cluster_index)
                    .map(Arc::new)
                    .map_err(|e| format!("route {i} ({}): {e}", r.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut gates = Vec::new();
        for (i, r) in routes.iter().enumerate() {
            if r.matches.is_empty() {
                gates.push(Gate {
                    route: i as u32,
                    index: u32::MAX,
                    lit: "".into(),
                    exact: false,
                });
            }
            for (j, m) in r.matches.iter().enumerate() {
                let (lit, exact) = match &m.path {
                    None => ("", false),
                    Some(StrMatch::Exact(e)) => (&**e, true),
                    Some(StrMatch::Prefix(p)) | Some(StrMatch::PathPrefix(p)) => (&**p, false),
                    Some(StrMatch::Regex(_, lit)) => (&**lit, false),
                };
                gates.push(Gate {
                    route: i as u32,
                    index: j as u32,
                    lit: lit.into(),
                    exact,
                });
            }
        }
        Ok(RouteTable {
            routes: routes.into(),
            gates: gates.into(),
        })
    }

    /// The first route `req` meets, and what its path match matched.
    #[inline]
    pub fn find(&self, req: &RequestView<'_>) -> Option<(&Arc<RouteEntry>, Matched)> {
        let path = req.path;
        for g in self.gates.iter() {
            let open = if g.exact {
                path.len() == g.lit.len() && starts_with(path, &g.lit)
            } else {
                starts_with(path, &g.lit)
            };
            if !open {
                continue;
            }
            let route = &self.routes[g.route as usize];
            let found = match route.matches.get(g.index as usize) {
                None => Some(Matched::Prefix(0)),
                Some(m) => m.find(req),
            };
            if let Some(matched) = found {
                return Some((route, matched));
            }
        }
        None
    }

    /// How many routes.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True with no route.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

impl RouteEntry {
    fn compile(
        r: &v1::HttpRoute,
        cluster_index: &dyn Fn(&str) -> Option<u32>,
    ) -> Result<RouteEntry, String> {
        if r.matches.len() > MAX_PARTS || r.clusters.len() > MAX_PARTS {
            return Err(format!("more than {MAX_PARTS} matches or destinations"));
        }
        let matches = r
            .matches
            .iter()
            .enumerate()
            .map(|(i, m)| Match::compile(m, &format!("matches[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        let action = if let Some(rd) = &r.redirect {
            Action::Redirect(Redirect::compile(rd)?)
        } else if r.direct_status != 0 {
            Action::Direct(status(r.direct_status, "direct_status")?)
        } else {
            let mut upto = 0u64;
            let mut dests = Vec::with_capacity(r.clusters.len());
            for (i, w) in r.clusters.iter().enumerate() {
                let f = format!("clusters[{i}]");
                let cluster = cluster_index(&w.cluster);
                upto += u64::from(w.weight);
                dests.push(Destination {
                    cluster,
                    upto,
                    request_headers: HeaderOps::compile(w.request_headers.as_ref(), &f)?,
                    response_headers: HeaderOps::compile(w.response_headers.as_ref(), &f)?,
                });
            }
            dests.retain(|d| d.upto > 0);
            Action::Forward(dests.into())
        };
        let retry = r.retry.as_ref().map(|rr| RouteRetry {
            attempts: rr.attempts.min(10),
            per_try_timeout: (rr.per_try_timeout_ms > 0)
                .then(|| Duration::from_millis(rr.per_try_timeout_ms)),
            retry_on: rr
                .retry_on
                .map(|bits| Conditions::new(bits, &rr.retriable_status_codes)),
        });
        let rewrite = match &r.rewrite {
            None => None,
            Some(rw) => Some(Rewrite {
                prefix: (!rw.prefix.is_empty()).then(|| rw.prefix.clone()),
                path: (!rw.path.is_empty()).then(|| rw.path.clone()),
                authority: match rw.authority.as_str() {
                    "" => None,
                    a => Some(
                        HeaderValue::from_str(a)
                            .ok()
                            .filter(|_| a.parse::<http::uri::Authority>().is_ok())
                            .ok_or_else(|| format!("rewrite.authority: {a:?} is not a host"))?,
                    ),
                },
            }),
        };
        let fault = match &r.fault {
            None => None,
            Some(f) => {
                let ppm = |p: f64, field: &str| {
                    if !(0.0..=100.0).contains(&p) {
                        return Err(format!(
                            "fault.{field}: {p} is not a percentage from 0 to 100"
                        ));
                    }
                    Ok((p * 10_000.0).round() as u32)
                };
                Some(Fault {
                    delay_ppm: ppm(f.delay_percent, "delay_percent")?,
                    delay: Duration::from_millis(f.delay_ms),
                    abort_ppm: ppm(f.abort_percent, "abort_percent")?,
                    abort: if f.abort_percent > 0.0 {
                        status(f.abort_status, "fault.abort_status")?
                    } else {
                        StatusCode::OK
                    },
                })
            }
        };
        Ok(RouteEntry {
            name: r.name.as_str().into(),
            matches: matches.into(),
            action,
            timeout: r
                .timeout_ms
                .map(|ms| (ms > 0).then(|| Duration::from_millis(ms))),
            retry,
            request_headers: HeaderOps::compile(r.request_headers.as_ref(), "request_headers")?,
            response_headers: HeaderOps::compile(r.response_headers.as_ref(), "response_headers")?,
            rewrite,
            fault,
        })
    }

    /// The destination a request goes to, picked by weight with `draw`
    /// (uniform over u64); None when the route forwards nowhere.
    #[inline]
    pub fn pick(&self, draw: u64) -> Option<(usize, &Destination)> {
        let Action::Forward(dests) = &self.action else {
            return None;
        };
        let total = dests.last()?.upto;
        let at = draw % total;
        dests.iter().enumerate().find(|(_, d)| at < d.upto)
    }
}

fn status(code: u32, field: &str) -> Result<StatusCode, String> {
    u16::try_from(code)
        .ok()
        .and_then(|c| StatusCode::from_u16(c).ok())
        .filter(|s| s.as_u16() >= 200)
        .ok_or_else(|| format!("{field}: {code} is not an HTTP status"))
}

impl HeaderOps {
    fn compile(ops: Option<&v1::HeaderOps>, field: &str) -> Result<HeaderOps, String> {
        let Some(ops) = ops else {
            return Ok(HeaderOps::default());
        };
        if ops.set.len() + ops.add.len() + ops.remove.len() > MAX_PARTS {
            return Err(format!("{field}: more than {MAX_PARTS} header changes"));
        }
        let pairs = |list: &[v1::HeaderValue], what: &str| {
            list.iter()
                .map(|h| {
                    let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| {
                        format!("{field}.{what}: {:?} is not a header name", h.name)
                    })?;
                    let value = HeaderValue::from_str(&h.value).map_err(|_| {
                        format!(
                            "{field}.{what}: the value of {:?} is not a header value",
                            h.name
                        )
                    })?;
                    Ok((name, value))
                })
                .collect::<Result<Vec<_>, String>>()
        };
        let remove = ops
            .remove
            .iter()
            .map(|n| {
                HeaderName::from_bytes(n.as_bytes())
                    .map_err(|_| format!("{field}.remove: {n:?} is not a header name"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HeaderOps {
            set: pairs(&ops.set, "set")?.into(),
            add: pairs(&ops.add, "add")?.into(),
            remove: remove.into(),
        })
    }

    /// True when there is nothing to change.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }

    /// Applies the changes: set, then add, then remove.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (n, v) in self.set.iter() {
            headers.insert(n.clone(), v.clone());
        }
        for (n, v) in self.add.iter() {
            headers.append(n.clone(), v.clone());
        }
        for n in self.remove.iter() {
            headers.remove(n);
        }
    }
}

impl Redirect {
    fn compile(r: &v1::Redirect) -> Result<Redirect, String> {
        let status = match r.status {
            0 => StatusCode::MOVED_PERMANENTLY,
            301 | 302 | 303 | 307 | 308 => status(r.status, "redirect.status")?,
            s => {
                return Err(format!(
                    "redirect.status: {s} is not 301, 302, 303, 307 or 308"
                ))
            }
        };
        if !matches!(r.scheme.as_str(), "" | "http" | "https") {
            return Err(format!(
                "redirect.scheme: {:?} is not http or https",
                r.scheme
            ));
        }
        let port = match r.port {
            0 => None,
            p => Some(u16::try_from(p).map_err(|_| format!("redirect.port: {p} is not a port"))?),
        };
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Ok(Redirect {
            scheme: nonempty(&r.scheme),
            host: nonempty(&r.host),
            port,
            path: nonempty(&r.path),
            prefix: nonempty(&r.prefix),
            status,
        })
    }

    /// The status and `Location` for a request to `authority` (`host[:port]`)
    /// with `scheme`, `path` and `query`, whose route's path match matched
    /// `matched`.
    pub fn location(
        &self,
        scheme: &str,
        authority: &str,
        path: &str,
        query: Option<&str>,
        matched: Matched,
    ) -> (StatusCode, String) {
        let (req_host, req_port) = split_port(authority);
        let scheme_out = self.scheme.as_deref().unwrap_or(scheme);
        let host = self.host.as_deref().unwrap_or(req_host);
        // The request's port goes with it only while the scheme stays.
        let port = self
            .port
            .or(req_port.filter(|_| self.scheme.is_none() || scheme_out == scheme));
        let default = if scheme_out == "https" { 443 } else { 80 };
        let path = match (&self.path, &self.prefix) {
            (Some(p), _) => p.clone(),
            (None, Some(p)) => replace_prefix(path, p, matched),
            (None, None) => path.to_string(),
        };
        let mut out = format!("{scheme_out}://{host}");
        if let Some(p) = port.filter(|p| *p != default) {
            out.push_str(&format!(":{p}"));
        }
        out.push_str(&path);
        if let Some(q) = query {
            out.push('?');
            out.push_str(q);
        }
        (self.status, out)
    }
}

impl Rewrite {
    /// The path sent upstream for `path` (the query kept by the caller),
    /// or None when the rewrite leaves it.
    pub fn path(&self, path: &str, matched: Matched) -> Option<String> {
        match (&self.path, &self.prefix) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(p)) => Some(replace_prefix(path, p, matched)),
            (None, None) => None,
        }
    }
}

impl Fault {
    /// The delay for a request drawing `draw` (uniform over u64).
    #[inline]
    pub fn delay(&self, draw: u64) -> Option<Duration> {
        ((draw % 1_000_000) < u64::from(self.delay_ppm)).then_some(self.delay)
    }

    /// The abort status for a request drawing `draw`.
    #[inline]
    pub fn abort(&self, draw: u64) -> Option<StatusCode> {
        (((draw >> 20) % 1_000_000) < u64::from(self.abort_ppm)).then_some(self.abort)
    }
}

/// `path` with the part `matched` replaced by `with`: a prefix (one `/`
/// kept between the two), or all of it.
fn replace_prefix(path: &str, with: &str, matched: Matched) -> String {
    let rest = match matched {
        Matched::Whole => return with.to_string(),
        Matched::Prefix(n) => path.get(n..).unwrap_or(""),
    };
    match (with.ends_with('/'), rest.starts_with('/')) {
        (true, true) => format!("{with}{}", &rest[1..]),
        _ if with.is_empty() && !rest.starts_with('/') => format!("/{rest}"),
        _ => format!("{with}{rest}"),
    }
}

fn split_port(authority: &str) -> (&str, Option<u16>) {
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse() {
            Ok(port) => (h, Some(port)),
            Err(_) => (authority, None),
        },
        _ => (authority, None),
    }
}

#[cfg(test)]
mod tests {
    use super::{Matched, RequestView, RouteTable};
    use http::{HeaderMap, Method};
    use minimesh_proto::v1::{self, string_match::Kind};

    fn sm(kind: Kind) -> Option<v1::StringMatch> {
        Some(v1::StringMatch { kind: Some(kind) })
    }

    fn to(cluster: &str, weight: u32) -> v1::WeightedCluster {
        v1::WeightedCluster {
            cluster: cluster.into(),
            weight,
            ..Default::default()
        }
    }

    fn index(name: &str) -> Option<u32> {
        ["a", "b", "c"]
            .iter()
            .position(|c| *c == name)
            .map(|i| i as u32)
    }

    fn view<'a>(method: &'a Method, path: &'a str, headers: &'a HeaderMap) -> RequestView<'a> {
        let (path, query) = match path.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path, None),
        };
        RequestView {
            method,
            path,
            query,
            headers,
        }
    }

    #[test]
    fn the_first_matching_route_wins_and_none_matching_is_none() {
        let routes = vec![
            v1::HttpRoute {
                name: "header".into(),
                matches: vec![v1::RouteMatch {
                    headers: vec![v1::HeaderMatch {
                        name: "x-canary".into(),
                        value: sm(Kind::Exact("yes".into())),
                        invert: false,
                    }],
                    ..Default::default()
                }],
                clusters: vec![to("b", 1)],
                ..Default::default()
            },
            v1::HttpRoute {
                name: "api".into(),
                matches: vec![v1::RouteMatch {
                    path: sm(Kind::PathPrefix("/api/".into())),
                    method: "GET".into(),
                    query: vec![v1::QueryMatch {
                        name: "v".into(),
                        value: sm(Kind::Regex("[0-9]+".into())),
                    }],
                    ..Default::default()
                }],
                clusters: vec![to("c", 1)],
                ..Default::default()
            },
            v1::HttpRoute {
                name: "exact".into(),
                matches: vec![v1::RouteMatch {
                    path: sm(Kind::Exact("/only".into())),
                    ..Default::default()
                }],
                clusters: vec![to("a", 1)],
                ..Default::default()
            },
        ];
        let t = RouteTable::compile(&routes, &index).expect("compiles");
        let get = Method::GET;
        let mut canary = HeaderMap::new();
        canary.insert("x-canary", "yes".parse().unwrap());
        let none = HeaderMap::new();
        let name = |m: &Method, p: &str, h: &HeaderMap| {
            t.find(&view(m, p, h)).map(|(r, m)| (r.name.to_string(), m))
        };
        assert_eq!(
            name(&get, "/x", &canary),
            Some(("header".into(), Matched::Prefix(0)))
        );
        assert_eq!(
            name(&get, "/api?v=12", &none),
            Some(("api".into(), Matched::Prefix(4)))
        );
        assert_eq!(
            name(&get, "/api/users?a=1&v=3", &none).map(|n| n.0),
            Some("api".into())
        );
        // Segments, not characters; the method and the query must hold too.
        assert_eq!(name(&get, "/apis?v=1", &none), None);
        assert_eq!(name(&Method::POST, "/api?v=1", &none), None);
        assert_eq!(name(&get, "/api?v=x", &none), None);
        assert_eq!(
            name(&get, "/only", &none),
            Some(("exact".into(), Matched::Whole))
        );
        assert_eq!(name(&get, "/only/", &none), None);
    }

    #[test]
    fn weights_split_as_written_and_zero_takes_nothing() {
        let routes = vec![v1::HttpRoute {
            clusters: vec![to("a", 90), to("b", 10), to("c", 0), to("gone", 50)],
            ..Default::default()
        }];
        let t = RouteTable::compile(&routes, &index).unwrap();
        let none = HeaderMap::new();
        let (r, _) = t.find(&view(&Method::GET, "/", &none)).unwrap();
        let mut counts = [0u32; 4];
        for draw in 0..1500u64 {
            let d = r.pick(draw).unwrap().1.cluster;
            counts[d.map_or(3, |c| c as usize)] += 1;
        }
        assert_eq!(counts, [900, 100, 0, 500]);
    }

    #[test]
    fn bad_config_is_refused_with_the_route_and_field() {
        let bad = |r: v1::HttpRoute| RouteTable::compile(&[r], &index).unwrap_err();
        let e = bad(v1::HttpRoute {
            name: "vs/default/web/0".into(),
            matches: vec![v1::RouteMatch {
                path: sm(Kind::Regex("(".into())),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert!(
            e.starts_with("route 0 (vs/default/web/0): matches[0].path: regex \"(\""),
            "{e}"
        );
        let e = bad(v1::HttpRoute {
            redirect: Some(v1::Redirect {
                status: 200,
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(
            e.ends_with("redirect.status: 200 is not 301, 302, 303, 307 or 308"),
            "{e}"
        );
        // A regex too big to compile within the limit.
        let e = bad(v1::HttpRoute {
            matches: vec![v1::RouteMatch {
                path: sm(Kind::Regex("a{1000}{1000}".into())),
                ..Default::default()
            }],
            ..Default::default()
        });
        assert!(e.contains("regex"), "{e}");
    }

    #[test]
    fn rewrites_and_redirects_replace_what_the_match_matched() {
        use super::replace_prefix;
        assert_eq!(
            replace_prefix("/foo/bar", "/xyz", Matched::Prefix(4)),
            "/xyz/bar"
        );
        assert_eq!(replace_prefix("/foo/bar", "/", Matched::Prefix(4)), "/bar");
        assert_eq!(replace_prefix("/foo", "/", Matched::Prefix(4)), "/");
        assert_eq!(replace_prefix("/foo", "/new", Matched::Whole), "/new");
        let r = super::Redirect::compile(&v1::Redirect {
            scheme: "https".into(),
            prefix: "/v2".into(),
            status: 302,
            ..Default::default()
        })
        .unwrap();
        let (s, loc) = r.location(
            "http",
            "web.example:8080",
            "/v1/x",
            Some("a=1"),
            Matched::Prefix(3),
        );
        assert_eq!(s.as_u16(), 302);
        assert_eq!(loc, "https://web.example/v2/x?a=1");
        let r = super::Redirect::compile(&v1::Redirect {
            host: "other.example".into(),
            ..Default::default()
        })
        .unwrap();
        let (s, loc) = r.location("http", "web.example:8080", "/p", None, Matched::Prefix(0));
        assert_eq!(
            (s.as_u16(), loc.as_str()),
            (301, "http://other.example:8080/p")
        );
    }

    #[test]
    fn a_regexs_literal_prefix_is_what_every_match_starts_with() {
        use super::literal_prefix;
        assert_eq!(literal_prefix("/reports/[0-9]+"), "/reports/");
        assert_eq!(literal_prefix("/reports?"), "/report");
        assert_eq!(literal_prefix("/a*b"), "/");
        assert_eq!(literal_prefix("/a{0,3}"), "/");
        assert_eq!(literal_prefix("/a|/b"), "");
        assert_eq!(literal_prefix("(?i)/a"), "");
        assert_eq!(literal_prefix(".*"), "");
        assert_eq!(literal_prefix("/v1\\.0"), "/v1");
        assert_eq!(literal_prefix("/exact"), "/exact");
    }

    #[test]
    fn header_changes_set_then_add_then_remove() {
        let ops = super::HeaderOps::compile(
            Some(&v1::HeaderOps {
                set: vec![v1::HeaderValue {
                    name: "x-version".into(),
                    value: "v2".into(),
                }],
                add: vec![v1::HeaderValue {
                    name: "x-tag".into(),
                    value: "b".into(),
                }],
                remove: vec!["x-secret".into()],
            }),
            "request_headers",
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-version", "v1".parse().unwrap());
        h.insert("x-tag", "a".parse().unwrap());
        h.insert("x-secret", "s".parse().unwrap());
        ops.apply(&mut h);
        assert_eq!(h.get_all("x-version").iter().count(), 1);
        assert_eq!(h["x-version"], "v2");
        let tags: Vec<_> = h.get_all("x-tag").iter().collect();
        assert_eq!(tags, ["a", "b"]);
        assert!(!h.contains_key("x-secret"));
        let e = super::HeaderOps::compile(
            Some(&v1::HeaderOps {
                set: vec![v1::HeaderValue {
                    name: "bad name".into(),
                    value: "v".into(),
                }],
                ..Default::default()
            }),
            "request_headers",
        )
        .unwrap_err();
        assert_eq!(e, "request_headers.set: \"bad name\" is not a header name");
    }
}
