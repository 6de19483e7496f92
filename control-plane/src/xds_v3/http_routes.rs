//! A Service port's HTTP routes (the route model, as sidecars get it) in
//! Envoy's terms: one `Route` each, in order, with its match, its weighted
//! clusters, redirect or direct response, its timeout and retry policy,
//! header changes and rewrites. What gRPC's xDS client honours of these is
//! gRFC A28's: path (exact, prefix, regex) and header matches, weighted
//! clusters, and (A31, A44) the timeout and retry policy; it never matches
//! a route with query-parameter matches. A route's fault is its
//! `typed_per_filter_config` for the HTTP fault filter (`FAULT_FILTER`),
//! which every listener minimesh serves (and Envoy's bootstrap) runs
//! before the router; gRPC honours it (gRFC A33).

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderValue, HeaderValueOption,
};
use envoy_types::pb::envoy::config::route::v3::{
    header_matcher::HeaderMatchSpecifier, query_parameter_matcher::QueryParameterMatchSpecifier,
    redirect_action, route, route_action, route_match, weighted_cluster, DirectResponseAction,
    HeaderMatcher, QueryParameterMatcher, RedirectAction, RetryPolicy, Route, RouteAction,
    RouteMatch, WeightedCluster,
};
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::{
    fault_delay::FaultDelaySecifier, FaultDelay,
};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    fault_abort::ErrorType, FaultAbort, HttpFault,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    string_matcher::MatchPattern, RegexMatchAndSubstitute, RegexMatcher, StringMatcher,
};
use envoy_types::pb::envoy::r#type::v3::{fractional_percent::DenominatorType, FractionalPercent};
use envoy_types::pb::google::protobuf::UInt32Value;
use minimesh_proto::v1::{self, string_match::Kind};

use super::{any, millis};

/// The Envoy routes of `routes`, on a port whose own cluster is `cluster`
/// (its settings stand where a route sets none). Envoy's routes have one
/// match each: a route with several is several in a row, the same action.
pub fn encode(routes: &[v1::HttpRoute], cluster: &v1::Cluster) -> Vec<Route> {
    let mut out = Vec::new();
    for r in routes {
        let first = one(r, cluster);
        if r.matches.len() <= 1 {
            out.push(first);
            continue;
        }
        for m in &r.matches {
            out.push(Route {
                r#match: Some(matches(Some(m))),
                ..first.clone()
            });
        }
    }
    out
}

fn regex(r: &str) -> RegexMatcher {
    RegexMatcher {
        regex: r.to_string(),
        ..Default::default()
    }
}

/// A path prefix of whole segments as a regex (gRPC knows no
/// `path_separated_prefix`).
fn segments(p: &str) -> String {
    format!("{}(/.*)?", regex_escape(p))
}

fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn path(m: &v1::StringMatch) -> Option<route_match::PathSpecifier> {
    use route_match::PathSpecifier as P;
    Some(match m.kind.as_ref()? {
        Kind::Exact(s) => P::Path(s.clone()),
        Kind::Prefix(s) => P::Prefix(s.clone()),
        Kind::PathPrefix(s) if s == "/" => P::Prefix("/".into()),
        Kind::PathPrefix(s) => P::SafeRegex(regex(&segments(s))),
        Kind::Regex(r) => P::SafeRegex(regex(r)),
    })
}

fn header(h: &v1::HeaderMatch) -> HeaderMatcher {
    let spec = match &h.value {
        Some(v) if v.kind.is_some() => HeaderMatchSpecifier::StringMatch(string_matcher(v)),
        _ => HeaderMatchSpecifier::PresentMatch(true),
    };
    HeaderMatcher {
        name: h.name.clone(),
        invert_match: h.invert,
        header_match_specifier: Some(spec),
        ..Default::default()
    }
}

fn string_matcher(m: &v1::StringMatch) -> StringMatcher {
    let pattern = match &m.kind {
        Some(Kind::Exact(s)) => MatchPattern::Exact(s.clone()),
        Some(Kind::Prefix(s)) | Some(Kind::PathPrefix(s)) => MatchPattern::Prefix(s.clone()),
        Some(Kind::Regex(r)) => MatchPattern::SafeRegex(regex(r)),
        None => MatchPattern::Prefix(String::new()),
    };
    StringMatcher {
        match_pattern: Some(pattern),
        ..Default::default()
    }
}

