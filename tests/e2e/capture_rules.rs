//! The capture rules in a lab, as linkerd2-proxy-init's iptables
//! integration tests check theirs: pods (network namespaces on a bridge) with
//! the rules of `sidecar init-capture` for one option set each, a stand-in
//! "proxy" answering on the capture ports and apps answering on theirs, and
//! who answers a connection says where the rules sent it. No sidecar runs:
//! these tests are about the rules alone (tests/e2e/capture.rs runs the
//! mesh through them). Needs root, `ip` and `nft`, as capture.rs.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::Duration;

use minimesh_cli::mesh::pod_network::PodNetwork;

use crate::harness::*;

/// Serves `NAME:PORT` on every port given, and `proxy` on the capture
/// ports (15001, 15006): which one answers says where a connection went.
const LAB_SERVER: &str = r#"
import http.server, socketserver, sys, threading
name = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        port = self.server.server_address[1]
        body = ("proxy" if port in (15001, 15006) else "%s:%d" % (name, port)).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
class S(http.server.ThreadingHTTPServer):
    def server_bind(self):
        # HTTPServer's own looks its name up in DNS, which the lab has not.
        socketserver.TCPServer.server_bind(self)
for p in sys.argv[2:]:
    srv = S(("0.0.0.0", int(p)), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"#;

/// One pod of the lab: its namespace, address and servers.
struct LabPod {
    ns: String,
    ip: Ipv4Addr,
    _server: Proc,
}

/// GETs `http://HOST:PORT/` from `ns` (as group `gid` when given) and
/// returns the body, or `refused` when no one answered.
fn who_answers(ns: &str, host: Ipv4Addr, port: u16, gid: Option<u32>) -> String {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, "curl", "-s", "-m", "5"])
        .arg(format!("http://{host}:{port}/"));
    if let Some(g) = gid {
        use std::os::unix::process::CommandExt;
        c.gid(g);
    }
    let out = c.output().expect("curl");
    if out.status.success() {
        String::from_utf8_lossy(&out.stdout).into_owned()
    } else {
        eprintln!("{ns} -> {host}:{port}: curl exited {}", out.status);
        "refused".into()
    }
}

