//! The `sidecar` binary (also the ingress gateway, with `--mode gateway`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    minimesh_cli::init_tracing();
    let args = minimesh_sidecar::Args::parse();
    let threads = match (args.worker_threads, args.mode.as_str()) {
        (Some(0), _) | (None, "gateway") => None, // one per core
        (Some(n), _) => Some(n),
        (None, _) => Some(1),
    };
    minimesh_cli::block_on_threads("sidecar", threads, minimesh_sidecar::run(args))
}
