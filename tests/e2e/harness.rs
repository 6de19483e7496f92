//! Starts the real binaries on loopback and talks to them over real sockets.
//! Each test owns a /24 of 127.0.0.0/8 (`Net::new(n)` -> 127.1.n.x), so tests
//! run in parallel on fixed ports without colliding, and beside a demo or a
//! benchmark (those use 127.0.n.x) on the same machine.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

pub use crate::client::{assert_no_failures, get, get_json, load, wait_http, Background, Conn};
pub use crate::loopback::{backend_weights, wait_cp_config, wait_cp_json, Loopback};
pub use crate::views::{endpoints_of, policy_of, wait_sidecar};
pub use crate::yaml::{endpoint_yaml, service_yaml, NS};

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

impl Loopback for Net {
    fn octet(&self) -> u8 {
        self.octet
    }

    fn config(&self) -> PathBuf {
        self.dir.join("config")
    }
}

impl Net {
    pub fn new(octet: u8) -> Net {
        let dir = std::env::temp_dir().join(format!("minimesh-e2e-{octet}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("config")).expect("temp dir");
        std::fs::create_dir_all(dir.join("logs")).expect("temp dir");
        crate::watchdog::started(octet, &dir);
        Net {
            octet,
            dir,
            end_checks: Default::default(),
        }
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
        let args = self.control_plane_flags(extra);
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
        let args = self.sidecar_flags(host, &format!("http://{xds}"), namespace, extra);
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
        crate::watchdog::ended(self.octet);
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

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
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
