//! Consistent hashing and PEAK_EWMA through a real sidecar.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use bytes::Bytes;
use http::{header, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;

use crate::harness::*;

/// GET on `stream` with extra headers; returns status, endpoint, Set-Cookie.
async fn exchange(
    stream: tokio::net::TcpStream,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String, Option<String>) {
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut b = Request::get(path).header(header::HOST, "backend");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = s
        .send_request(b.body(Empty::<Bytes>::new()).expect("req"))
        .await
        .expect("resp");
    let status = resp.status().as_u16();
    let ep = resp
        .headers()
        .get("x-minimesh-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let cookie = resp
        .headers()
        .get(header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let _ = resp.into_body().collect().await;
    (status, ep, cookie)
}

/// GET with extra headers from any local address.
async fn get_with(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String, Option<String>) {
    exchange(
        tokio::net::TcpStream::connect(addr).await.expect("connect"),
        path,
        headers,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_hash_and_maglev_are_sticky_and_spread_keys_evenly() {
    let net = Net::new(61);
    let _procs = mesh(
        &net,
        &[(1, &[]), (2, &[]), (3, &[])],
        "consistentHash:\n  httpHeaderName: x-user\n  ringHash:\n    minimumRingSize: 1024",
        &[100],
    )
    .await;
    let proxy = net.addr(100, 15001);
    for (policy, lb) in [
        (
            "RING_HASH",
            "consistentHash:\n  httpHeaderName: x-user\n  ringHash:\n    minimumRingSize: 1024",
        ),
        (
            "MAGLEV",
            "consistentHash:\n  httpHeaderName: x-user\n  maglev:\n    tableSize: 65537",
        ),
    ] {
        net.rule("rule.yaml", "backend", lb);
        wait_sidecar(
            net.addr(100, 15000),
            std::time::Duration::from_secs(3),
            |v| policy_of(v, "backend") == policy,
        )
        .await;
        let mut owner = BTreeMap::new();
        for k in 0..1000 {
            let user = format!("user-{k}");
            let (status, ep, _) = get_with(proxy, "/", &[("x-user", &user)]).await;
            assert_eq!(status, 200);
            owner.insert(user, ep);
        }
        let mut shares: BTreeMap<&String, u32> = BTreeMap::new();
        for ep in owner.values() {
            *shares.entry(ep).or_default() += 1;
        }
        for (ep, n) in &shares {
            assert!(
                (267..=400).contains(n),
                "{policy}: {ep} owns {n} of 1000 keys: {shares:?}"
            );
        }
        // The same key always reaches the same endpoint.
        for k in (0..1000).step_by(50) {
            let user = format!("user-{k}");
            for _ in 0..3 {
                let (_, ep, _) = get_with(proxy, "/", &[("x-user", &user)]).await;
                assert_eq!(ep, owner[&user], "{policy}: {user} moved");
            }
        }
        // No key: still served.
        let (status, _, _) = get_with(proxy, "/", &[]).await;
        assert_eq!(status, 200);
    }
}

/// Which endpoint each of `keys` reaches through `proxy`.
async fn owners(proxy: SocketAddr, keys: &[String]) -> BTreeMap<String, String> {
    let mut owner = BTreeMap::new();
    let mut conn = Conn::open(proxy).await.expect("connect");
    for user in keys {
        let (status, ep) = conn
            .get_with("backend", "/", &[("x-user", user)])
            .await
            .expect("response");
        assert_eq!(status, 200);
        owner.insert(user.clone(), ep.unwrap_or_default());
    }
    owner
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_one_of_five_endpoints_moves_only_its_keys() {
    let net = Net::new(65);
    let backends: Vec<(u8, &[(&str, &str)])> = (1..=5).map(|h| (h, &[][..])).collect();
    let _procs = mesh(
        &net,
        &backends,
        "consistentHash:\n  httpHeaderName: x-user\n  ringHash:\n    minimumRingSize: 1024",
        &[100],
    )
    .await;
    let proxy = net.addr(100, 15001);
    let admin = net.addr(100, 15000);
    let keys: Vec<String> = (0..1000).map(|k| format!("user-{k}")).collect();
    let gone = net.addr(5, 9090).to_string();
    for (policy, lb, must_stay) in [
        (
            "RING_HASH",
            "consistentHash:\n  httpHeaderName: x-user\n  ringHash:\n    minimumRingSize: 1024",
            1.0,
        ),
        (
            "MAGLEV",
            "consistentHash:\n  httpHeaderName: x-user\n  maglev:\n    tableSize: 65537",
            0.99,
        ),
    ] {
        net.service("backend", &[1, 2, 3, 4, 5]);
        net.rule("rule.yaml", "backend", lb);
        wait_sidecar(admin, std::time::Duration::from_secs(3), |v| {
            policy_of(v, "backend") == policy && endpoints_of(v, "backend").len() == 5
        })
        .await;
        let before = owners(proxy, &keys).await;
        net.service("backend", &[1, 2, 3, 4]);
        wait_sidecar(admin, std::time::Duration::from_secs(3), |v| {
            endpoints_of(v, "backend").len() == 4
        })
        .await;
        let after = owners(proxy, &keys).await;
        let survivors: Vec<&String> = before
            .iter()
            .filter(|(_, ep)| **ep != gone)
            .map(|(k, _)| k)
            .collect();
        let stayed = survivors
            .iter()
            .filter(|k| before[**k] == after[**k])
            .count();
        let fraction = stayed as f64 / survivors.len() as f64;
        eprintln!(
            "{policy}: {stayed} of {} keys of surviving endpoints stayed ({:.2}%)",
            survivors.len(),
            fraction * 100.0
        );
        assert!(
            fraction >= must_stay,
            "{policy}: only {stayed} of {} keys of surviving endpoints stayed",
            survivors.len()
        );
        // The removed endpoint's keys went somewhere that serves.
        assert!(after.values().all(|ep| *ep != gone && !ep.is_empty()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_is_set_once_and_honoured() {
    let net = Net::new(62);
    let _procs = mesh(
        &net,
        &[(1, &[]), (2, &[]), (3, &[])],
        "consistentHash:\n  httpCookie:\n    name: mm-session\n    path: /\n    ttl: 3600s",
        &[100],
    )
    .await;
    let proxy = net.addr(100, 15001);
    let (status, first_ep, cookie) = get_with(proxy, "/", &[]).await;
    assert_eq!(status, 200);
    let cookie = cookie.expect("Set-Cookie on the first response");
    assert!(
        cookie.starts_with("mm-session=") && cookie.contains("; Path=/; Max-Age=3600; HttpOnly"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().expect("pair").to_string();
    let mut seen = BTreeSet::new();
    for _ in 0..30 {
        let (status, ep, set) =
            get_with(proxy, "/", &[("cookie", &format!("other=1; {pair}"))]).await;
        assert_eq!(status, 200);
        assert!(set.is_none(), "cookie set again");
        seen.insert(ep);
    }
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen.into_iter().next().expect("one"), first_ep);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peak_ewma_starves_the_slow_replica_without_snowballing() {
    let net = Net::new(63);
    let _f1 = net.backend(1, &[("TIMING_50_PERCENTILE", "10ms")]).await;
    let _f2 = net.backend(2, &[("TIMING_50_PERCENTILE", "10ms")]).await;
    let _slow = net.backend(3, &[("TIMING_50_PERCENTILE", "1000ms")]).await;
    net.service("backend", &[1, 2, 3]);
    net.rule("rule.yaml", "backend", "simple: PEAK_EWMA");
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(100, &[]).await;
    let c = load(net.addr(100, 15001), "backend", 10, 3000).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    let slow = c.share(net.addr(3, 9090));
    assert!(
        slow < 0.02,
        "slow replica served {slow}: {:?}",
        c.by_endpoint
    );
    for h in [1, 2] {
        let s = c.share(net.addr(h, 9090));
        assert!(s < 0.70, "fast replica {h} served {s}: {:?}", c.by_endpoint);
    }
}

async fn get_from(src: std::net::Ipv4Addr, addr: SocketAddr, headers: &[(&str, &str)]) -> String {
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.bind(SocketAddr::from((src, 0))).expect("bind source");
    let (status, ep, _) = exchange(sock.connect(addr).await.expect("connect"), "/", headers).await;
    assert_eq!(status, 200);
    ep
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_ip_hashing_is_sticky_per_client_and_can_trust_x_forwarded_for() {
    let net = Net::new(64);
    let _b: Vec<_> = futures_util::future::join_all((1..=3).map(|h| net.backend(h, &[]))).await;
    net.service("backend", &[1, 2, 3]);
    net.rule(
        "rule.yaml",
        "backend",
        "consistentHash:\n  useSourceIp: true",
    );
    let _cp = net.control_plane().await;
    let _plain = net.sidecar(100, &[]).await;
    let _gw = net.sidecar(101, &["--trust-forwarded-for"]).await;
    let mut used = BTreeSet::new();
    for client in 10..40u8 {
        let src = net.ip(client);
        let first = get_from(src, net.addr(100, 15001), &[]).await;
        for _ in 0..4 {
            assert_eq!(
                get_from(src, net.addr(100, 15001), &[]).await,
                first,
                "client {src} moved"
            );
        }
        used.insert(first);
        // Behind a trusting gateway the forwarded client decides, not the socket.
        let xff = format!("203.0.113.{client}, 10.0.0.1");
        let via = get_from(
            net.ip(200),
            net.addr(101, 15001),
            &[("x-forwarded-for", &xff)],
        )
        .await;
        for other in [net.ip(201), net.ip(202)] {
            assert_eq!(
                get_from(other, net.addr(101, 15001), &[("x-forwarded-for", &xff)]).await,
                via
            );
        }
    }
    assert_eq!(
        used.len(),
        3,
        "30 clients should reach all three endpoints: {used:?}"
    );
}
