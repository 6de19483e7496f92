//! Interop with gRPC's C core (grpcio, installed from PyPI into
//! target/python-deps when missing):
//! - against the control plane's discovery port (tonic): a state-of-the-world
//!   stream with ACKs, a response several flow-control windows long, and an
//!   unknown service (tests/interop/grpcio_client.py);
//! - through the mesh: grpcio servers behind sidecars, called by a grpcio
//!   client through its own sidecar (tests/interop/grpc_mesh.py).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::harness::*;

/// A script of tests/interop/.
pub(crate) fn interop(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/interop")
        .join(script)
}

/// Installs grpcio once per test run: the tests run in parallel, and two pip
/// installs into one directory would race.
pub(crate) async fn grpcio() {
    static INSTALLED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            let status = tokio::task::spawn_blocking(|| {
                Command::new("python3")
                    .arg(interop("grpc_mesh.py"))
                    .arg("install")
                    .status()
            })
            .await
            .expect("join")
            .expect("python3 runs");
            assert!(status.success(), "installing grpcio failed");
        })
        .await;
}

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
    grpcio().await;

    let script = interop("grpcio_client.py");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_on_one_connection_are_balanced_per_call_through_the_mesh() {
    let net = Net::new(27);
    grpcio().await;
    // Three grpcio servers (.1-.3:9091), each behind its pod's inbound
    // sidecar (:9090), which speaks to the app in the version the call came
    // in: HTTP/2.
    let mut servers = Vec::new();
    for host in 1..=3u8 {
        let log = net.dir.join("logs").join(format!("greeter-{host}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let child = Command::new("python3")
            .arg(interop("grpc_mesh.py"))
            .args(["server", &format!("greeter-{host}")])
            .arg(net.addr(host, 9091).to_string())
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .expect("python3 runs");
        servers.push(Proc {
            name: format!("greeter-{host}"),
            child,
            log,
        });
    }
    // The Service declares its port gRPC, so callers' sidecars speak
    // HTTP/2 to it; without that they would speak HTTP/1.1, which no gRPC
    // server takes.
    let endpoints: Vec<(Ipv4Addr, String)> = (1..=3)
        .map(|h| (net.ip(h), format!("greeter-{h}")))
        .collect();
    net.write(
        "svc-greeter.yaml",
        &service_yaml("greeter", &endpoints).replacen(
            "  - name: http\n    port: 80\n",
            "  - name: api\n    port: 80\n    appProtocol: grpc\n",
            1,
        ),
    );
    net.rule("dr-greeter.yaml", "greeter", "simple: ROUND_ROBIN");
    let _cp = net.control_plane().await;
    let mut inbound = Vec::new();
    for host in 1..=3u8 {
        let (listen, app) = (net.addr(host, 9090), net.addr(host, 9091));
        inbound.push(
            net.sidecar(
                host,
                &["--inbound", &listen.to_string(), "--app", &app.to_string()],
            )
            .await,
        );
    }
    let _client = net.sidecar(10, &[]).await;
    wait_sidecar(net.addr(10, 15000), Duration::from_secs(10), |v| {
        policy_of(v, "greeter") == "ROUND_ROBIN"
    })
    .await;
    let v = get_json(net.addr(10, 15000), "/debug/config").await;
    let cluster = format!("greeter.{NS}.svc.cluster.local:80");
    assert_eq!(v["clusters"][&cluster]["protocol"], "HTTP/2", "{v:#}");
    // What `minimesh get endpoints` shows.
    let v = get_json(net.cp_admin(), "/debug/endpoints").await;
    assert_eq!(v[&cluster]["protocol"], "HTTP/2", "{v:#}");
    for (host, s) in (1..=3u8).zip(&mut servers) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(net.addr(host, 9091))
            .await
            .is_err()
        {
            s.assert_running();
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} never served",
                s.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let proxy = net.addr(10, 15001).to_string();
    let stdout = grpc_client(&proxy, "client", 300).await;
    assert_eq!(
        stdout,
        // Round robin per call, not per connection: 100 each.
        "who: greeter-1=100 greeter-2=100 greeter-3=100\n\
         fail: NOT_FOUND no such thing\n\
         flaky: 0 failed, served by greeter-1,greeter-2\n\
         count: got 300000 bytes\n\
         repeat: 3 messages from 1 server\n"
    );
    // The client's sidecar multiplexed: one connection to each endpoint.
    let v = get_json(net.addr(10, 15000), "/debug/config").await;
    let eps = v["clusters"][format!("greeter.{NS}.svc.cluster.local:80")]["endpoints"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let conns: Vec<u64> = eps
        .iter()
        .map(|e| e["connections"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(conns, [1, 1, 1], "{v:#}");

    // A replica dies (its pod's sidecar with it): no call fails, and the
    // others serve every one.
    inbound[1].kill();
    servers[1].kill();
    let stdout = grpc_client(&proxy, "who", 60).await;
    let served: u32 = stdout
        .trim_start_matches("who: ")
        .split_whitespace()
        .map(|kv| {
            assert!(!kv.starts_with("greeter-2="), "{stdout}");
            kv.split('=')
                .nth(1)
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(served, 60, "{stdout}");

    // gRPC health checking: greeter-3 answers NOT_SERVING, greeter-2 is
    // gone; greeter-1 takes every call.
    net.write(
        "dr-greeter.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: greeter-dr\nspec:\n  host: greeter\n  trafficPolicy:\n    loadBalancer: {simple: ROUND_ROBIN}\n    healthCheck: {grpcService: \"\", interval: 100ms}\n",
    );
    wait_sidecar(net.addr(10, 15000), Duration::from_secs(10), |v| {
        let eps = &v["clusters"][format!("greeter.{NS}.svc.cluster.local:80")]["endpoints"];
        let failing = |pod: &str| {
            eps.as_array()
                .into_iter()
                .flatten()
                .any(|e| e["pod"] == pod && e["health_check_failing"].as_bool() == Some(true))
        };
        failing("greeter-2") && failing("greeter-3")
    })
    .await;
    assert_eq!(grpc_client(&proxy, "who", 30).await, "who: greeter-1=30\n");
}

/// Runs tests/interop/grpc_mesh.py's client through `proxy` and returns
/// what it printed; fails the test if any call failed.
async fn grpc_client(proxy: &str, mode: &str, calls: u32) -> String {
    let args = [
        mode.to_string(),
        proxy.to_string(),
        "greeter".into(),
        calls.to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .arg(interop("grpc_mesh.py"))
            .args(args)
            .output()
    })
    .await
    .expect("join")
    .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "the grpcio client failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
