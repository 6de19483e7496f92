//! `minimesh up`: plays the part of Kubernetes on one machine. Each pod is an
//! app (fake-service) and its sidecar, on its own loopback address; the
//! control plane watches a config directory into which this module writes the
//! Service and EndpointSlice files a cluster would produce.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use tokio::process::{Child, Command};

use crate::http;
use crate::topology::Topology;

mod identity;
pub mod pod_network;
mod ready;
pub use ready::wait_converged;
use ready::{wait_endpoints, wait_http};

mod captured;
mod gateway;
mod loopback;
mod process;
mod state;
mod summary;
pub use state::{CaptureState, MeshState, Pod};
pub use summary::print_summary;

/// Port of the app inside each pod (the sidecar's inbound listener takes the Service's targetPort).
pub const APP_PORT: u16 = 8080;
/// Outbound listener port of each sidecar (the app's HTTP_PROXY).
pub const OUTBOUND_PORT: u16 = 15001;
/// Admin port of each sidecar.
pub const SIDECAR_ADMIN_PORT: u16 = 15000;
/// Discovery port of the control plane.
pub const XDS_PORT: u16 = 15010;
/// Admin port of the control plane.
pub const CP_ADMIN_PORT: u16 = 15014;

/// `minimesh up` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Topology file (kind: LocalMesh).
    #[arg(default_value = "examples/local/topology.yaml")]
    pub topology: PathBuf,
    /// Override the topology's /24 network, e.g. 127.0.7.0 (to run two meshes
    /// at once); an ingress listening inside the topology's network moves with it.
    #[arg(long)]
    pub network: Option<Ipv4Addr>,
    /// Override the ingress listener, e.g. 127.0.0.1:30000.
    #[arg(long)]
    pub ingress: Option<SocketAddr>,
    /// Event loops of each sidecar (its `--worker-threads`; default 1).
    #[arg(long)]
    pub sidecar_worker_threads: Option<usize>,
    /// Start a process that exited (killed, crashed, `minimesh kill`) again
    /// after this long, as a kubelet restarts a container (its first
    /// back-off is 10s); `never` leaves it down.
    #[arg(long, default_value = "10s", value_parser = restart_after)]
    pub restart_after: RestartAfter,
    /// How long workload certificates last (the control plane's
    /// `--workload-cert-ttl`; each sidecar renews at half of it). Default:
    /// the control plane's, 24h.
    #[arg(long, value_parser = parse_duration)]
    pub workload_cert_ttl: Option<Duration>,
    /// Pods as on Kubernetes with transparent capture (Linux, root): each
    /// pod a network namespace of its own on a bridge, with an address and
    /// a Service IP from 198.18.0.0/15, names resolved per namespace, the
    /// capture rules of `sidecar init-capture`, and its app unchanged
    /// (listening on 0.0.0.0:8080, no proxy settings). Everything made is
    /// removed when the mesh stops (docs/capture.md).
    #[arg(long)]
    pub capture: bool,
}

/// Parses a duration flag (`10s`, `2m`) with the control plane's grammar.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    minimesh_proto::duration::parse_positive(s)
}

/// When `minimesh up` starts an exited process again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartAfter(pub Option<Duration>);

fn restart_after(s: &str) -> Result<RestartAfter, String> {
    if s == "never" {
        return Ok(RestartAfter(None));
    }
    minimesh_control_plane::duration(s).map(|d| RestartAfter(Some(d)))
}

/// Set on every process `minimesh up` starts: the process exits when its
/// parent is gone, so that even a SIGKILLed `minimesh up` leaves no orphans.
pub const PARENT_PID_ENV: &str = "MINIMESH_PARENT_PID";

/// A running local mesh; dropping it kills every process.
pub struct Mesh {
    /// Where it runs.
    pub state: MeshState,
    /// State directory.
    pub home: PathBuf,
    children: Vec<Process>,
    /// Services as the topology declares them: name, port, target port.
    services: Vec<(String, u16, u16)>,
    /// Pods whose endpoint is published as not ready: one of their
    /// processes exited, and they have not passed their checks since.
    not_ready: BTreeSet<String>,
    /// With `--capture`: the pods' network, removed when the mesh is dropped.
    pod_network: Option<pod_network::PodNetwork>,
    /// Each Service's port `appProtocol`, where the topology sets one.
    app_protocols: BTreeMap<String, String>,
    /// Each deployment's app command, where the topology sets one.
    commands: BTreeMap<String, Vec<String>>,
}

