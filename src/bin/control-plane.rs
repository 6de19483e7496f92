//! The `control-plane` binary.

use clap::Parser;

fn main() -> std::process::ExitCode {
    minimesh_cli::init_tracing();
    let args = minimesh_control_plane::Args::parse();
    minimesh_cli::block_on("control-plane", minimesh_control_plane::run(args))
}
