//! What serving HTTP needs of a client connection's transport: a plain
//! TCP stream on the outbound listener (read directly, no wrapper on each
//! read), TLS or plaintext ([`crate::tls::Io`]) on the inbound and captured
//! ones.

use tokio::net::TcpStream;

/// A client connection as [`super::serve_http`] serves it: bytes both ways, and
/// what its transport says of the client. A plain TCP stream (outbound)
/// or the TLS-or-plaintext [`crate::tls::Io`] (inbound, captured).
pub(crate) trait ClientIo:
    tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static
{
    /// Plaintext (no TLS).
    fn plaintext(&self) -> bool;
    /// The SPIFFE identity a mutual TLS client proved.
    fn peer_identity(&self) -> Option<String>;
}

impl ClientIo for TcpStream {
    fn plaintext(&self) -> bool {
        true
    }

    fn peer_identity(&self) -> Option<String> {
        None
    }
}

impl ClientIo for crate::tls::Io {
    fn plaintext(&self) -> bool {
        matches!(self, crate::tls::Io::Plain(_))
    }

    fn peer_identity(&self) -> Option<String> {
        crate::tls::Io::peer_identity(self)
    }
}