fn init_capture(ns: &str, flags: &[&str]) {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, bin("sidecar"), "init-capture"])
        .args(flags)
        .output()
        .expect("init-capture");
    assert!(
        out.status.success(),
        "init-capture {flags:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_option_set_sends_connections_where_it_says() {
    if minimesh_cli::mesh::pod_network::unavailable().is_some() {
        if std::env::var_os("CI").is_some() {
            panic!("the capture rules lab cannot run under CI");
        }
        return;
    }
    let net = Net::new(144);
    let mut lab = {
        let _shared = crate::capture::STARTS.read().await;
        PodNetwork::create().expect("pod network")
    };
    let hosts = minimesh_cli::mesh::pod_network::hosts_file("lab", &[]);
    let mut pods = std::collections::BTreeMap::new();
    // (pod, init-capture flags; None: no rules)
    let sets: [(&str, Option<&[&str]>); 7] = [
        ("none", None),
        ("all", Some(&[])),
        ("some", Some(&["--include-inbound-ports=9090,9099"])),
        ("ignored", Some(&["--exclude-inbound-ports=7070"])),
        ("subnets", Some(&["--exclude-outbound-ip-ranges=@NONE@/32"])),
        ("ports", Some(&["--exclude-outbound-ports=8080"])),
        ("outside", None),
    ];
    for (i, (name, _)) in sets.iter().enumerate() {
        let ns = lab.add_pod(name, i as u8 + 1, &hosts).expect("pod");
        let ip = lab.pod_ip(i as u8 + 1);
        let log = net.dir.join(format!("logs/{name}.log"));
        let child = Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", LAB_SERVER, name])
            .args(["7070", "8080", "9090", "9099", "15001", "15006"])
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::File::create(log.with_extension("err")).expect("log"))
            .spawn()
            .expect("lab server");
        let server = Proc {
            name: format!("{name} lab server"),
            child,
            log,
        };
        pods.insert(
            *name,
            LabPod {
                ns,
                ip,
                _server: server,
            },
        );
    }
    let none_ip = pods["none"].ip.to_string();
    for (name, flags) in sets {
        if let Some(flags) = flags {
            let flags: Vec<String> = flags
                .iter()
                .map(|f| f.replace("@NONE@", &none_ip))
                .collect();
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            init_capture(&pods[name].ns, &flags);
        }
    }
    let outside = pods["outside"].ns.clone();
    let ip = |p: &str| pods[p].ip;
    // Every lab server listens before any case is checked.
    for (name, pod) in &pods {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while who_answers(&pod.ns, Ipv4Addr::LOCALHOST, 8080, None) != format!("{name}:8080") {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}'s lab server never answered"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Inbound, (target, port, who answers).
    for (pod, port, want) in [
        // No rules: the app's ports, nothing else.
        ("none", 8080, "none:8080".to_string()),
        // Every port to the proxy, the app's own ones too.
        ("all", 8080, "proxy".into()),
        ("all", 7070, "proxy".into()),
        // The sidecar's own ports are never redirected (nothing listens
        // on 15000 here: redirected, the proxy would have answered).
        ("all", 15000, "refused".into()),
        // includeInboundPorts: those to the proxy, the rest to the app.
        ("some", 9090, "proxy".into()),
        ("some", 9099, "proxy".into()),
        ("some", 8080, "some:8080".into()),
        // excludeInboundPorts: straight to the app.
        ("ignored", 7070, "ignored:7070".into()),
        ("ignored", 8080, "proxy".into()),
    ] {
        assert_eq!(
            who_answers(&outside, ip(pod), port, None),
            want,
            "inbound {pod}:{port}"
        );
    }

    // Outbound, from the pod with every default rule.
    let all = pods["all"].ns.clone();
    // The app's connection to another pod goes to its proxy...
    assert_eq!(who_answers(&all, ip("none"), 8080, None), "proxy");
    // ...the proxy's own (group 1337) goes where it was sent...
    assert_eq!(who_answers(&all, ip("none"), 8080, Some(1337)), "none:8080");
    // ...and loopback, and the pod's calls to itself, are not redirected.
    assert_eq!(
        who_answers(&all, Ipv4Addr::LOCALHOST, 8080, None),
        "all:8080"
    );
    // (its own address: its own app, directly)
    assert_eq!(who_answers(&all, ip("all"), 8080, None), "all:8080");
    // excludeOutboundIPRanges: the excluded address directly, others to the proxy.
    let subnets = pods["subnets"].ns.clone();
    assert_eq!(who_answers(&subnets, ip("none"), 8080, None), "none:8080");
    assert_eq!(who_answers(&subnets, ip("outside"), 8080, None), "proxy");
    // excludeOutboundPorts: the excluded port directly, others to the proxy.
    let ports = pods["ports"].ns.clone();
    assert_eq!(who_answers(&ports, ip("none"), 8080, None), "none:8080");
    assert_eq!(who_answers(&ports, ip("none"), 9090, None), "proxy");

    // Idempotent: the step run again leaves one copy of each rule;
    // removable: after --remove nothing is redirected.
    let rules = |ns: &str| {
        let out = Command::new("ip")
            .args([
                "netns", "exec", ns, "nft", "list", "table", "ip", "minimesh",
            ])
            .output()
            .expect("nft");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("redirect"))
            .count()
    };
    let before = rules(&all);
    assert!(before >= 2, "{before} redirect rules");
    init_capture(&all, &[]);
    assert_eq!(rules(&all), before, "a second run added rules");
    init_capture(&all, &["--remove"]);
    assert_eq!(rules(&all), 0);
    assert_eq!(who_answers(&outside, ip("all"), 8080, None), "all:8080");
    assert_eq!(who_answers(&all, ip("none"), 8080, None), "none:8080");

    drop(pods);
    lab.remove();
}
