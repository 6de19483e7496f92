//! The in-process tier's mesh: a control plane, sidecars and fake-service
//! apps started as libraries on this test's runtime, with the same names
//! as the end-to-end tier's harness (`net.control_plane()`,
//! `net.sidecar(host, flags)`, `net.backend(host, env)`), so that a test
//! moves between the tiers unchanged but for what it starts. Each part
//! stops when its handle is dropped; whatever it spawned ends with the
//! test's runtime. Nothing here is process-wide: two tests run side by
//! side, each on its own `127.1.N.0/24`.

use std::path::PathBuf;

use clap::Parser;

pub use crate::client::{assert_no_failures, get, get_json, load, wait_http, Conn};
pub use crate::loopback::{backend_weights, poll_cp_json, wait_cp_config, wait_cp_json, Loopback};
pub use crate::views::{endpoints_of, policy_of, wait_sidecar};
pub use crate::yaml::NS;

/// One test's network and config directory, removed at its end (kept, and
/// named, when the test failed).
pub struct Net {
    pub octet: u8,
    pub dir: PathBuf,
}

/// A control plane running on the test's runtime; stops when dropped.
pub struct ControlPlane {
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// A sidecar running on the test's runtime; stops (drains) when dropped.
pub struct Sidecar {
    running: Option<minimesh_sidecar::Running>,
}

impl Sidecar {
    /// Stops accepting, drains, and ends its tasks.
    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.stop().await;
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        // Dropping `Running` closes its stop channel: the listeners drain
        // and end; its other tasks end with the runtime.
        drop(self.running.take());
    }
}

/// A fake-service app; stops listening when dropped.
pub struct App {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for App {
    fn drop(&mut self) {
        self.task.abort();
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
        assert!(
            octet >= 200,
            "the in-process tier's nets are 127.1.200.0 and up"
        );
        let dir = std::env::temp_dir().join(format!(
            "minimesh-in-process-{octet}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("config")).expect("config dir");
        Net { octet, dir }
    }

    /// Starts the control plane on the config directory and waits until
    /// it serves.
    pub async fn control_plane(&self) -> ControlPlane {
        self.control_plane_with(&[]).await
    }

    /// The same, with extra flags.
    pub async fn control_plane_with(&self, extra: &[&str]) -> ControlPlane {
        let flags = self.control_plane_flags(extra);
        capture_logs();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let args = parse("control-plane", &flags);
        tokio::spawn(async move {
            let run = minimesh_control_plane::run_until(args, async move {
                let _ = stopped.await;
            });
            if let Err(e) = run.await {
                panic!("the control plane failed: {e:#}");
            }
        });
        wait_http(self.cp_admin(), "/readyz").await;
        ControlPlane { _stop: stop }
    }

    /// Starts a sidecar of workload `client-{host}` at .host (outbound
    /// :15001, admin :15000) and waits until it has its config.
    pub async fn sidecar(&self, host: u8, extra: &[&str]) -> Sidecar {
        self.sidecar_in(host, NS, extra).await
    }

    /// A sidecar of a workload in `namespace`.
    pub async fn sidecar_in(&self, host: u8, namespace: &str, extra: &[&str]) -> Sidecar {
        let xds = format!("http://{}", self.cp_xds());
        let flags = self.sidecar_flags(host, &xds, namespace, extra);
        self.sidecar_with(host, &flags).await
    }

    /// A sidecar with these flags only (its admin at .host:15000), once
    /// ready.
    pub async fn sidecar_with(&self, host: u8, flags: &[String]) -> Sidecar {
        capture_logs();
        let running = minimesh_sidecar::start(parse("sidecar", flags))
            .await
            .unwrap_or_else(|e| panic!("sidecar at .{host}: {e:#}"));
        wait_http(self.addr(host, 15000), "/ready").await;
        Sidecar {
            running: Some(running),
        }
    }

    /// A fake-service backend (`NAME` backend-HOST) at .host:9090, with
    /// fake-service's environment variables in `env`, once it answers.
    pub async fn backend(&self, host: u8, env: &[(&str, &str)]) -> App {
        self.fake_service(host, 9090, env).await
    }

    /// A fake-service app at .host:8080, the app a sidecar with
    /// [`Net::inbound_flags`] stands in front of.
    pub async fn app(&self, host: u8) -> App {
        self.fake_service(host, 8080, &[]).await
    }

    async fn fake_service(&self, host: u8, port: u16, env: &[(&str, &str)]) -> App {
        let listen = self.addr(host, port).to_string();
        let name = format!("backend-{host}");
        let config = fake_service::Config::from_vars(|var| match var {
            "LISTEN_ADDR" => Some(listen.clone()),
            "NAME" => Some(name.clone()),
            _ => env
                .iter()
                .find(|(k, _)| *k == var)
                .map(|(_, v)| v.to_string()),
        })
        .expect("fake-service settings");
        let task = tokio::spawn(async move {
            if let Err(e) = fake_service::run(config).await {
                panic!("fake-service: {e:#}");
            }
        });
        wait_http(self.addr(host, port), "/health").await;
        App { task }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("config kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// What every control plane and sidecar of this process logged so far, as
/// their binaries print it (info and up). Tests run side by side, so a test
/// looks for a line only its own parts write.
pub fn logs() -> String {
    String::from_utf8_lossy(&LOGS.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

static LOGS: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

/// Writes into [`LOGS`].
struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut logs = LOGS.lock().unwrap_or_else(|e| e.into_inner());
        logs.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends this process's logs to [`LOGS`] (once; the subscriber is the
/// process's).
fn capture_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .try_init();
    });
}

/// A binary's flags parsed as its `main` would.
fn parse<T: Parser>(bin: &str, flags: &[String]) -> T {
    T::try_parse_from(std::iter::once(bin.to_string()).chain(flags.iter().cloned()))
        .unwrap_or_else(|e| panic!("{bin} flags: {e}"))
}
