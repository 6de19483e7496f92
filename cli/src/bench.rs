//! `minimesh bench SCENARIO`: the published load-balancing experiments as
//! one command. For each policy of the scenario: a fresh local mesh, the
//! policy applied, the load driven through the ingress, the failures
//! injected on time; then k6-style summaries, a side-by-side table, JSON and
//! an HTML report.

mod args;
pub mod control_plane;
pub mod drive;
pub mod overhead;
pub mod peers;
pub mod report;
pub mod scenario;
pub mod soak;

use std::io::IsTerminal;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::time::Instant;

pub use args::BenchArgs;

use crate::apply::{apply_file, wait_rule};
use crate::mesh::{wait_converged, Mesh, UpArgs};
use report::{EventRecord, RunResult};
use scenario::{Action, Scenario};

/// Finds the scenario file: a path, or a shipped scenario's name.
pub fn resolve(scenario: &str) -> anyhow::Result<PathBuf> {
    let p = PathBuf::from(scenario);
    if p.is_file() {
        return Ok(p);
    }
    let shipped = Path::new("examples/bench").join(format!("{scenario}.yaml"));
    if shipped.is_file() {
        return Ok(shipped);
    }
    let names: Vec<String> = std::fs::read_dir("examples/bench")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let n = e.file_name().to_string_lossy().into_owned();
                    n.strip_suffix(".yaml")
                        .filter(|n| !n.ends_with(".topology"))
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    if names.is_empty() {
        bail!("{scenario}: no such file; shipped scenarios are in examples/bench/ (run from the repository root)");
    }
    let mut names = names;
    names.sort();
    bail!(
        "{scenario}: no such file or shipped scenario (shipped: {})",
        names.join(", ")
    )
}

