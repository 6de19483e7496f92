//! gRPC framing of the discovery port's streams, over [`crate::http2`].
//!
//! tonic's generated servers keep, for each stream, a decode buffer as large
//! as the largest request it has read and an encode buffer as large as the
//! largest response it has sent, for as long as the stream lives. The
//! control plane holds two streams per sidecar for hours, and a sidecar's
//! load reports and endpoint pushes grow with the endpoints it calls: at 100
//! endpoints those two buffers were 26 KiB of every sidecar's cost
//! (`minimesh bench control-plane --endpoints 100`, heaptrack). Here a
//! request's bytes are held only while a message is partly received, and
//! each response is encoded into a buffer of its exact size that goes with
//! it to the socket.
//!
//! What a stream accepts: uncompressed messages of at most
//! [`MAX_MESSAGE_BYTES`] (tonic's default limit); anything else ends it with
//! a status saying why.

use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::Stream;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::{Body, Frame};
use tonic::Status;

use crate::discovery::session::BoxStream;
use crate::http2::RecvBody;

/// The largest request message a stream accepts.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Compressed-flag byte and big-endian length before each message.
const PREFIX: usize = 5;

/// The messages of a request body, decoded one at a time.
pub(crate) struct Inbound<T> {
    body: RecvBody,
    /// A message received in part (or several frames' worth); empty, and
    /// with no allocation, between messages.
    partial: BytesMut,
    ended: bool,
    failed: bool,
    _message: PhantomData<fn() -> T>,
}

impl<T> Inbound<T> {
    /// Reads `body`.
    pub(crate) fn new(body: RecvBody) -> Self {
        Inbound {
            body,
            partial: BytesMut::new(),
            ended: false,
            failed: false,
            _message: PhantomData,
        }
    }
}

/// The length of the message at the front of `bytes`, once its prefix is
/// there, or why it is refused.
fn declared_len(bytes: &[u8]) -> Option<Result<usize, Status>> {
    let header = bytes.get(..PREFIX)?;
    if header[0] != 0 {
        return Some(Err(Status::unimplemented(
            "compressed messages are not accepted",
        )));
    }
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Some(Err(Status::resource_exhausted(format!(
            "a message of {len} bytes; the limit is {MAX_MESSAGE_BYTES}"
        ))));
    }
    Some(Ok(len))
}

/// The message at the front of `bytes`, if it is all there, and how many
/// bytes it took.
fn front<T: prost::Message + Default>(bytes: &[u8]) -> Option<Result<(T, usize), Status>> {
    let len = match declared_len(bytes)? {
        Ok(len) => len,
        Err(e) => return Some(Err(e)),
    };
    let body = bytes.get(PREFIX..PREFIX + len)?;
    Some(
        T::decode(body)
            .map(|m| (m, PREFIX + len))
            .map_err(|e| Status::invalid_argument(format!("undecodable message: {e}"))),
    )
}

impl<T: prost::Message + Default> Inbound<T> {
    fn next_in_partial(&mut self) -> Option<Result<T, Status>> {
        let r = front::<T>(&self.partial);
        match r {
            Some(Ok((m, used))) => {
                self.partial.advance(used);
                if self.partial.is_empty() {
                    // Free it: an idle stream holds nothing.
                    self.partial = BytesMut::new();
                }
                Some(Ok(m))
            }
            Some(Err(e)) => Some(Err(e)),
            None => {
                // Room for the whole message at once, not by doublings.
                if let Some(Ok(len)) = declared_len(&self.partial) {
                    self.partial
                        .reserve((PREFIX + len).saturating_sub(self.partial.len()));
                }
                None
            }
        }
    }
}

impl<T: prost::Message + Default> Stream for Inbound<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if this.failed {
                return Poll::Ready(None);
            }
            if !this.partial.is_empty() {
                if let Some(r) = this.next_in_partial() {
                    this.failed = r.is_err();
                    return Poll::Ready(Some(r));
                }
            }
            if this.ended {
                if this.partial.is_empty() {
                    return Poll::Ready(None);
                }
                this.failed = true;
                return Poll::Ready(Some(Err(Status::invalid_argument(
                    "the request ended inside a message",
                ))));
            }
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => this.ended = true,
                Poll::Ready(Some(Err(reset))) => {
                    this.failed = true;
                    return Poll::Ready(Some(Err(Status::cancelled(reset.to_string()))));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(mut data) = frame.into_data() else {
                        continue; // trailers: nothing in them for us
                    };
                    if this.partial.is_empty() {
                        // Most messages come in one frame: decode them
                        // where they are, and keep only what is left over.
                        if let Some(r) = front::<T>(&data) {
                            match r {
                                Ok((m, used)) => {
                                    data.advance(used);
                                    this.partial.extend_from_slice(&data);
                                    return Poll::Ready(Some(Ok(m)));
                                }
                                Err(e) => {
                                    this.failed = true;
                                    return Poll::Ready(Some(Err(e)));
                                }
                            }
                        }
                    }
                    this.partial.extend_from_slice(&data);
                }
            }
        }
    }
}

