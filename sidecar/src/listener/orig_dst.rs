//! Where a captured connection was going: the destination the app (or the
//! caller) dialed before the pod's capture rules redirected it to this
//! listener, read from the kernel's connection tracking (`SO_ORIGINAL_DST`),
//! as linkerd2-proxy's `orig_dst` layer does.

use std::net::SocketAddr;

use tokio::net::TcpStream;

/// The original destination of `tcp`, or None when it was not redirected
/// (dialed to this listener's own address, or no record of a redirect).
pub fn original_dst(tcp: &TcpStream) -> Option<SocketAddr> {
    let local = tcp.local_addr().ok()?;
    let sock = socket2::SockRef::from(tcp);
    let dst = match local {
        SocketAddr::V4(_) => sock.original_dst_v4(),
        SocketAddr::V6(_) => sock.original_dst_v6(),
    }
    .ok()?
    .as_socket()?;
    (dst != local).then_some(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_dialed_to_the_listener_was_not_redirected() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let _client = TcpStream::connect(addr).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        assert_eq!(original_dst(&server), None);
    }
}
