//! The load of a scenario run: k6-like virtual users (each a loop of one
//! request, then think time, stages ramping their number) or a fortio-like
//! fixed rate over N connections. Every virtual user or connection sends
//! from its own loopback address (127.100.x.y), so that source-IP hashing
//! sees one client per user, as it would with real clients.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;
use tokio::time::Instant;

use super::scenario::{Scenario, Shape};

/// One request as the client saw it.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// When it was sent, ms from the start of the load.
    pub start_ms: u32,
    /// Time to the end of the response body, µs.
    pub latency_us: u32,
    /// HTTP status; 0 for a transport error or timeout.
    pub status: u16,
    /// Index of the backend that served it; [`UNKNOWN`] when not known.
    pub backend: u16,
}

/// Backend index of a response no backend could be named for.
pub const UNKNOWN: u16 = u16::MAX;

/// Live counters, for the progress line.
#[derive(Default)]
pub struct Live {
    /// Requests completed.
    pub requests: AtomicU64,
    /// Requests failed.
    pub errors: AtomicU64,
    /// Virtual users running, those thinking between requests included (or,
    /// at a fixed rate, connections).
    pub users: AtomicU32,
    /// Requests sent and not yet answered.
    pub in_flight: AtomicU32,
}

/// Where to send and how to name backends.
#[derive(Clone)]
pub struct Target {
    /// The ingress.
    pub addr: SocketAddr,
    /// Host header.
    pub host: String,
    /// Path.
    pub path: String,
    /// Pod addresses of the compared service, by backend index.
    pub backends: Arc<Vec<Ipv4Addr>>,
    /// Request timeout.
    pub timeout: Duration,
}

impl Target {
    fn backend_of(&self, ip: &str) -> Option<u16> {
        let ip: Ipv4Addr = ip.parse().ok()?;
        self.backends
            .iter()
            .position(|b| *b == ip)
            .map(|i| i as u16)
    }

    /// Names the backend: the endpoint the ingress picked when it is one of
    /// the compared service's pods, else the address in the body.
    fn identify(&self, endpoint: Option<&str>, body: &[u8]) -> u16 {
        if let Some(b) = endpoint
            .and_then(|e| e.rsplit_once(':').map(|(ip, _)| ip))
            .and_then(|ip| self.backend_of(ip))
        {
            return b;
        }
        // A backend reached directly (nginx, HAProxy) names itself; simple-web
        // names the simple-backend it called.
        serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| {
                [
                    &v["ip_addresses"][0],
                    &v["upstream_calls"][0]["ip_addresses"][0],
                ]
                .into_iter()
                .find_map(|ip| ip.as_str().and_then(|ip| self.backend_of(ip)))
            })
            .unwrap_or(UNKNOWN)
    }
}

/// The source address of user or connection `i`.
pub fn client_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(127, 100, (i / 250) as u8, (i % 250 + 1) as u8)
}

struct Client {
    ip: Ipv4Addr,
    sender: Option<SendRequest<Empty<Bytes>>>,
    user: String,
    /// Why requests failed: `x-minimesh-error`, the status, or the transport error.
    reasons: Reasons,
}

/// Failure reasons and how often each was seen.
pub type Reasons = std::collections::BTreeMap<String, u64>;

/// Most distinct failure reasons kept per client (they are for reading, not counting).
const MAX_REASONS: usize = 32;

fn note(reasons: &mut Reasons, reason: String) {
    // Addresses and counts vary; keep the first line, bounded.
    let reason: String = reason
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(200)
        .collect();
    if reasons.len() < MAX_REASONS || reasons.contains_key(&reason) {
        *reasons.entry(reason).or_default() += 1;
    }
}

impl Client {
    fn new(i: u32) -> Client {
        Client {
            ip: client_ip(i),
            sender: None,
            user: format!("vu-{i}"),
            reasons: Reasons::new(),
        }
    }

    async fn connect(&mut self, to: SocketAddr) -> anyhow::Result<SendRequest<Empty<Bytes>>> {
        let sock = TcpSocket::new_v4()?;
        // A user's own loopback address, for source-IP hashing; a pod of a
        // network namespace (`--capture`) is reached from the host's
        // address on its bridge, which the kernel picks.
        if to.ip().is_loopback() {
            sock.bind(SocketAddr::from((self.ip, 0)))?;
        }
        let stream = sock.connect(to).await?;
        stream.set_nodelay(true)?;
        let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(s)
    }

    /// One request; returns the status and the backend.
    async fn request(&mut self, t: &Target, keep_alive: bool) -> anyhow::Result<(u16, u16)> {
        let reusable = match self.sender.take() {
            Some(mut s) if keep_alive => s.ready().await.is_ok().then_some(s),
            _ => None,
        };
        let mut s = match reusable {
            Some(s) => s,
            None => self.connect(t.addr).await?,
        };
        let mut req = Request::get(t.path.as_str())
            .header(header::HOST, t.host.as_str())
            .header("x-user", self.user.as_str());
        if !keep_alive {
            req = req.header(header::CONNECTION, "close");
        }
        let resp = s.send_request(req.body(Empty::new())?).await?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            let why = resp
                .headers()
                .get(minimesh_proto::headers::ERROR)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            note(&mut self.reasons, format!("{status} {why}"));
        }
        let endpoint = resp
            .headers()
            .get(minimesh_proto::headers::ENDPOINT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp.into_body().collect().await?.to_bytes();
        let backend = if (200..300).contains(&status) {
            t.identify(endpoint.as_deref(), &body)
        } else {
            UNKNOWN
        };
        if keep_alive {
            self.sender = Some(s);
        }
        Ok((status, backend))
    }

