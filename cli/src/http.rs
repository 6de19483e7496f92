//! A one-shot HTTP/1.1 GET for talking to admin APIs.

use std::time::Duration;

use anyhow::{anyhow, Context};
use bytes::Bytes;
use http::{header, Request};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// GETs `path` from `addr` (`ip:port`); returns status and body.
pub async fn get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let fut = async {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let req = Request::get(path)
            .header(header::HOST, addr)
            .body(Empty::<Bytes>::new())?;
        let resp = sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok::<_, anyhow::Error>((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .map_err(|_| anyhow!("{addr}{path}: no answer within 5s"))?
}

/// GETs JSON.
pub async fn get_json(addr: &str, path: &str) -> anyhow::Result<serde_json::Value> {
    let (status, body) = get(addr, path).await?;
    if status != 200 {
        return Err(anyhow!("{addr}{path}: HTTP {status}: {}", body.trim()));
    }
    serde_json::from_str(&body).with_context(|| format!("{addr}{path}: not JSON"))
}