/// A process of the mesh, and how to start it again.
struct Process {
    name: String,
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    /// The group it runs as (a captured pod's sidecar: the one the capture
    /// rules exclude), when not this process's.
    gid: Option<u32>,
    child: Child,
    /// When it was seen to have exited (None: running).
    exited: Option<tokio::time::Instant>,
}

/// Finds a sibling binary of the running `minimesh`.
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the minimesh binary")?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow!("minimesh binary has no directory"))?;
    // Test binaries live one level down, in deps/.
    for d in [dir, dir.parent().unwrap_or(dir)] {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!(
        "cannot find the {name} binary next to minimesh (in {}); build every binary with `cargo build --release`",
        dir.display()
    )
}

/// The last line of a file that is not blank, from its last 4 KiB.
fn last_line(path: &Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(4096))).ok()?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).ok()?;
    String::from_utf8_lossy(&tail)
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
}

/// `listen` moved from the topology's network `from` to `to` when it is an
/// address of that /24 (the lb-lab gateway's 127.0.9.252), else as it is
/// (the demo's 127.0.0.1:30000): a mesh moved with `--network` must not
/// share its ingress with the mesh it runs beside.
fn moved(listen: SocketAddr, from: Ipv4Addr, to: Ipv4Addr) -> SocketAddr {
    match listen.ip() {
        std::net::IpAddr::V4(ip) if ip.octets()[..3] == from.octets()[..3] => {
            SocketAddr::from((offset(to, ip.octets()[3]), listen.port()))
        }
        _ => listen,
    }
}

fn offset(net: Ipv4Addr, host: u8) -> Ipv4Addr {
    let o = net.octets();
    Ipv4Addr::new(o[0], o[1], o[2], host)
}

