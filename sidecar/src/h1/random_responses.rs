//! Random upstream responses, checked against a model of what each one
//! means. For every well-formed response, in every framing RFC 9112 allows
//! (Content-Length, chunked with extensions and trailers, until close,
//! bodyless), arriving in random pieces, the client must read back exactly
//! the status, fields, body and trailers that were sent, and must offer the
//! connection for reuse exactly when the server keeps it open; a reused
//! connection must then read the next response intact (no bytes of one
//! response leak into the next). Responses cut short must be errors, never a
//! body that looks complete; responses with flipped bytes must never panic
//! or hang.
//!
//! Case `i` uses seed `i`; a failure names its seed and the bytes sent.
//! `MINIMESH_H1_FUZZ_CASES` runs more than the default 1,500.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::UpstreamBody;
use super::*;
use bytes::Bytes;
use http::header::HeaderValue;
use http::Method;

/// splitmix64: small, fast, and the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }

    /// A field value: visible ASCII and inner spaces.
    fn value(&mut self) -> String {
        let n = 1 + self.below(20) as usize;
        (0..n)
            .map(|i| {
                let c = (b' ' + self.below(95) as u8) as char;
                if c == ' ' && (i == 0 || i == n - 1) {
                    'v'
                } else {
                    c
                }
            })
            .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Framing {
    Length,
    Chunked,
    /// No length: the body runs until the server closes.
    UntilClose,
    /// A transfer coding that is not chunked: until close as well.
    OtherCoding,
    /// HEAD, 204 or 304.
    Bodyless,
}

/// What one response means, and its bytes.
struct Case {
    head_request: bool,
    status: u16,
    fields: Vec<(String, String)>,
    body: Vec<u8>,
    trailers: Vec<(String, String)>,
    framing: Framing,
    keep_alive: bool,
    bytes: Vec<u8>,
    /// Where the final response's body framing begins (after its head).
    head_len: usize,
    /// None, or the corruption applied to `bytes`.
    corruption: Option<Corruption>,
}

#[derive(Clone, Copy, Debug)]
enum Corruption {
    /// The server closes after this many bytes.
    CutAt(usize),
    /// A byte flipped.
    Flip,
}

fn random_case(seed: u64) -> Case {
    let mut rng = Rng(seed);
    let head_request = rng.chance(10);
    let status = if head_request {
        200
    } else {
        rng.pick(&[200, 200, 201, 204, 304, 404, 500, 503])
    };
    let framing = if head_request || status == 204 || status == 304 {
        Framing::Bodyless
    } else {
        rng.pick(&[
            Framing::Length,
            Framing::Length,
            Framing::Chunked,
            Framing::Chunked,
            Framing::UntilClose,
            Framing::OtherCoding,
        ])
    };
    let http10 = matches!(framing, Framing::Length | Framing::Bodyless) && rng.chance(10);
    let body_len = match rng.below(4) {
        0 => 0,
        1 | 2 => rng.below(200),
        _ => rng.below(100_000),
    } as usize;
    let body: Vec<u8> = match framing {
        Framing::Bodyless => Vec::new(),
        _ => (0..body_len).map(|_| rng.next() as u8).collect(),
    };

    let mut out = Vec::new();
    if !http10 && rng.chance(10) {
        out.extend_from_slice(rng.pick(&[
            &b"HTTP/1.1 100 Continue\r\n\r\n"[..],
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n",
        ]));
    }
    let version = if http10 { "HTTP/1.0" } else { "HTTP/1.1" };
    let reason = rng.pick(&["OK", "", "Whatever It Says"]);
    out.extend(format!("{version} {status} {reason}\r\n").into_bytes());
    let mut fields = Vec::new();
    for i in 0..rng.below(6) {
        let name = if rng.chance(50) {
            format!("x-field-{i}")
        } else {
            format!("X-Field-{i}")
        };
        fields.push((name, rng.value()));
    }
    let mut keep_alive = !http10;
    if http10 && rng.chance(50) {
        fields.push(("Connection".into(), "keep-alive".into()));
        keep_alive = true;
    }
    if rng.chance(15) {
        fields.push(("connection".into(), "close".into()));
        keep_alive = false;
    }
    let cl_name = rng.pick(&["content-length", "Content-Length"]);
    match framing {
        Framing::Length => fields.push((cl_name.into(), body.len().to_string())),
        Framing::Chunked => {
            let coding = rng.pick(&["chunked", "gzip, chunked", "Chunked"]);
            fields.push(("transfer-encoding".into(), coding.into()));
        }
        Framing::UntilClose => keep_alive = false,
        Framing::OtherCoding => {
            fields.push(("transfer-encoding".into(), "gzip".into()));
            keep_alive = false;
        }
        Framing::Bodyless => {
            // A HEAD (or 304) response may state the length the body would
            // have had; none follows.
            if status != 204 && rng.chance(50) {
                fields.push((cl_name.into(), rng.below(100_000).to_string()));
            }
        }
    }
    for (name, value) in &fields {
        out.extend(format!("{name}: {value}\r\n").into_bytes());
    }
    out.extend_from_slice(b"\r\n");
    let head_len = out.len();

    let mut trailers = Vec::new();
    match framing {
        Framing::Chunked => {
            let mut rest = &body[..];
            while !rest.is_empty() {
                let n = (1 + rng.below(rest.len() as u64 * 2) as usize).min(rest.len());
                let ext = if rng.chance(20) { ";name=value" } else { "" };
                let size = if rng.chance(50) {
                    format!("{n:x}")
                } else {
                    format!("{n:X}")
                };
                out.extend(format!("{size}{ext}\r\n").into_bytes());
                out.extend_from_slice(&rest[..n]);
                out.extend_from_slice(b"\r\n");
                rest = &rest[n..];
            }
            out.extend_from_slice(b"0\r\n");
            for i in 0..rng.below(3) {
                let t = (format!("x-trailer-{i}"), rng.value());
                out.extend(format!("{}: {}\r\n", t.0, t.1).into_bytes());
                trailers.push(t);
            }
            out.extend_from_slice(b"\r\n");
        }
        Framing::Bodyless => {}
        _ => out.extend_from_slice(&body),
    }

    let corruption = if rng.chance(35) {
        let at = rng.below(out.len() as u64) as usize;
        Some(if rng.chance(50) {
            Corruption::CutAt(at)
        } else {
            out[at] ^= 1 << rng.below(8);
            Corruption::Flip
        })
    } else {
        None
    };
    Case {
        head_request,
        status,
        fields,
        body,
        trailers,
        framing,
        keep_alive,
        bytes: out,
        head_len,
        corruption,
    }
}

/// What the client read.
#[derive(Debug, Default)]
struct Read {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
    trailers: Option<HeaderMap>,
}

async fn read_response(conn: &mut Conn, is_head: bool) -> Result<Read, Error> {
    let method = if is_head { Method::HEAD } else { Method::GET };
    let body = UpstreamBody::Buffered(Bytes::new());
    let mut out = encode(&method, "/", &HeaderMap::new(), Some("ep:80"), body);
    let (response, mut decoder) = conn.exchange(&mut out).await?;
    let mut read = Read {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        ..Read::default()
    };
    while let Some(frame) = std::future::poll_fn(|cx| decoder.poll_frame(conn, cx)).await {
        match frame?.into_data() {
            Ok(data) => read.body.extend_from_slice(&data),
            Err(frame) => read.trailers = frame.into_trailers().ok(),
        }
    }
    Ok(read)
}

/// The upstream: reads each request head and answers with `responses` in
/// random pieces, closing after the last.
async fn serve_one(listener: &TcpListener, seed: u64, responses: Vec<Vec<u8>>) {
    let (mut io, _) = listener.accept().await.unwrap();
    let mut rng = Rng(seed ^ 0x5eed);
    for response in responses {
        let mut request = Vec::new();
        let mut byte = [0u8; 1];
        while !request.ends_with(b"\r\n\r\n") {
            match io.read(&mut byte).await {
                Ok(1) => request.push(byte[0]),
                _ => return,
            }
        }
        let mut rest = &response[..];
        while !rest.is_empty() {
            let n = if rng.chance(30) {
                1 + rng.below(rest.len() as u64) as usize
            } else {
                rest.len()
            };
            if io.write_all(&rest[..n]).await.is_err() {
                return;
            }
            tokio::task::yield_now().await;
            rest = &rest[n..];
        }
    }
    // Closing: a response framed by the close ends here.
}

/// One case; the reason if the client got it wrong.
async fn run_case(listener: &TcpListener, seed: u64) -> Result<(), String> {
    let case = random_case(seed);
    let second = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond".to_vec();
    // The server offers a second response only when it keeps the
    // connection open (and the first was sent whole).
    let mut responses = vec![match case.corruption {
        Some(Corruption::CutAt(at)) => case.bytes[..at].to_vec(),
        _ => case.bytes.clone(),
    }];
    if case.keep_alive && case.corruption.is_none() {
        responses.push(second);
    }
    let addr = listener.local_addr().unwrap();
    // The client reads the first response and, when the connection may be
    // reused, the next one; then it lets the connection go, so that a
    // server still writing what the client refused is not left blocked.
    let client = async {
        let io = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let io = crate::tls::Io::Plain(io);
        let mut conn = Conn::new(io, &Arc::new(AtomicU32::new(0)));
        let first = read_response(&mut conn, case.head_request).await;
        let reusable = conn.reusable();
        let next = if first.is_ok() && reusable && case.corruption.is_none() {
            Some(read_response(&mut conn, false).await)
        } else {
            None
        };
        Ok::<_, String>((first, reusable, next))
    };
    let ((), client) = tokio::join!(serve_one(listener, seed, responses), async {
        tokio::time::timeout(Duration::from_secs(10), client).await
    });
    let (first, reusable, next) = client.map_err(|_| "the client hung".to_string())??;

    match case.corruption {
        Some(Corruption::Flip) => return Ok(()), // anything but a panic or a hang
        Some(Corruption::CutAt(at)) => {
            let detectable =
                at < case.head_len || matches!(case.framing, Framing::Length | Framing::Chunked);
            return match first {
                Ok(read) if detectable => Err(format!(
                    "a response cut at byte {at} of {} read as complete ({} body bytes)",
                    case.bytes.len(),
                    read.body.len()
                )),
                _ => Ok(()),
            };
        }
        None => {}
    }

    let read = first.map_err(|e| format!("a well-formed response refused: {e}"))?;
    if read.status != case.status {
        return Err(format!("status {} read as {}", case.status, read.status));
    }
    for (name, value) in &case.fields {
        let got: Vec<&[u8]> = read
            .headers
            .get_all(name.as_str())
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        if !got.contains(&value.as_bytes()) {
            return Err(format!("field {name}: {value:?} read as {got:?}"));
        }
    }
    if read.body != case.body {
        return Err(format!(
            "a {:?} body of {} bytes read as {} bytes{}",
            case.framing,
            case.body.len(),
            read.body.len(),
            if read.body.len() == case.body.len() {
                " with other content"
            } else {
                ""
            }
        ));
    }
    let mut want_trailers: Vec<(String, String)> = case.trailers.clone();
    want_trailers.sort();
    let mut got_trailers: Vec<(String, String)> = read
        .trailers
        .iter()
        .flat_map(|t| t.iter())
        .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
        .collect();
    got_trailers.sort();
    if got_trailers != want_trailers {
        return Err(format!(
            "trailers {want_trailers:?} read as {got_trailers:?}"
        ));
    }
    if reusable != case.keep_alive {
        return Err(format!(
            "reusable: {reusable}, though the server {} the connection open",
            if case.keep_alive {
                "keeps"
            } else {
                "does not keep"
            }
        ));
    }
    if let Some(next) = next {
        // The next response on the same connection reads intact.
        let next = next.map_err(|e| format!("the next response on the connection: {e}"))?;
        if next.body != b"second" {
            return Err(format!(
                "the next response read as {:?}",
                String::from_utf8_lossy(&next.body)
            ));
        }
    }
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn random_responses_read_as_sent() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cases: u64 = std::env::var("MINIMESH_H1_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_500);
    let mut failures = Vec::new();
    for seed in 0..cases {
        if let Err(reason) = run_case(&listener, seed).await {
            failures.push((seed, reason));
        }
    }
    if let Some((seed, _)) = failures.first() {
        let list: Vec<String> = failures
            .iter()
            .take(5)
            .map(|(seed, reason)| format!("  seed {seed}: {reason}"))
            .collect();
        let case = random_case(*seed);
        let shown = &case.bytes[..case.bytes.len().min(2_000)];
        panic!(
            "{} of {cases} cases failed; the first five:\n{}\nseed {seed} sent ({:?}, {:?}): {:?}",
            failures.len(),
            list.join("\n"),
            case.framing,
            case.corruption,
            String::from_utf8_lossy(shown)
        );
    }
}
