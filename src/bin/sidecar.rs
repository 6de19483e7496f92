//! The `sidecar` binary (also the ingress gateway, with `--mode gateway`).
//! `sidecar init-capture` is the pod's capture init step (docs/capture.md).

use clap::Parser;

fn main() -> std::process::ExitCode {
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "init-capture")
    {
        let args = minimesh_sidecar::capture::InitArgs::parse_from(std::env::args_os().skip(1));
        return match minimesh_sidecar::capture::init(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("init-capture: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    minimesh_cli::init_tracing();
    let args = minimesh_sidecar::Args::parse();
    // One single-threaded runtime here; more event loops, when asked for,
    // run on threads of their own (see `--worker-threads`).
    minimesh_cli::block_on_threads("sidecar", Some(1), minimesh_sidecar::run(args))
}