impl Mesh {
    /// Starts everything the topology describes and waits until every proxy
    /// has ACKed the config with every endpoint in it.
    pub async fn start(home: &Path, args: &UpArgs) -> anyhow::Result<Mesh> {
        let topo = Topology::load(&args.topology)?;
        let pod_net = if args.capture {
            Some(pod_network::PodNetwork::create()?)
        } else {
            None
        };
        let net = args.network.unwrap_or(topo.spec.network);
        if !net.is_loopback() {
            bail!("network {net} is not in 127.0.0.0/8: local meshes use loopback addresses only");
        }
        let ns = topo.spec.namespace.clone();
        let config_dir = home.join("config");
        let logs = home.join("logs");
        if config_dir.exists() {
            std::fs::remove_dir_all(&config_dir)
                .with_context(|| format!("clearing {}", config_dir.display()))?;
        }
        for d in [
            config_dir.join("services"),
            config_dir.join("rules"),
            logs.clone(),
        ] {
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let cp_ip = offset(net, 254);
        let pods = plan_pods(&topo, net, pod_net.as_ref());
        let ingress = topo.spec.ingress.as_ref().map(|i| {
            args.ingress
                .unwrap_or_else(|| moved(i.listen, topo.spec.network, net))
        });
        let capture = pod_net.as_ref().map(|pn| CaptureState {
            network: pn.index(),
            namespaces: pods
                .iter()
                .map(|(p, _)| (p.name.clone(), pn.namespace(&p.name)))
                .collect(),
            service_ips: topo
                .spec
                .services
                .iter()
                .enumerate()
                .map(|(i, s)| (s.name.clone(), pn.service_ip(i as u8 + 1)))
                .collect(),
        });
        // Captured pods reach the control plane on the host's end of their bridge.
        let xds_ip = pod_net.as_ref().map_or(cp_ip, |pn| pn.host_ip());
        let state = MeshState {
            name: topo.metadata.name.clone(),
            namespace: ns.clone(),
            config_dir: std::path::absolute(&config_dir)?,
            control_plane_admin: SocketAddr::from((cp_ip, CP_ADMIN_PORT)),
            control_plane_xds: SocketAddr::from((xds_ip, XDS_PORT)),
            ingress,
            ingress_admin: ingress
                .map(|_| SocketAddr::from((offset(net, 253), SIDECAR_ADMIN_PORT))),
            pods: pods.iter().map(|(p, _)| p.clone()).collect(),
            pid: std::process::id(),
            pids: BTreeMap::new(),
            restart_after_ms: args.restart_after.0.map(|d| d.as_millis() as u64),
            capture,
        };
        let mut mesh = Mesh {
            state,
            home: home.to_path_buf(),
            children: Vec::new(),
            services: topo
                .spec
                .services
                .iter()
                .map(|s| {
                    let target = if args.capture {
                        APP_PORT
                    } else {
                        s.target_port
                    };
                    (s.name.clone(), s.port, target)
                })
                .collect(),
            not_ready: BTreeSet::new(),
            pod_network: pod_net,
            app_protocols: topo
                .spec
                .services
                .iter()
                .filter_map(|s| Some((s.name.clone(), s.app_protocol.clone()?)))
                .collect(),
            commands: topo
                .spec
                .services
                .iter()
                .flat_map(|s| &s.deployments)
                .filter(|d| !d.command.is_empty())
                .map(|d| (d.name.clone(), d.command.clone()))
                .collect(),
        };
        if !args.capture {
            if let Some(d) = mesh.commands.keys().next() {
                bail!("{}: spec.services[].deployments[{d}].command: an app command runs only with --capture (the loopback mesh runs fake-service behind each sidecar)", args.topology.display());
            }
        }
        // Mutual TLS between every sidecar: tokens for the CA, labelled pods.
        let ids = match topo.spec.mtls {
            true => Some(identity::Identities::prepare(home, &ns, &mesh.state)?),
            false => None,
        };
        // Services first (no endpoints yet), so that routes exist from the start.
        for (name, port, target) in mesh.services.clone() {
            mesh.write_service(&name, port, target, false)?;
        }
        // The topology's ingress hosts, as the Gateway and VirtualServices
        // users would write (a Service's file name has no dot).
        if let Some(y) = (topo.spec.ingress.as_ref()).and_then(|i| gateway::ingress_objects(&ns, i))
        {
            let file = mesh
                .state
                .config_dir
                .join("services")
                .join("ingress.routes.yaml");
            write_atomic(&file, &y)?;
        }
        let cp = binary("control-plane")?;
        let s = mesh.state.clone();
        mesh.spawn(
            "control-plane",
            Command::new(&cp)
                .arg("--config-dir")
                .arg(&s.config_dir)
                .args(["--default-namespace", &ns])
                .args(["--xds-addr", &s.control_plane_xds.to_string()])
                .args(["--admin-addr", &s.control_plane_admin.to_string()])
                // Reports every second, so that `minimesh top` is live.
                .args(["--load-report-interval", "1s"])
                .args(identity::control_plane_args(
                    ids.as_ref(),
                    args.workload_cert_ttl,
                )),
        )?;
        wait_http(
            &s.control_plane_admin.to_string(),
            "/readyz",
            Duration::from_secs(15),
            &mut mesh,
        )
        .await?;

        // With mutual TLS, discovery is TLS too.
        let scheme = if ids.is_some() { "https" } else { "http" };
        let xds = format!("{scheme}://{}", s.control_plane_xds);
        if let Some(c) = &mesh.state.capture {
            mesh.start_captured_pods(c.clone(), &pods, &xds, &ids, args.sidecar_worker_threads)?;
        }
        if !args.capture {
            mesh.start_loopback_pods(&pods, &xds, ids.as_ref(), args.sidecar_worker_threads)?;
        }
        if let (Some(listen), Some(admin), Some(ing)) =
            (s.ingress, s.ingress_admin, &topo.spec.ingress)
        {
            mesh.start_gateway(listen, admin, ing, &xds, ids.as_ref())
                .await?;
        }
        mesh.wait_pods_ready(&pods).await?;
        // Every pod is up: publish the endpoints, as the endpoint controller would.
        for (name, port, target) in mesh.services.clone() {
            mesh.write_service(&name, port, target, true)?;
        }
        let base = args.topology.parent().unwrap_or(Path::new("."));
        for rule in &topo.spec.rules {
            let path = base.join(rule);
            crate::apply::apply_file(&mesh.state, &path)?;
        }
        mesh.write_state()?;
        wait_endpoints(&mesh.state, mesh.state.pods.len(), Duration::from_secs(10)).await?;
        wait_converged(&mesh.state, Duration::from_secs(20)).await?;
        Ok(mesh)
    }

    /// Waits until every pod's app answers and its sidecar is ready.
    async fn wait_pods_ready(
        &mut self,
        pods: &[(Pod, BTreeMap<String, String>)],
    ) -> anyhow::Result<()> {
        for (pod, _) in pods {
            // An app of the topology's own command is ready once it listens.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while self.commands.contains_key(&pod.deployment) && !self.app_ready(pod).await {
                if let Some(exit) = self.exited() {
                    bail!("{exit}");
                }
                if tokio::time::Instant::now() > deadline {
                    bail!("{}: the app never listened on {}", pod.name, pod.app());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            if !self.commands.contains_key(&pod.deployment) {
                wait_http(
                    &pod.app().to_string(),
                    "/health",
                    Duration::from_secs(15),
                    self,
                )
                .await?;
            }
            wait_http(
                &pod.admin().to_string(),
                "/ready",
                Duration::from_secs(15),
                self,
            )
            .await?;
        }
        Ok(())
    }

    /// True when `pod`'s app answers: fake-service's `/health`, or a
    /// connection to an app of the topology's own command.
    async fn app_ready(&self, pod: &Pod) -> bool {
        if self.commands.contains_key(&pod.deployment) {
            // From outside its namespace a connection to the pod is the
            // sidecar's (captured), so ask the namespace what listens.
            let Some(netns) = self
                .state
                .capture
                .as_ref()
                .and_then(|c| c.namespaces.get(&pod.name))
            else {
                return false;
            };
            let sport = format!("sport = :{APP_PORT}");
            let out = Command::new("ip")
                .args(["netns", "exec", netns, "ss", "-Htln", &sport])
                .output()
                .await;
            return out.is_ok_and(|o| o.status.success() && !o.stdout.trim_ascii().is_empty());
        }
        matches!(
            http::get(&pod.app().to_string(), "/health").await,
            Ok((200, _))
        )
    }

    /// Writes `<home>/mesh.json`, which `minimesh get`, `apply` and `kill` read.
    fn write_state(&self) -> anyhow::Result<()> {
        write_atomic(
            &self.home.join("mesh.json"),
            &serde_json::to_string_pretty(&self.state)?,
        )
    }

    /// Writes the Service and EndpointSlice of a service: its pods, ready but
    /// for those in `not_ready`, or none listed.
    pub fn write_service(
        &self,
        name: &str,
        port: u16,
        target_port: u16,
        with_endpoints: bool,
    ) -> anyhow::Result<()> {
        let ns = &self.state.namespace;
        let cluster_ip = self
            .state
            .capture
            .as_ref()
            .and_then(|c| c.service_ips.get(name))
            .map_or(String::new(), |ip| format!("\n  clusterIP: {ip}"));
        let app_protocol = self
            .app_protocols
            .get(name)
            .map_or(String::new(), |p| format!("\n    appProtocol: {p}"));
        let mut y = format!(
            "# Written by minimesh up, as a cluster's endpoint controller would.\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:{cluster_ip}\n  ports:\n  - name: http\n    port: {port}\n    targetPort: {target_port}\n    protocol: TCP{app_protocol}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-local\n  namespace: {ns}\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\nports:\n- name: http\n  port: {target_port}\n  protocol: TCP\nendpoints:"
        );
        let pods: Vec<&Pod> = self
            .state
            .pods
            .iter()
            .filter(|p| p.service == name && with_endpoints)
            .collect();
        if pods.is_empty() {
            y.push_str(" []\n");
        } else {
            y.push('\n');
            for p in pods {
                let ready = !self.not_ready.contains(&p.name);
                let _ = write!(
                    y,
                    "- addresses: [\"{}\"]\n  conditions: {{ready: {ready}, serving: {ready}, terminating: false}}\n  targetRef: {{kind: Pod, name: {}, namespace: {ns}}}\n  zone: {}\n",
                    p.ip, p.name, p.zone
                );
            }
        }
        write_atomic(
            &self
                .state
                .config_dir
                .join("services")
                .join(format!("{name}.yaml")),
            &y,
        )
    }
}

/// Every pod of the topology (each deployment's replicas in order) with its
/// environment: on the loopback network, or in the pod network when captured.
fn plan_pods(
    topo: &Topology,
    net: Ipv4Addr,
    pod_net: Option<&pod_network::PodNetwork>,
) -> Vec<(Pod, BTreeMap<String, String>)> {
    let mut pods = Vec::new();
    let mut next = 1u8;
    for svc in &topo.spec.services {
        for d in &svc.deployments {
            for i in 0..d.replicas {
                // Captured, a pod is reached on its app's own port.
                let (ip, port) = match pod_net {
                    Some(pn) => (pn.pod_ip(next), APP_PORT),
                    None => (offset(net, next), svc.target_port),
                };
                pods.push((
                    Pod {
                        name: format!("{}-{i}", d.name),
                        service: svc.name.clone(),
                        deployment: d.name.clone(),
                        ip,
                        port,
                        zone: d.zone.clone(),
                        annotations: d.annotations.clone(),
                        labels: d.labels.clone(),
                    },
                    d.env.clone(),
                ));
                next += 1;
            }
        }
    }
    pods
}

/// Writes a file by renaming a temporary one, so that the control plane
/// never reads half a file.
pub fn write_atomic(path: &Path, text: &str) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| anyhow!("{} has no directory", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}
/// `minimesh up`.
pub async fn up(home: PathBuf, args: UpArgs) -> anyhow::Result<()> {
    println!("starting mesh from {} ...", args.topology.display());
    let mut mesh = Mesh::start(&home, &args).await?;
    print_summary(&mesh.state);
    // One signal watch for the whole run: a SIGTERM that arrives while the
    // mesh is being supervised is kept for the next turn, not lost.
    let stop = minimesh_control_plane::shutdown_signal();
    tokio::pin!(stop);
    let result = loop {
        tokio::select! {
            _ = &mut stop => break Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                match mesh.supervise().await {
                    Ok(said) => said.iter().for_each(|l| println!("{l}")),
                    Err(e) => break Err(e),
                }
            }
        }
    };
    println!("stopping mesh ...");
    mesh.stop().await;
    result
}

/// Sends `signal` to `pid` (the process `name`) with kill(1).
pub fn send_signal(pid: u32, signal: &str, name: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .context("running kill")?;
    if !status.success() {
        bail!("kill -s {signal} {pid} ({name}) failed: {status}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ingress_inside_the_topology_network_moves_with_it() {
        let (from, to) = (Ipv4Addr::new(127, 0, 9, 0), Ipv4Addr::new(127, 0, 38, 0));
        let moved_to = |a: &str| moved(a.parse().expect("address"), from, to).to_string();
        assert_eq!(moved_to("127.0.9.252:30000"), "127.0.38.252:30000");
        // The demo's ingress is outside its network (127.0.1.0) and stays.
        assert_eq!(moved_to("127.0.0.1:30000"), "127.0.0.1:30000");
        assert_eq!(moved_to("[::1]:30000"), "[::1]:30000");
    }

    #[test]
    fn the_last_line_of_a_log_says_why_a_process_stopped() {
        let dir = std::env::temp_dir().join(format!("minimesh-last-line-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let log = dir.join("x.log");
        let mut text = "noise\n".repeat(2000);
        text.push_str("sidecar: binding outbound address 127.0.0.1:30000: in use\n\n");
        std::fs::write(&log, text).expect("write");
        assert_eq!(
            last_line(&log).as_deref(),
            Some("sidecar: binding outbound address 127.0.0.1:30000: in use")
        );
        assert_eq!(last_line(&dir.join("none.log")), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
