//! Compiles the wire protocol with protox (a pure-Rust protobuf compiler), so
//! that building minimesh needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/minimesh/v1/discovery.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::Codec")
        .compile_fds(fds)?;
    Ok(())
}
