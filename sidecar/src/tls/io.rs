//! A connection to or from another sidecar: plaintext TCP, or TLS over it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A connection's byte stream.
pub enum Io {
    /// Plaintext.
    Plain(TcpStream),
    /// TLS this sidecar opened.
    Client(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    /// TLS a client opened to this sidecar.
    Server(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Io {
    /// True when an idle connection cannot take a request: the peer closed
    /// or reset it, or sent bytes nobody asked for. For plaintext, no
    /// system call unless the socket became readable; over TLS, one
    /// non-blocking read (which also takes in records that carry no data,
    /// such as session tickets).
    pub fn is_closed(&mut self) -> bool {
        match self {
            Io::Plain(s) => {
                let mut probe = [0u8; 1];
                !matches!(s.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
            tls => {
                let mut probe = [0u8; 1];
                let mut buf = ReadBuf::new(&mut probe);
                let mut cx = Context::from_waker(std::task::Waker::noop());
                !matches!(Pin::new(tls).poll_read(&mut cx, &mut buf), Poll::Pending)
            }
        }
    }

    /// The TCP stream under it.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Io::Plain(s) => s,
            Io::Client(s) => s.get_ref().0,
            Io::Server(s) => s.get_ref().0,
        }
    }

    /// True over TLS.
    pub fn is_tls(&self) -> bool {
        !matches!(self, Io::Plain(_))
    }

    /// The application protocol the TLS handshake settled on (ALPN).
    pub fn alpn(&self) -> Option<&[u8]> {
        match self {
            Io::Plain(_) => None,
            Io::Client(s) => s.get_ref().1.alpn_protocol(),
            Io::Server(s) => s.get_ref().1.alpn_protocol(),
        }
    }

    /// The SPIFFE ID of the peer's certificate (a TLS client this sidecar
    /// accepted, or the server it dialed).
    pub fn peer_identity(&self) -> Option<String> {
        let certs = match self {
            Io::Plain(_) => return None,
            Io::Client(s) => s.get_ref().1.peer_certificates(),
            Io::Server(s) => s.get_ref().1.peer_certificates(),
        }?;
        super::spiffe_id(certs.first()?)
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Client(s) => Pin::new(s).poll_read(cx, buf),
            Io::Server(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Client(s) => Pin::new(s).poll_write(cx, buf),
            Io::Server(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Client(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Server(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Client(s) => s.is_write_vectored(),
            Io::Server(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Client(s) => Pin::new(s).poll_flush(cx),
            Io::Server(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Client(s) => Pin::new(s).poll_shutdown(cx),
            Io::Server(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
