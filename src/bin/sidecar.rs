//! The `sidecar` binary (also the ingress gateway, with `--mode gateway`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    minimesh_cli::init_tracing();
    let args = minimesh_sidecar::Args::parse();
    let threads = args.worker_threads;
    minimesh_cli::block_on_threads("sidecar", threads, minimesh_sidecar::run(args))
}
