//! The tests' HTTP client, shared by the end-to-end and in-process tiers
//! (each includes it as `crate::client`): one request, a keep-alive
//! connection, and load from many connections counted by the endpoint that
//! answered (`x-minimesh-endpoint`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Waits (up to 20 s) for 200 from `addr` `path`.
pub async fn wait_http(addr: SocketAddr, path: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _, _)) = get(addr, "localhost", path).await {
            return;
        }
        assert!(Instant::now() < deadline, "{addr}{path} never became ready");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One GET on a fresh connection: status, x-minimesh-endpoint, body.
pub async fn get(
    addr: SocketAddr,
    host: &str,
    path: &str,
) -> anyhow::Result<(u16, Option<String>, String)> {
    let mut c = Conn::open(addr).await?;
    c.get(host, path).await
}

pub async fn get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let (status, _, body) = get(addr, "localhost", path).await.expect("admin reachable");
    assert_eq!(status, 200, "{addr}{path}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

/// A keep-alive HTTP/1.1 connection.
pub struct Conn {
    addr: SocketAddr,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> anyhow::Result<Conn> {
        let mut c = Conn { addr, sender: None };
        c.connect().await?;
        Ok(c)
    }

    async fn connect(&mut self) -> anyhow::Result<()> {
        let stream = TcpStream::connect(self.addr).await?;
        stream.set_nodelay(true)?;
        let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        self.sender = Some(s);
        Ok(())
    }

    pub async fn get(
        &mut self,
        host: &str,
        path: &str,
    ) -> anyhow::Result<(u16, Option<String>, String)> {
        self.request(host, path, &[]).await
    }

    /// GET with extra headers; returns the status and the serving endpoint.
    pub async fn get_with(
        &mut self,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<(u16, Option<String>)> {
        let (status, ep, _) = self.request(host, path, headers).await?;
        Ok((status, ep))
    }

    async fn request(
        &mut self,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<(u16, Option<String>, String)> {
        let (status, headers, body) = self
            .send(Method::GET, host, path, headers, Bytes::new())
            .await?;
        let ep = headers
            .get("x-minimesh-endpoint")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        Ok((status, ep, body))
    }

    /// Any request: status, response headers, body. Bounded by a generous
    /// 60 s that no test waits for an answer, so that a request that gets
    /// none fails its test instead of hanging it.
    pub async fn send(
        &mut self,
        method: Method,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<(u16, HeaderMap, String)> {
        let what = format!("{method} {host}{path}");
        match tokio::time::timeout(
            Duration::from_secs(60),
            self.send_once(method, host, path, headers, body),
        )
        .await
        {
            Ok(r) => r,
            Err(_) => {
                self.sender = None;
                anyhow::bail!("{what} to {}: no response within 60 s", self.addr)
            }
        }
    }

    async fn send_once(
        &mut self,
        method: Method,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> anyhow::Result<(u16, HeaderMap, String)> {
        let ready = match self.sender.as_mut() {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            self.connect().await?;
        }
        let sender = self.sender.as_mut().expect("connected");
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, host);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body))?;
        let resp = sender.send_request(req).await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                self.sender = None;
                return Err(e.into());
            }
        };
        let status = resp.status().as_u16();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok((
            status,
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        ))
    }
}

/// Counts of a load run.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub by_endpoint: BTreeMap<String, u64>,
    pub ok: u64,
    pub failed: Vec<String>,
    /// Latency of every request, microseconds.
    pub lat_us: Vec<u64>,
}

impl Counts {
    pub fn quantile(&self, q: f64) -> Duration {
        let mut v = self.lat_us.clone();
        v.sort_unstable();
        let i = ((v.len().max(1) - 1) as f64 * q).round() as usize;
        Duration::from_micros(v.get(i).copied().unwrap_or(0))
    }

    pub fn share(&self, ep: SocketAddr) -> f64 {
        *self.by_endpoint.get(&ep.to_string()).unwrap_or(&0) as f64 / self.ok.max(1) as f64
    }
}

/// Sends `total` requests for `host` through the proxy at `proxy` from `clients`
/// concurrent connections.
pub async fn load(proxy: SocketAddr, host: &str, clients: usize, total: u64) -> Counts {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let next = next.clone();
        let host = host.to_string();
        tasks.push(tokio::spawn(async move {
            let mut counts = Counts::default();
            let mut conn = Conn {
                addr: proxy,
                sender: None,
            };
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let t0 = Instant::now();
                let r = conn.get(&host, "/").await;
                counts.lat_us.push(t0.elapsed().as_micros() as u64);
                record(&mut counts, r);
            }
            counts
        }));
    }
    merge(tasks).await
}

/// Sends requests from `clients` connections until `stop` is set; returns
/// counts plus the time each endpoint first answered.
pub async fn load_until(
    proxy: SocketAddr,
    host: &str,
    clients: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
    first_seen: Arc<std::sync::Mutex<BTreeMap<String, Instant>>>,
) -> Counts {
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let host = host.to_string();
        let stop = stop.clone();
        let first_seen = first_seen.clone();
        tasks.push(tokio::spawn(async move {
            let mut counts = Counts::default();
            let mut conn = Conn {
                addr: proxy,
                sender: None,
            };
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let r = conn.get(&host, "/").await;
                counts.lat_us.push(t0.elapsed().as_micros() as u64);
                if let Ok((200, Some(ep), _)) = &r {
                    first_seen
                        .lock()
                        .expect("lock")
                        .entry(ep.clone())
                        .or_insert_with(Instant::now);
                }
                record(&mut counts, r);
            }
            counts
        }));
    }
    merge(tasks).await
}

fn record(counts: &mut Counts, r: anyhow::Result<(u16, Option<String>, String)>) {
    match r {
        Ok((200, ep, _)) => {
            counts.ok += 1;
            *counts
                .by_endpoint
                .entry(ep.unwrap_or_default())
                .or_default() += 1;
        }
        Ok((status, _, body)) => counts.failed.push(format!("{status}: {}", body.trim())),
        Err(e) => counts.failed.push(format!("transport: {e}")),
    }
}

async fn merge(tasks: Vec<tokio::task::JoinHandle<Counts>>) -> Counts {
    let mut all = Counts::default();
    for t in tasks {
        let c = t.await.expect("load task");
        all.ok += c.ok;
        all.failed.extend(c.failed);
        all.lat_us.extend(c.lat_us);
        for (k, v) in c.by_endpoint {
            *all.by_endpoint.entry(k).or_default() += v;
        }
    }
    all
}

/// Load from `clients` connections in the background until [`Background::finish`].
pub struct Background {
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// When each endpoint first answered.
    pub first_seen: Arc<std::sync::Mutex<BTreeMap<String, Instant>>>,
    task: tokio::task::JoinHandle<Counts>,
}

impl Background {
    pub fn start(proxy: SocketAddr, host: &str, clients: usize) -> Background {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let first_seen = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
        let (host, s, f) = (host.to_string(), stop.clone(), first_seen.clone());
        let task = tokio::spawn(async move { load_until(proxy, &host, clients, s, f).await });
        Background {
            stop,
            first_seen,
            task,
        }
    }

    pub async fn finish(self) -> Counts {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("load task")
    }
}

/// Fails with the first few failures when there were any.
pub fn assert_no_failures(c: &Counts, what: &str) {
    assert!(
        c.failed.is_empty(),
        "{what}{} of {} failed: {:?}",
        c.failed.len(),
        c.failed.len() as u64 + c.ok,
        &c.failed[..c.failed.len().min(5)]
    );
}