/// The response body of a stream: each response a gRPC message, then the
/// status as trailers.
struct Outbound<R> {
    responses: BoxStream<R>,
    done: bool,
}

fn trailers(status: &Status) -> HeaderMap {
    let mut map = HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        map.clear();
        map.insert("grpc-status", HeaderValue::from(status.code() as i32));
    }
    map
}

impl<R: prost::Message> Body for Outbound<R> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match this.responses.as_mut().poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(m))) => {
                let len = m.encoded_len();
                let Ok(len32) = u32::try_from(len) else {
                    this.done = true;
                    return Poll::Ready(Some(Ok(Frame::trailers(trailers(&Status::internal(
                        format!("a response of {len} bytes is too large for gRPC"),
                    ))))));
                };
                let mut buf = Vec::with_capacity(PREFIX + len);
                buf.push(0);
                buf.extend_from_slice(&len32.to_be_bytes());
                // The buffer has room for it all: encoding cannot fail.
                let _ = m.encode(&mut buf);
                Poll::Ready(Some(Ok(Frame::data(Bytes::from(buf)))))
            }
            Poll::Ready(Some(Err(status))) => {
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
            }
            Poll::Ready(None) => {
                this.done = true;
                Poll::Ready(Some(Ok(Frame::trailers(trailers(&Status::ok(""))))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// Serves a bidirectional-streaming call: `open` turns the request's
/// messages into the response stream.
pub(crate) fn serve<T, R>(
    request: Request<RecvBody>,
    open: impl FnOnce(Inbound<T>) -> BoxStream<R>,
) -> Response<tonic::body::Body>
where
    T: prost::Message + Default,
    R: prost::Message + 'static,
{
    if let Some(encoding) = request
        .headers()
        .get("grpc-encoding")
        .filter(|e| e.as_bytes() != b"identity")
    {
        return Status::unimplemented(format!(
            "messages compressed with {} are not accepted",
            String::from_utf8_lossy(encoding.as_bytes())
        ))
        .into_http();
    }
    let responses = open(Inbound::new(request.into_body()));
    let mut response = Response::new(tonic::body::Body::new(Outbound {
        responses,
        done: false,
    }));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use minimesh_proto::v1::Node;
    use prost::Message as _;

    fn framed(flag: u8, len: u32, body: &[u8]) -> Vec<u8> {
        let mut v = vec![flag];
        v.extend_from_slice(&len.to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn a_message_is_read_once_it_is_all_there_and_bad_ones_say_why() {
        let node = Node {
            id: "a.default".into(),
            ..Default::default()
        };
        let body = node.encode_to_vec();
        let whole = framed(0, body.len() as u32, &body);
        // Not all there: the prefix, or the prefix and part of the message.
        for cut in [0, 3, PREFIX, whole.len() - 1] {
            assert!(front::<Node>(&whole[..cut]).is_none(), "{cut}");
        }
        let (got, used) = front::<Node>(&whole).expect("all there").expect("decodes");
        assert_eq!((got, used), (node, whole.len()));
        // Compressed, too large (refused from the prefix alone), undecodable.
        let err = |bytes: &[u8]| {
            front::<Node>(bytes)
                .expect("an answer")
                .expect_err("refused")
        };
        let e = err(&framed(1, body.len() as u32, &body));
        assert_eq!(e.code(), tonic::Code::Unimplemented);
        assert_eq!(e.message(), "compressed messages are not accepted");
        let e = err(&framed(0, 5 << 20, &[]));
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            e.message(),
            "a message of 5242880 bytes; the limit is 4194304"
        );
        let e = err(&framed(0, 2, &[0xff, 0xff]));
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(
            e.message().starts_with("undecodable message: "),
            "{}",
            e.message()
        );
    }
}
