//! A demo service compatible with the environment variables and JSON
//! response of nicholasjackson/fake-service, as the simple-web and
//! simple-backend demo apps use it, plus a capacity limit (`CONCURRENCY`).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `LISTEN_ADDR` | address to listen on | `0.0.0.0:9090` |
//! | `NAME` | service name in responses | `Service` |
//! | `MESSAGE` | `body` of responses | `Hello World` |
//! | `UPSTREAM_URIS` | comma-separated URLs called (in order) for every request | none |
//! | `TIMING_50_PERCENTILE`, `TIMING_90_PERCENTILE`, `TIMING_99_PERCENTILE` | latency distribution (`20ms`, `1s`) | `0s` |
//! | `TIMING_VARIANCE` | ± percent applied to each latency | `0` |
//! | `ERROR_RATE` | share of requests answered with `ERROR_CODE` (0.0–1.0) | `0` |
//! | `ERROR_CODE` | status of injected errors | `500` |
//! | `CONCURRENCY` | requests served at once; more wait in a queue (0 = unlimited) | `0` |
//! | `MAX_QUEUE` | with `CONCURRENCY`, requests waiting at most; more are answered 503 at once (0 = unbounded) | `0` |
//! | `HEALTH_PATH` | path answering 200 `OK` without delay or errors | `/health` |
//! | `HTTP_PROXY` | upstream calls go through this proxy (the sidecar) | none |
//!
//! Signals inject a failure into a running service: after `SIGUSR1` it
//! answers every request but its health checks at once with `ERROR_CODE`, as
//! an app whose database went away does (its process and port stay up, its
//! health path stays green); `SIGUSR2` makes it serve again.

pub mod client;
mod timing;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info};

pub use timing::Timing;

/// The service's settings, normally read from the environment.
#[derive(Clone, Debug)]
pub struct Config {
    /// Listen address.
    pub listen: SocketAddr,
    /// Service name.
    pub name: String,
    /// Response body text.
    pub message: String,
    /// Upstreams called for each request.
    pub upstreams: Vec<String>,
    /// Latency distribution.
    pub timing: Timing,
    /// Share of requests failed with `error_code`.
    pub error_rate: f64,
    /// Status of injected errors.
    pub error_code: StatusCode,
    /// Requests served at once (0 = unlimited).
    pub concurrency: usize,
    /// Requests waiting for a slot at most (0 = unbounded).
    pub max_queue: usize,
    /// Health path.
    pub health_path: String,
    /// Proxy for upstream calls.
    pub http_proxy: Option<SocketAddr>,
}

/// Parses a Go-style duration as fake-service takes them (`20ms`, `1.5s`, `1m`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix("us").or_else(|| s.strip_suffix("µs")) {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if s == "0" {
        ("0", 0.0)
    } else {
        return Err(format!("{s:?} needs a unit (us, ms, s, m)"));
    };
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 && v * mult <= 3600.0 => {
            Ok(Duration::from_secs_f64(v * mult))
        }
        _ => Err(format!(
            "{s:?} is not a duration like 20ms or 1s (at most 1h)"
        )),
    }
}

impl Config {
    /// Reads the settings from the environment, naming the variable on error.
    pub fn from_env() -> anyhow::Result<Config> {
        Config::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the settings from variables looked up by `var` (the
    /// environment's, or a test's own), naming the variable on error. A
    /// variable set to blanks counts as unset.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<Config> {
        let env = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let dur = |name: &str| -> anyhow::Result<Option<Duration>> {
            env(name)
                .map(|v| parse_duration(&v).map_err(|e| anyhow::anyhow!("{name}: {e}")))
                .transpose()
        };
        let listen = env("LISTEN_ADDR").unwrap_or_else(|| "0.0.0.0:9090".into());
        let listen: SocketAddr = listen
            .parse()
            .with_context(|| format!("LISTEN_ADDR: {listen:?} is not ip:port"))?;
        let p50 = dur("TIMING_50_PERCENTILE")?.unwrap_or_default();
        let p90 = dur("TIMING_90_PERCENTILE")?.unwrap_or(p50);
        let p99 = dur("TIMING_99_PERCENTILE")?.unwrap_or(p90);
        let variance: f64 = match env("TIMING_VARIANCE") {
            Some(v) => v
                .parse()
                .ok()
                .filter(|v: &f64| (0.0..=100.0).contains(v))
                .with_context(|| format!("TIMING_VARIANCE: {v:?} is not a percentage 0-100"))?,
            None => 0.0,
        };
        let error_rate: f64 = match env("ERROR_RATE") {
            Some(v) => v
                .parse()
                .ok()
                .filter(|v: &f64| (0.0..=1.0).contains(v))
                .with_context(|| format!("ERROR_RATE: {v:?} is not between 0.0 and 1.0"))?,
            None => 0.0,
        };
        let error_code = match env("ERROR_CODE") {
            Some(v) => v
                .parse::<u16>()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .with_context(|| format!("ERROR_CODE: {v:?} is not an HTTP status"))?,
            None => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let concurrency = match env("CONCURRENCY") {
            Some(v) => v
                .parse()
                .with_context(|| format!("CONCURRENCY: {v:?} is not a whole number"))?,
            None => 0,
        };
        let max_queue = match env("MAX_QUEUE") {
            Some(v) => v
                .parse()
                .with_context(|| format!("MAX_QUEUE: {v:?} is not a whole number"))?,
            None => 0,
        };
        if max_queue > 0 && concurrency == 0 {
            bail!("MAX_QUEUE: needs CONCURRENCY (without a limit nothing ever waits)");
        }
        let http_proxy = match env("HTTP_PROXY").or_else(|| env("http_proxy")) {
            Some(p) => {
                let hostport = p.trim_start_matches("http://").trim_end_matches('/');
                Some(
                    hostport
                        .parse()
                        .with_context(|| format!("HTTP_PROXY: {p:?} is not http://ip:port"))?,
                )
            }
            None => None,
        };
        let upstreams: Vec<String> = env("UPSTREAM_URIS")
            .map(|u| {
                u.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        for u in &upstreams {
            if !u.starts_with("http://") {
                bail!("UPSTREAM_URIS: {u:?} must be an http:// URL");
            }
        }
        Ok(Config {
            listen,
            name: env("NAME").unwrap_or_else(|| "Service".into()),
            message: env("MESSAGE").unwrap_or_else(|| "Hello World".into()),
            upstreams,
            timing: Timing {
                p50,
                p90,
                p99,
                variance,
            },
            error_rate,
            error_code,
            concurrency,
            max_queue,
            health_path: env("HEALTH_PATH").unwrap_or_else(|| "/health".into()),
            http_proxy,
        })
    }
}

struct State {
    config: Config,
    limit: Option<Semaphore>,
    waiting: std::sync::atomic::AtomicUsize,
    /// Set by SIGUSR1, cleared by SIGUSR2.
    failing: AtomicBool,
    client: client::Client,
    ip: String,
}

/// Serves until the process is stopped.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("LISTEN_ADDR: cannot listen on {}", config.listen))?;
    let ip = if config.listen.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        config.listen.ip().to_string()
    };
    info!(name = config.name, listen = %config.listen, upstreams = ?config.upstreams, "fake-service listening");
    let state = Arc::new(State {
        limit: (config.concurrency > 0).then(|| Semaphore::new(config.concurrency)),
        waiting: Default::default(),
        failing: AtomicBool::new(false),
        client: client::Client::new(config.http_proxy),
        config,
        ip,
    });
    watch_fault_signals(state.clone())?;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(state.clone(), req));
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                debug!(error = %e, "connection ended");
            }
        });
    }
}