fn matches(m: Option<&v1::RouteMatch>) -> RouteMatch {
    let Some(m) = m else {
        return RouteMatch {
            path_specifier: Some(route_match::PathSpecifier::Prefix(String::new())),
            ..Default::default()
        };
    };
    let mut headers: Vec<HeaderMatcher> = m.headers.iter().map(header).collect();
    if !m.method.is_empty() {
        headers.push(HeaderMatcher {
            name: ":method".into(),
            header_match_specifier: Some(HeaderMatchSpecifier::StringMatch(StringMatcher {
                match_pattern: Some(MatchPattern::Exact(m.method.clone())),
                ..Default::default()
            })),
            ..Default::default()
        });
    }
    RouteMatch {
        path_specifier: m
            .path
            .as_ref()
            .and_then(path)
            .or(Some(route_match::PathSpecifier::Prefix(String::new()))),
        headers,
        query_parameters: m
            .query
            .iter()
            .map(|q| QueryParameterMatcher {
                name: q.name.clone(),
                query_parameter_match_specifier: Some(match &q.value {
                    None => QueryParameterMatchSpecifier::PresentMatch(true),
                    Some(v) => QueryParameterMatchSpecifier::StringMatch(string_matcher(v)),
                }),
            })
            .collect(),
        ..Default::default()
    }
}

fn header_options(ops: Option<&v1::HeaderOps>) -> (Vec<HeaderValueOption>, Vec<String>) {
    let Some(ops) = ops else {
        return (Vec::new(), Vec::new());
    };
    let option = |h: &v1::HeaderValue, action: HeaderAppendAction| HeaderValueOption {
        header: Some(HeaderValue {
            key: h.name.clone(),
            value: h.value.clone(),
            ..Default::default()
        }),
        append_action: action as i32,
        ..Default::default()
    };
    let add = ops
        .set
        .iter()
        .map(|h| option(h, HeaderAppendAction::OverwriteIfExistsOrAdd))
        .chain(
            ops.add
                .iter()
                .map(|h| option(h, HeaderAppendAction::AppendIfExistsOrAdd)),
        )
        .collect();
    (add, ops.remove.clone())
}

fn retry_policy(r: &v1::HttpRoute, c: &v1::Cluster) -> Option<RetryPolicy> {
    let Some(x) = &r.retry else {
        return super::routes::retry_policy(c);
    };
    let own = v1::Cluster {
        retry_attempts: x.attempts,
        per_try_timeout_ms: match x.per_try_timeout_ms {
            0 => c.per_try_timeout_ms,
            ms => ms,
        },
        retry_on: x.retry_on.unwrap_or(c.retry_on),
        retriable_status_codes: match x.retry_on {
            Some(_) => x.retriable_status_codes.clone(),
            None => c.retriable_status_codes.clone(),
        },
        ..Default::default()
    };
    super::routes::retry_policy(&own)
}

