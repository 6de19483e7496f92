//! The `minimesh` command: `up`, `apply`, `get`, `demo`.

fn main() -> std::process::ExitCode {
    minimesh_cli::main()
}
