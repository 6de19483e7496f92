//! The book's apps joining unchanged: balanced through capture from the
//! ingress, curl and Python in simple-web's pod; passthrough to a pod
//! outside the mesh; PERMISSIVE and STRICT.

use std::process::Command;
use std::time::Duration;

use super::outside::{Outside, ECHO, ECHO_CLIENT, HTTPS};
use super::{
    assert_network_gone, assert_thirds, backend_requests, cannot_run, metric, stdout_of,
    wait_listening, Captured,
};
use crate::harness::*;

/// A test topology in the book's shape: simple-web calls simple-backend
/// (three replicas over two deployments) by its Service name; `direct` keeps
/// its app's port out of capture; simple-web's port 7001 calls are not
/// captured.
const TOPOLOGY: &str = r#"
apiVersion: minimesh.io/v1alpha1
kind: LocalMesh
metadata:
  name: captured
spec:
  namespace: istioinaction
  mtls: true
  ingress:
    hosts:
      simple-web.istioinaction.io: simple-web
  services:
  - name: simple-web
    deployments:
    - name: simple-web
      env:
        UPSTREAM_URIS: "http://simple-backend:80/"
      annotations:
        traffic.sidecar.istio.io/excludeOutboundPorts: "7001"
  - name: simple-backend
    deployments:
    - name: simple-backend-1
      env:
        MESSAGE: "Hello from simple-backend-1"
    - name: simple-backend-2
      replicas: 2
      env:
        MESSAGE: "Hello from simple-backend-2"
  - name: direct
    deployments:
    - name: direct
      annotations:
        traffic.sidecar.istio.io/excludeInboundPorts: "8080"
  # A port of no protocol Istio knows: detected from the first bytes.
  - name: detected
    appProtocol: custom
    deployments:
    - name: detected
  # An opaque TCP port: balanced per connection, bytes untouched.
  - name: opaque
    appProtocol: tcp
    deployments:
    - name: opaque
"#;

const ROUND_ROBIN: &str = r#"
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata:
  name: simple-backend-dr
  namespace: istioinaction
spec:
  host: simple-backend.istioinaction.svc.cluster.local
  trafficPolicy:
    loadBalancer:
      simple: ROUND_ROBIN
"#;

const STRICT: &str = r#"
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata:
  name: default
  namespace: istioinaction
