//! Interop: gRPC's C core (grpcio, installed from PyPI into
//! target/python-deps when missing) against the control plane's own HTTP/2
//! server: a state-of-the-world stream with ACKs, a response several
//! flow-control windows long, and an unknown service
//! (tests/interop/grpcio_client.py).

use std::net::Ipv4Addr;
use std::path::Path;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_c_core_gets_config_through_the_control_planes_http2_server() {
    let net = Net::new(98);
    // 3,000 endpoints: their assignment (about 100 KB) takes six of the
    // 16 KiB stream windows the client allows, so the server must act on the
    // client's WINDOW_UPDATEs (ignoring them fails this test on its 30 s
    // deadline).
    let endpoints: Vec<(Ipv4Addr, String)> = (0..3000u32)
        .map(|i| {
            let ip = Ipv4Addr::new(10, 98, (i / 250) as u8, (i % 250 + 1) as u8);
            (ip, format!("big-{i}"))
        })
        .collect();
    net.write("svc-big.yaml", &service_yaml("big", &endpoints));
    let _cp = net.control_plane().await;

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/grpcio_client.py");
    let (xds, admin) = (net.cp_xds().to_string(), net.cp_admin().to_string());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .args([xds, admin])
            .output()
    })
    .await
    .expect("join")
    .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the grpcio client failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout,
        "clusters: 1\n\
         endpoints: 3000 in more than one window\n\
         connected streams: 1\n\
         unknown service: UNIMPLEMENTED no service serves /minimesh.v1.Nope/Call\n"
    );

    // The client has gone: so has its stream.
    connected_becomes(&net, 0).await;
}
