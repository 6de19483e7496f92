//! The `sidecar` binary (also the ingress gateway, with `--mode gateway`).

use clap::Parser;

fn main() -> std::process::ExitCode {
    minimesh_cli::init_tracing();
    let args = minimesh_sidecar::Args::parse();
    minimesh_cli::block_on("sidecar", minimesh_sidecar::run(args))
}