fn one(r: &v1::HttpRoute, c: &v1::Cluster) -> Route {
    let (request_headers_to_add, request_headers_to_remove) =
        header_options(r.request_headers.as_ref());
    let (response_headers_to_add, response_headers_to_remove) =
        header_options(r.response_headers.as_ref());
    let action = if let Some(rd) = &r.redirect {
        use redirect_action::{
            PathRewriteSpecifier, RedirectResponseCode as Code, SchemeRewriteSpecifier,
        };
        route::Action::Redirect(RedirectAction {
            host_redirect: rd.host.clone(),
            port_redirect: rd.port,
            response_code: match rd.status {
                302 => Code::Found,
                303 => Code::SeeOther,
                307 => Code::TemporaryRedirect,
                308 => Code::PermanentRedirect,
                _ => Code::MovedPermanently,
            } as i32,
            scheme_rewrite_specifier: (!rd.scheme.is_empty())
                .then(|| SchemeRewriteSpecifier::SchemeRedirect(rd.scheme.clone())),
            path_rewrite_specifier: if !rd.path.is_empty() {
                Some(PathRewriteSpecifier::PathRedirect(rd.path.clone()))
            } else if !rd.prefix.is_empty() {
                Some(PathRewriteSpecifier::PrefixRewrite(rd.prefix.clone()))
            } else {
                None
            },
            ..Default::default()
        })
    } else if r.direct_status != 0 {
        route::Action::DirectResponse(DirectResponseAction {
            status: r.direct_status,
            ..Default::default()
        })
    } else {
        let timeout_ms = r.timeout_ms.unwrap_or(c.timeout_ms);
        let clusters = r
            .clusters
            .iter()
            .map(|w| {
                let (add, remove) = header_options(w.request_headers.as_ref());
                let (radd, rremove) = header_options(w.response_headers.as_ref());
                weighted_cluster::ClusterWeight {
                    name: w.cluster.clone(),
                    weight: Some(UInt32Value { value: w.weight }),
                    request_headers_to_add: add,
                    request_headers_to_remove: remove,
                    response_headers_to_add: radd,
                    response_headers_to_remove: rremove,
                    ..Default::default()
                }
            })
            .collect();
        let rewrite = r.rewrite.as_ref();
        route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::WeightedClusters(
                WeightedCluster {
                    clusters,
                    ..Default::default()
                },
            )),
            prefix_rewrite: rewrite.map(|rw| rw.prefix.clone()).unwrap_or_default(),
            regex_rewrite: rewrite.filter(|rw| !rw.path.is_empty()).map(|rw| {
                RegexMatchAndSubstitute {
                    pattern: Some(regex("^.*$")),
                    substitution: rw.path.clone(),
                }
            }),
            host_rewrite_specifier: rewrite.filter(|rw| !rw.authority.is_empty()).map(|rw| {
                route_action::HostRewriteSpecifier::HostRewriteLiteral(rw.authority.clone())
            }),
            retry_policy: retry_policy(r, c),
            timeout: Some(millis(timeout_ms)),
            max_stream_duration: (timeout_ms > 0).then(|| route_action::MaxStreamDuration {
                max_stream_duration: Some(millis(timeout_ms)),
                ..Default::default()
            }),
            hash_policy: super::routes::action(c).hash_policy,
            ..Default::default()
        })
    };
    Route {
        name: r.name.clone(),
        r#match: Some(matches(r.matches.first())),
        action: Some(action),
        request_headers_to_add,
        request_headers_to_remove,
        response_headers_to_add,
        response_headers_to_remove,
        typed_per_filter_config: r
            .fault
            .as_ref()
            .and_then(fault)
            .map(|f| (FAULT_FILTER.to_string(), any(&f)))
            .into_iter()
            .collect(),
        ..Default::default()
    }
}

/// The name of the HTTP fault filter, as listeners and routes name it.
pub const FAULT_FILTER: &str = "envoy.filters.http.fault";

/// A share of requests (0 to 100) as a fraction of a million.
fn share(percent: f64) -> FractionalPercent {
    FractionalPercent {
        numerator: (percent.clamp(0.0, 100.0) * 10_000.0).round() as u32,
        denominator: DenominatorType::Million as i32,
    }
}

