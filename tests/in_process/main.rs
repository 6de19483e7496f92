//! The in-process tier: the control plane and sidecars as libraries, in one
//! test process (no binary started, no global state shared between them),
//! real sockets on loopback and real HTTP between them. Each test owns
//! `127.1.N.0/24` with N from 200 up (the end-to-end tier's nets are below).
//! A request-path case runs here in about a second, where the binary tier
//! spends several starting processes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A test's loopback net and config directory, removed at the end.
struct Net {
    octet: u8,
    dir: PathBuf,
}

impl Net {
    fn new(octet: u8) -> Net {
        let dir = std::env::temp_dir().join(format!(
            "minimesh-in-process-{octet}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("config dir");
        Net { octet, dir }
    }

    fn addr(&self, host: u8, port: u16) -> SocketAddr {
        SocketAddr::from(([127, 1, self.octet, host], port))
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.join(name), text).expect("write config");
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An app that answers every request with its name and the path it got,
/// and the mesh headers it saw.
async fn app(addr: SocketAddr, name: &'static str) {
    let listener = TcpListener::bind(addr).await.expect("bind app");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&got).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
                let body = format!("{name} {path}\n");
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
}

/// `GET path` with `Host: host` through the proxy at `proxy`: the status
/// and body, or None when the connection failed.
async fn get(proxy: SocketAddr, host: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(proxy).await.ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.ok()?;
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

fn service(name: &str, endpoints: &[SocketAddr]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  ports:\n  - name: http\n    port: 80\n    targetPort: {}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-abc\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\nports:\n- name: http\n  port: {}\nendpoints:\n",
        endpoints[0].port(),
        endpoints[0].port()
    );
    for (i, e) in endpoints.iter().enumerate() {
        y.push_str(&format!(
            "- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: {name}-{i}}}\n",
            e.ip()
        ));
    }
    y
}

fn args<T: Parser>(bin: &str, flags: &[String]) -> T {
    T::try_parse_from(std::iter::once(bin.to_string()).chain(flags.iter().cloned()))
        .unwrap_or_else(|e| panic!("{bin} flags: {e}"))
}

fn flags(pairs: &[(&str, String)]) -> Vec<String> {
    pairs
        .iter()
        .flat_map(|(k, v)| [format!("--{k}"), v.clone()])
        .collect()
}

/// Polls `f` until it is true, for at most 10 s.
async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "{what}: not within 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A control plane and two sidecars in this one process: the caller's
/// sidecar balances over the backend's sidecar (its inbound listener in
/// front of the app) and the app answers; a rule changed in the config
/// directory reaches the caller; everything stops when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_and_two_sidecars_share_one_process() {
    let started = Instant::now();
    let net = Net::new(200);
    let (cp_xds, cp_admin) = (net.addr(100, 15010), net.addr(100, 15014));
    // The backend: its app on 8080, its sidecar's inbound on 15006.
    app(net.addr(2, 8080), "backend").await;
    net.write("backend.yaml", &service("backend", &[net.addr(2, 15006)]));
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: backend\n  namespace: default\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer:\n      simple: ROUND_ROBIN\n",
    );
    let (stop_cp, stopped) = tokio::sync::oneshot::channel::<()>();
    let control_plane = tokio::spawn(minimesh_control_plane::run_until(
        args(
            "control-plane",
            &flags(&[
                ("config-dir", net.dir.display().to_string()),
                ("xds-addr", cp_xds.to_string()),
                ("admin-addr", cp_admin.to_string()),
                ("poll-interval", "50ms".into()),
            ]),
        ),
        async move {
            let _ = stopped.await;
        },
    ));
    let xds = format!("http://{cp_xds}");
    let backend = minimesh_sidecar::start(args(
        "sidecar",
        &flags(&[
            ("workload", "backend".into()),
            ("namespace", "default".into()),
            ("outbound", net.addr(2, 15001).to_string()),
            ("inbound", net.addr(2, 15006).to_string()),
            ("app", net.addr(2, 8080).to_string()),
            ("admin", net.addr(2, 15000).to_string()),
            ("xds-addr", xds.clone()),
        ]),
    ))
    .await
    .expect("backend's sidecar");
    let web = minimesh_sidecar::start(args(
        "sidecar",
        &flags(&[
            ("workload", "web".into()),
            ("namespace", "default".into()),
            ("outbound", net.addr(1, 15001).to_string()),
            ("admin", net.addr(1, 15000).to_string()),
            ("xds-addr", xds),
        ]),
    ))
    .await
    .expect("web's sidecar");

    // web -> web's sidecar -> backend's sidecar -> backend's app.
    let outbound = net.addr(1, 15001);
    until("a request through both sidecars", async || {
        get(outbound, "backend", "/hello").await == Some((200, "backend /hello\n".into()))
    })
    .await;
    // The rule as web's sidecar holds it, and a change of it.
    let policy = async || {
        get(net.addr(1, 15000), "localhost", "/debug/config")
            .await
            .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
            .map(|v| v["clusters"]["backend.default.svc.cluster.local:80"]["policy"].clone())
    };
    until("the rule at web's sidecar", async || {
        policy().await == Some("ROUND_ROBIN".into())
    })
    .await;
    net.write(
        "rule.yaml",
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: backend\n  namespace: default\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer:\n      simple: RANDOM\n",
    );
    until("the changed rule at web's sidecar", async || {
        policy().await == Some("RANDOM".into())
    })
    .await;
    for i in 0..20 {
        let path = format!("/{i}");
        assert_eq!(
            get(outbound, "backend", &path).await,
            Some((200, format!("backend {path}\n")))
        );
    }

    web.stop().await;
    backend.stop().await;
    let _ = stop_cp.send(());
    tokio::time::timeout(Duration::from_secs(10), control_plane)
        .await
        .expect("the control plane stops when told")
        .expect("join")
        .expect("the control plane ran without an error");
    assert!(
        get(outbound, "backend", "/").await.is_none(),
        "web's sidecar stopped listening"
    );
    assert!(
        TcpStream::connect(net.addr(1, 15000)).await.is_err(),
        "web's admin server stopped"
    );
    eprintln!("in-process: {:?}", started.elapsed());
}
