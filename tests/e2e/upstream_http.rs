//! The sidecar's upstream HTTP/1.1 side against a backend written here byte
//! by byte, so that each response is exactly the framing under test:
//! chunked with extensions and trailers, until close, interim 100 Continue,
//! a large Content-Length body, conflicting lengths; request bodies
//! buffered, streamed with a length and streamed chunked; keep-alive reuse,
//! and a server that closes its idle connections.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::harness::*;

/// What the backend saw of one request.
#[derive(Clone, Debug)]
struct Seen {
    path: String,
    /// `length N`, `chunked` or `none`.
    framing: String,
    body: Vec<u8>,
}

/// A backend at `addr` answering by path (see `answer`), counting the
/// connections it accepted and recording every request.
struct RawBackend {
    conns: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

const BIG: usize = 1 << 20;

fn big_body() -> Vec<u8> {
    (0..BIG).map(|i| (i % 251) as u8).collect()
}

impl RawBackend {
    /// `first_only`: answer only the first request on each connection and
    /// close the connection on the next one unanswered, as a server whose
    /// idle timeout fires just as a request arrives.
    async fn start(addr: SocketAddr, first_only: bool) -> RawBackend {
        let l = TcpListener::bind(addr).await.expect("bind backend");
        let conns = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (c, s) = (conns.clone(), seen.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = l.accept().await {
                c.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve(stream, s.clone(), first_only));
            }
        });
        RawBackend { conns, seen }
    }

    fn conns(&self) -> usize {
        self.conns.load(Ordering::Relaxed)
    }

    fn last(&self) -> Seen {
        self.seen
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("a request")
    }
}

/// Serves requests on one connection until the client closes it or a
/// response says to close.
async fn serve(mut s: TcpStream, seen: Arc<Mutex<Vec<Seen>>>, first_only: bool) {
    let mut buf = Vec::new();
    for n in 0.. {
        let Some(req) = read_request(&mut s, &mut buf).await else {
            return;
        };
        if first_only && n > 0 {
            return;
        }
        let path = req.path.clone();
        seen.lock().expect("lock").push(req.clone());
        let (response, close): (Vec<u8>, bool) = match path.as_str() {
            "/chunked" => (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-checksum: 1\r\n\r\n".to_vec(),
                false,
            ),
            "/until-close" => (b"HTTP/1.1 200 OK\r\n\r\nread until the server closes".to_vec(), true),
            "/continue" => (
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
                false,
            ),
            "/big" => {
                let mut r = format!("HTTP/1.1 200 OK\r\ncontent-length: {BIG}\r\n\r\n").into_bytes();
                r.extend(big_body());
                (r, false)
            }
            "/conflict" => (
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabc".to_vec(),
                true,
            ),
            // Keep-alive as far as the headers say, then the server closes
            // the connection anyway (an idle timeout of zero).
            "/then-close" => (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(), true),
            _ => {
                let body = format!("{} {}", req.framing, req.body.len());
                (
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}", body.len()).into_bytes(),
                    false,
                )
            }
        };
        if s.write_all(&response).await.is_err() || close {
            return;
        }
    }
}

/// Reads one request (head and body by its framing) from `s`.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Seen> {
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        fill(s, buf).await?;
    };
    let head = String::from_utf8(buf.drain(..end).collect()).ok()?;
    let mut lines = head.split("\r\n");
    let path = lines.next()?.split(' ').nth(1)?.to_string();
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let (framing, body) = if let Some(n) = header("content-length") {
        let n: usize = n.parse().ok()?;
        while buf.len() < n {
            fill(s, buf).await?;
        }
        (format!("length {n}"), buf.drain(..n).collect())
    } else if header("transfer-encoding").is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
        let mut body = Vec::new();
        loop {
            let eol = loop {
                if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
                    break i;
                }
                fill(s, buf).await?;
            };
            let size = usize::from_str_radix(std::str::from_utf8(&buf[..eol]).ok()?, 16).ok()?;
            buf.drain(..eol + 2);
            while buf.len() < size + 2 {
                fill(s, buf).await?;
            }
            body.extend(buf.drain(..size));
            buf.drain(..2);
            if size == 0 {
                break;
            }
        }
        ("chunked".to_string(), body)
    } else {
        ("none".to_string(), Vec::new())
    };
    Some(Seen {
        path,
        framing,
        body,
    })
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 16 * 1024];
    match s.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// One request through the sidecar at `proxy` with `body`: status, the
/// error header and the body.
async fn send<B>(
    proxy: SocketAddr,
    host: &str,
    method: &str,
    path: &str,
    body: B,
) -> (u16, Option<String>, Vec<u8>)
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = TcpStream::connect(proxy)
        .await
        .expect("connect to the sidecar");
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", host)
        .body(body)
        .expect("request");
    let resp = tx.send_request(req).await.expect("response");
    let status = resp.status().as_u16();
    let error = resp
        .headers()
        .get("x-minimesh-error")
        .map(|v| v.to_str().unwrap_or_default().to_string());
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
        .to_vec();
    (status, error, body)
}

