//! A fixed-rate load generator in the manner of fortio (`-c N -qps R -t D
//! -jitter`): N keep-alive connections, each sending on its own schedule so
//! that the total is R requests a second, never more than one request in
//! flight per connection. As fortio, it stops at D: when responses take
//! longer than a connection's interval, fewer than R a second go out, and
//! the rate achieved says so.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

/// What to send.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Where to connect.
    pub target: SocketAddr,
    /// Host header.
    pub host: String,
    /// Request path.
    pub path: String,
    /// Connections (each with at most one request in flight).
    pub connections: usize,
    /// Total requests per second.
    pub qps: f64,
    /// How long.
    pub duration: Duration,
    /// ±10% jitter on each interval, as fortio's -jitter.
    pub jitter: bool,
    /// Give up on a request after this long.
    pub timeout: Duration,
}

/// The outcome of one run.
#[derive(Debug, Default)]
pub struct LoadResult {
    /// Latencies of every request, in microseconds, sorted.
    pub latencies_us: Vec<u64>,
    /// Requests answered with 2xx.
    pub ok: u64,
    /// Requests that failed (non-2xx, transport error or timeout).
    pub errors: u64,
    /// Failures by status (0 = transport error or timeout).
    pub error_codes: BTreeMap<u16, u64>,
    /// Successful requests per label (as `classify` names them).
    pub by_label: BTreeMap<String, u64>,
}

impl LoadResult {
    /// Latency at quantile `q` (0..=1), in milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies_us.len() as f64 - 1.0) * q).round() as usize;
        self.latencies_us[i] as f64 / 1000.0
    }

    /// Total requests.
    pub fn total(&self) -> u64 {
        self.ok + self.errors
    }
}

struct Worker {
    ok: u64,
    errors: u64,
    error_codes: BTreeMap<u16, u64>,
    latencies: Vec<u64>,
    by_label: BTreeMap<String, u64>,
}

/// Runs the load; `classify` names the backend of a successful response body.
pub async fn run(spec: &LoadSpec, classify: fn(&[u8]) -> Option<String>) -> LoadResult {
    let start = Instant::now();
    let c = spec.connections.max(1);
    let interval = Duration::from_secs_f64(c as f64 / spec.qps.max(0.001));
    let mut tasks = Vec::new();
    for w in 0..c {
        let spec = spec.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Worker {
                ok: 0,
                errors: 0,
                error_codes: BTreeMap::new(),
                latencies: Vec::new(),
                by_label: BTreeMap::new(),
            };
            let mut sender: Option<SendRequest<Empty<Bytes>>> = None;
            let end = start + spec.duration;
            let mut next = start + interval.mul_f64(w as f64 / c as f64);
            let mut k: u64 = 0;
            while next < end {
                tokio::time::sleep_until(next).await;
                let t0 = Instant::now();
                if t0 >= end {
                    // Behind schedule (slow responses): the time is up.
                    break;
                }
                let outcome = tokio::time::timeout(spec.timeout, one(&spec, &mut sender)).await;
                let lat = t0.elapsed().as_micros() as u64;
                out.latencies.push(lat);
                match outcome {
                    Ok(Ok((status, body))) if (200..300).contains(&status) => {
                        out.ok += 1;
                        if let Some(label) = classify(&body) {
                            *out.by_label.entry(label).or_default() += 1;
                        }
                    }
                    Ok(Ok((status, _))) => {
                        out.errors += 1;
                        *out.error_codes.entry(status).or_default() += 1;
                    }
                    _ => {
                        sender = None;
                        out.errors += 1;
                        *out.error_codes.entry(0).or_default() += 1;
                    }
                }
                k += 1;
                let factor = if spec.jitter {
                    0.9 + 0.2 * rand_unit()
                } else {
                    1.0
                };
                next = start
                    + interval.mul_f64(w as f64 / c as f64)
                    + interval.mul_f64(k as f64 - 1.0 + factor);
            }
            out
        }));
    }
    let mut r = LoadResult::default();
    for t in tasks {
        if let Ok(w) = t.await {
            r.ok += w.ok;
            r.errors += w.errors;
            r.latencies_us.extend(w.latencies);
            for (k, v) in w.error_codes {
                *r.error_codes.entry(k).or_default() += v;
            }
            for (k, v) in w.by_label {
                *r.by_label.entry(k).or_default() += v;
            }
        }
    }
    r.latencies_us.sort_unstable();
    r
}

/// A uniform number in [0, 1), for jitter.
pub fn rand_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

async fn one(
    spec: &LoadSpec,
    sender: &mut Option<SendRequest<Empty<Bytes>>>,
) -> anyhow::Result<(u16, Bytes)> {
    let reusable = match sender.take() {
        Some(mut s) => s.ready().await.is_ok().then_some(s),
        None => None,
    };
    let mut s = match reusable {
        Some(s) => s,
        None => {
            let stream = TcpStream::connect(spec.target).await?;
            stream.set_nodelay(true)?;
            let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            s
        }
    };
    let req = Request::get(spec.path.as_str())
        .header(header::HOST, spec.host.as_str())
        .body(Empty::new())?;
    let resp = s.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    *sender = Some(s);
    Ok((status, body))
}

/// Names the backend of a simple-web response: the first upstream call's
/// body and address, e.g. `Hello from simple-backend-1 (127.0.1.2)`.
pub fn upstream_backend(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let call = &v["upstream_calls"][0];
    let text = call["body"].as_str()?;
    let ip = call["ip_addresses"][0].as_str().unwrap_or("?");
    Some(format!("{text} ({ip})"))
}
