//! The gateway at the edge: what outside clients may send it, and what they
//! see come back. Raw bytes on TCP, as a hostile client sends them.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

/// Writes `request` on a new connection and reads until the gateway closes
/// it, or until nothing more comes for `quiet`.
async fn exchange(addr: std::net::SocketAddr, request: &[u8], quiet: Duration) -> (String, bool) {
    let mut s = TcpStream::connect(addr)
        .await
        .expect("connect to the gateway");
    s.write_all(request).await.expect("write");
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let closed = loop {
        match tokio::time::timeout(quiet, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

/// The status of every HTTP/1.1 response in `raw`.
fn statuses(raw: &str) -> Vec<u16> {
    raw.match_indices("HTTP/1.1 ")
        .filter_map(|(i, _)| raw.get(i + 9..i + 12)?.parse().ok())
        .collect()
}

/// The header block of the first response in `raw`.
fn head(raw: &str) -> &str {
    raw.split("\r\n\r\n").next().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_battery_of_bad_requests_gets_4xx_or_a_close_and_no_internal_address() {
    let net = Net::new(217);
    let _b1 = net.backend(1, &[]).await;
    let _b2 = net.backend(2, &[]).await;
    net.service("backend", &[1, 2]);
    // A service whose only endpoint refuses connections.
    net.service("down", &[3]);
    net.rule("rule.yaml", "backend", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let _gw = net
        .sidecar(
            10,
            &[
                "--mode",
                "gateway",
                "--default-route",
                &format!("backend.{NS}"),
                "--route",
                &format!("down.example=down.{NS}"),
                "--client-idle-timeout",
                "2s",
            ],
        )
        .await;
    let gw = net.addr(10, 15001);
    let internal = format!("127.1.{}.", net.octet);
    let quiet = Duration::from_secs(5);

    // A normal request, with a forged mesh header: served, and nothing of
    // the mesh's own comes back.
    let normal =
        b"GET / HTTP/1.1\r\nHost: web\r\nx-minimesh-unprocessed: true\r\nConnection: close\r\n\r\n";
    let (raw, _) = exchange(gw, normal, quiet).await;
    assert_eq!(statuses(&raw), [200], "{raw}");
    let h = head(&raw).to_ascii_lowercase();
    assert!(!h.contains("x-minimesh-") && !h.contains(&internal), "{h}");

    // An upstream failure: what failed, not where.
    let (raw, _) = exchange(
        gw,
        b"GET / HTTP/1.1\r\nHost: down.example\r\nConnection: close\r\n\r\n",
        quiet,
    )
    .await;
    assert_eq!(statuses(&raw), [503], "{raw}");
    assert!(raw.ends_with("minimesh: upstream unavailable\n"), "{raw}");
    assert!(
        !raw.contains(&internal) && !raw.to_ascii_lowercase().contains("x-minimesh-"),
        "{raw}"
    );

    let big = format!(
        "GET / HTTP/1.1\r\nHost: web\r\nx-big: {}\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    let many = format!(
        "GET / HTTP/1.1\r\nHost: web\r\n{}\r\n",
        (0..101)
            .map(|i| format!("x-h{i}: 1\r\n"))
            .collect::<String>()
    );
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("a 200 KB header", big.into_bytes(), 431),
        ("101 header fields", many.into_bytes(), 431),
        (
            "a NUL byte in a header value",
            b"GET / HTTP/1.1\r\nHost: web\r\nx-a: a\0b\r\n\r\n".to_vec(),
            400,
        ),
        (
            "an obs-folded header",
            b"GET / HTTP/1.1\r\nHost: web\r\nx-a: a\r\n b\r\n\r\n".to_vec(),
            400,
        ),
        (
            "a malformed chunked body",
            b"POST / HTTP/1.1\r\nHost: web\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
            400,
        ),
    ];
    for (what, request, want) in cases {
        let (raw, closed) = exchange(gw, &request, quiet).await;
        assert_eq!(statuses(&raw), [want], "{what}: {raw}");
        assert!(closed, "{what}: the connection stays open after {want}");
        assert!(!raw.contains(&internal), "{what}: {raw}");
        assert!(
            !raw.to_ascii_lowercase().contains("x-minimesh-"),
            "{what}: {raw}"
        );
    }

    // Content-Length beside Transfer-Encoding: the body is framed by the
    // chunked encoding alone, and the connection closed after the answer
    // (RFC 9112 §6.3), so that the request hidden after it is never read.
    let smuggle = b"POST / HTTP/1.1\r\nHost: web\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: web\r\n\r\n";
    let (raw, closed) = exchange(gw, smuggle, quiet).await;
    assert_eq!(
        statuses(&raw).len(),
        1,
        "the smuggled request was answered: {raw}"
    );
    assert!(
        closed,
        "the connection stays open after a CL+TE request: {raw}"
    );

    // An HTTP/2 preface followed by rubbish: a GOAWAY and a close.
    let (raw, closed) = exchange(
        gw,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        quiet,
    )
    .await;
    assert!(
        closed,
        "the connection stays open after a broken HTTP/2 preface"
    );
    assert!(!raw.contains(&internal), "{raw}");

    // 300 clients holding partial headers: a normal request beside them is
    // served, and each of them is closed after the header timeout.
    let mut slow = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(gw).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nHost: web\r\nx-slow: ")
            .await
            .expect("write");
        slow.push(s);
    }
    let (raw, _) = exchange(gw, normal, quiet).await;
    assert_eq!(statuses(&raw), [200], "beside 300 slow clients: {raw}");
    let closed = futures_util::future::join_all(slow.into_iter().map(|mut s| async move {
        let mut buf = [0u8; 1024];
        let mut got = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => return None,
            }
        }
    }))
    .await;
    let open = closed.iter().filter(|c| c.is_none()).count();
    assert_eq!(
        open, 0,
        "slow clients still connected 10 s after a 2 s header timeout"
    );
    for got in closed.into_iter().flatten() {
        let got = String::from_utf8_lossy(&got);
        assert!(!got.contains(&internal), "{got}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_serves_its_hosts_and_no_internal_service_name() {
    let net = Net::new(218);
    let _web = net.backend(1, &[]).await;
    let _secret = net.backend(2, &[("MESSAGE", "internal only")]).await;
    net.service("web", &[1]);
    net.service("secret", &[2]);
    let _cp = net.control_plane().await;
    let _gw = net
        .sidecar(
            10,
            &[
                "--mode",
                "gateway",
                "--route",
                &format!("web.example=web.{NS}"),
            ],
        )
        .await;
    let gw = net.addr(10, 15001);
    wait_http(net.addr(10, 15000), "/ready").await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, _) = get(gw, "web.example", "/").await.expect("answer");
        if status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never routed: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every name of the internal Service, from outside: 404, nothing reached.
    for host in [
        "secret".to_string(),
        format!("secret.{NS}"),
        format!("secret.{NS}.svc.cluster.local"),
        format!("secret.{NS}.svc.cluster.local:80"),
    ] {
        let (status, _, body) = get(gw, &host, "/").await.expect("answer");
        assert_eq!(
            (status, body.as_str()),
            (
                404,
                format!("minimesh: no route for host {host}\n").as_str()
            )
        );
    }
}
