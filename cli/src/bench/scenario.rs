//! Scenario files (`kind: BenchScenario`): the mesh to start, the load to
//! drive through it, the failures to inject and the policies to compare.
//! Every field is checked when the file is read, and an error names the file,
//! the field and the reason.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde::Deserialize;

use crate::topology::{Metadata, Topology};

/// A scenario document.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScenarioFile {
    /// `minimesh.io/v1alpha1`.
    pub api_version: String,
    /// `BenchScenario`.
    pub kind: String,
    /// Name of the scenario (the report's title and directory).
    pub metadata: Metadata,
    /// What to run.
    pub spec: Spec,
}

/// `spec` of a scenario.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    /// One line on what it reproduces.
    #[serde(default)]
    pub description: String,
    /// The mesh (`kind: LocalMesh`), relative to the scenario file.
    pub topology: PathBuf,
    /// The service whose balancing is compared: rules are applied to it and
    /// its endpoints are reported.
    pub service: String,
    /// Host header of every request (default: the ingress's default service).
    #[serde(default)]
    pub host: Option<String>,
    /// Request path (default `/`).
    #[serde(default = "default_path")]
    pub path: String,
    /// The load.
    pub load: Load,
    /// Failures injected during each run.
    #[serde(default)]
    pub events: Vec<Event>,
    /// The policies compared, each a DestinationRule `trafficPolicy`.
    pub policies: Vec<PolicyDef>,
    /// nginx and HAProxy configured the same way, run when installed.
    #[serde(default)]
    pub peers: Vec<PeerDef>,
}

/// A peer proxy balancing over the compared service's apps directly.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PeerDef {
    /// Its name in the tables.
    pub name: String,
    /// nginx `upstream` directives, e.g. `least_conn;` (empty: round robin).
    #[serde(default)]
    pub nginx: Option<String>,
    /// HAProxy `backend` lines, e.g. `balance leastconn`.
    #[serde(default)]
    pub haproxy: Option<String>,
    /// Server weights by pod name or prefix (`s1-*`); others weigh 1.
    #[serde(default)]
    pub weights: Vec<PodWeight>,
    /// Also retry a 500, 502, 503 or 504 response on another server, as a
    /// rule's `retryOn: 5xx` does (nginx `proxy_next_upstream … http_500
    /// http_502 http_503 http_504`, which also counts them towards
    /// `max_fails`; HAProxy `retry-on … 500 502 503 504`). Default: only
    /// connection errors and timeouts.
    #[serde(default)]
    pub retry_5xx: bool,
}

/// A weight for the pods a pattern matches.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodWeight {
    /// Pod name, or a prefix ending in `*`.
    pub pod: String,
    /// Weight, 1 to 256 (HAProxy's range).
    pub weight: u32,
}

/// A peer run, resolved.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Name.
    pub name: String,
    /// nginx or HAProxy.
    pub kind: super::peers::Kind,
    /// Its balancing directives.
    pub directives: String,
    /// (pattern, weight).
    pub weights: Vec<(String, u32)>,
    /// Retry 5xx responses on another server.
    pub retry_5xx: bool,
}

impl Peer {
    /// The weight of `pod`: the first pattern that matches, else 1.
    pub fn weight_of(&self, pod: &str) -> u32 {
        self.weights
            .iter()
            .find(|(p, _)| match p.strip_suffix('*') {
                Some(prefix) => pod.starts_with(prefix),
                None => pod == p,
            })
            .map_or(1, |(_, w)| *w)
    }
}

fn default_path() -> String {
    "/".into()
}

/// The load: k6-like virtual users or a fortio-like fixed rate.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Load {
    /// k6's ramping-vus executor.
    #[serde(default)]
    pub virtual_users: Option<VirtualUsers>,
    /// fortio's `load -c N -qps R -t D [-jitter]`.
    #[serde(default)]
    pub fixed_rate: Option<FixedRate>,
}

/// Virtual users in stages, each looping request, think time.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VirtualUsers {
    /// Users at the start (k6's `startVUs`, default 0).
    #[serde(default)]
    pub start: u32,
    /// Each stage ramps linearly to `target` users over `duration`.
    pub stages: Vec<Stage>,
    /// Pause after each response (k6's `sleep()`), e.g. `100ms`.
    #[serde(default)]
    pub think_time: Option<String>,
    /// Open a new TCP connection for every request (default: keep-alive).
    #[serde(default)]
    pub new_connection_per_request: bool,
    /// Request timeout (default 10s).
    #[serde(default)]
    pub timeout: Option<String>,
}

