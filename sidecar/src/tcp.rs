//! Opaque TCP proxying of captured connections: bytes copied both ways
//! untouched, each direction's end (half-close) passed on. To a Service
//! port that is not HTTP, the connection is balanced by the cluster's
//! policy (one pick per connection, over mutual TLS to an endpoint that runs
//! a sidecar); to an address that is no Service's, it goes where the app
//! sent it (Istio's PassthroughCluster).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::balance::xxhash::xxh64;
use crate::endpoint::EndpointState;
use crate::routing::{ClusterHandle, HashPolicy};
use crate::tls::Alpn;

/// Why a connection could not be proxied.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// No endpoint of the cluster could be reached.
    #[error("no endpoint of {cluster} could be reached ({tried} tried)")]
    NoEndpoint {
        /// The cluster.
        cluster: Arc<str>,
        /// Endpoints dialed.
        tried: usize,
    },
    /// The original destination could not be reached.
    #[error("connecting to {addr}: {source}")]
    Connect {
        /// Where the app sent the connection.
        addr: SocketAddr,
        /// Why it failed.
        source: std::io::Error,
    },
}

/// Proxies `client` to an endpoint of `cluster`: picked as a request would
/// be (a source-IP hash policy hashes `peer`), and another one tried, up to
/// the cluster's retry attempts, when the connect fails. The connection
/// counts as one request of its endpoint while it lasts; its latency is the
/// time to connect. Returns the bytes copied each way.
pub async fn to_cluster<C>(
    mut client: C,
    peer: SocketAddr,
    cluster: &ClusterHandle,
) -> Result<(u64, u64), TcpError>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let hash = match cluster.hash {
        Some(HashPolicy::SourceIp) => Some(xxh64(peer.ip().to_string().as_bytes(), 0)),
        _ => None,
    };
    let mut tried: Vec<Arc<EndpointState>> = Vec::new();
    for _ in 0..=cluster.retry_attempts {
        let now = crate::clock::now_ms();
        let Some(endpoint) = cluster.balancer.pick(hash, &tried, now).cloned() else {
            break;
        };
        let active = endpoint.start();
        let started = tokio::time::Instant::now();
        let timeout = cluster.pool.connect_timeout;
        let peer = endpoint.pool().peer();
        match crate::tls::dial(endpoint.addr, timeout, peer.as_deref(), Alpn::Tcp).await {
            Ok(mut upstream) => {
                endpoint.mark_reachable();
                let us = started.elapsed().as_micros() as u64;
                endpoint.counters().count_response(false, us);
                let copied = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                drop(active);
                return Ok(copied.unwrap_or((0, 0)));
            }
            Err(e) => {
                tracing::debug!(cluster = %cluster.name, endpoint = %endpoint.addr, error = %e, "TCP connect failed");
                endpoint.mark_connect_failure();
                endpoint.counters().count_failure();
                drop(active);
                tried.push(endpoint);
            }
        }
    }
    Err(TcpError::NoEndpoint {
        cluster: cluster.name.clone(),
        tried: tried.len(),
    })
}

/// Proxies `client` to `addr`, where it was going: a destination outside
/// the mesh. Returns the bytes copied each way.
pub async fn passthrough<C>(
    mut client: C,
    addr: SocketAddr,
    connect_timeout: Duration,
) -> Result<(u64, u64), TcpError>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let connect = |source| TcpError::Connect { addr, source };
    let mut upstream = tokio::time::timeout(connect_timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| connect(std::io::ErrorKind::TimedOut.into()))?
        .map_err(connect)?;
    let _ = upstream.set_nodelay(true);
    Ok(tokio::io::copy_bidirectional(&mut client, &mut upstream)
        .await
        .unwrap_or((0, 0)))
}
