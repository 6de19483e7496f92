//! The mesh's processes: starting each with what it needs, noticing one that
//! exits (and starting it again after `--restart-after`), signals, and
//! stopping them all.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, Context};
use tokio::process::{Child, Command};

use super::{last_line, send_signal, Mesh, Process, PARENT_PID_ENV};
use crate::http;

/// How long [`Mesh::stop`] waits after SIGTERM before SIGKILL: a sidecar's
/// default drain (`--drain`, 5 s) and a second to exit.
pub const STOP_GRACE: Duration = Duration::from_secs(6);

impl Mesh {
    pub(super) fn spawn(&mut self, name: &str, cmd: &mut Command) -> anyhow::Result<()> {
        self.spawn_as(name, cmd, None)
    }

    /// Starts `cmd` as [`Mesh::spawn`] does, in group `gid` when given (and
    /// again in it when it is started again).
    pub(super) fn spawn_as(
        &mut self,
        name: &str,
        cmd: &mut Command,
        gid: Option<u32>,
    ) -> anyhow::Result<()> {
        if let Some(g) = gid {
            cmd.gid(g);
        }
        let std = cmd.as_std();
        let program = std.get_program().to_owned();
        let args = std.get_args().map(|a| a.to_owned()).collect();
        let env = std
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        let child = self.start_process(name, cmd, false)?;
        self.children.push(Process {
            name: name.to_string(),
            program,
            args,
            env,
            gid,
            child,
            exited: None,
        });
        Ok(())
    }

    /// Starts `cmd` as the process `name`, its output to its log (appended
    /// to when it is started again).
    pub(super) fn start_process(
        &mut self,
        name: &str,
        cmd: &mut Command,
        again: bool,
    ) -> anyhow::Result<Child> {
        let log_path = self.home.join("logs").join(format!("{name}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(again)
            .truncate(!again)
            .open(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let err = log.try_clone()?;
        let child = cmd
            .env(PARENT_PID_ENV, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        if let Some(pid) = child.id() {
            self.state.pids.insert(name.to_string(), pid);
        }
        Ok(child)
    }

    /// A process that exited, with its status and the last line of its log
    /// (where a process says why it stops), if any did.
    pub fn exited(&mut self) -> Option<String> {
        for p in &mut self.children {
            if let Ok(Some(status)) = p.child.try_wait() {
                let log = self.home.join("logs").join(format!("{}.log", p.name));
                let last = last_line(&log).map_or(String::new(), |l| format!(": {l}"));
                return Some(format!(
                    "{} exited ({status}){last}; see {}",
                    p.name,
                    log.display()
                ));
            }
        }
        None
    }

    /// Plays the kubelet and the endpoint controller, once: a process that
    /// exited is reported and its pod's endpoint published as not ready; it
    /// is started again after the restart delay; a pod whose processes all
    /// run and pass their checks is published as ready again. Returns what
    /// happened, a line each.
    pub async fn supervise(&mut self) -> anyhow::Result<Vec<String>> {
        let mut said = Vec::new();
        let mut changed = BTreeSet::new();
        let mut restarted = false;
        let now = tokio::time::Instant::now();
        let delay = self.state.restart_after_ms.map(Duration::from_millis);
        for i in 0..self.children.len() {
            let p = &mut self.children[i];
            let pod = p.name.rsplit_once('.').map(|(pod, _)| pod.to_string());
            match p.exited {
                None => {
                    let Ok(Some(status)) = p.child.try_wait() else {
                        continue;
                    };
                    p.exited = Some(now);
                    let then = match delay {
                        Some(d) => format!("starting it again in {d:?}"),
                        None => "not starting it again (--restart-after never)".to_string(),
                    };
                    let mut line = format!("{} exited ({status}); {then}", p.name);
                    if let Some(pod) = pod {
                        if let Some(svc) = self.state.pods.iter().find(|q| q.name == pod) {
                            let _ = write!(
                                line,
                                "; endpoint {}:{} of {} not ready",
                                svc.ip, svc.port, svc.service
                            );
                            changed.insert(svc.service.clone());
                            self.not_ready.insert(pod);
                        }
                    }
                    said.push(line);
                }
                Some(at) if delay.is_some_and(|d| now.duration_since(at) >= d) => {
                    let mut cmd = Command::new(&p.program);
                    cmd.args(&p.args).envs(p.env.iter().map(|(k, v)| (k, v)));
                    if let Some(g) = p.gid {
                        cmd.gid(g);
                    }
                    let name = p.name.clone();
                    let child = self.start_process(&name, &mut cmd, true)?;
                    let pid = child.id().unwrap_or_default();
                    let p = &mut self.children[i];
                    p.child = child;
                    p.exited = None;
                    restarted = true;
                    said.push(format!("{name} started again (pid {pid})"));
                }
                Some(_) => {}
            }
        }
        // Ready again once every process of the pod runs and passes its check.
        let waiting: Vec<String> = self.not_ready.iter().cloned().collect();
        for pod in waiting {
            let running = self
                .children
                .iter()
                .filter(|p| p.name.rsplit_once('.').is_some_and(|(q, _)| q == pod))
                .all(|p| p.exited.is_none());
            let Some(p) = self.state.pods.iter().find(|p| p.name == pod).cloned() else {
                continue;
            };
            if running
                && self.app_ready(&p).await
                && matches!(
                    http::get(&p.admin().to_string(), "/ready").await,
                    Ok((200, _))
                )
            {
                self.not_ready.remove(&pod);
                changed.insert(p.service.clone());
                said.push(format!(
                    "{pod} is ready: endpoint {}:{} of {} ready again",
                    p.ip, p.port, p.service
                ));
            }
        }
        for name in changed {
            if let Some((_, port, target)) =
                self.services.iter().find(|(n, _, _)| *n == name).cloned()
            {
                self.write_service(&name, port, target, true)?;
            }
        }
        if restarted {
            self.write_state()?;
        }
        Ok(said)
    }

    /// Sends `signal` (`KILL`, `STOP`, `CONT`, …) to the process `name`
    /// (`<pod>.app`, `<pod>.sidecar`, `control-plane`, `ingress-gateway`).
    pub fn signal(&self, name: &str, signal: &str) -> anyhow::Result<()> {
        let p = self
            .children
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| anyhow!("no process {name} in the mesh"))?;
        let pid = p
            .child
            .id()
            .ok_or_else(|| anyhow!("{name} has already exited"))?;
        send_signal(pid, signal, name)
    }

    /// The process id of `name`, while it runs.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.children
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.child.id())
    }

    /// Stops every process as Kubernetes stops a pod: SIGTERM (and SIGCONT,
    /// for one a test has stopped), so that each shuts down cleanly (a
    /// sidecar drains its requests in flight; a build instrumented for
    /// `scripts/pgo-build.sh` writes its profile), then SIGKILL for any still
    /// running after [`STOP_GRACE`].
    pub async fn stop(mut self) {
        for p in &self.children {
            if let Some(pid) = p.child.id() {
                let _ = send_signal(pid, "TERM", &p.name);
                let _ = send_signal(pid, "CONT", &p.name);
            }
        }
        let exited = async {
            for p in &mut self.children {
                let _ = p.child.wait().await;
            }
        };
        if tokio::time::timeout(STOP_GRACE, exited).await.is_err() {
            for p in &mut self.children {
                let _ = p.child.start_kill();
            }
            for p in &mut self.children {
                let _ = p.child.wait().await;
            }
        }
        let _ = std::fs::remove_file(self.home.join("mesh.json"));
    }
}
