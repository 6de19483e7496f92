//! Clients that hold connections without using them, as a hostile or
//! broken one does: thousands that send `P` (the start of HTTP/2's
//! preface) and stop, idle HTTP/2 connections, request bodies that stop
//! arriving, and connections beyond `--max-connections`. Each is closed
//! (or answered 408) within its bound, and a normal request meanwhile is
//! answered at once.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::*;

/// HTTP/2's client preface and an empty SETTINGS frame.
const H2_START: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Waits until the sidecar's outbound listener serves `n` connections.
async fn wait_open(net: &Net, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, _, m) = get(net.addr(100, 15000), "localhost", "/metrics")
            .await
            .expect("metrics");
        let open: u64 = m
            .lines()
            .filter_map(|l| l.strip_prefix("minimesh_listener_connections{listener=\"outbound\","))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        if open == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{open} connections open, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The status line of the response on `s`, read by `deadline` ("" if none).
async fn response_head(s: &mut TcpStream, deadline: Instant) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while !got.windows(2).any(|w| w == b"\r\n") {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&got)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

/// Reads until the server closes; Err when it has not by `deadline`.
async fn closed_by(s: &mut TcpStream, deadline: Instant) -> Result<(), ()> {
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout_at(deadline.into(), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(()),
            Ok(Ok(_)) => continue, // a SETTINGS or GOAWAY frame
            Err(_) => return Err(()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_and_idle_clients_are_closed_in_time_and_excess_connections_refused() {
    let net = Net::new(147);
    let _b = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    let _cp = net.control_plane().await;
    let idle = Duration::from_secs(2);
    let _sc = net
        .sidecar(
            100,
            &[
                "--client-idle-timeout",
                "2s",
                "--client-body-timeout",
                "2s",
                "--max-connections",
                "2401",
            ],
        )
        .await;
    let addr = net.addr(100, 15001);
    let mut stalled = Vec::new();
    for i in 0..2000 {
        let mut s = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        s.write_all(b"P").await.expect("write");
        stalled.push(s);
    }
    let mut idle_h2 = Vec::new();
    for _ in 0..200 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(H2_START).await.expect("write");
        idle_h2.push(s);
    }
    // Request bodies that stop after 10 bytes: small ones (buffered before
    // the request goes out) and large ones (streamed to the endpoint).
    let mut bodies = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let len = if i % 2 == 0 { 1_000_000 } else { 1_000 };
        let head =
            format!("POST / HTTP/1.1\r\nhost: backend\r\ncontent-length: {len}\r\n\r\n0123456789");
        s.write_all(head.as_bytes()).await.expect("write");
        bodies.push(s);
    }
    let opened = Instant::now();
    // Meanwhile a normal request is answered at once.
    let started = Instant::now();
    let (status, _, body) = get(addr, "backend", "/").await.expect("answer");
    let took = started.elapsed();
    assert_eq!(status, 200, "{body}");
    assert!(took < Duration::from_millis(100), "took {took:?}");
    // At the bound (2,200 held, and one more once the request's is gone):
    // every connection beyond it is closed at once.
    wait_open(&net, 2400).await;
    let _filler = TcpStream::connect(addr).await.expect("connect");
    wait_open(&net, 2401).await;
    for i in 0..100 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let at_once = Instant::now() + Duration::from_millis(500);
        assert!(
            closed_by(&mut s, at_once).await.is_ok(),
            "extra connection {i} kept"
        );
    }
    let (_, _, metrics) = get(net.addr(100, 15000), "localhost", "/metrics")
        .await
        .expect("metrics");
    let counted: u64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("minimesh_listener_connections_refused_total{listener=\"outbound\"} ")
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no refusal count:\n{metrics}"));
    assert_eq!(counted, 100);
    // Every stalled and idle connection is closed within its bound + 1 s.
    let deadline = opened + idle + Duration::from_secs(1);
    for (i, s) in stalled.iter_mut().enumerate() {
        assert!(
            closed_by(s, deadline).await.is_ok(),
            "`P` connection {i} still open"
        );
    }
    for (i, s) in idle_h2.iter_mut().enumerate() {
        assert!(
            closed_by(s, deadline).await.is_ok(),
            "idle h2c connection {i} still open"
        );
    }
    for (i, s) in bodies.iter_mut().enumerate() {
        let head = response_head(s, deadline).await;
        assert!(
            head.starts_with("HTTP/1.1 408 "),
            "stalled body {i}: {head:?}"
        );
    }
    // Room again: a new request is served.
    let (status, _, _) = get(addr, "backend", "/").await.expect("answer");
    assert_eq!(status, 200);
}
