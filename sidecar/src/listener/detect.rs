//! Whether a captured plaintext connection speaks HTTP, read from its first
//! bytes without consuming them, as Linkerd's and Istio's protocol detection:
//! an HTTP/1 request line's method and a space, or HTTP/2's preface, is
//! HTTP; any other first bytes, or none within the wait (a protocol where
//! the server speaks first, as MySQL or SMTP), is opaque TCP.

use std::time::Duration;

use tokio::net::TcpStream;

/// What a connection was found to speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detected {
    /// HTTP/1.x or HTTP/2: proxied request by request.
    Http,
    /// Anything else: proxied as bytes.
    Opaque,
}

/// The starts of an HTTP/1 request line (methods of RFC 9110 and PATCH),
/// and of HTTP/2's preface.
const STARTS: [&[u8]; 10] = [
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"CONNECT ",
    b"OPTIONS ",
    b"TRACE ",
    b"PATCH ",
    b"PRI * HTTP/2.0",
];

/// What `first` says: Some when it tells, None while it is the start of one
/// of [`STARTS`] and shorter.
pub fn classify(first: &[u8]) -> Option<Detected> {
    let mut maybe = false;
    for start in STARTS {
        let n = first.len().min(start.len());
        if first[..n] == start[..n] {
            if n == start.len() {
                return Some(Detected::Http);
            }
            maybe = true;
        }
    }
    (!maybe).then_some(Detected::Opaque)
}

/// How long to wait for more of a client's first bytes when what it sent
/// so far could still begin a request line (a peek returns at once while
/// those bytes wait unread).
const MORE_BYTES: Duration = Duration::from_millis(5);

/// Reads what `tcp`'s first bytes say within `within`; None when the client
/// closed without sending any.
pub async fn detect(tcp: &TcpStream, within: Duration) -> std::io::Result<Option<Detected>> {
    let read = async {
        let mut first = [0u8; 16];
        let mut seen = 0;
        loop {
            let n = tcp.peek(&mut first).await?;
            if n == 0 {
                return Ok(None);
            }
            if let Some(d) = classify(&first[..n]) {
                return Ok(Some(d));
            }
            if n == seen {
                // Nothing new since the last look: wait for more.
                tokio::time::sleep(MORE_BYTES).await;
            }
            seen = n;
        }
    };
    match tokio::time::timeout(within, read).await {
        Ok(read) => read,
        Err(_) => Ok(Some(Detected::Opaque)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_and_the_h2_preface_are_http_anything_else_opaque() {
        for http in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"POST /x HTTP/1.1\r\n",
            b"PATCH /x",
            b"OPTIONS * HTTP/1.1",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            assert_eq!(classify(http), Some(Detected::Http), "{http:?}");
        }
        for opaque in [
            &b"\x16\x03\x01\x02\x00"[..], // a TLS ClientHello
            b"GETX",
            b"get / HTTP/1.1",
            b"\x00\x00\x00\x01",
            b"HELO example.org\r\n",
            b"PRI * HTTP/1.1",
        ] {
            assert_eq!(classify(opaque), Some(Detected::Opaque), "{opaque:?}");
        }
        // Too short to tell yet.
        for partial in [&b"G"[..], b"GET", b"P", b"PU", b"PRI * HT", b"DELE"] {
            assert_eq!(classify(partial), None, "{partial:?}");
        }
    }

    async fn detected(send: &'static [u8], close: bool) -> Option<Detected> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let client = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut c = TcpStream::connect(addr).await.expect("connect");
            c.write_all(send).await.expect("write");
            if close {
                c.shutdown().await.expect("shutdown");
            }
            // Held open until the server has looked.
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let (server, _) = listener.accept().await.expect("accept");
        if !send.is_empty() || close {
            // The bytes (or the end) arrived before the wait starts: paused
            // time would otherwise run the wait out first.
            server.readable().await.expect("readable");
        }
        let got = detect(&server, Duration::from_secs(10))
            .await
            .expect("peek");
        client.abort();
        got
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_client_is_opaque_once_the_wait_is_over() {
        assert_eq!(
            detected(b"GET / HTTP/1.1\r\n", false).await,
            Some(Detected::Http)
        );
        assert_eq!(
            detected(b"\x16\x03\x01", false).await,
            Some(Detected::Opaque)
        );
        // Server-first protocols send nothing: opaque after the wait (paused
        // time runs it out at once).
        assert_eq!(detected(b"", false).await, Some(Detected::Opaque));
        // Part of a method, then silence: opaque after the wait too.
        assert_eq!(detected(b"GE", false).await, Some(Detected::Opaque));
        assert_eq!(detected(b"", true).await, None);
    }
}