async fn get(proxy: SocketAddr, path: &str) -> (u16, Option<String>, Vec<u8>) {
    send(proxy, "raw", "GET", path, Full::new(Bytes::new())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_http1_framing_passes_through_the_sidecar_intact() {
    let net = Net::new(97);
    let backend_addr = net.addr(10, 9090);
    let backend = RawBackend::start(backend_addr, false).await;
    let closing = RawBackend::start(net.addr(11, 9090), true).await;
    net.service("raw", &[10]);
    net.service("closing", &[11]);
    // No retries: every request below must succeed on its first attempt.
    for svc in ["raw", "closing"] {
        net.write(
            &format!("dr-{svc}.yaml"),
            &format!("apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {{name: {svc}-dr}}\nspec:\n  host: {svc}\n  trafficPolicy:\n    retries: {{attempts: 0}}\n"),
        );
    }
    let _cp = net.control_plane().await;
    let _sc = net.sidecar(1, &[]).await;
    let proxy = net.addr(1, 15001);
    wait_sidecar(net.addr(1, 15000), Duration::from_secs(10), |v| {
        let s = v.to_string();
        endpoints_of(v, "raw").len() == 1 && s.contains("raw-dr") && s.contains("closing-dr")
    })
    .await;

    // Response framings.
    assert_eq!(
        get(proxy, "/chunked").await,
        (200, None, b"hello, world".to_vec())
    );
    assert_eq!(
        get(proxy, "/until-close").await,
        (200, None, b"read until the server closes".to_vec())
    );
    assert_eq!(get(proxy, "/continue").await, (200, None, b"ok".to_vec()));
    let (status, _, body) = get(proxy, "/big").await;
    assert_eq!(status, 200);
    assert!(
        body == big_body(),
        "1 MiB body arrived as {} bytes, not intact",
        body.len()
    );
    assert_eq!(
        get(proxy, "/conflict").await,
        (
            502,
            Some(format!(
                "upstream {backend_addr} failed: invalid response: conflicting content-length values"
            )),
            format!("minimesh: upstream {backend_addr} failed: invalid response: conflicting content-length values\n")
                .into_bytes()
        )
    );

    // Request bodies: none, small (buffered for retries), large with a
    // length (streamed), and of unknown length (streamed chunked).
    assert_eq!(get(proxy, "/echo").await.2, b"none 0");
    assert_eq!(backend.last().framing, "none");
    let small = Bytes::from_static(b"ten bytes!");
    assert_eq!(
        send(proxy, "raw", "POST", "/echo", Full::new(small.clone()))
            .await
            .2,
        b"length 10 10"
    );
    assert_eq!(backend.last().body, small);
    let large = Bytes::from(big_body()[..200 * 1024].to_vec());
    assert_eq!(
        send(proxy, "raw", "POST", "/echo", Full::new(large.clone()))
            .await
            .2,
        b"length 204800 204800"
    );
    assert!(backend.last().body == large, "200 KiB body not intact");
    let parts: Vec<Result<Frame<Bytes>, Infallible>> = (0..3)
        .map(|i| Ok(Frame::data(Bytes::from(vec![b'a' + i; 40 * 1024]))))
        .collect();
    let streamed = StreamBody::new(tokio_stream::iter(parts));
    assert_eq!(
        send(proxy, "raw", "POST", "/echo", streamed).await.2,
        b"chunked 122880"
    );
    let seen = backend.last();
    assert_eq!(seen.path, "/echo");
    assert!(
        seen.body.len() == 3 * 40 * 1024
            && seen.body[40 * 1024] == b'b'
            && seen.body[80 * 1024] == b'c',
        "chunked body not intact"
    );

    // HTTP/2 from the caller (h2c), HTTP/1.1 upstream: a body of unknown
    // length goes out chunked, a chunked response comes back whole.
    let stream = TcpStream::connect(proxy).await.expect("connect");
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .expect("h2 handshake");
    tokio::spawn(conn);
    let parts: Vec<Result<Frame<Bytes>, Infallible>> = (0..2)
        .map(|i| Ok(Frame::data(Bytes::from(vec![b'x' + i; 70 * 1024]))))
        .collect();
    let req = http::Request::post("http://raw/echo")
        .body(StreamBody::new(tokio_stream::iter(parts)))
        .expect("request");
    let resp = h2.send_request(req).await.expect("h2 response");
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"chunked 143360");
    let seen = backend.last();
    assert!(
        seen.body.len() == 140 * 1024 && seen.body[0] == b'x' && seen.body[70 * 1024] == b'y',
        "h2 body not intact"
    );
    let req = http::Request::get("http://raw/chunked")
        .body(StreamBody::new(tokio_stream::iter(Vec::new())))
        .expect("request");
    let resp = h2.send_request(req).await.expect("h2 response");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(&body[..], b"hello, world");

    // Keep-alive: a run of requests takes one upstream connection.
    let before = backend.conns();
    for _ in 0..20 {
        assert_eq!(get(proxy, "/echo").await.0, 200);
    }
    assert!(
        backend.conns() - before <= 1,
        "20 sequential requests opened {} upstream connections",
        backend.conns() - before
    );

    // A server that closes every connection after answering, although its
    // response says keep-alive: the next request on the pooled connection
    // must not fail, whether the close has arrived (seen at checkout) or
    // not (the request goes out again on a new connection).
    for i in 0..20 {
        let (status, error, _) = get(proxy, "/then-close").await;
        assert_eq!(
            (status, error),
            (200, None),
            "request {i} after the server closed"
        );
        if i % 2 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // A server that closes a kept-alive connection as the next request
    // arrives: an idempotent request goes out again on a new connection;
    // a POST does not (the server may have acted on it) and fails with
    // the reason.
    for i in 0..10 {
        let (status, error, body) =
            send(proxy, "closing", "GET", "/echo", Full::new(Bytes::new())).await;
        assert_eq!(
            (status, error, body),
            (200, None, b"none 0".to_vec()),
            "GET {i}"
        );
    }
    assert_eq!(
        closing.conns(),
        10,
        "each GET after the first resent on a new connection"
    );
    let (status, error, _) = send(
        proxy,
        "closing",
        "POST",
        "/echo",
        Full::new(Bytes::from_static(b"x")),
    )
    .await;
    let closing_addr = net.addr(11, 9090);
    assert_eq!(
        (status, error),
        (
            502,
            Some(format!(
                "upstream {closing_addr} failed: connection closed before a response"
            ))
        )
    );
}
