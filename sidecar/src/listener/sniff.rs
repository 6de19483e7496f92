//! Which HTTP version a plaintext client speaks, read from the first bytes
//! it sent without consuming them (`peek`), so that an HTTP/1.1 connection
//! is served by hyper's HTTP/1.1 server directly. hyper-util's `auto`
//! server reads those bytes instead and then wraps every later read and
//! write of the connection in a layer that replays them (`Rewind`): a cost
//! on each request for a question answered once per connection.

use tokio::net::TcpStream;

/// The client preface every HTTP/2 connection starts with (RFC 9113, 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What the first bytes say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Speaks {
    /// Anything but the HTTP/2 preface: HTTP/1.1.
    Http1,
    /// The whole HTTP/2 preface.
    Http2,
    /// The start of the preface only, so far (a client that split it):
    /// left to hyper-util's `auto` server, which reads on until it knows.
    Unsure,
}

/// Waits for the client's first bytes and reads what they say; None when
/// the client closed without sending any.
pub(super) async fn speaks(tcp: &TcpStream) -> std::io::Result<Option<Speaks>> {
    let mut first = [0u8; H2_PREFACE.len()];
    let n = tcp.peek(&mut first).await?;
    Ok(Some(match n {
        0 => return Ok(None),
        n if first[..n] != H2_PREFACE[..n] => Speaks::Http1,
        n if n == H2_PREFACE.len() => Speaks::Http2,
        _ => Speaks::Unsure,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What `speaks` makes of a client that sends `bytes` then stops.
    async fn sniffed(bytes: &'static [u8]) -> (Option<Speaks>, Vec<u8>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(bytes).await.expect("write");
            c.shutdown().await.expect("shutdown");
        });
        let (mut server, _) = listener.accept().await.expect("accept");
        client.await.expect("client");
        let got = speaks(&server).await.expect("peek");
        // Nothing was consumed: the server still reads every byte.
        let mut all = Vec::new();
        server.read_to_end(&mut all).await.expect("read");
        (got, all)
    }

    #[tokio::test]
    async fn the_first_bytes_tell_the_version_and_stay_unread() {
        let get = b"GET / HTTP/1.1\r\nhost: a\r\n\r\n";
        assert_eq!(sniffed(get).await, (Some(Speaks::Http1), get.to_vec()));
        // POST and PUT start like the preface, and part from it at once.
        let post = b"POST / HTTP/1.1\r\n";
        assert_eq!(sniffed(post).await, (Some(Speaks::Http1), post.to_vec()));
        let h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
        assert_eq!(sniffed(h2).await, (Some(Speaks::Http2), h2.to_vec()));
        let part = b"PRI * HTTP/2";
        assert_eq!(sniffed(part).await, (Some(Speaks::Unsure), part.to_vec()));
        assert_eq!(sniffed(b"").await, (None, Vec::new()));
    }
}
