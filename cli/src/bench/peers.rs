//! nginx and HAProxy as peers in the same run: the same backends (the
//! compared service's apps, reached directly), the same load, the same
//! failures, with the balancing and retry settings users reach for.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::process::{Child, Command};

use crate::mesh::Pod;

pub mod mtls;

/// Which proxy a peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// nginx (Debian `nginx-light` or `nginx`).
    Nginx,
    /// HAProxy.
    Haproxy,
}

impl Kind {
    /// The binary's name.
    pub fn binary(self) -> &'static str {
        match self {
            Kind::Nginx => "nginx",
            Kind::Haproxy => "haproxy",
        }
    }

    /// The Debian package that provides it.
    pub fn package(self) -> &'static str {
        match self {
            Kind::Nginx => "nginx-light",
            Kind::Haproxy => "haproxy",
        }
    }
}

/// Finds `name` on PATH or in the sbin directories Debian installs servers into.
pub fn find(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A running peer proxy, killed when dropped.
pub struct Peer {
    child: Child,
}

impl Peer {
    /// Its (master) process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Stops it: SIGTERM (both shut their workers down), SIGKILL after 5 s,
    /// and any worker still left is killed too, so that none keeps the port.
    pub async fn stop(mut self) {
        let Some(pid) = self.child.id() else { return };
        let workers = children_of(pid);
        signal(pid, "TERM");
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
        for w in workers {
            signal(w, "KILL");
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // An early exit (an error, Ctrl-C): leave no worker behind.
        if let Some(pid) = self.child.id() {
            for w in children_of(pid) {
                signal(w, "KILL");
            }
            signal(pid, "KILL");
        }
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args(["-s", sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// Processes whose parent is `pid` (nginx's workers).
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|stat| {
                    stat.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                        .and_then(|v| v.parse::<u32>().ok())
                })
                == Some(pid)
        })
        .collect()
}

/// Settings shared by both peers, matching minimesh's defaults: 1 s connect
/// timeout, 10 s read timeout, retry on connection errors and timeouts to
/// another server (nginx `proxy_next_upstream error timeout`, HAProxy
/// `retries 2` with `option redispatch`), and with `retry_5xx` on 5xx
/// responses too.
pub struct PeerConfig<'a> {
    /// Where the peer listens.
    pub listen: SocketAddr,
    /// The backends (the apps of the compared service) and their weights.
    pub servers: Vec<(&'a Pod, u32)>,
    /// Balancing directives (nginx upstream block or HAProxy backend section).
    pub directives: &'a str,
    /// Request timeout.
    pub timeout: Duration,
    /// Retry 500, 502, 503 and 504 responses on another server too.
    pub retry_5xx: bool,
    /// nginx only: also answer `200 ok` by itself on this address, with no
    /// upstream (the overhead bench's measure of the machine's floor).
    pub static_listen: Option<SocketAddr>,
}

fn nginx_conf(dir: &Path, c: &PeerConfig) -> String {
    let d = dir.display();
    let mut servers = String::new();
    for (pod, w) in &c.servers {
        servers.push_str(&format!(
            "    server {}:{} weight={w} max_fails=1 fail_timeout=10s;\n",
            pod.ip,
            crate::mesh::APP_PORT
        ));
    }
    format!(
        "# Written by minimesh bench.\nworker_processes 2;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 16384; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
           fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
           upstream backend {{\n    {}\n{servers}    keepalive 256;\n  }}\n\
           server {{\n    listen {};\n    location / {{\n      proxy_pass http://backend;\n      proxy_http_version 1.1;\n\
                 proxy_set_header Connection \"\";\n      proxy_set_header Host $host;\n\
                 proxy_next_upstream error timeout{};\n      proxy_next_upstream_tries 3;\n\
                 proxy_connect_timeout 1s;\n      proxy_read_timeout {}s;\n    }}\n  }}\n{}}}\n",
        c.directives.replace('\n', "\n    "),
        c.listen,
        if c.retry_5xx {
            " http_500 http_502 http_503 http_504"
        } else {
            ""
        },
        c.timeout.as_secs().max(1),
        c.static_listen.map_or(String::new(), |a| format!(
            "  server {{\n    listen {a};\n    location / {{ return 200 \"ok\\n\"; }}\n  }}\n"
        ))
    )
}

fn haproxy_conf(c: &PeerConfig) -> String {
    let mut servers = String::new();
    for (pod, w) in &c.servers {
        servers.push_str(&format!(
            "  server {} {}:{} weight {w}\n",
            pod.name,
            pod.ip,
            crate::mesh::APP_PORT
        ));
    }
    format!(
        "# Written by minimesh bench.\nglobal\n  maxconn 8000\n  nbthread 2\n\
         defaults\n  mode http\n  timeout connect 1s\n  timeout client 60s\n  timeout server {}s\n\
           retries 2\n  option redispatch 1\n  option http-keep-alive\n{}\
         frontend fe\n  bind {}\n  default_backend be\n\
         backend be\n  {}\n{servers}",
        c.timeout.as_secs().max(1),
        if c.retry_5xx {
            "  retry-on conn-failure empty-response response-timeout 500 502 503 504\n"
        } else {
            ""
        },
        c.listen,
        c.directives.replace('\n', "\n  ")
    )
}

/// Writes the config into `dir`, checks it with the proxy's own test mode,
/// starts the proxy and waits until it accepts connections.
pub async fn start(
    kind: Kind,
    binary: &Path,
    dir: &Path,
    c: &PeerConfig<'_>,
) -> anyhow::Result<Peer> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = std::path::absolute(dir)?;
    let (conf, text) = match kind {
        Kind::Nginx => (dir.join("nginx.conf"), nginx_conf(&dir, c)),
        Kind::Haproxy => (dir.join("haproxy.cfg"), haproxy_conf(c)),
    };
    std::fs::write(&conf, text)?;
    launch(kind, binary, &dir, &conf, c.listen).await
}

/// Checks `conf` with the proxy's own test mode, starts the proxy on it and
/// waits until it accepts connections on `listen`.
pub async fn launch(
    kind: Kind,
    binary: &Path,
    dir: &Path,
    conf: &Path,
    listen: SocketAddr,
) -> anyhow::Result<Peer> {
    if tokio::net::TcpStream::connect(listen).await.is_ok() {
        bail!(
            "{listen} is already in use (a proxy left from an earlier run?); stop it and try again"
        );
    }
    let mut check = Command::new(binary);
    let mut run = Command::new(binary);
    match kind {
        Kind::Nginx => {
            let prefix = format!("{}/", dir.display());
            check
                .args(["-p", &prefix, "-e", "stderr", "-t", "-c"])
                .arg(conf);
            run.args(["-p", &prefix, "-e", "stderr", "-c"]).arg(conf);
        }
        Kind::Haproxy => {
            check.args(["-c", "-f"]).arg(conf);
            run.args(["-db", "-f"]).arg(conf);
        }
    }
    let out = check
        .output()
        .await
        .with_context(|| format!("running {}", binary.display()))?;
    if !out.status.success() {
        bail!(
            "{} rejects {}: {}",
            kind.binary(),
            conf.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let log = std::fs::File::create(dir.join("stderr.log"))?;
    let child = run
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let mut peer = Peer { child };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = peer.child.try_wait() {
            bail!(
                "{} exited ({status}); see {}",
                kind.binary(),
                dir.join("stderr.log").display()
            );
        }
        if tokio::net::TcpStream::connect(listen).await.is_ok() {
            return Ok(peer);
        }
        if tokio::time::Instant::now() > deadline {
            peer.stop().await;
            bail!("{} did not listen on {listen} within 10s", kind.binary());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
