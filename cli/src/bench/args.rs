//! `minimesh bench`'s flags: the scenario, the load, the peers, the
//! reports, each documented in `minimesh bench --help` and docs/bench.md.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// `minimesh bench` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Scenario file, or the name of a shipped one (`examples/bench/NAME.yaml`):
    /// lb-lab-steady, lb-lab-burst, lb-lab-failure, istio-slow-replica, slow-replica-5, capacity-ramp;
    /// or `overhead` (the data-plane cost: direct, one sidecar, a pair, nginx, HAProxy, and nginx answering by itself as the machine's CPU floor),
    /// or `control-plane` (memory per sidecar and change-to-ACK time for --sidecars N),
    /// or `soak` (the demo mesh under steady load for --minutes while a replica is
    /// killed every 30 s, the rule changes every 10 s and certificates rotate:
    /// fails on a failed request or on a process growing).
    /// These three names always mean the built-in benchmarks, even where a file
    /// of that name exists (such as the control-plane binary in
    /// target/release); write `./overhead` for a scenario file so named.
    pub scenario: String,
    /// Multiply every stage, duration and event time by this (0.05 runs a
    /// scenario in a twentieth of its time; think time and latencies stay).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    /// Run only these policies (by their name in the scenario; repeatable).
    #[arg(long = "only")]
    pub only: Vec<String>,
    /// Results go to DIR/<scenario>/: summary.txt, results.json, report.html.
    #[arg(long, default_value = "target/bench")]
    pub out: PathBuf,
    /// Override the topology's /24 network (to run beside another mesh); an
    /// ingress listening inside the topology's network moves with it.
    #[arg(long)]
    pub network: Option<Ipv4Addr>,
    /// Override the ingress listener.
    #[arg(long)]
    pub ingress: Option<SocketAddr>,
    /// Skip the nginx and HAProxy peers even when they are installed.
    #[arg(long)]
    pub no_peers: bool,
    /// For `overhead`: `auto` uses oha when it is installed (`cargo install oha`;
    /// found in PATH or ~/.cargo/bin), else the built-in generator; `oha` or
    /// `built-in` choose one.
    #[arg(long, default_value = "auto", value_parser = ["auto", "oha", "built-in"])]
    pub load_generator: String,
    /// For `overhead`: how many times each path is measured, the paths taking
    /// turns; the medians are reported (1 to 20).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub rounds: u64,
    /// For `overhead`: another build's sidecar binary, run beside this
    /// build's as a path of its own ("baseline sidecar (-> app)") in the same
    /// rounds, and compared with it round by round: an A/B of two builds on
    /// one machine at one time.
    #[arg(long)]
    pub baseline_sidecar: Option<std::path::PathBuf>,
    /// For `soak`: how long the load runs, in minutes (1 to 1440).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=1440))]
    pub minutes: u64,
    /// For `soak`: requests per second through the ingress.
    #[arg(long, default_value_t = 100.0)]
    pub qps: f64,
    /// For `soak`: how long workload certificates last (each sidecar renews
    /// at half of it).
    #[arg(long, default_value = "60s", value_parser = crate::mesh::parse_duration)]
    pub cert_ttl: Duration,
    /// For `overhead`: run the mesh with mutual TLS, and measure a sidecar
    /// pair over it ("sidecar pair, mutual TLS") beside the plaintext pair
    /// (kept plaintext by a rule's `tls: {mode: DISABLE}`), in the same
    /// rounds. Not with --baseline-sidecar (an older build may not speak it).
    #[arg(long)]
    pub mtls: bool,
    /// For `overhead`: also measure transparent capture (Linux, root): one
    /// pod in a network namespace with the capture rules, its sidecar
    /// reached through capture and through its explicit inbound listener in
    /// the same rounds, and the two set against each other round by round
    /// (docs/capture.md).
    #[arg(long)]
    pub capture: bool,
    /// For `control-plane`: numbers of simulated sidecars, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1000usize, 5000, 10000])]
    pub sidecars: Vec<usize>,
    /// For `control-plane`: give the service a LOAD_AWARE rule, so that every
    /// simulated sidecar reports load each second and the control plane
    /// pushes new weights whenever they change (without it: no rule, a report
    /// every 10 s).
    #[arg(long)]
    pub load_aware: bool,
    /// For `control-plane`: the simulated clients speak Envoy's xDS v3, as
    /// Envoy with deploy/envoy/bootstrap.yaml does (ADS state of the world:
    /// clusters, their endpoints by name, the outbound routes; LRS per
    /// endpoint), instead of minimesh's protocol as sidecars do.
    #[arg(long)]
    pub xds_v3: bool,
    /// For `control-plane`: endpoints of the one service every simulated
    /// sidecar calls and reports on, 3 by default (1 to 995: the 5 changes
    /// add one each, up to an EndpointSlice's limit of 1,000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=995))]
    pub endpoints: Option<u64>,
    /// For `control-plane`: services in the mesh, 1 by default (1 to 1000).
    /// Every simulated sidecar subscribes to all of them and calls and
    /// reports on three (fewer when there are fewer); with `--load-aware`
    /// every service has a LOAD_AWARE rule. The changes are made to the
    /// first service, `backend`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub services: Option<u64>,
}
