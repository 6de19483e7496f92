//! The admin servers' debug views, from a neighbour's address: refused
//! unless opened (binds a non-loopback address, so the binaries run here;
//! the gateway's edge cases are in the in-process tier, `edge.rs`).

use crate::harness::*;

/// This host's address on its network (not loopback): where a pod's
/// neighbours would reach its admin port from.
fn network_address() -> std::net::IpAddr {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp socket");
    // Connecting a UDP socket sends nothing: it picks the route's source.
    s.connect("192.0.2.1:9")
        .expect("this test needs a non-loopback address with a route");
    let ip = s.local_addr().expect("local address").ip();
    assert!(!ip.is_loopback(), "no non-loopback address: {ip}");
    ip
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_views_answer_loopback_callers_only_unless_opened() {
    let net = Net::new(120);
    let ip = network_address();
    let (sidecar_admin, cp_admin) = (21120, 21121);
    let _sidecar = net.spawn(
        "sidecar",
        "sidecar",
        &[
            "--xds-addr".into(),
            format!("http://{}", net.cp_xds()),
            "--outbound".into(),
            net.addr(1, 15001).to_string(),
            "--admin".into(),
            format!("0.0.0.0:{sidecar_admin}"),
        ],
        &[],
    );
    let _cp = net.spawn(
        "control-plane",
        "control-plane",
        &[
            "--config-dir".into(),
            net.config().display().to_string(),
            "--xds-addr".into(),
            net.cp_xds().to_string(),
            "--admin-addr".into(),
            format!("0.0.0.0:{cp_admin}"),
        ],
        &[],
    );
    for (port, debug, health) in [
        (sidecar_admin, "/debug/config", "/healthz"),
        (cp_admin, "/debug/endpoints", "/readyz"),
    ] {
        let outside = std::net::SocketAddr::new(ip, port);
        let local = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        wait_http(outside, health).await;
        let (status, _, body) = get(outside, "admin", debug).await.expect("admin");
        assert_eq!(status, 403, "{debug} from {ip}: {body}");
        assert_eq!(body, minimesh_proto::admin::DEBUG_REFUSED);
        let (status, _, body) = get(outside, "admin", "/metrics").await.expect("admin");
        assert_eq!(status, 200, "/metrics from {ip}: {body}");
        let (status, _, body) = get(local, "admin", debug).await.expect("admin");
        assert_eq!(status, 200, "{debug} from loopback: {body}");
    }
    // Opened to every caller.
    let opened = 21122;
    let _open = net.spawn(
        "sidecar-open",
        "sidecar",
        &[
            "--xds-addr".into(),
            format!("http://{}", net.cp_xds()),
            "--outbound".into(),
            net.addr(2, 15001).to_string(),
            "--admin".into(),
            format!("0.0.0.0:{opened}"),
            "--admin-debug".into(),
        ],
        &[],
    );
    let outside = std::net::SocketAddr::new(ip, opened);
    wait_http(outside, "/healthz").await;
    let (status, _, body) = get(outside, "admin", "/debug/config").await.expect("admin");
    assert_eq!(status, 200, "with --admin-debug: {body}");
}