/// One k6 stage.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Stage {
    /// How long, e.g. `30s`.
    pub duration: String,
    /// Users at its end.
    pub target: u32,
}

/// A fixed request rate over N connections.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FixedRate {
    /// Requests per second, in total.
    pub qps: f64,
    /// Connections, each with at most one request in flight.
    pub connections: u32,
    /// How long, e.g. `60s`.
    pub duration: String,
    /// ±10% on each interval, as fortio's `-jitter`.
    #[serde(default)]
    pub jitter: bool,
    /// Request timeout (default 10s).
    #[serde(default)]
    pub timeout: Option<String>,
}

/// A failure injected at a time into the run.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Event {
    /// When, from the start of the load, e.g. `60s` (scaled with `--scale`).
    pub at: String,
    /// `kill` (SIGKILL the app and its sidecar), `stop` (SIGSTOP the app: it
    /// hangs), `cont` (SIGCONT: it resumes), `errors` (the app answers every
    /// request at once with its `ERROR_CODE`, default 500, its health path
    /// still green: fake-service's SIGUSR1), `recover` (it serves again:
    /// SIGUSR2).
    pub action: String,
    /// The pod (`<deployment>-<i>`).
    pub pod: String,
}

/// One policy to compare.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicyDef {
    /// Its name in the tables.
    pub name: String,
    /// The DestinationRule `spec.trafficPolicy` applied to the service.
    pub traffic_policy: serde_json::Value,
}

/// What a virtual-user or fixed-rate run does, durations resolved and scaled.
#[derive(Debug, Clone)]
pub enum Shape {
    /// k6-like.
    Users {
        /// Users at the start.
        start: u32,
        /// (duration, target) of each stage.
        stages: Vec<(Duration, u32)>,
        /// Think time.
        think: Duration,
        /// New connection per request.
        new_connection: bool,
    },
    /// fortio-like.
    Rate {
        /// Requests per second.
        qps: f64,
        /// Connections.
        connections: u32,
        /// Jitter.
        jitter: bool,
    },
}

/// An injected failure, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL.
    Kill,
    /// SIGSTOP.
    Stop,
    /// SIGCONT.
    Cont,
    /// SIGUSR1: fake-service fails every request.
    Errors,
    /// SIGUSR2: fake-service serves again.
    Recover,
}

impl Action {
    /// Its name in the scenario and the report.
    pub fn as_str(&self) -> &'static str {
        match self {
            Action::Kill => "kill",
            Action::Stop => "stop",
            Action::Cont => "cont",
            Action::Errors => "errors",
            Action::Recover => "recover",
        }
    }
}

/// A scenario ready to run.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Name.
    pub name: String,
    /// Description.
    pub description: String,
    /// The scenario file.
    pub file: PathBuf,
    /// The topology file, resolved.
    pub topology: PathBuf,
    /// The topology, read.
    pub mesh: Topology,
    /// Service compared.
    pub service: String,
    /// Host header.
    pub host: String,
    /// Path.
    pub path: String,
    /// Load shape.
    pub shape: Shape,
    /// Length of the load.
    pub duration: Duration,
    /// Request timeout.
    pub timeout: Duration,
    /// (at, action, pod).
    pub events: Vec<(Duration, Action, String)>,
    /// Policies: (name, rule YAML for the service).
    pub policies: Vec<(String, String)>,
    /// Peer runs.
    pub peers: Vec<Peer>,
}

/// Most virtual users or connections a scenario may ask for.
pub const MAX_USERS: u32 = 5000;
/// Longest a scenario may run, per policy.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);