/// `minimesh bench`.
pub async fn run(home: PathBuf, args: BenchArgs) -> anyhow::Result<()> {
    if args.scenario != "control-plane" {
        if args.load_aware {
            bail!("--load-aware: only `minimesh bench control-plane` takes it");
        }
        if args.endpoints.is_some() {
            bail!("--endpoints: only `minimesh bench control-plane` takes it");
        }
        if args.services.is_some() {
            bail!("--services: only `minimesh bench control-plane` takes it");
        }
        if args.xds_v3 {
            bail!("--xds-v3: only `minimesh bench control-plane` takes it");
        }
    }
    if args.mtls && args.scenario != "overhead" {
        bail!("--mtls: only `minimesh bench overhead` takes it");
    }
    if args.capture && args.scenario != "overhead" {
        bail!("--capture: only `minimesh bench overhead` takes it");
    }
    if args.scenario == "soak" {
        if !(args.qps > 0.0 && args.qps <= 10_000.0) {
            bail!("--qps {}: must be above 0 and at most 10000", args.qps);
        }
        let soak = soak::SoakArgs {
            duration: Duration::from_secs(args.minutes * 60),
            qps: args.qps,
            cert_ttl: args.cert_ttl,
        };
        return soak::run(
            &home,
            &args.out.join("soak"),
            &soak,
            args.network,
            args.ingress,
        )
        .await;
    }
    if args.scenario == "overhead" {
        let generator = overhead::Generator::choose(&args.load_generator)?;
        return overhead::run(&home, &args, generator).await;
    }
    if args.scenario == "control-plane" {
        if let Some(n) = args.sidecars.iter().find(|n| **n == 0 || **n > 15_000) {
            bail!("--sidecars {n}: must be between 1 and 15000 (each is a TCP connection in this process and the control plane)");
        }
        return control_plane::run(
            &args.out.join("control-plane"),
            &args.sidecars,
            args.network,
            args.load_aware,
            args.xds_v3,
            args.endpoints.unwrap_or(3) as usize,
            args.services.unwrap_or(1) as usize,
        )
        .await;
    }
    let path = resolve(&args.scenario)?;
    let scenario = Scenario::load(&path, args.scale)?;
    let known: Vec<&str> = scenario
        .policies
        .iter()
        .map(|(n, _)| n.as_str())
        .chain(scenario.peers.iter().map(|p| p.name.as_str()))
        .collect();
    for o in &args.only {
        if !known.contains(&o.as_str()) {
            bail!(
                "--only {o:?}: {} has no such policy (policies: {})",
                path.display(),
                known.join(", ")
            );
        }
    }
    let out = args.out.join(&scenario.name);
    std::fs::create_dir_all(out.join("rules"))
        .with_context(|| format!("creating {}", out.display()))?;
    println!(
        "minimesh bench {}: {}\n  scale {}, {:?} of load per policy, peak {} {}, load generator: built-in",
        scenario.name,
        scenario.description,
        args.scale,
        scenario.duration,
        scenario.peak_users(),
        match scenario.shape {
            scenario::Shape::Users { .. } => "virtual users",
            scenario::Shape::Rate { .. } => "connections",
        }
    );
    let mut results = Vec::new();
    for (name, rule) in &scenario.policies {
        if !args.only.is_empty() && !args.only.contains(name) {
            continue;
        }
        let r = run_one(&home, &args, &scenario, &out, name, Subject::Policy(rule)).await?;
        let summary = report::k6_summary(&scenario, &r);
        println!("{summary}");
        results.push(r);
    }
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| o == name);
    for kind in [peers::Kind::Nginx, peers::Kind::Haproxy] {
        let runs: Vec<_> = scenario
            .peers
            .iter()
            .filter(|p| p.kind == kind && wanted(&p.name))
            .collect();
        if runs.is_empty() || args.no_peers {
            continue;
        }
        let Some(binary) = peers::find(kind.binary()) else {
            println!(
                "\n  {} is not installed: skipping {} peer run(s) (apt-get install {})",
                kind.binary(),
                runs.len(),
                kind.package()
            );
            continue;
        };
        for peer in runs {
            let subject = Subject::Peer(peer, &binary);
            let r = run_one(&home, &args, &scenario, &out, &peer.name, subject).await?;
            println!("{}", report::k6_summary(&scenario, &r));
            results.push(r);
        }
    }
    let table = report::side_by_side(&scenario, &results);
    println!("{table}");
    let mut text = String::new();
    for r in &results {
        text.push_str(&report::k6_summary(&scenario, r));
        text.push('\n');
    }
    text.push_str(&table);
    std::fs::write(out.join("summary.txt"), text)?;
    let json = report::json(&scenario, args.scale, &results);
    std::fs::write(
        out.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    std::fs::write(out.join("report.html"), report::html(&scenario, &results))?;
    println!(
        "results: {0}/summary.txt, {0}/results.json, {0}/report.html",
        out.display()
    );
    Ok(())
}

/// A fresh mesh of the scenario's topology, for one run.
async fn start_mesh(
    home: &Path,
    args: &BenchArgs,
    scenario: &Scenario,
    run: &str,
) -> anyhow::Result<Mesh> {
    let up = UpArgs {
        topology: scenario.topology.clone(),
        network: args.network,
        ingress: args.ingress,
        sidecar_worker_threads: None,
        restart_after: crate::mesh::RestartAfter(None),
        workload_cert_ttl: None,
        capture: false,
    };
    Mesh::start(&home.join("bench"), &up)
        .await
        .with_context(|| format!("starting the mesh for {run}"))
}

/// What one run puts in front of the scenario's service.
enum Subject<'a> {
    /// minimesh's ingress, with this rule applied.
    Policy(&'a str),
    /// A peer proxy (nginx or HAProxy, the binary found) beside the ingress.
    Peer(&'a scenario::Peer, &'a Path),
}

/// One run in a fresh mesh (the backends, and the same failures), stopped
/// after it whatever the outcome.
async fn run_one(
    home: &Path,
    args: &BenchArgs,
    scenario: &Scenario,
    out: &Path,
    name: &str,
    subject: Subject<'_>,
) -> anyhow::Result<RunResult> {
    let mesh = start_mesh(home, args, scenario, name).await?;
    let result = match subject {
        Subject::Policy(rule) => measure(&mesh, scenario, out, name, rule).await,
        Subject::Peer(peer, binary) => peer_run(&mesh, scenario, out, peer, binary).await,
    };
    mesh.stop().await;
    result
}

