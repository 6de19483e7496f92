//! `minimesh bench overhead --capture`: what transparent capture costs. One
//! pod in a network namespace of its own (`mesh/pod_network.rs`) with the
//! capture rules of `sidecar init-capture`, the echo app on `0.0.0.0:8080`,
//! and one sidecar in front of it two ways at once: its explicit inbound
//! listener (`--inbound :9090 --app 127.0.0.1:8080`, the port excluded from
//! capture) and its inbound capture listener (a connection to the app's own
//! port, redirected by the rules to `:15006`, its original destination read
//! back). The two paths go through the same process to the same app, take
//! turns in every round, and are set against each other round by round: the
//! difference is the capture's own cost (the kernel's NAT of every packet,
//! one `SO_ORIGINAL_DST` and the port's proxy lookup per connection).
//! Outbound capture adds the same NAT and one lookup of the Service address
//! per request, a hash map's.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Serialize;
use tokio::process::{Child, Command};

use super::drive::Target;
use super::{PathResult, PEER_WORKERS};
use crate::mesh::pod_network::{self, PodNetwork};

/// The path through the sidecar's explicit inbound listener.
pub const EXPLICIT: &str = "capture: explicit inbound";
/// The path through capture to the same sidecar.
pub const CAPTURED: &str = "capture: captured inbound";

/// The explicit inbound listener's port (excluded from capture).
const EXPLICIT_PORT: u16 = 9090;

/// The capture pod: its network, app and sidecar, removed when dropped.
pub struct CapturePod {
    /// Its address.
    pub ip: Ipv4Addr,
    sidecar: Child,
    _app: Child,
    _net: PodNetwork,
}

