//! Reading a response from memory exactly as the pool reads one from a
//! connection (head, then body to its end), split into reads of a chosen
//! size: the entry point of the coverage-guided fuzz target
//! (`fuzz/fuzz_targets/h1_response.rs`) and of the corpus test. Not part of
//! the sidecar's interface.

use std::future::Future;
use std::pin::{pin, Pin};

use tokio::io::ReadBuf;

use super::*;

/// What reading a response came to, comparable across read sizes.
#[derive(Debug, PartialEq, Eq)]
pub struct Read {
    /// Its status.
    pub status: u16,
    /// Its header fields, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Its body, decoded.
    pub body: Vec<u8>,
    /// Its trailer fields, as passed on.
    pub trailers: Option<Vec<(String, Vec<u8>)>>,
    /// The connection would be used again (kept alive, nothing after the
    /// response).
    pub reusable: bool,
}

/// Bytes handed out at most `step` at a time.
struct Trickle<'a> {
    data: &'a [u8],
    step: usize,
}

impl AsyncRead for Trickle<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let n = self.step.min(self.data.len()).min(buf.remaining());
        let (now, rest) = self.data.split_at(n);
        buf.put_slice(now);
        self.data = rest;
        Poll::Ready(Ok(()))
    }
}

struct Memory<'a> {
    io: Trickle<'a>,
    rbuf: BytesMut,
}

impl Source for Memory<'_> {
    fn rbuf(&mut self) -> &mut BytesMut {
        &mut self.rbuf
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        poll_fill(&mut self.io, &mut self.rbuf, cx)
    }
}

fn fields(h: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    h.iter()
        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
        .collect()
}

/// Reads one response (to a HEAD request when `is_head`) from `data`, in
/// reads of at most `step` bytes. Memory never makes a read wait, so a
/// pending poll is a bug and reported as an error.
pub fn read_response(data: &[u8], step: usize, is_head: bool) -> Result<Read, Error> {
    let mut mem = Memory {
        io: Trickle {
            data,
            step: step.max(1),
        },
        rbuf: BytesMut::new(),
    };
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut keep_alive = true;
    let (head, mut decoder) = {
        let mut head = pin!(read_head(
            &mut mem.io,
            &mut mem.rbuf,
            &mut keep_alive,
            is_head
        ));
        match head.as_mut().poll(&mut cx) {
            Poll::Ready(r) => r?,
            Poll::Pending => return Err(invalid("reading the head waited on memory")),
        }
    };
    let mut body = Vec::new();
    let mut trailers = None;
    loop {
        match decoder.poll_frame(&mut mem, &mut cx) {
            Poll::Ready(None) => break,
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => body.extend_from_slice(&data),
                Err(frame) => trailers = frame.into_trailers().ok().map(|t| fields(&t)),
            },
            Poll::Ready(Some(Err(e))) => return Err(e),
            Poll::Pending => return Err(invalid("reading the body waited on memory")),
        }
    }
    Ok(Read {
        status: head.status().as_u16(),
        headers: fields(head.headers()),
        body,
        trailers,
        // Bytes after the response make the connection unusable whether
        // they came in the same read (left in the buffer) or after it (the
        // pool's checkout sees the socket readable).
        reusable: keep_alive && mem.rbuf.is_empty() && mem.io.data.is_empty(),
    })
}

/// The fuzz target's property: reading `data` gives the same result (or an
/// error either way) whether it arrives in one read, byte by byte, or in
/// reads of `step` bytes; and never panics or waits. Returns the one-read
/// result.
pub fn check(data: &[u8], step: usize, is_head: bool) -> Result<Read, Error> {
    let whole = read_response(data, usize::MAX, is_head);
    for s in [1, step.max(1)] {
        let split = read_response(data, s, is_head);
        match (&whole, &split) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "reads of {s} bytes read otherwise"),
            (Err(_), Err(_)) => {}
            _ => panic!("reads of {s} bytes: {split:?}; one read: {whole:?}"),
        }
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz target's seed corpus, checked on every test run.
    #[test]
    fn the_fuzz_corpus_reads_alike_however_it_is_split() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/h1_response");
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).expect("the corpus") {
            let data = std::fs::read(entry.expect("entry").path()).expect("read");
            let Some((&first, rest)) = data.split_first() else {
                continue;
            };
            let _ = check(rest, usize::from(first % 64) + 1, first & 0x80 != 0);
            n += 1;
        }
        assert!(n >= 5, "{n} corpus files in {}", dir.display());
    }

    #[test]
    fn a_response_reads_whole_however_it_is_split() {
        let r = check(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;a=\"b\"\r\nhello\r\n0\r\nx-sum: 1\r\ncontent-length: 9\r\n\r\n",
            3,
            false,
        )
        .expect("reads");
        assert_eq!(r.body, b"hello");
        assert_eq!(r.trailers, Some(vec![("x-sum".into(), b"1".to_vec())]));
        assert!(r.reusable);
        // A head over the limit is refused whether it came in one read or many.
        let mut big = b"HTTP/1.1 200 OK\r\n".to_vec();
        while big.len() <= MAX_HEAD {
            big.extend_from_slice(b"x-pad: 0123456789012345678901234567890123456789\r\n");
        }
        big.extend_from_slice(b"content-length: 0\r\n\r\n");
        assert!(check(&big, 9000, false).is_err());
    }
}