/// The pods of the service the scenario compares.
fn service_pods(mesh: &Mesh, scenario: &Scenario) -> Vec<crate::mesh::Pod> {
    mesh.state
        .pods
        .iter()
        .filter(|p| p.service == scenario.service)
        .cloned()
        .collect()
}

/// The load's target: `addr` in front of `pods`.
fn target(addr: SocketAddr, scenario: &Scenario, pods: &[crate::mesh::Pod]) -> drive::Target {
    drive::Target {
        addr,
        host: scenario.host.clone(),
        path: scenario.path.clone(),
        backends: Arc::new(pods.iter().map(|p| p.ip).collect()),
        timeout: scenario.timeout,
    }
}

async fn measure(
    mesh: &Mesh,
    scenario: &Scenario,
    out: &Path,
    name: &str,
    rule: &str,
) -> anyhow::Result<RunResult> {
    let file = out.join("rules").join(format!("{}.yaml", slug(name)));
    std::fs::write(&file, rule)?;
    for r in apply_file(&mesh.state, &file)? {
        wait_rule(&mesh.state, &r.key, &r.policy).await?;
    }
    wait_converged(&mesh.state, Duration::from_secs(20)).await?;
    let ingress = mesh
        .state
        .ingress
        .context("the scenario's topology needs an ingress")?;
    let pods = service_pods(mesh, scenario);
    let port = scenario
        .mesh
        .spec
        .services
        .iter()
        .find(|s| s.name == scenario.service)
        .map_or(80, |s| s.port);
    let cluster = format!(
        "{}.{}.svc.cluster.local:{port}",
        scenario.service, mesh.state.namespace
    );
    let target = target(ingress, scenario, &pods);
    let mut proxies: Vec<String> = mesh
        .state
        .ingress_admin
        .iter()
        .map(|a| a.to_string())
        .collect();
    proxies.extend(mesh.state.pods.iter().map(|p| p.admin().to_string()));
    let (samples, events) = drive_with_events(mesh, scenario, name, target).await;
    let pick = report::pick(&proxies, &cluster).await;
    Ok(RunResult::new(
        name, scenario, "minimesh", samples, &pods, events, pick,
    ))
}

/// Drives the load with the events and the progress line beside it.
async fn drive_with_events(
    mesh: &Mesh,
    scenario: &Scenario,
    name: &str,
    target: drive::Target,
) -> ((Vec<drive::Sample>, drive::Reasons), Vec<EventRecord>) {
    let live = Arc::new(drive::Live::default());
    let done = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let load = async {
        let s = drive::run(scenario, target, start, live.clone()).await;
        done.store(true, Ordering::Relaxed);
        s
    };
    let events = inject(mesh, scenario, start, &done);
    let progress = progress(name, scenario, start, &live, &done);
    let (samples, events, ()) = tokio::join!(load, events, progress);
    (samples, events)
}

/// One peer run: the peer in front of the compared service's apps, the
/// same load.
async fn peer_run(
    mesh: &Mesh,
    scenario: &Scenario,
    out: &Path,
    peer: &scenario::Peer,
    binary: &Path,
) -> anyhow::Result<RunResult> {
    let ingress = mesh
        .state
        .ingress
        .context("the scenario's topology needs an ingress")?;
    // Beside the ingress: same network, host .251, same port.
    let listen = match ingress.ip() {
        std::net::IpAddr::V4(ip) => {
            let o = ip.octets();
            SocketAddr::from((Ipv4Addr::new(o[0], o[1], o[2], 251), ingress.port()))
        }
        std::net::IpAddr::V6(_) => bail!("peers need an IPv4 ingress"),
    };
    let pods = service_pods(mesh, scenario);
    let config = peers::PeerConfig {
        listen,
        servers: pods.iter().map(|p| (p, peer.weight_of(&p.name))).collect(),
        directives: &peer.directives,
        timeout: scenario.timeout,
        retry_5xx: peer.retry_5xx,
        static_listen: None,
    };
    let dir = out.join("peers").join(slug(&peer.name));
    let proxy = peers::start(peer.kind, binary, &dir, &config).await?;
    let target = target(listen, scenario, &pods);
    let (samples, events) = drive_with_events(mesh, scenario, &peer.name, target).await;
    proxy.stop().await;
    Ok(RunResult::new(
        &peer.name,
        scenario,
        peer.kind.binary(),
        samples,
        &pods,
        events,
        None,
    ))
}