    async fn sample(
        &mut self,
        t: &Target,
        start: Instant,
        keep_alive: bool,
        live: &Live,
    ) -> Sample {
        let t0 = Instant::now();
        let outcome = tokio::time::timeout(t.timeout, self.request(t, keep_alive)).await;
        let latency_us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
        let (status, backend) = match outcome {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                self.sender = None;
                note(&mut self.reasons, format!("transport: {e:#}"));
                (0, UNKNOWN)
            }
            Err(_) => {
                self.sender = None;
                note(&mut self.reasons, format!("timeout after {:?}", t.timeout));
                (0, UNKNOWN)
            }
        };
        live.requests.fetch_add(1, Ordering::Relaxed);
        if !(200..300).contains(&status) {
            live.errors.fetch_add(1, Ordering::Relaxed);
        }
        Sample {
            start_ms: t0.duration_since(start).as_millis() as u32,
            latency_us,
            status,
            backend,
        }
    }
}

/// Runs the load against `target` from `start`; returns every sample and why requests failed.
pub async fn run(
    scenario: &Scenario,
    target: Target,
    start: Instant,
    live: Arc<Live>,
) -> (Vec<Sample>, Reasons) {
    match scenario.shape.clone() {
        Shape::Rate {
            qps,
            connections,
            jitter,
        } => {
            fixed(
                target,
                start,
                scenario.duration,
                qps,
                connections,
                jitter,
                live,
            )
            .await
        }
        Shape::Users {
            think,
            new_connection,
            ..
        } => users(scenario, target, start, think, !new_connection, live).await,
    }
}

async fn users(
    scenario: &Scenario,
    target: Target,
    start: Instant,
    think: Duration,
    keep_alive: bool,
    live: Arc<Live>,
) -> (Vec<Sample>, Reasons) {
    let end = start + scenario.duration;
    // Users with an index below this run; the others finish their
    // iteration and leave (k6's graceful ramp-down).
    let wanted = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let now = Instant::now();
        if now >= end {
            break;
        }
        let n = scenario.users_at(now - start);
        wanted.store(n, Ordering::Relaxed);
        live.users.store(n, Ordering::Relaxed);
        while (tasks.len() as u32) < n {
            let i = tasks.len() as u32;
            let (t, w, s, l) = (target.clone(), wanted.clone(), stop.clone(), live.clone());
            tasks.push(tokio::spawn(async move {
                let mut c = Client::new(i);
                let mut out = Vec::new();
                loop {
                    if s.load(Ordering::Relaxed) {
                        break;
                    }
                    if i >= w.load(Ordering::Relaxed) {
                        // Ramped down: wait to be wanted again.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    l.in_flight.fetch_add(1, Ordering::Relaxed);
                    out.push(c.sample(&t, start, keep_alive, &l).await);
                    l.in_flight.fetch_sub(1, Ordering::Relaxed);
                    if !think.is_zero() {
                        tokio::time::sleep(think).await;
                    }
                }
                (out, c.reasons)
            }));
        }
    }
    stop.store(true, Ordering::Relaxed);
    collect(tasks).await
}

/// Closed loop without think time on `connections`: the highest rate the
/// path reaches.
pub async fn saturate(
    target: Target,
    start: Instant,
    duration: Duration,
    connections: u32,
    live: Arc<Live>,
) -> (Vec<Sample>, Reasons) {
    let mut tasks = Vec::new();
    for w in 0..connections {
        let (t, l) = (target.clone(), live.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = Client::new(w);
            let mut out = Vec::new();
            while start.elapsed() < duration {
                out.push(client.sample(&t, start, true, &l).await);
            }
            (out, client.reasons)
        }));
    }
    collect(tasks).await
}

async fn collect(
    tasks: Vec<tokio::task::JoinHandle<(Vec<Sample>, Reasons)>>,
) -> (Vec<Sample>, Reasons) {
    let mut all = Vec::new();
    let mut reasons = Reasons::new();
    for t in tasks {
        if let Ok((mut v, r)) = t.await {
            all.append(&mut v);
            for (k, n) in r {
                *reasons.entry(k).or_default() += n;
            }
        }
    }
    (all, reasons)
}

/// fortio-like: `connections` each sending on its own schedule, `qps` in total.
pub async fn fixed(
    target: Target,
    start: Instant,
    duration: Duration,
    qps: f64,
    connections: u32,
    jitter: bool,
    live: Arc<Live>,
) -> (Vec<Sample>, Reasons) {
    let c = connections.max(1);
    let interval = Duration::from_secs_f64(f64::from(c) / qps);
    let mut tasks = Vec::new();
    for w in 0..c {
        let (t, l) = (target.clone(), live.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = Client::new(w);
            let mut out = Vec::new();
            let end = start + duration;
            let offset = interval.mul_f64(f64::from(w) / f64::from(c));
            let mut next = start + offset;
            let mut k: u64 = 0;
            l.users.fetch_add(1, Ordering::Relaxed);
            while next < end {
                tokio::time::sleep_until(next).await;
                l.in_flight.fetch_add(1, Ordering::Relaxed);
                out.push(client.sample(&t, start, true, &l).await);
                l.in_flight.fetch_sub(1, Ordering::Relaxed);
                k += 1;
                let factor = if jitter {
                    0.9 + 0.2 * crate::load::rand_unit()
                } else {
                    1.0
                };
                // Behind schedule (a slow response): send at once, as fortio does.
                next = (start + offset + interval.mul_f64(k as f64 - 1.0 + factor))
                    .max(Instant::now());
            }
            l.users.fetch_sub(1, Ordering::Relaxed);
            (out, client.reasons)
        }));
    }
    collect(tasks).await
}
