//! The `sidecar` binary (also the ingress gateway, with `--mode gateway`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    minimesh_cli::init_tracing();
    let args = minimesh_sidecar::Args::parse();
    // One single-threaded runtime here; more event loops, when asked for,
    // run on threads of their own (see `--worker-threads`).
    minimesh_cli::block_on_threads("sidecar", Some(1), minimesh_sidecar::run(args))
}
