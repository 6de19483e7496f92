//! The `fake-service` demo app (simple-web / simple-backend), configured by
//! environment variables like nicholasjackson/fake-service.

fn main() -> std::process::ExitCode {
    minimesh_cli::init_tracing();
    match fake_service::Config::from_env() {
        Ok(config) => minimesh_cli::block_on("fake-service", fake_service::run(config)),
        Err(e) => {
            eprintln!("fake-service: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