/// Sends each event's signal on time: `kill` takes the whole pod down (app
/// and sidecar, as a node or container failure would); `stop` and `cont`
/// hang and resume the app.
async fn inject(
    mesh: &Mesh,
    scenario: &Scenario,
    start: Instant,
    done: &AtomicBool,
) -> Vec<EventRecord> {
    let mut out = Vec::new();
    for (at, action, pod) in &scenario.events {
        tokio::time::sleep_until(start + *at).await;
        if done.load(Ordering::Relaxed) {
            break;
        }
        let result = match action {
            Action::Kill => mesh
                .signal(&format!("{pod}.app"), "KILL")
                .and_then(|()| mesh.signal(&format!("{pod}.sidecar"), "KILL")),
            Action::Stop => mesh.signal(&format!("{pod}.app"), "STOP"),
            Action::Cont => mesh.signal(&format!("{pod}.app"), "CONT"),
            Action::Errors => mesh.signal(&format!("{pod}.app"), "USR1"),
            Action::Recover => mesh.signal(&format!("{pod}.app"), "USR2"),
        };
        let at_s = start.elapsed().as_secs_f64();
        if let Err(e) = &result {
            eprintln!("  event {} {pod} failed: {e:#}", action.as_str());
        }
        out.push(EventRecord {
            at_s,
            action: action.as_str(),
            pod: pod.clone(),
            done: result.is_ok(),
        });
    }
    out
}

/// A progress line with the users running, requests in flight, live RPS and
/// errors: redrawn on a terminal, every ten seconds otherwise (CI logs).
async fn progress(
    name: &str,
    scenario: &Scenario,
    start: Instant,
    live: &drive::Live,
    done: &AtomicBool,
) {
    let tty = std::io::stdout().is_terminal();
    let every = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(10)
    };
    let total = scenario.duration.as_secs_f64();
    let running = match scenario.shape {
        scenario::Shape::Users { .. } => "users",
        scenario::Shape::Rate { .. } => "conns",
    };
    let mut last = (Instant::now(), 0u64);
    loop {
        tokio::time::sleep(every.min(Duration::from_millis(200))).await;
        if done.load(Ordering::Relaxed) {
            break;
        }
        if last.0.elapsed() < every {
            continue;
        }
        let n = live.requests.load(Ordering::Relaxed);
        let rps = (n - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), n);
        let t = start.elapsed().as_secs_f64().min(total);
        let width = 30;
        let filled = ((t / total) * width as f64) as usize;
        let line = format!(
            "  {name:<24} [{}{}] {t:>5.0}s/{total:.0}s  {running} {:>4}  in flight {:>4}  rps {rps:>7.0}  requests {n:>7}  errors {}",
            "=".repeat(filled),
            " ".repeat(width - filled.min(width)),
            live.users.load(Ordering::Relaxed),
            live.in_flight.load(Ordering::Relaxed),
            live.errors.load(Ordering::Relaxed)
        );
        if tty {
            print!("\r{line}");
            let _ = std::io::Write::flush(&mut std::io::stdout());
        } else {
            println!("{line}");
        }
    }
    if tty {
        println!();
    }
}

/// Prints `summary`, then writes it to `out/summary.txt` and `json` to `out/json_name`.
fn save(
    out: &Path,
    summary: &str,
    json_name: &str,
    json: &serde_json::Value,
) -> anyhow::Result<()> {
    println!("{summary}");
    std::fs::write(out.join("summary.txt"), summary)?;
    std::fs::write(out.join(json_name), serde_json::to_string_pretty(json)?)?;
    println!("results: {0}/summary.txt, {0}/{json_name}", out.display());
    Ok(())
}

fn slug(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}
