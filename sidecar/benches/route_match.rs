//! Route matching cost: a request against a Service port's table of 10
//! routes (path prefixes and exact paths, a header match, a method, a
//! regex, a query parameter), matching the first route, the last, and
//! none but the catch-all after them, one thread.
//! `cargo bench -p minimesh-sidecar --bench route_match`. Prints
//! nanoseconds per match (best of 5 runs of 2M matches).

use std::hint::black_box;
use std::time::Instant;

use http::{HeaderMap, Method};
use minimesh_proto::v1::{self, string_match::Kind};
use minimesh_sidecar::routing::routes::{RequestView, RouteTable};

const MATCHES: u32 = 2_000_000;

fn sm(kind: Kind) -> Option<v1::StringMatch> {
    Some(v1::StringMatch { kind: Some(kind) })
}

fn route(name: &str, m: v1::RouteMatch) -> v1::HttpRoute {
    v1::HttpRoute {
        name: name.into(),
        matches: vec![m],
        clusters: vec![v1::WeightedCluster {
            cluster: "c".into(),
            weight: 1,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Ten routes as a user writes them, then a catch-all.
fn table() -> RouteTable {
    let mut routes = vec![route(
        "testers",
        v1::RouteMatch {
            headers: vec![v1::HeaderMatch {
                name: "x-canary".into(),
                value: sm(Kind::Exact("yes".into())),
                invert: false,
            }],
            ..Default::default()
        },
    )];
    for (i, p) in [
        "/api/v1/users",
        "/api/v1/orders",
        "/api/v2",
        "/static",
        "/login",
    ]
    .iter()
    .enumerate()
    {
        routes.push(route(
            &format!("prefix-{i}"),
            v1::RouteMatch {
                path: sm(Kind::PathPrefix((*p).into())),
                ..Default::default()
            },
        ));
    }
    routes.push(route(
        "health",
        v1::RouteMatch {
            path: sm(Kind::Exact("/healthz".into())),
            ..Default::default()
        },
    ));
    routes.push(route(
        "posts",
        v1::RouteMatch {
            path: sm(Kind::Prefix("/upload".into())),
            method: "POST".into(),
            ..Default::default()
        },
    ));
    routes.push(route(
        "debug",
        v1::RouteMatch {
            query: vec![v1::QueryMatch {
                name: "debug".into(),
                value: sm(Kind::Exact("1".into())),
            }],
            ..Default::default()
        },
    ));
    routes.push(route(
        "reports",
        v1::RouteMatch {
            path: sm(Kind::Regex("/reports/[0-9]+".into())),
            ..Default::default()
        },
    ));
    assert_eq!(routes.len(), 10);
    routes.push(route("catch-all", v1::RouteMatch::default()));
    RouteTable::compile(&routes, &|_| Some(0)).expect("compiles")
}

fn ns_per_match(t: &RouteTable, view: &RequestView<'_>, want: &str) -> f64 {
    let found = t.find(view).map(|(r, _)| r.name.to_string());
    assert_eq!(found.as_deref(), Some(want));
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..MATCHES {
            black_box(t.find(black_box(view)));
        }
        best = best.min(start.elapsed().as_nanos() as f64 / f64::from(MATCHES));
    }
    best
}

fn main() {
    let t = table();
    let mut canary = HeaderMap::new();
    canary.insert("x-canary", http::HeaderValue::from_static("yes"));
    // A request's usual headers: the header match looks one up.
    let mut usual = HeaderMap::new();
    for (k, v) in [
        ("host", "web.default.svc.cluster.local"),
        ("user-agent", "curl/8.5.0"),
        ("accept", "*/*"),
        ("x-request-id", "5f0c9b1e-8d4c-4f4b-9a57-3c1f2b7f9e21"),
    ] {
        usual.insert(k, http::HeaderValue::from_static(v));
    }
    let get = Method::GET;
    let view =
        |path: &'static str, query: Option<&'static str>, h: &'static HeaderMap| RequestView {
            method: &get,
            path,
            query,
            headers: h,
        };
    let canary: &'static HeaderMap = Box::leak(Box::new(canary));
    let usual: &'static HeaderMap = Box::leak(Box::new(usual));
    println!(
        "{:<40} {:>10}",
        "request (10 routes, then a catch-all)", "ns/match"
    );
    for (what, v, want) in [
        (
            "matches the first (a header)",
            view("/", None, canary),
            "testers",
        ),
        (
            "matches the 2nd (a path prefix)",
            view("/api/v1/users/42", None, usual),
            "prefix-0",
        ),
        (
            "matches the 10th (a regex)",
            view("/reports/2026", None, usual),
            "reports",
        ),
        (
            "matches none of the 10",
            view("/index.html", Some("a=1"), usual),
            "catch-all",
        ),
    ] {
        println!("{what:<40} {:>10.1}", ns_per_match(&t, &v, want));
    }
}