impl Scenario {
    /// Reads and checks a scenario; `scale` multiplies every stage, duration
    /// and event time.
    pub fn load(path: &Path, scale: f64) -> anyhow::Result<Scenario> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let f: ScenarioFile =
            serde_saphyr::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let err = |field: &str, reason: String| anyhow!("{}: {field}: {reason}", path.display());
        if f.kind != "BenchScenario" {
            return Err(err("kind", format!("{:?} is not BenchScenario", f.kind)));
        }
        if !(scale.is_finite() && scale > 0.0 && scale <= 10.0) {
            bail!("--scale {scale} must be above 0 and at most 10");
        }
        let dur =
            |field: &str, v: &str| minimesh_control_plane::duration(v).map_err(|r| err(field, r));
        let base = path.parent().unwrap_or(Path::new("."));
        let topology = base.join(&f.spec.topology);
        let mesh = Topology::load(&topology).map_err(|e| err("spec.topology", format!("{e:#}")))?;
        let ns = mesh.spec.namespace.clone();
        let Some(svc) = mesh.spec.services.iter().find(|s| s.name == f.spec.service) else {
            return Err(err(
                "spec.service",
                format!(
                    "{:?} is not a service of {}",
                    f.spec.service,
                    topology.display()
                ),
            ));
        };
        let pods: Vec<String> = mesh
            .spec
            .services
            .iter()
            .flat_map(|s| &s.deployments)
            .flat_map(|d| (0..d.replicas).map(move |i| format!("{}-{i}", d.name)))
            .collect();
        if mesh.spec.ingress.is_none() {
            return Err(err(
                "spec.topology",
                format!("{} has no ingress to send the load to", topology.display()),
            ));
        }
        let host = f
            .spec
            .host
            .clone()
            .or_else(|| {
                mesh.spec
                    .ingress
                    .as_ref()
                    .and_then(|i| i.default_service.clone())
            })
            .unwrap_or_else(|| svc.name.clone());
        let l = &f.spec.load;
        let (shape, duration, timeout) = match (&l.virtual_users, &l.fixed_rate) {
            (Some(vu), None) => {
                const F: &str = "spec.load.virtualUsers";
                if vu.stages.is_empty() {
                    return Err(err(
                        &format!("{F}.stages"),
                        "needs at least one stage".into(),
                    ));
                }
                let mut stages = Vec::new();
                for (i, s) in vu.stages.iter().enumerate() {
                    let d = dur(&format!("{F}.stages[{i}].duration"), &s.duration)?;
                    if s.target > MAX_USERS {
                        return Err(err(
                            &format!("{F}.stages[{i}].target"),
                            format!("{} is more than {MAX_USERS}", s.target),
                        ));
                    }
                    stages.push((d.mul_f64(scale), s.target));
                }
                if vu.start > MAX_USERS {
                    return Err(err(
                        &format!("{F}.start"),
                        format!("{} is more than {MAX_USERS}", vu.start),
                    ));
                }
                let think = match &vu.think_time {
                    Some(t) => dur(&format!("{F}.thinkTime"), t)?,
                    None => Duration::ZERO,
                };
                let timeout = match &vu.timeout {
                    Some(t) => dur(&format!("{F}.timeout"), t)?,
                    None => Duration::from_secs(10),
                };
                let total = stages.iter().map(|(d, _)| *d).sum();
                (
                    Shape::Users {
                        start: vu.start,
                        stages,
                        think,
                        new_connection: vu.new_connection_per_request,
                    },
                    total,
                    timeout,
                )
            }
            (None, Some(fr)) => {
                const F: &str = "spec.load.fixedRate";
                if !(fr.qps.is_finite() && fr.qps > 0.0 && fr.qps <= 1_000_000.0) {
                    return Err(err(
                        &format!("{F}.qps"),
                        format!("{} must be above 0 and at most 1000000", fr.qps),
                    ));
                }
                if fr.connections == 0 || fr.connections > MAX_USERS {
                    return Err(err(
                        &format!("{F}.connections"),
                        format!("{} must be between 1 and {MAX_USERS}", fr.connections),
                    ));
                }
                let d = dur(&format!("{F}.duration"), &fr.duration)?;
                let timeout = match &fr.timeout {
                    Some(t) => dur(&format!("{F}.timeout"), t)?,
                    None => Duration::from_secs(10),
                };
                (
                    Shape::Rate {
                        qps: fr.qps,
                        connections: fr.connections,
                        jitter: fr.jitter,
                    },
                    d.mul_f64(scale),
                    timeout,
                )
            }
            _ => {
                return Err(err(
                    "spec.load",
                    "set exactly one of virtualUsers and fixedRate".into(),
                ))
            }
        };
        if duration.is_zero() || duration > MAX_DURATION {
            return Err(err(
                "spec.load",
                format!("lasts {duration:?}: must be above 0 and at most 1h"),
            ));
        }
        let mut events = Vec::new();
        for (i, e) in f.spec.events.iter().enumerate() {
            let at = dur(&format!("spec.events[{i}].at"), &e.at)?.mul_f64(scale);
            let action = match e.action.as_str() {
                "kill" => Action::Kill,
                "stop" => Action::Stop,
                "cont" => Action::Cont,
                "errors" => Action::Errors,
                "recover" => Action::Recover,
                other => {
                    return Err(err(
                        &format!("spec.events[{i}].action"),
                        format!(
                            "unknown action {other:?} (known: kill, stop, cont, errors, recover)"
                        ),
                    ))
                }
            };
            if !pods.contains(&e.pod) {
                return Err(err(
                    &format!("spec.events[{i}].pod"),
                    format!(
                        "{:?} is not a pod of {} (pods: {})",
                        e.pod,
                        topology.display(),
                        pods.join(", ")
                    ),
                ));
            }
            if at >= duration {
                return Err(err(
                    &format!("spec.events[{i}].at"),
                    format!("{} is not within the load's {duration:?}", e.at),
                ));
            }
            events.push((at, action, e.pod.clone()));
        }
        if f.spec.policies.is_empty() {
            return Err(err("spec.policies", "needs at least one policy".into()));
        }
        let mut policies = Vec::new();
        for (i, p) in f.spec.policies.iter().enumerate() {
            if policies.iter().any(|(n, _)| n == &p.name) {
                return Err(err(
                    &format!("spec.policies[{i}].name"),
                    format!("{:?} appears twice", p.name),
                ));
            }
            let rule = serde_json::json!({
                "apiVersion": "minimesh.io/v1alpha1",
                "kind": "DestinationRule",
                "metadata": {"name": format!("{}-bench", f.spec.service), "namespace": ns},
                "spec": {"host": f.spec.service, "trafficPolicy": p.traffic_policy},
            });
            let text = serde_json::to_string_pretty(&rule)?;
            let label = format!("{} spec.policies[{i}] ({})", path.display(), p.name);
            crate::apply::validate_text(Path::new(&label), &text, &ns)?;
            policies.push((p.name.clone(), text));
        }
        let mut peers = Vec::new();
        for (i, p) in f.spec.peers.iter().enumerate() {
            let field = format!("spec.peers[{i}]");
            if policies.iter().any(|(n, _)| n == &p.name)
                || peers.iter().any(|q: &Peer| q.name == p.name)
            {
                return Err(err(
                    &format!("{field}.name"),
                    format!("{:?} appears twice", p.name),
                ));
            }
            let (kind, directives) = match (&p.nginx, &p.haproxy) {
                (Some(n), None) => (super::peers::Kind::Nginx, n.clone()),
                (None, Some(h)) => (super::peers::Kind::Haproxy, h.clone()),
                _ => return Err(err(&field, "set exactly one of nginx and haproxy".into())),
            };
            let behind_ingress = mesh
                .spec
                .ingress
                .as_ref()
                .is_some_and(|i| i.default_service.as_deref() == Some(f.spec.service.as_str()));
            if !behind_ingress {
                return Err(err(
                    &field,
                    format!("peers replace the ingress's balancing, so {} must be the ingress's defaultService", f.spec.service),
                ));
            }
            let mut weights = Vec::new();
            for (j, w) in p.weights.iter().enumerate() {
                if !(1..=256).contains(&w.weight) {
                    return Err(err(
                        &format!("{field}.weights[{j}].weight"),
                        format!("{} is not between 1 and 256", w.weight),
                    ));
                }
                weights.push((w.pod.clone(), w.weight));
            }
            peers.push(Peer {
                name: p.name.clone(),
                kind,
                directives,
                weights,
                retry_5xx: p.retry_5xx,
            });
        }
        Ok(Scenario {
            name: f.metadata.name,
            description: f.spec.description,
            file: path.to_path_buf(),
            topology,
            mesh,
            service: f.spec.service,
            host,
            path: f.spec.path,
            shape,
            duration,
            timeout,
            events,
            policies,
            peers,
        })
    }

    /// Users (or connections) at time `t` of the load.
    pub fn users_at(&self, t: Duration) -> u32 {
        match &self.shape {
            Shape::Rate { connections, .. } => *connections,
            Shape::Users { start, stages, .. } => {
                let mut from = *start as f64;
                let mut t0 = Duration::ZERO;
                for (d, target) in stages {
                    if t < t0 + *d {
                        let f = (t - t0).as_secs_f64() / d.as_secs_f64().max(1e-9);
                        return (from + (*target as f64 - from) * f).round() as u32;
                    }
                    t0 += *d;
                    from = *target as f64;
                }
                from as u32
            }
        }
    }

    /// Most users at any time.
    pub fn peak_users(&self) -> u32 {
        match &self.shape {
            Shape::Rate { connections, .. } => *connections,
            Shape::Users { start, stages, .. } => stages.iter().map(|s| s.1).fold(*start, u32::max),
        }
    }
}