/// A route's fault as the fault filter's per-route config; None when it
/// does nothing.
fn fault(f: &v1::Fault) -> Option<HttpFault> {
    let delay = (f.delay_percent > 0.0 && f.delay_ms > 0).then(|| FaultDelay {
        percentage: Some(share(f.delay_percent)),
        fault_delay_secifier: Some(FaultDelaySecifier::FixedDelay(millis(f.delay_ms))),
    });
    let abort = (f.abort_percent > 0.0 && f.abort_status != 0).then(|| FaultAbort {
        percentage: Some(share(f.abort_percent)),
        error_type: Some(ErrorType::HttpStatus(f.abort_status)),
        ..Default::default()
    });
    (delay.is_some() || abort.is_some()).then(|| HttpFault {
        delay,
        abort,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::encode;
    use envoy_types::pb::envoy::config::route::v3::{
        header_matcher::HeaderMatchSpecifier, route, route_action::ClusterSpecifier,
        route_match::PathSpecifier,
    };
    use minimesh_proto::v1::{self, string_match::Kind};

    fn sm(kind: Kind) -> Option<v1::StringMatch> {
        Some(v1::StringMatch { kind: Some(kind) })
    }

    #[test]
    fn a_split_and_a_header_match_are_envoys_weighted_clusters_and_header_matcher() {
        let cluster = v1::Cluster {
            name: "web.default.svc.cluster.local:80".into(),
            timeout_ms: 3000,
            ..Default::default()
        };
        let routes = [
            v1::HttpRoute {
                name: "VirtualService/default/web/testers".into(),
                matches: vec![
                    v1::RouteMatch {
                        headers: vec![v1::HeaderMatch {
                            name: "x-canary".into(),
                            value: sm(Kind::Exact("yes".into())),
                            invert: false,
                        }],
                        ..Default::default()
                    },
                    v1::RouteMatch {
                        path: sm(Kind::PathPrefix("/beta".into())),
                        ..Default::default()
                    },
                ],
                clusters: vec![v1::WeightedCluster {
                    cluster: "web.default.svc.cluster.local:80|v2".into(),
                    weight: 100,
                    ..Default::default()
                }],
                timeout_ms: Some(500),
                ..Default::default()
            },
            v1::HttpRoute {
                clusters: vec![
                    v1::WeightedCluster {
                        cluster: "web.default.svc.cluster.local:80|v1".into(),
                        weight: 90,
                        ..Default::default()
                    },
                    v1::WeightedCluster {
                        cluster: "web.default.svc.cluster.local:80|v2".into(),
                        weight: 10,
                        ..Default::default()
                    },
                ],
                ..Default::default()
            },
        ];
        let out = encode(&routes, &cluster);
        // Two matches: two routes in a row, then the split.
        assert_eq!(out.len(), 3);
        let m = out[0].r#match.as_ref().unwrap();
        assert!(matches!(
            &m.headers[0].header_match_specifier,
            Some(HeaderMatchSpecifier::StringMatch(_))
        ));
        let m = out[1].r#match.as_ref().unwrap();
        let Some(PathSpecifier::SafeRegex(r)) = &m.path_specifier else {
            panic!("{m:?}")
        };
        assert_eq!(r.regex, "/beta(/.*)?");
        let weights = |r: &envoy_types::pb::envoy::config::route::v3::Route| {
            let Some(route::Action::Route(a)) = &r.action else {
                panic!("forwards")
            };
            let Some(ClusterSpecifier::WeightedClusters(w)) = &a.cluster_specifier else {
                panic!("weighted")
            };
            let t = a
                .timeout
                .as_ref()
                .map(|d| d.seconds * 1000 + i64::from(d.nanos) / 1_000_000);
            let w: Vec<(String, u32)> = w
                .clusters
                .iter()
                .map(|c| (c.name.clone(), c.weight.as_ref().map_or(0, |x| x.value)))
                .collect();
            (w, t)
        };
        assert_eq!(
            weights(&out[0]),
            (
                vec![("web.default.svc.cluster.local:80|v2".into(), 100)],
                Some(500)
            )
        );
        assert_eq!(
            weights(&out[2]),
            (
                vec![
                    ("web.default.svc.cluster.local:80|v1".into(), 90),
                    ("web.default.svc.cluster.local:80|v2".into(), 10)
                ],
                Some(3000)
            )
        );
    }

    #[test]
    fn a_fault_is_the_fault_filters_per_route_config() {
        use super::{HttpFault, FAULT_FILTER};
        use minimesh_proto::prost::Message;
        let route = v1::HttpRoute {
            fault: Some(v1::Fault {
                abort_percent: 12.5,
                abort_status: 503,
                delay_percent: 100.0,
                delay_ms: 250,
            }),
            ..Default::default()
        };
        let out = encode(&[route, v1::HttpRoute::default()], &v1::Cluster::default());
        let any = &out[0].typed_per_filter_config[FAULT_FILTER];
        assert_eq!(
            any.type_url,
            "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"
        );
        let f = HttpFault::decode(any.value.as_slice()).expect("HTTPFault");
        let abort = f.abort.expect("abort");
        assert_eq!(
            abort.percentage.map(|p| (p.numerator, p.denominator)),
            Some((125_000, 2))
        );
        let delay = f.delay.expect("delay");
        assert_eq!(delay.percentage.map(|p| p.numerator), Some(1_000_000));
        // No fault: no per-route config.
        assert!(out[1].typed_per_filter_config.is_empty());
    }
}
