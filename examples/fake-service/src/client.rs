//! Upstream calls: through the HTTP proxy when `HTTP_PROXY` is set (proxy
//! style, absolute-form request line, as any proxy-aware client sends), or
//! directly. Connections are kept alive and reused.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

/// Idle connections kept for reuse.
const MAX_IDLE: usize = 64;
/// An upstream call that takes longer fails (fake-service's default client timeout is 30 s).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A small keep-alive client.
pub struct Client {
    proxy: Option<SocketAddr>,
    idle: Mutex<Vec<(SocketAddr, SendRequest<Full<Bytes>>)>>,
}

impl Client {
    /// A client that sends every request through `proxy` when set.
    pub fn new(proxy: Option<SocketAddr>) -> Self {
        Client {
            proxy,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// GETs `url`; returns the upstream's JSON (or an error entry like fake-service's).
    pub async fn get(&self, url: &str) -> Value {
        match tokio::time::timeout(CALL_TIMEOUT, self.try_get(url)).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => json!({"uri": url, "code": -1, "error": e}),
            Err(_) => json!({"uri": url, "code": -1, "error": "upstream call timed out"}),
        }
    }

    async fn try_get(&self, url: &str) -> Result<Value, String> {
        let uri: Uri = url.parse().map_err(|e| format!("bad URL: {e}"))?;
        let authority = uri.authority().ok_or("URL has no host")?.clone();
        let target = match self.proxy {
            Some(p) => p,
            None => {
                let port = authority.port_u16().unwrap_or(80);
                tokio::net::lookup_host((authority.host(), port))
                    .await
                    .map_err(|e| format!("resolving {authority}: {e}"))?
                    .next()
                    .ok_or("host has no address")?
            }
        };
        // Through a proxy the request line carries the absolute URL; directly, the path.
        let line_uri = if self.proxy.is_some() {
            uri.clone()
        } else {
            uri.path_and_query()
                .map_or("/", |p| p.as_str())
                .parse()
                .map_err(|_| "bad path")?
        };
        let mut req = Request::new(Full::new(Bytes::new()));
        *req.uri_mut() = line_uri;
        req.headers_mut().insert(
            header::HOST,
            HeaderValue::from_str(authority.as_str()).map_err(|_| "bad host")?,
        );
        let mut sender = self.checkout(target).await?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        self.checkin(target, sender);
        let mut v: Value = serde_json::from_slice(&body)
            .unwrap_or_else(|_| json!({"body": String::from_utf8_lossy(&body)}));
        if let Some(obj) = v.as_object_mut() {
            obj.insert("uri".into(), json!(url));
            obj.insert("code".into(), json!(status));
        }
        Ok(v)
    }

    async fn checkout(&self, target: SocketAddr) -> Result<SendRequest<Full<Bytes>>, String> {
        loop {
            let found = {
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                idle.iter()
                    .position(|(a, _)| *a == target)
                    .map(|i| idle.swap_remove(i).1)
            };
            match found {
                Some(mut s) => {
                    if s.ready().await.is_ok() {
                        return Ok(s);
                    }
                }
                None => break,
            }
        }
        let stream = TcpStream::connect(target)
            .await
            .map_err(|e| format!("connecting to {target}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    fn checkin(&self, target: SocketAddr, sender: SendRequest<Full<Bytes>>) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push((target, sender));
        }
    }
}
