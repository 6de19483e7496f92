//! The `minimesh` command: `up` (a local mesh of processes from a topology
//! file), `apply`, `get`, and `demo`. Also the small runtime helpers every
//! minimesh binary shares (logging setup, the Tokio runtime).

pub mod apply;
pub mod bench;
pub mod delete;
pub mod demo;
pub mod get;
pub mod http;
pub mod kill;
pub mod load;
pub mod mesh;
pub mod top;
pub mod topology;

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Logs to stderr; `RUST_LOG` sets the level (default `info`).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs `fut` on a multi-threaded runtime; prints `name: error` and exits 1 on failure.
pub fn block_on(name: &str, fut: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    block_on_threads(name, None, fut)
}

/// The same with `threads` worker threads (None or 0: one per core). One thread
/// runs everything on the calling thread (tokio's current-thread
/// scheduler): no work stealing and no cross-thread wake-ups, the cheapest
/// per request when one core is enough.
pub fn block_on_threads(
    name: &str,
    threads: Option<usize>,
    fut: impl Future<Output = anyhow::Result<()>>,
) -> ExitCode {
    exit_with_parent(name);
    let mut builder = match threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) if n > 1 => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// When started by `minimesh up` (which sets [`mesh::PARENT_PID_ENV`]),
/// exits as soon as that parent is gone: the parent cannot clean up after a
/// SIGKILL, so each child watches for it.
fn exit_with_parent(name: &str) {
    let Some(parent) = std::env::var(mesh::PARENT_PID_ENV)
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
    else {
        return;
    };
    let name = name.to_string();
    std::thread::spawn(move || loop {
        if std::os::unix::process::parent_id() != parent {
            eprintln!("{name}: parent process {parent} is gone; exiting");
            std::process::exit(1);
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    });
}

/// `minimesh` flags.
#[derive(Debug, Parser)]
#[command(
    name = "minimesh",
    version,
    about = "minimesh: a small, fast service mesh"
)]
pub struct Cli {
    /// State directory of the local mesh (config files, logs, mesh.json).
    #[arg(
        long,
        global = true,
        env = "MINIMESH_HOME",
        default_value = ".minimesh"
    )]
    pub home: PathBuf,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a local mesh (control plane, apps, sidecars, ingress) and run until Ctrl-C.
    Up(mesh::UpArgs),
    /// Validate rule files and put them into the running mesh.
    Apply(apply::ApplyArgs),
    /// Remove what `apply` put into the running mesh (by file, or kind and name).
    Delete(delete::DeleteArgs),
    /// Show rules, endpoints or proxies of the running mesh.
    Get(get::GetArgs),
    /// Kill (or hang) a pod or process of the running mesh, to watch the mesh route around it.
    Kill(kill::KillArgs),
    /// Live load per service and endpoint, as every sidecar reports it.
    Top(top::TopArgs),
    /// Bring the demo mesh up, try each example policy under load, print the results, stop.
    Demo(demo::DemoArgs),
    /// Run a load-balancing experiment (a scenario file) for every policy it lists.
    Bench(bench::BenchArgs),
    /// Print a CustomResourceDefinition (YAML) to install on Kubernetes, generated from the Rust types.
    Crds {
        /// Which: `destinationrules`, `peerauthentications`, `virtualservices` or `authorizationpolicies`.
        #[arg(default_value = "destinationrules", value_parser = ["destinationrules", "peerauthentications", "virtualservices", "authorizationpolicies"])]
        kind: String,
    },
}

/// Entry point of the `minimesh` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(
        cli.command,
        Command::Apply(_)
            | Command::Delete(_)
            | Command::Get(_)
            | Command::Top(_)
            | Command::Kill(_)
            | Command::Crds { .. }
    ) {
        init_tracing_quiet();
    }
    let home = cli.home;
    match cli.command {
        Command::Up(a) => block_on("minimesh up", mesh::up(home, a)),
        Command::Apply(a) => block_on("minimesh apply", apply::run(home, a)),
        Command::Delete(a) => block_on("minimesh delete", delete::run(home, a)),
        Command::Get(a) => block_on("minimesh get", get::run(home, a)),
        Command::Demo(a) => block_on("minimesh demo", demo::run(home, a)),
        Command::Top(a) => block_on("minimesh top", top::run(home, a)),
        Command::Bench(a) => block_on("minimesh bench", bench::run(home, a)),
        Command::Kill(a) => match kill::run(home, a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("minimesh kill: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Crds { kind } => {
            let crds = minimesh_control_plane::config::crd::crds();
            if let Some((_, _, yaml)) = crds.iter().find(|(k, _, _)| *k == kind) {
                print!("{yaml}");
            }
            ExitCode::SUCCESS
        }
    }
}

/// The CLI prints its own progress; logs only warnings unless RUST_LOG says otherwise.
fn init_tracing_quiet() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
