//! `minimesh kill`: a failure, by hand, in the running local mesh. Signals a
//! pod's processes (or one process) as `kill(1)` would; `minimesh up` sees
//! the exit, publishes the pod's endpoint as not ready and starts the
//! process again after its `--restart-after`, as a kubelet would.

use std::path::PathBuf;

use anyhow::bail;

use crate::mesh::{send_signal, MeshState};

/// `minimesh kill` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct KillArgs {
    /// A pod (`simple-backend-1-0`: its app and its sidecar), or one process:
    /// `<pod>.app`, `<pod>.sidecar`, `control-plane`, `ingress-gateway`.
    pub target: String,
    /// Only the pod's app: its sidecar stays up and answers for it (the app
    /// crashed inside a running pod).
    #[arg(long)]
    pub app: bool,
    /// KILL (die at once), TERM (shut down gracefully: a sidecar drains),
    /// STOP (hang: connections are accepted, nothing is answered), CONT
    /// (resume after STOP), or, to an app only, USR1 (the demo app fails
    /// every request at once with its ERROR_CODE, 500 by default, its health
    /// check still green: a replica whose database went away) and USR2 (it
    /// serves again).
    #[arg(long, short, default_value = "KILL", value_parser = ["KILL", "TERM", "STOP", "CONT", "USR1", "USR2"])]
    pub signal: String,
}

/// `minimesh kill`.
pub fn run(home: PathBuf, args: KillArgs) -> anyhow::Result<()> {
    let state = MeshState::load(&home)?;
    if !running_child_of(state.pid, 0) {
        bail!(
            "the mesh in {} is not running (minimesh up, pid {}, is gone): start one with `minimesh up`",
            home.display(),
            state.pid
        );
    }
    let target = args.target.as_str();
    let names = if state.pods.iter().any(|p| p.name == target) {
        if args.app {
            vec![format!("{target}.app")]
        } else {
            vec![format!("{target}.app"), format!("{target}.sidecar")]
        }
    } else if state.pids.contains_key(target) {
        if args.app {
            bail!("--app takes a pod name; {target} is a process");
        }
        vec![target.to_string()]
    } else {
        let pods: Vec<&str> = state.pods.iter().map(|p| p.name.as_str()).collect();
        bail!(
            "no pod or process {target} in mesh {}: pods are {}; processes are control-plane{}, and <pod>.app, <pod>.sidecar",
            state.name,
            pods.join(", "),
            if state.ingress.is_some() { ", ingress-gateway" } else { "" }
        );
    };
    if args.signal.starts_with("USR") && !names.iter().all(|n| n.ends_with(".app")) {
        bail!(
            "--signal {} goes to an app (add --app, or name <pod>.app): a sidecar, the control plane or the gateway would exit on it",
            args.signal
        );
    }
    for name in &names {
        let pid = state.pids.get(name).copied().unwrap_or_default();
        if !running_child_of(pid, state.pid) {
            let again = match state.restart_after_ms {
                Some(ms) => format!(
                    "minimesh up starts it again {}s after it exited",
                    ms as f64 / 1000.0
                ),
                None => "minimesh up leaves it down (--restart-after never)".to_string(),
            };
            bail!("{name} is not running: it exited; {again}");
        }
        send_signal(pid, &args.signal, name)?;
        println!("sent SIG{} to {name} (pid {pid})", args.signal);
    }
    let again = if args.app {
        format!("{target} --app")
    } else {
        target.to_string()
    };
    match (args.signal.as_str(), state.restart_after_ms) {
        ("STOP", _) => println!("it hangs until `minimesh kill {again} --signal CONT`"),
        ("CONT", _) => {}
        ("USR1", _) => println!(
            "it answers every request with its ERROR_CODE until `minimesh kill {again} --signal USR2`; callers eject it after 5 consecutive 5xx other than 503 (unless their rule counts 503s)"
        ),
        ("USR2", _) => println!("it serves again; callers send it requests once its ejection ends"),
        (_, Some(ms)) => println!(
            "minimesh up publishes its endpoint as not ready, starts it again after {}s, and ready once it passes its checks",
            ms as f64 / 1000.0
        ),
        (_, None) => println!(
            "minimesh up publishes its endpoint as not ready and leaves it down (--restart-after never)"
        ),
    }
    Ok(())
}

/// True when `pid` is a live process whose parent is `parent` (0: any).
/// A process `minimesh up` started is its child; a pid that outlived its
/// process and was reused is not.
fn running_child_of(pid: u32, parent: u32) -> bool {
    if pid == 0 {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // pid (comm) state ppid …; comm may hold spaces and parentheses.
    let Some((_, rest)) = stat.rsplit_once(") ") else {
        return false;
    };
    let mut fields = rest.split(' ');
    let state = fields.next().unwrap_or("");
    let ppid: u32 = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    state != "Z" && (parent == 0 || ppid == parent)
}
