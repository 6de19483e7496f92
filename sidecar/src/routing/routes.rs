//! HTTP routes: a Service port's ordered routes (from a VirtualService or
//! an HTTPRoute, translated by the control plane into one model), compiled
//! once per config into a table the request path walks. A request takes
//! the first route whose match it meets; the route says where it goes (a
//! cluster picked by weight), or answers it (a redirect, a fixed status),
//! and what changes on the way (headers, path, authority, timeouts,
//! retries, injected faults).

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use minimesh_proto::v1;

use crate::retry::Conditions;

mod actions;
mod matching;
use actions::status;
pub use actions::{Fault, HeaderOps, Redirect, Rewrite};
use matching::{starts_with, Match, StrMatch};
pub use matching::{Matched, RequestView};

/// The most routes one Service port may have, and the most matches,
/// headers and destinations one route may have: config is bounded as any
/// other input.
pub const MAX_ROUTES: usize = 1024;
const MAX_PARTS: usize = 64;

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
        let rewrite = r.rewrite.as_ref().map(Rewrite::compile).transpose()?;
        let fault = r.fault.as_ref().map(Fault::compile).transpose()?;
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
        use super::actions::replace_prefix;
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
        use super::matching::literal_prefix;
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
