//! Starts the real binaries on loopback and talks to them over real sockets.
//! Each test owns a /24 of 127.0.0.0/8 (`Net::new(n)` -> 127.1.n.x), so tests
//! run in parallel on fixed ports without colliding, and beside a demo or a
//! benchmark (those use 127.0.n.x) on the same machine.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

pub const NS: &str = "default";

/// A child process killed (SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status();
    }

    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited with {status}; log:\n{}",
                self.name,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }

    /// Waits for the process to exit by itself (polled, so that a process
    /// that never exits fails the test with its log instead of hanging it).
    pub async fn exited(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if Instant::now() >= deadline {
                self.kill();
                panic!(
                    "{} had not exited {within:?} after it was told to; log:\n{}",
                    self.name,
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One test's network, config directory and processes.
pub struct Net {
    pub octet: u8,
    pub dir: PathBuf,
    /// Checks run when the test ends without a panic: each says what went
    /// wrong out of the test's sight (a request the fake API server refused
    /// the control plane), and the test fails with it.
    end_checks: std::sync::Mutex<Vec<EndCheck>>,
}

/// What an end check found wrong; empty when nothing.
type EndCheck = Box<dyn Fn() -> Vec<String> + Send>;

pub fn bin(name: &str) -> &'static str {
    match name {
        "control-plane" => env!("CARGO_BIN_EXE_control-plane"),
        "sidecar" => env!("CARGO_BIN_EXE_sidecar"),
        "fake-service" => env!("CARGO_BIN_EXE_fake-service"),
        "minimesh" => env!("CARGO_BIN_EXE_minimesh"),
        _ => panic!("unknown binary {name}"),
    }
}

impl Net {
    pub fn new(octet: u8) -> Net {
        let dir = std::env::temp_dir().join(format!("minimesh-e2e-{octet}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("config")).expect("temp dir");
        std::fs::create_dir_all(dir.join("logs")).expect("temp dir");
        watchdog::started(octet, &dir);
        Net {
            octet,
            dir,
            end_checks: Default::default(),
        }
    }

    pub fn ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, 1, self.octet, host)
    }

    pub fn addr(&self, host: u8, port: u16) -> SocketAddr {
        SocketAddr::from((self.ip(host), port))
    }

    pub fn config(&self) -> PathBuf {
        self.dir.join("config")
    }

    pub fn cp_admin(&self) -> SocketAddr {
        self.addr(254, 15014)
    }

    pub fn cp_xds(&self) -> SocketAddr {
        self.addr(254, 15010)
    }

    pub fn spawn(
        &self,
        name: &str,
        program: &str,
        args: &[String],
        env: &[(&str, String)],
    ) -> Proc {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let mut cmd = Command::new(bin(program));
        cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
        cmd.env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {program}: {e}"));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    /// Starts the control plane and waits until it serves.
    pub async fn control_plane(&self) -> Proc {
        self.control_plane_with(&[]).await
    }

    /// The same, with extra flags.
    pub async fn control_plane_with(&self, extra: &[&str]) -> Proc {
        let mut args = vec![
            "--config-dir".to_string(),
            self.config().display().to_string(),
            "--xds-addr".into(),
            self.cp_xds().to_string(),
            "--admin-addr".into(),
            self.cp_admin().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let p = self.spawn("control-plane", "control-plane", &args, &[]);
        wait_http(self.cp_admin(), "/readyz").await;
        p
    }

    /// Starts a sidecar at .host (outbound :15001, admin :15000) and waits for config.
    pub async fn sidecar(&self, host: u8, extra: &[&str]) -> Proc {
        self.sidecar_of(host, self.cp_xds(), extra).await
    }

    /// The same, connected to the control plane at `xds`.
    pub async fn sidecar_of(&self, host: u8, xds: SocketAddr, extra: &[&str]) -> Proc {
        self.sidecar_at(host, xds, NS, extra).await
    }

    /// A sidecar of a workload in `namespace`.
    pub async fn sidecar_in(&self, host: u8, namespace: &str, extra: &[&str]) -> Proc {
        self.sidecar_at(host, self.cp_xds(), namespace, extra).await
    }

    async fn sidecar_at(&self, host: u8, xds: SocketAddr, namespace: &str, extra: &[&str]) -> Proc {
        let mut args = vec![
            "--xds-addr".to_string(),
            format!("http://{xds}"),
            "--workload".into(),
            format!("client-{host}"),
            "--namespace".into(),
            namespace.into(),
            "--outbound".into(),
            self.addr(host, 15001).to_string(),
            "--admin".into(),
            self.addr(host, 15000).to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let p = self.spawn(&format!("sidecar-{host}"), "sidecar", &args, &[]);
        wait_http(self.addr(host, 15000), "/ready").await;
        p
    }

    /// Starts a fake-service backend at .host:9090 and waits for it.
    pub async fn backend(&self, host: u8, env: &[(&str, &str)]) -> Proc {
        self.fake_service(&format!("backend-{host}"), host, 9090, env)
            .await
    }

    /// Starts a fake-service app at .host:8080, the app a sidecar with
    /// [`Net::inbound_flags`] stands in front of, and waits for it.
    pub async fn app(&self, host: u8) -> Proc {
        self.app_with(host, &[]).await
    }

    /// The same, with more fake-service environment.
    pub async fn app_with(&self, host: u8, env: &[(&str, &str)]) -> Proc {
        self.fake_service(&format!("app-{host}"), host, 8080, env)
            .await
    }

    /// Starts fake-service (`NAME` backend-HOST) at .host:port, logged as
    /// `name`, and waits until it answers its health path.
    async fn fake_service(&self, name: &str, host: u8, port: u16, env: &[(&str, &str)]) -> Proc {
        let mut e: Vec<(&str, String)> = vec![
            ("LISTEN_ADDR", self.addr(host, port).to_string()),
            ("NAME", format!("backend-{host}")),
        ];
        e.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
        let p = self.spawn(name, "fake-service", &[], &e);
        wait_http(self.addr(host, port), "/health").await;
        p
    }

    /// A sidecar's flags for an inbound listener at .host:9090 in front of
    /// the app at .host:8080 ([`Net::app`]).
    pub fn inbound_flags(&self, host: u8) -> [String; 4] {
        [
            "--inbound".into(),
            self.addr(host, 9090).to_string(),
            "--app".into(),
            self.addr(host, 8080).to_string(),
        ]
    }

    /// Writes `name.yaml` into the config directory atomically.
    pub fn write(&self, name: &str, text: &str) {
        let path = self.config().join(name);
        let tmp = self.config().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
    }

    pub fn remove(&self, name: &str) {
        std::fs::remove_file(self.config().join(name)).expect("remove");
    }

    /// Writes a Service `name` (port 80) and its EndpointSlice with backends at `hosts` (:9090).
    pub fn service(&self, name: &str, hosts: &[u8]) {
        self.write(
            &format!("svc-{name}.yaml"),
            &service_yaml(
                name,
                &hosts
                    .iter()
                    .map(|h| (self.ip(*h), format!("{name}-{h}")))
                    .collect::<Vec<_>>(),
            ),
        );
    }

    /// Writes a DestinationRule for `service`.
    pub fn rule(&self, file: &str, service: &str, load_balancer: &str) {
        self.write(
            file,
            &format!(
                "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: {service}-dr\nspec:\n  host: {service}\n  trafficPolicy:\n    loadBalancer:\n{}\n",
                load_balancer.lines().map(|l| format!("      {l}")).collect::<Vec<_>>().join("\n")
            ),
        );
    }
}

impl Net {
    /// Runs `check` when the test ends (without a panic of its own); what
    /// it returns fails the test.
    pub fn check_at_end(&self, check: impl Fn() -> Vec<String> + Send + 'static) {
        self.end_checks.lock().expect("lock").push(Box::new(check));
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        watchdog::ended(self.octet);
        let found: Vec<String> = if std::thread::panicking() {
            Vec::new()
        } else {
            let checks =
                std::mem::take(&mut *self.end_checks.lock().unwrap_or_else(|e| e.into_inner()));
            let mut found: Vec<String> = checks.iter().flat_map(|c| c()).collect();
            found.sort();
            found.dedup(); // two control planes' checks of one fake
            found
        };
        if !found.is_empty() {
            eprintln!("logs kept in {}", self.dir.display());
            panic!("{}", found.join("\n"));
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("logs kept in {}", self.dir.display());
        }
    }
}

pub fn service_yaml(name: &str, endpoints: &[(Ipv4Addr, String)]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NS}\nspec:\n  ports:\n  - name: http\n    port: 80\n    targetPort: 9090\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-abc\n  namespace: {NS}\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\nports:\n- name: http\n  port: 9090\nendpoints:\n"
    );
    if endpoints.is_empty() {
        y.push_str("[]\n");
    }
    for (ip, pod) in endpoints {
        y.push_str(&endpoint_yaml(*ip, pod, None));
    }
    y
}

/// One ready EndpointSlice endpoint, optionally in a zone.
pub fn endpoint_yaml(ip: Ipv4Addr, pod: &str, zone: Option<&str>) -> String {
    let zone = zone.map(|z| format!("  zone: {z}\n")).unwrap_or_default();
    format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: {pod}}}\n{zone}")
}

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

/// Waits until `pred` holds on the sidecar's /debug/config (up to `within`);
/// returns how long it took.
pub async fn wait_sidecar(
    admin: SocketAddr,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let v = get_json(admin, "/debug/config").await;
        if pred(&v) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "sidecar config never matched within {within:?}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `pred` holds on the control plane's /debug/config (up to
/// 5 s); returns the config that matched.
pub async fn wait_cp_config(
    net: &Net,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    poll_cp_json(net, "/debug/config", Duration::from_secs(5), pred).await
}

/// Polls the control plane's admin `path` (JSON) until `pred` holds (up to
/// 10 s); returns the value that matched.
pub async fn wait_cp_json(
    net: &Net,
    path: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    poll_cp_json(net, path, Duration::from_secs(10), pred).await
}

/// Polls the control plane's admin `path` (JSON) until `pred` holds, up
/// to `within`; returns the value that matched.
pub async fn poll_cp_json(
    net: &Net,
    path: &str,
    within: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let start = Instant::now();
    loop {
        let v = get_json(net.cp_admin(), path).await;
        if pred(&v) {
            return v;
        }
        assert!(
            start.elapsed() < within,
            "control plane's {path} never matched within {within:?}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The policy of `cluster` in a sidecar's /debug/config.
pub fn policy_of(v: &serde_json::Value, service: &str) -> String {
    v["clusters"][format!("{service}.{NS}.svc.cluster.local:80")]["policy"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// The weights of `backend`'s endpoints on hosts 1, 2 and 3 (0 for one not
/// listed), from a cluster entry of a control plane's /debug/endpoints or a
/// sidecar's /debug/config (both list `endpoints` with `address` and `weight`).
pub fn backend_weights(cluster: &serde_json::Value, net: &Net) -> Vec<u64> {
    let eps = cluster["endpoints"].as_array().cloned().unwrap_or_default();
    (1..=3)
        .map(|h| {
            let a = net.addr(h, 9090).to_string();
            eps.iter()
                .find(|e| e["address"] == a.as_str())
                .and_then(|e| e["weight"].as_u64())
                .unwrap_or(0)
        })
        .collect()
}

/// Endpoint addresses of `service` in a sidecar's /debug/config.
pub fn endpoints_of(v: &serde_json::Value, service: &str) -> Vec<String> {
    v["clusters"][format!("{service}.{NS}.svc.cluster.local:80")]["endpoints"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["address"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
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

/// Backends (host, fake-service env) behind Service `backend`, a rule with
/// this load balancer, the control plane and sidecars at `sidecars`; the
/// processes live as long as the returned vector.
pub async fn mesh(
    net: &Net,
    backends: &[(u8, &[(&str, &str)])],
    load_balancer: &str,
    sidecars: &[u8],
) -> Vec<Proc> {
    let mut procs = Vec::new();
    for (host, env) in backends {
        procs.push(net.backend(*host, env).await);
    }
    let hosts: Vec<u8> = backends.iter().map(|(h, _)| *h).collect();
    net.service("backend", &hosts);
    net.rule("rule.yaml", "backend", load_balancer);
    procs.push(net.control_plane().await);
    for s in sidecars {
        procs.push(net.sidecar(*s, &[]).await);
    }
    procs
}

/// The unequal-capacity backends of the LOAD_AWARE experiments:
/// CONCURRENCY 16/4/2 at 20/40/60 ms.
pub const UNEQUAL: [(u8, &[(&str, &str)]); 3] = [
    (
        1,
        &[("CONCURRENCY", "16"), ("TIMING_50_PERCENTILE", "20ms")],
    ),
    (2, &[("CONCURRENCY", "4"), ("TIMING_50_PERCENTILE", "40ms")]),
    (3, &[("CONCURRENCY", "2"), ("TIMING_50_PERCENTILE", "60ms")]),
];

/// Waits (up to 5 s) for the control plane's connected-streams gauge to
/// read `want`.
pub async fn connected_becomes(net: &Net, want: u64) {
    gauge_becomes(net, "minimesh_xds_connected_proxies", want).await;
}

/// Waits (up to 5 s) for the control plane's gauge `series` (no labels) to
/// read `want`.
pub async fn gauge_becomes(net: &Net, series: &str, want: u64) {
    let mut last = String::new();
    let prefix = format!("{series} ");
    for _ in 0..100 {
        let (_, _, body) = get(net.cp_admin(), "localhost", "/metrics")
            .await
            .expect("metrics");
        last = body
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or("")
            .to_string();
        if last == format!("{series} {want}") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{series} never became {want}; last: {last:?}");
}

/// Ends the whole test run, naming the tests' networks and logs still in
/// use, when it has run far longer than it ever does (40 minutes; a whole run
/// takes about ten on two cores; `MINIMESH_E2E_WATCHDOG_SECS` changes it): a
/// test that hangs fails the run with its logs instead of running into CI's
/// time limit unnamed. Every process the tests started is killed first, as
/// their drops would have: left running, they would hold the run's output
/// open.
mod watchdog {
    use std::collections::BTreeMap;
    use std::io::Write;
    use std::path::{Path, PathBuf};
    use std::sync::{Mutex, Once};
    use std::time::Duration;

    static RUNNING: Mutex<BTreeMap<u8, PathBuf>> = Mutex::new(BTreeMap::new());
    static START: Once = Once::new();

    pub fn started(octet: u8, dir: &Path) {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(octet, dir.to_path_buf());
        START.call_once(|| {
            let secs = std::env::var("MINIMESH_E2E_WATCHDOG_SECS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(2400);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(secs));
                let running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
                // Straight to the run's stderr: eprintln! from a test's
                // thread is captured with the test's output, never shown.
                let mut err = std::io::stderr().lock();
                let _ = writeln!(err, "e2e: still running after {secs} s, which no run takes; the tests on these networks hang (their logs are kept):");
                for (octet, dir) in running.iter() {
                    let _ = writeln!(err, "  127.1.{octet}.0/24  {}", dir.display());
                    for log in std::fs::read_dir(dir.join("logs")).into_iter().flatten().flatten() {
                        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                        let tail: Vec<&str> = text.lines().rev().take(5).collect();
                        let _ = writeln!(err, "    {}:", log.path().display());
                        for l in tail.iter().rev() {
                            let _ = writeln!(err, "      {l}");
                        }
                    }
                }
                kill_descendants(std::process::id());
                std::process::exit(101);
            });
        });
    }

    /// SIGKILLs every process descended from `pid`, children first found
    /// from /proc (each one's parent is the fourth field of its `stat`).
    fn kill_descendants(pid: u32) {
        let mut parents: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(child) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // pid (comm) state ppid ...: comm may hold spaces, so after ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parents.entry(ppid).or_default().push(child);
            }
        }
        let mut stack = vec![pid];
        while let Some(p) = stack.pop() {
            for &c in parents.get(&p).map(Vec::as_slice).unwrap_or_default() {
                stack.push(c);
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &c.to_string()])
                    .status();
            }
        }
    }

    pub fn ended(octet: u8) {
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&octet);
    }
}
