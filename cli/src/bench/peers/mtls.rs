//! nginx as a proxy pair over mutual TLS, set beside minimesh's sidecar
//! pair over mutual TLS in `minimesh bench overhead --mtls`: a front nginx
//! (where the client connects) proxies over TLS 1.3 with a client
//! certificate (`proxy_ssl_certificate`, the server verified against the
//! mesh's root, sessions reused, keep-alive) to a back nginx that requires
//! and verifies it (`ssl_verify_client on`) and proxies to the app. Both
//! certificates come from the mesh's CA, as the sidecars' do.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context;
use minimesh_control_plane::ca::{Ca, Identity};

use super::{launch, Kind, Peer};

/// The name the back nginx's certificate carries.
const BACK_NAME: &str = "nginx-back.minimesh.local";

/// The two nginx processes of the pair, front first.
pub struct NginxPair {
    /// The one the client connects to.
    pub front: Peer,
    /// The one in front of the app.
    pub back: Peer,
}

/// Starts the pair: `front` (plaintext from the client) -> `back` (mutual
/// TLS) -> `app`. Certificates are signed by `ca` for the namespace's
/// `nginx-front` and `nginx-back` service accounts.
pub async fn start_nginx_pair(
    binary: &Path,
    dir: &Path,
    ca: &Ca,
    namespace: &str,
    front: SocketAddr,
    back: SocketAddr,
    app: SocketAddr,
) -> anyhow::Result<NginxPair> {
    let dir = std::path::absolute(dir)?;
    let who = |sa: &str| Identity {
        namespace: namespace.to_string(),
        service_account: sa.to_string(),
        pod: None,
    };
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).with_context(|| format!("writing {name}"))
    };
    std::fs::create_dir_all(dir.join("front"))?;
    std::fs::create_dir_all(dir.join("back"))?;
    let (front_cert, front_key) = ca.issue_with_key(&who("nginx-front"), &[])?;
    // nginx checks a server's certificate by DNS name (not by address):
    // the back one's names it, and the front one asks for it.
    let (back_cert, back_key) = ca.issue_with_key(&who("nginx-back"), &[BACK_NAME.to_string()])?;
    write("root.pem", ca.root_pem())?;
    write("front.pem", &front_cert)?;
    write("front-key.pem", &front_key)?;
    write("back.pem", &back_cert)?;
    write("back-key.pem", &back_key)?;
    let d = dir.display();
    let common = |sub: &str| {
        format!(
            "# Written by minimesh bench overhead --mtls.\nworker_processes 2;\ndaemon off;\npid {d}/{sub}/nginx.pid;\nerror_log {d}/{sub}/error.log warn;\n\
             events {{ worker_connections 16384; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/{sub}/body;\n  proxy_temp_path {d}/{sub}/proxy;\n\
               fastcgi_temp_path {d}/{sub}/fastcgi;\n  uwsgi_temp_path {d}/{sub}/uwsgi;\n  scgi_temp_path {d}/{sub}/scgi;\n"
        )
    };
    let back_conf = format!(
        "{}  upstream app {{\n    server {app};\n    keepalive 256;\n  }}\n\
           server {{\n    listen {back} ssl;\n    ssl_protocols TLSv1.3;\n\
             ssl_certificate {d}/back.pem;\n    ssl_certificate_key {d}/back-key.pem;\n\
             ssl_client_certificate {d}/root.pem;\n    ssl_verify_client on;\n\
             location / {{\n      proxy_pass http://app;\n      proxy_http_version 1.1;\n\
               proxy_set_header Connection \"\";\n      proxy_set_header Host $host;\n    }}\n  }}\n}}\n",
        common("back")
    );
    let front_conf = format!(
        "{}  upstream back {{\n    server {back};\n    keepalive 256;\n  }}\n\
           server {{\n    listen {front};\n    location / {{\n      proxy_pass https://back;\n\
               proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_set_header Host $host;\n\
               proxy_ssl_protocols TLSv1.3;\n      proxy_ssl_certificate {d}/front.pem;\n\
               proxy_ssl_certificate_key {d}/front-key.pem;\n      proxy_ssl_trusted_certificate {d}/root.pem;\n\
               proxy_ssl_verify on;\n      proxy_ssl_name {BACK_NAME};\n      proxy_ssl_session_reuse on;\n    }}\n  }}\n}}\n",
        common("front"),
    );
    let back_path = dir.join("back").join("nginx.conf");
    std::fs::write(&back_path, back_conf)?;
    let back_peer = launch(Kind::Nginx, binary, &dir.join("back"), &back_path, back).await?;
    let front_path = dir.join("front").join("nginx.conf");
    std::fs::write(&front_path, front_conf)?;
    let front_peer = match launch(Kind::Nginx, binary, &dir.join("front"), &front_path, front).await
    {
        Ok(p) => p,
        Err(e) => {
            back_peer.stop().await;
            return Err(e);
        }
    };
    Ok(NginxPair {
        front: front_peer,
        back: back_peer,
    })
}
