//! A pod outside the mesh on the mesh's bridge, and the apps it runs
//! (a TCP echo, an HTTPS server) and their clients.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;

use super::stdout_of;
use crate::harness::*;

/// A namespace outside the mesh on the mesh's bridge (no sidecar, no
/// capture), as an unmeshed Kubernetes namespace's pod; its name carries
/// the network's prefix, so the network's cleanup takes it too.
pub(super) struct Outside {
    ns: String,
    pub(super) ip: Ipv4Addr,
    procs: Vec<Proc>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Outside {
    pub(super) fn new(network: u8, host: u8) -> Outside {
        let ns = format!("mm{network}-outside-{host}");
        let veth = format!("mm{network}o{host}");
        let addr = Ipv4Addr::new(198, 18, network, host);
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&[
            "link",
            "set",
            &veth,
            "master",
            &format!("mmbr{network}"),
            "up",
        ]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        Outside {
            ns,
            ip: addr,
            procs: Vec::new(),
        }
    }

    pub(super) fn exec(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// The status of a plain curl GET of `url` from this namespace.
    pub(super) fn status_of(&self, url: &str) -> String {
        stdout_of(
            self.exec("curl")
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", url]),
        )
    }

    pub(super) fn serve(&mut self, name: &str, log: &Path, program: &str, args: &[&str]) {
        let child = self
            .exec(program)
            .args(args)
            .stdout(std::fs::File::create(log).expect("log"))
            .stderr(std::fs::File::create(log.with_extension("err")).expect("log"))
            .spawn()
            .expect("server");
        self.procs.push(Proc {
            name: name.into(),
            child,
            log: log.to_path_buf(),
        });
    }
}

impl Drop for Outside {
    fn drop(&mut self) {
        self.procs.clear();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

pub(super) const ECHO: &str = r#"
import socket, sys, threading
def echo(c):
    while True:
        b = c.recv(65536)
        if not b:
            break
        c.sendall(b)
    c.shutdown(socket.SHUT_WR)
    c.close()
def serve(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(16)
    while True:
        c, _ = s.accept()
        threading.Thread(target=echo, args=(c,), daemon=True).start()
for p in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"#;

pub(super) const HTTPS: &str = r#"
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello from outside the mesh over TLS"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
srv = http.server.HTTPServer(("0.0.0.0", 8443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1], sys.argv[2])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("listening", flush=True)
srv.serve_forever()
"#;

/// Sends 256 KiB through a connection to `addr` from `pod`'s namespace,
/// half-closes, and checks every byte came back in order.
pub(super) const ECHO_CLIENT: &str = r#"
import os, socket, sys
data = os.urandom(256 * 1024)
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(data)
s.shutdown(socket.SHUT_WR)
got = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    got += b
print("same" if got == data else "differs: %d of %d bytes" % (len(got), len(data)))
"#;