/// SIGUSR1 starts failing every request, SIGUSR2 stops.
fn watch_fault_signals(state: Arc<State>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut fail = signal(SignalKind::user_defined1()).context("watching SIGUSR1")?;
    let mut heal = signal(SignalKind::user_defined2()).context("watching SIGUSR2")?;
    tokio::spawn(async move {
        loop {
            let failing = tokio::select! {
                Some(()) = fail.recv() => true,
                Some(()) = heal.recv() => false,
                else => return,
            };
            state.failing.store(failing, Ordering::Relaxed);
            if failing {
                info!(
                    code = state.config.error_code.as_u16(),
                    "SIGUSR1: answering every request with an error"
                );
            } else {
                info!("SIGUSR2: serving again");
            }
        }
    });
    Ok(())
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let cfg = &state.config;
    if req.uri().path() == cfg.health_path || req.uri().path() == "/ready" {
        return Ok(Response::new(Full::new(Bytes::from_static(b"OK"))));
    }
    let uri = req
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let _ = req.into_body().collect().await;
    if state.failing.load(Ordering::Relaxed) {
        let body = json!({
            "name": cfg.name,
            "uri": uri,
            "type": "HTTP",
            "ip_addresses": [state.ip],
            "code": cfg.error_code.as_u16(),
            "error": "Service error injected by SIGUSR1",
        });
        return Ok(json_response(cfg.error_code, &body));
    }
    let start = SystemTime::now();
    let started = tokio::time::Instant::now();
    let _permit = match &state.limit {
        Some(s) => match s.try_acquire() {
            Ok(p) => Some(p),
            Err(_) => {
                use Ordering::Relaxed;
                if cfg.max_queue > 0 && state.waiting.fetch_add(1, Relaxed) >= cfg.max_queue {
                    state.waiting.fetch_sub(1, Relaxed);
                    let mut r = Response::new(Full::new(Bytes::from_static(b"queue full\n")));
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                    return Ok(r);
                }
                let p = s.acquire().await.ok();
                if cfg.max_queue > 0 {
                    state.waiting.fetch_sub(1, Relaxed);
                }
                p
            }
        },
        None => None,
    };
    let mut code = StatusCode::OK;
    let mut calls = Vec::new();
    for u in &cfg.upstreams {
        let call = state.client.get(u).await;
        let ok = call
            .get("code")
            .and_then(Value::as_u64)
            .is_some_and(|c| (200..300).contains(&c));
        if !ok {
            code = StatusCode::INTERNAL_SERVER_ERROR;
        }
        calls.push(call);
    }
    let delay = cfg.timing.sample();
    if !delay.is_zero() {
        // A zero sleep would still wait for the timer's next 1 ms tick.
        tokio::time::sleep(delay).await;
    }
    let injected =
        code == StatusCode::OK && cfg.error_rate > 0.0 && timing::uniform() < cfg.error_rate;
    if injected {
        code = cfg.error_code;
    }
    let end = SystemTime::now();
    let mut body = json!({
        "name": cfg.name,
        "uri": uri,
        "type": "HTTP",
        "ip_addresses": [state.ip],
        "start_time": timing::rfc3339(start),
        "end_time": timing::rfc3339(end),
        "duration": format!("{:.6}ms", started.elapsed().as_secs_f64() * 1000.0),
        "body": cfg.message,
        "code": code.as_u16(),
    });
    if !calls.is_empty() {
        body["upstream_calls"] = Value::Array(calls);
    }
    if code != StatusCode::OK {
        body["error"] = json!(if injected {
            "Service error automatically injected"
        } else {
            "Error processing upstream request"
        });
    }
    Ok(json_response(code, &body))
}

fn json_response(code: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(format!("{body:#}\n"))));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
