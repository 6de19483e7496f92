//! The app's HTTP probes, made by the sidecar for the kubelet. With capture
//! and STRICT mutual TLS, the kubelet's plaintext probe of the app's port
//! would be refused, so the injector points each HTTP probe at the
//! sidecar's admin port (`/app-health/<container>/<livez|readyz|startupz>`,
//! as Istio's `/app-health/` on its agent) and gives the sidecar the
//! original (`--app-probes`, JSON: the admin path to `{"port", "path",
//! "httpHeaders"}`); the sidecar sends it to the app over loopback, which
//! no capture rule takes, and answers with the app's status.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Where the admin port serves the app's probes.
pub const PREFIX: &str = "/app-health/";

/// One HTTP probe of the app, as its pod spec declared it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// The app's port (a named port already resolved by the injector).
    pub port: u16,
    /// Path and query.
    pub path: String,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
}

/// The probes by admin path.
#[derive(Clone, Debug, Default)]
pub struct AppProbes(HashMap<String, Probe>);

impl AppProbes {
    /// Reads the injector's JSON; Err says which entry is wrong.
    pub fn parse(json: &str) -> Result<AppProbes, String> {
        let v: Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
        let map = v.as_object().ok_or("not a JSON object of probes")?;
        let mut probes = HashMap::new();
        for (admin_path, p) in map {
            if !admin_path.starts_with(PREFIX) {
                return Err(format!(
                    "{admin_path:?}: a probe's path must start with {PREFIX}"
                ));
            }
            let port = p["port"]
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{admin_path}: port is not a port number"))?;
            let path = p["path"].as_str().unwrap_or("/");
            if !path.starts_with('/') {
                return Err(format!("{admin_path}: path {path:?} does not start with /"));
            }
            let mut headers = Vec::new();
            for h in p["httpHeaders"].as_array().into_iter().flatten() {
                let (Some(name), Some(value)) = (h["name"].as_str(), h["value"].as_str()) else {
                    return Err(format!(
                        "{admin_path}: httpHeaders entries need a name and a value"
                    ));
                };
                headers.push((name.to_string(), value.to_string()));
            }
            probes.insert(
                admin_path.clone(),
                Probe {
                    port,
                    path: path.to_string(),
                    headers,
                },
            );
        }
        Ok(AppProbes(probes))
    }

    /// The probe served at `admin_path`.
    pub fn get(&self, admin_path: &str) -> Option<&Probe> {
        self.0.get(admin_path)
    }

    /// How many probes there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Sends `probe` to the app on 127.0.0.1 within `timeout`: the app's
/// status, as the kubelet reads it (2xx and 3xx pass), or 503 when the app
/// cannot be reached or answer in time.
pub async fn run(probe: &Probe, timeout: Duration) -> (StatusCode, String) {
    let send = async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", probe.port)).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(std::io::Error::other)?;
        tokio::spawn(conn);
        let mut req = Request::get(probe.path.as_str())
            .header(http::header::HOST, format!("127.0.0.1:{}", probe.port))
            .header(http::header::USER_AGENT, "kube-probe (minimesh sidecar)");
        for (k, v) in &probe.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req
            .body(Empty::<Bytes>::new())
            .map_err(std::io::Error::other)?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(std::io::Error::other)?;
        Ok::<_, std::io::Error>(resp.status())
    };
    match tokio::time::timeout(timeout, send).await {
        Ok(Ok(status)) => (status, format!("app answered {status}\n")),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("app probe failed: {e}\n"),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("app probe timed out after {timeout:?}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_injectors_json_is_read_and_a_bad_entry_named() {
        let p = AppProbes::parse(
            r#"{"/app-health/web/readyz": {"port": 8080, "path": "/health?full=1", "httpHeaders": [{"name": "x-probe", "value": "1"}]},
                "/app-health/web/livez": {"port": 8080}}"#,
        )
        .expect("valid");
        assert_eq!(
            p.get("/app-health/web/readyz"),
            Some(&Probe {
                port: 8080,
                path: "/health?full=1".into(),
                headers: vec![("x-probe".into(), "1".into())]
            })
        );
        assert_eq!(
            p.get("/app-health/web/livez").map(|p| p.path.as_str()),
            Some("/")
        );
        assert_eq!(p.len(), 2);
        for (bad, why) in [
            (
                r#"{"/x": {"port": 1}}"#,
                r#""/x": a probe's path must start with /app-health/"#,
            ),
            (
                r#"{"/app-health/a/livez": {"port": 0}}"#,
                "/app-health/a/livez: port is not a port number",
            ),
            (
                r#"{"/app-health/a/livez": {"port": 80, "path": "x"}}"#,
                r#"/app-health/a/livez: path "x" does not start with /"#,
            ),
            ("[]", "not a JSON object of probes"),
        ] {
            assert_eq!(AppProbes::parse(bad).unwrap_err(), why);
        }
    }

    #[tokio::test]
    async fn the_apps_status_comes_back_and_a_closed_port_is_503() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let status = if head.starts_with("GET /health ") && head.contains("x-probe: 1") {
                    "204 No Content"
                } else {
                    "500 Internal Server Error"
                };
                let _ = s
                    .write_all(format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n").as_bytes())
                    .await;
            }
        });
        let probe = Probe {
            port,
            path: "/health".into(),
            headers: vec![("x-probe".into(), "1".into())],
        };
        assert_eq!(
            run(&probe, Duration::from_secs(5)).await.0,
            StatusCode::NO_CONTENT
        );
        let wrong = Probe {
            headers: vec![],
            ..probe.clone()
        };
        assert_eq!(
            run(&wrong, Duration::from_secs(5)).await.0,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        // Nothing listens on port 1.
        let closed = Probe { port: 1, ..probe };
        assert_eq!(
            run(&closed, Duration::from_secs(5)).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