spec:
  mtls:
    mode: STRICT
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_apps_join_unchanged_and_are_balanced_through_capture() {
    if cannot_run().is_some() {
        return;
    }
    let net = Net::new(141);
    let c = Captured::start(&net, TOPOLOGY).await;
    let k = c.network;
    c.apply(&net.dir, "rr.yaml", ROUND_ROBIN);

    // Every address in the pods' namespaces is loopback or 198.18.0.0/15.
    for ns in c.namespaces.values() {
        let text = stdout_of(Command::new("ip").args(["-n", ns, "-4", "-o", "addr"]));
        for word in text.split_whitespace().filter(|w| w.contains('/')) {
            assert!(
                word.starts_with("127.")
                    || word.starts_with("198.18.")
                    || word.starts_with("198.19."),
                "{ns}: {word}"
            );
        }
    }

    // Through the ingress by the book's host, 300 times: 0 errors, thirds.
    let before = backend_requests(&c).await;
    let ingress = net.addr(250, 30000);
    let connect_to = format!(
        "simple-web.istioinaction.io:80:{}:{}",
        ingress.ip(),
        ingress.port()
    );
    let urls: Vec<&str> = vec!["http://simple-web.istioinaction.io/"; 300];
    let codes = stdout_of(
        Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}\n",
                "--connect-to",
                &connect_to,
            ])
            .args(&urls),
    );
    assert_eq!(
        codes.lines().filter(|l| *l == "200").count(),
        300,
        "{codes}"
    );
    let after = backend_requests(&c).await;
    assert_thirds(&before, &after, 0.03, "through the ingress");

    // From the meshed pod, plain curl by the Service's short name.
    let urls: Vec<&str> = vec!["http://simple-backend/"; 300];
    let codes = stdout_of(
        c.exec("simple-web-0", "curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}\n"])
            .args(&urls),
    );
    assert_eq!(
        codes.lines().filter(|l| *l == "200").count(),
        300,
        "{codes}"
    );
    let after_curl = backend_requests(&c).await;
    assert_thirds(&after, &after_curl, 0.03, "curl from simple-web's pod");

    // Python's urllib (a new connection each time), by the full name.
    let script = "import urllib.request\nfor _ in range(60):\n    r = urllib.request.urlopen('http://simple-backend.istioinaction.svc.cluster.local/', timeout=10)\n    assert r.status == 200, r.status\nprint('ok')";
    let out = stdout_of(c.exec("simple-web-0", "python3").args(["-c", script]));
    assert_eq!(out.trim(), "ok");
    let after_python = backend_requests(&c).await;
    assert_thirds(
        &after_curl,
        &after_python,
        0.05,
        "urllib from simple-web's pod",
    );

    // Between meshed pods the connection is mutual TLS: each backend's
    // sidecar counts simple-web's identity.
    for pod in c.pod_ips.keys().filter(|p| p.starts_with("simple-backend")) {
        let n = metric(
            c.admin(pod),
            "minimesh_captured_connections_total",
            &[
                ("side", "inbound"),
                ("tls", "mutual"),
                (
                    "peer",
                    "spiffe://cluster.local/ns/istioinaction/sa/simple-web",
                ),
            ],
        )
        .await;
        assert!(
            n >= 1,
            "{pod} counted no mutual TLS connection from simple-web"
        );
    }

    // A port of unknown protocol is detected as HTTP from the request's
    // first bytes; a TCP port is proxied as bytes, over mutual TLS too.
    let web = c.admin("simple-web-0");
    let outbound = |how: &'static str| [("side", "outbound"), ("proxied", how)];
    for (svc, how) in [("detected", "http"), ("opaque", "tcp")] {
        let before = metric(web, "minimesh_captured_connections_total", &outbound(how)).await;
        let body = stdout_of(
            c.exec("simple-web-0", "curl")
                .args(["-s", &format!("http://{svc}/")]),
        );
        let v: serde_json::Value = serde_json::from_str(&body).expect("fake-service JSON");
        assert_eq!(v["name"], svc, "{body}");
        let after = metric(web, "minimesh_captured_connections_total", &outbound(how)).await;
        assert_eq!(after, before + 1, "{svc}: proxied as {how}");
    }
    let opaque_in = metric(
        c.admin("opaque-0"),
        "minimesh_captured_connections_total",
        &[
            ("side", "inbound"),
            ("proxied", "tcp"),
            ("tls", "mutual"),
            (
                "peer",
                "spiffe://cluster.local/ns/istioinaction/sa/simple-web",
            ),
        ],
    )
    .await;
    assert_eq!(
        opaque_in, 1,
        "opaque-0 took the TCP connection over mutual TLS"
    );

    // Outside the mesh: a TCP echo and an HTTPS server of their own.
    let mut outside = Outside::new(k, 200);
    outside.serve(
        "echo",
        &net.dir.join("logs/echo.log"),
        "python3",
        &["-c", ECHO, "7000", "7001"],
    );
    let cert = rcgen::generate_simple_self_signed(vec!["outside.test".to_string()]).expect("cert");
    let (cert_pem, key_pem) = (net.dir.join("outside.pem"), net.dir.join("outside-key.pem"));
    std::fs::write(&cert_pem, cert.cert.pem()).expect("cert");
    std::fs::write(&key_pem, cert.signing_key.serialize_pem()).expect("key");
    outside.serve(
        "https",
        &net.dir.join("logs/https.log"),
        "python3",
        &["-c", HTTPS, &path_str(&cert_pem), &path_str(&key_pem)],
    );
    let web_admin = c.admin("simple-web-0");
    let passthrough = [("side", "outbound"), ("proxied", "passthrough")];
    wait_listening(&c, "simple-web-0", outside.ip, 7001).await;
    let passed = metric(
        web_admin,
        "minimesh_captured_connections_total",
        &passthrough,
    )
    .await;
    let host = outside.ip.to_string();
    let echoed =
        stdout_of(
            c.exec("simple-web-0", "python3")
                .args(["-c", ECHO_CLIENT, &host, "7000"]),
        );
    assert_eq!(echoed.trim(), "same");
    assert_eq!(
        metric(
            web_admin,
            "minimesh_captured_connections_total",
            &passthrough
        )
        .await,
        passed + 1,
        "the echo went through the sidecar's passthrough"
    );
    wait_listening(&c, "simple-web-0", outside.ip, 8443).await;
    let passed = metric(
        web_admin,
        "minimesh_captured_connections_total",
        &passthrough,
    )
    .await;
    let resolve = format!("outside.test:8443:{host}");
    let body = stdout_of(
        c.exec("simple-web-0", "curl")
            .args([
                "-s",
                "--cacert",
                &path_str(&cert_pem),
                "--resolve",
                &resolve,
            ])
            .arg("https://outside.test:8443/"),
    );
    assert_eq!(body, "hello from outside the mesh over TLS");
    assert_eq!(
        metric(
            web_admin,
            "minimesh_captured_connections_total",
            &passthrough
        )
        .await,
        passed + 1,
        "the HTTPS call went through the sidecar's passthrough, its TLS untouched"
    );

    // An excluded outbound port bypasses the sidecar: its counters stay.
    let all_outbound = [("side", "outbound")];
    let counted = metric(
        web_admin,
        "minimesh_captured_connections_total",
        &all_outbound,
    )
    .await;
    let echoed =
        stdout_of(
            c.exec("simple-web-0", "python3")
                .args(["-c", ECHO_CLIENT, &host, "7001"]),
        );
    assert_eq!(echoed.trim(), "same");
    assert_eq!(
        metric(
            web_admin,
            "minimesh_captured_connections_total",
            &all_outbound
        )
        .await,
        counted,
        "an excluded port went through the sidecar"
    );

    // An excluded inbound port: an unmeshed client reaches the app itself.
    let direct = format!("http://{}:8080/", c.pod_ips["direct-0"]);
    assert_eq!(outside.status_of(&direct), "200");
    let inbound = [("side", "inbound")];
    assert_eq!(
        metric(
            c.admin("direct-0"),
            "minimesh_captured_connections_total",
            &inbound
        )
        .await,
        0,
        "the excluded inbound port went through direct-0's sidecar"
    );

    // PERMISSIVE serves a plaintext client outside the mesh; STRICT refuses it.
    let backend = format!("http://{}:8080/", c.pod_ips["simple-backend-1-0"]);
    assert_eq!(
        outside.status_of(&backend),
        "200",
        "PERMISSIVE serves plaintext"
    );
    c.apply(&net.dir, "strict.yaml", STRICT);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = outside
            .exec("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-m",
                "5",
                &backend,
            ])
            .output()
            .expect("curl");
        if !out.status.success() {
            break; // refused: no response at all
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "STRICT never refused plaintext"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Meshed callers still get through under STRICT.
    let codes = stdout_of(
        c.exec("simple-web-0", "curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}\n"])
            .args(vec!["http://simple-backend/"; 30]),
    );
    assert_eq!(codes.lines().filter(|l| *l == "200").count(), 30, "{codes}");

    drop(outside);
    let k = c.stop().await;
    assert_network_gone(k);
}