impl CapturePod {
    /// Makes the pod and waits until both paths answer.
    pub async fn start(out: &Path) -> anyhow::Result<CapturePod> {
        let mut net = PodNetwork::create().context("--capture")?;
        let hosts = pod_network::hosts_file("overhead", &[]);
        let ns = net.add_pod("overhead-echo", 1, &hosts)?;
        let ip = net.pod_ip(1);
        let sidecar_bin = crate::mesh::binary("sidecar")?;
        let app_bin = crate::mesh::binary("fake-service")?;
        let init = std::process::Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(&sidecar_bin)
            .args([
                "init-capture",
                &format!("--exclude-inbound-ports={EXPLICIT_PORT}"),
            ])
            .output()
            .context("running sidecar init-capture")?;
        if !init.status.success() {
            bail!(
                "sidecar init-capture: {}",
                String::from_utf8_lossy(&init.stderr).trim()
            );
        }
        let log = |name: &str| -> anyhow::Result<(Stdio, Stdio)> {
            let f = std::fs::File::create(out.join(format!("capture-{name}.log")))?;
            Ok((f.try_clone()?.into(), f.into()))
        };
        let (o, e) = log("app")?;
        let app = Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(&app_bin)
            .env("LISTEN_ADDR", "0.0.0.0:8080")
            .env("NAME", "echo")
            .env("MESSAGE", "echo")
            .stdout(o)
            .stderr(e)
            .kill_on_drop(true)
            .spawn()
            .context("starting the capture pod's app")?;
        let (o, e) = log("sidecar")?;
        // No control plane: both inbound listeners serve without config
        // (allowed to before the policies arrive, which they never do).
        // Its discovery client's reconnects cost both paths alike.
        let sidecar = Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(&sidecar_bin)
            .args(["--xds-addr", &format!("http://{}:9", net.host_ip())])
            .args(["--workload", "overhead-echo", "--namespace", "overhead"])
            .args(["--outbound", "127.0.0.1:15001"])
            .args([
                "--inbound",
                &format!("0.0.0.0:{EXPLICIT_PORT}"),
                "--app",
                "127.0.0.1:8080",
            ])
            .args(["--inbound-capture", "0.0.0.0:15006"])
            .args(["--admin", &format!("{ip}:15000")])
            .args(["--inbound-before-config", "allow"])
            .args(["--worker-threads", &PEER_WORKERS.to_string()])
            .stdout(o)
            .stderr(e)
            .gid(minimesh_proto::capture::PROXY_GID)
            .kill_on_drop(true)
            .spawn()
            .context("starting the capture pod's sidecar")?;
        let pod = CapturePod {
            ip,
            sidecar,
            _app: app,
            _net: net,
        };
        let started = tokio::time::Instant::now();
        for port in [EXPLICIT_PORT, 8080] {
            let addr = format!("{ip}:{port}");
            while !matches!(crate::http::get(&addr, "/health").await, Ok((200, _))) {
                if started.elapsed() > Duration::from_secs(15) {
                    bail!(
                        "the capture pod never answered on {addr} (see {})",
                        out.join("capture-sidecar.log").display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(pod)
    }

    /// The two paths, through the one sidecar.
    pub fn specs(
        &self,
        target: impl Fn(SocketAddr, &str) -> Target,
    ) -> Vec<(String, Target, Vec<u32>)> {
        let pid: Vec<u32> = self.sidecar.id().into_iter().collect();
        vec![
            (
                EXPLICIT.to_string(),
                target(SocketAddr::from((self.ip, EXPLICIT_PORT)), "echo"),
                pid.clone(),
            ),
            (
                CAPTURED.to_string(),
                target(SocketAddr::from((self.ip, 8080)), "echo"),
                pid,
            ),
        ]
    }
}

/// Capture against the explicit listener, round by round.
#[derive(Debug, Clone, Serialize)]
pub struct CaptureCost {
    /// Captured CPU per request at the fixed rate over explicit's, each round.
    pub cpu_ratio_rounds: Vec<f64>,
    /// Their median.
    pub cpu_ratio: f64,
    /// Captured CPU per request saturated over explicit's, each round.
    pub cpu_saturated_ratio_rounds: Vec<f64>,
    /// Their median.
    pub cpu_saturated_ratio: f64,
    /// Captured p50 minus explicit p50 at the fixed rate, ms, each round.
    pub p50_diff_ms_rounds: Vec<f64>,
    /// Their median.
    pub p50_diff_ms: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The capture's cost from the two paths' rounds; None without both.
pub fn cost(results: &[PathResult]) -> Option<CaptureCost> {
    let find = |name: &str| results.iter().find(|r| r.path == name);
    let (explicit, captured) = (find(EXPLICIT)?, find(CAPTURED)?);
    let ratios = |a: &[f64], b: &[f64]| -> Vec<f64> {
        a.iter()
            .zip(b)
            .filter(|(_, b)| **b > 0.0)
            .map(|(a, b)| a / b)
            .collect()
    };
    let cpu = ratios(
        &captured.cpu_s_per_1000_rounds,
        &explicit.cpu_s_per_1000_rounds,
    );
    let sat = ratios(
        &captured.cpu_us_per_request_saturated_rounds,
        &explicit.cpu_us_per_request_saturated_rounds,
    );
    let p50: Vec<f64> = captured
        .p50_ms_rounds
        .iter()
        .zip(&explicit.p50_ms_rounds)
        .map(|(c, e)| c - e)
        .collect();
    Some(CaptureCost {
        cpu_ratio: median(cpu.clone()),
        cpu_ratio_rounds: cpu,
        cpu_saturated_ratio: median(sat.clone()),
        cpu_saturated_ratio_rounds: sat,
        p50_diff_ms: median(p50.clone()),
        p50_diff_ms_rounds: p50,
    })
}

/// The summary's lines for `cost`.
pub fn summary(c: &CaptureCost) -> String {
    let list = |v: &[f64], f: &dyn Fn(f64) -> String| {
        v.iter().map(|x| f(*x)).collect::<Vec<_>>().join(" ")
    };
    format!(
        "\ncapture against the explicit listener (the same sidecar and app, round by round):\n  CPU at the fixed rate {:.3}x (rounds: {})\n  CPU saturated         {:.3}x (rounds: {})\n  p50 difference        {:+.3}ms (rounds: {})\n",
        c.cpu_ratio,
        list(&c.cpu_ratio_rounds, &|x| format!("{x:.3}")),
        c.cpu_saturated_ratio,
        list(&c.cpu_saturated_ratio_rounds, &|x| format!("{x:.3}")),
        c.p50_diff_ms,
        list(&c.p50_diff_ms_rounds, &|x| format!("{x:+.3}")),
    )
}
