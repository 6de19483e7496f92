//! Random frame sequences against the server, as a hostile or broken peer
//! would send them: mostly well-formed requests, with bad frames, bad
//! settings, bad header blocks, stray CONTINUATIONs, resets, window updates
//! of every size and flipped bytes mixed in. Whatever a peer sends, the
//! server must
//! - not panic, and close the connection once the peer has closed its side;
//! - write only whole frames: its header blocks decode, its DATA belongs to
//!   streams it answered and stays within the peer's windows, nothing follows
//!   a GOAWAY for an error;
//! - keep serving everyone else.
//!
//! The cases are deterministic (case `i` uses seed `i`): a failure names its
//! seed and the bytes sent. `MINIMESH_HTTP2_FUZZ_CASES` runs more cases than
//! the default 1,500 (for a longer search by hand).

use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::hpack::{self, put_integer};
use super::*;

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
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// Fewer than `n` random bytes.
    fn some_bytes(&mut self, n: u64) -> Vec<u8> {
        let len = self.below(n) as usize;
        self.bytes(len)
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, id: u32, payload: &[u8]) {
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.extend([kind, flags]);
    out.extend(id.to_be_bytes());
    out.extend_from_slice(payload);
}

/// What one case sends, and what it tells the checks.
struct Case {
    bytes: Vec<u8>,
    /// The case may have raised the server's send windows (WINDOW_UPDATE, a
    /// larger SETTINGS_INITIAL_WINDOW_SIZE, or flipped bytes that could be
    /// either); otherwise the server may send at most 65,535 bytes of DATA.
    windows_raised: bool,
}

/// A string literal, Huffman-coded or not (the flag only: random bytes
/// flagged as Huffman are a decoding error the server must report).
fn put_string(out: &mut Vec<u8>, s: &[u8], huffman: bool) {
    put_integer(out, s.len(), 7, if huffman { 0x80 } else { 0 });
    out.extend_from_slice(s);
}

/// The sizes of the entries in the server's dynamic table, as this peer
/// keeps track of them (RFC 7541 §4: name, value and 32 bytes an entry).
struct Table {
    sizes: std::collections::VecDeque<usize>,
    max: usize,
}

impl Table {
    fn insert(&mut self, name: &[u8], value: &[u8]) {
        self.sizes.push_front(name.len() + value.len() + 32);
        self.evict();
    }

    fn evict(&mut self) {
        while self.sizes.iter().sum::<usize>() > self.max {
            self.sizes.pop_back();
        }
    }
}

/// A request header block: valid, in every representation HPACK has, or
/// (with chance `bad` percent at each choice) something a peer may not send.
fn header_block(rng: &mut Rng, bad: u64, table: &mut Table) -> Vec<u8> {
    let mut b = Vec::new();
    if rng.chance(bad / 4) {
        return rng.some_bytes(40);
    }
    if rng.chance(10) {
        // A dynamic table size update: within the 4,096 allowed, or not.
        let size = if rng.chance(bad) {
            rng.pick(&[4097, 1 << 20])
        } else {
            rng.pick(&[0, 100, 4096])
        };
        put_integer(&mut b, size, 5, 0x20);
        table.max = size;
        table.evict();
    }
    if rng.chance(bad) {
        hpack::put_field(&mut b, b":method", rng.pick(&[&b""[..], b"B A D"]), false);
    } else {
        b.push(0x83); // :method POST
    }
    b.push(0x86); // :scheme http
    let path: &[u8] = if rng.chance(bad) {
        rng.pick(&[&b""[..], b"no-slash"])
    } else {
        rng.pick(&[&b"/echo"[..], b"/trailers", b"/big", b"/slow"])
    };
    match rng.below(3) {
        // Literal with incremental indexing: enters the dynamic table.
        0 => {
            b.push(0x44);
            put_string(&mut b, path, false);
            table.insert(b":path", path);
        }
        // Indexed from the dynamic table: an entry put there before (a
        // path, or an authority: then the request has no path), or, when
        // bad, one beyond the table.
        1 if !table.sizes.is_empty() || rng.chance(bad) => {
            let len = table.sizes.len();
            let index = if len == 0 || rng.chance(bad) {
                len
            } else {
                rng.below(len as u64) as usize
            };
            put_integer(&mut b, 62 + index, 7, 0x80);
        }
        _ => hpack::put_field(&mut b, b":path", path, false),
    }
    if rng.chance(70) {
        b.push(0x41); // :authority, indexed name, incremental indexing
        put_string(&mut b, b"cp", false);
        table.insert(b":authority", b"cp");
    }
    for _ in 0..rng.below(4) {
        if !rng.chance(bad) {
            let (name, value) = rng.pick(&[
                (&b"content-type"[..], &b"application/grpc"[..]),
                (b"te", b"trailers"),
                (b"grpc-timeout", b"5S"),
            ]);
            hpack::put_field(&mut b, name, value, rng.chance(20));
            continue;
        }
        match rng.below(4) {
            // Not a valid field name in HTTP/2 (upper case), or a pseudo-
            // header a request does not have.
            0 => hpack::put_field(&mut b, b"X-Upper", b"1", false),
            1 => hpack::put_field(&mut b, b":bogus", b"1", false),
            2 => {
                b.push(0x00);
                let (name, value) = (rng.some_bytes(8), rng.some_bytes(8));
                put_string(&mut b, &name, rng.chance(50));
                put_string(&mut b, &value, rng.chance(50));
            }
            // A length far beyond the block: refused, not allocated.
            _ => {
                b.push(0x00);
                put_integer(&mut b, 1 << 30, 7, 0);
            }
        }
    }
    b
}

fn settings_payload(rng: &mut Rng, bad: u64, windows_raised: &mut bool) -> Vec<u8> {
    let mut p = Vec::new();
    for _ in 0..rng.below(4) {
        let (key, value): (u16, u32) = if rng.chance(bad) {
            (
                rng.pick(&[0x2, 0x4, 0x5]),
                rng.pick(&[2, 16_383, 0x8000_0000, 1 << 24, u32::MAX]),
            )
        } else {
            match rng.below(7) {
                0 => (0x1, rng.pick(&[0, 4096, 1 << 16])),
                1 => (0x2, rng.pick(&[0, 1])),
                2 => (0x3, rng.pick(&[0, 100])),
                3 => (0x4, rng.pick(&[0, 1, 1000, 65_535, 1 << 20, 0x7fff_ffff])),
                4 => (0x5, rng.pick(&[16_384, 1 << 20, 16_777_215])),
                5 => (0x6, rng.pick(&[0, 1 << 20])),
                // Unknown settings are ignored.
                _ => (rng.pick(&[0x0, 0x7, 0x8, 0xffff]), rng.next() as u32),
            }
        };
        if key == 0x4 && value > 65_535 {
            *windows_raised = true;
        }
        p.extend(key.to_be_bytes());
        p.extend(value.to_be_bytes());
    }
    if rng.chance(bad / 4) {
        p.push(0); // not a multiple of 6
    }
    p
}

/// One connection's bytes. A case has a hostility, `bad`: the chance in
/// percent, at each choice, of something a peer may not send. A third of
/// the cases are well-behaved, so that the deeper states (responses, flow
/// control, trailers, settings changes mid-stream) are reached as often as
/// the errors.
fn random_case(seed: u64) -> Case {
    let mut rng = Rng(seed);
    let bad = rng.pick(&[0, 0, 1, 3, 10, 30]);
    let mut out = Vec::new();
    let mut windows_raised = false;
    if rng.chance(bad / 4) {
        out.extend(rng.bytes(24));
    } else {
        out.extend_from_slice(PREFACE);
    }
    if !rng.chance(bad / 4) {
        let p = settings_payload(&mut rng, bad, &mut windows_raised);
        frame(&mut out, SETTINGS, 0, 0, &p);
    }
    let mut next_id = 1u32;
    let mut opened: Vec<u32> = Vec::new();
    let mut table = Table {
        sizes: Default::default(),
        max: hpack::TABLE_SIZE,
    };
    for _ in 0..=rng.below(24) {
        // A stream this peer opened, or (when bad, or none is open) any.
        let id = |rng: &mut Rng, opened: &[u32]| -> u32 {
            if opened.is_empty() || rng.chance(bad) {
                rng.pick(&[0, 1, 2, 3, 99, 0x7fff_ffff, 0xffff_ffff])
            } else {
                rng.pick(opened)
            }
        };
        if rng.chance(bad / 3) {
            // A frame no client may send, or that no peer may send here.
            match rng.below(5) {
                0 => {
                    let p = header_block(&mut rng, bad, &mut table);
                    let id = id(&mut rng, &opened);
                    frame(&mut out, CONTINUATION, END_HEADERS, id, &p);
                }
                1 => frame(&mut out, PUSH_PROMISE, END_HEADERS, 1, &[0, 0, 0, 2]),
                2 => frame(&mut out, PING, 0, rng.pick(&[0, 1]), &rng.some_bytes(12)),
                3 => frame(&mut out, GOAWAY, 0, 1, &[0; 8]),
                _ => frame(&mut out, RST_STREAM, 0, rng.pick(&[0, 99]), &[0; 4]),
            }
            continue;
        }
        // Frames on streams wait for a stream to be open, unless bad.
        let kind = if opened.is_empty() && !rng.chance(bad) {
            0
        } else {
            rng.below(100)
        };
        match kind {
            0..=29 => {
                let id = if rng.chance(90) {
                    let id = next_id;
                    next_id += 2;
                    opened.push(id);
                    id
                } else {
                    // Trailers on an open stream, or a stream id out of order.
                    id(&mut rng, &opened)
                };
                let block = header_block(&mut rng, bad, &mut table);
                let mut flags = 0;
                if rng.chance(50) {
                    flags |= END_STREAM;
                }
                let mut payload = Vec::new();
                let pad = rng.chance(10).then(|| rng.below(20) as u8);
                if let Some(pad) = pad {
                    flags |= PADDED;
                    payload.push(pad);
                }
                if rng.chance(10) {
                    flags |= PRIORITY_FLAG;
                    payload.extend(rng.pick(&[0u32, 1, 0x8000_0001]).to_be_bytes());
                    payload.push(15);
                }
                // Split the block across CONTINUATION frames now and then.
                let split = if rng.chance(15) {
                    rng.below(block.len() as u64 + 1) as usize
                } else {
                    block.len()
                };
                payload.extend_from_slice(&block[..split]);
                if let Some(pad) = pad {
                    // When bad, a pad length longer than the frame.
                    let n = if rng.chance(bad) { 0 } else { usize::from(pad) };
                    payload.extend(std::iter::repeat_n(0, n));
                }
                if split == block.len() && !rng.chance(bad) {
                    flags |= END_HEADERS;
                }
                frame(&mut out, HEADERS, flags, id, &payload);
                if split < block.len() {
                    let rest = &block[split..];
                    let mid = rest.len() / 2;
                    frame(&mut out, CONTINUATION, 0, id, &rest[..mid]);
                    let end = if rng.chance(bad) { 0 } else { END_HEADERS };
                    frame(&mut out, CONTINUATION, end, id, &rest[mid..]);
                }
            }
            30..=59 => {
                let id = id(&mut rng, &opened);
                let len = if rng.chance(bad) {
                    MAX_FRAME as u64 + rng.below(100)
                } else if rng.chance(80) {
                    rng.below(100)
                } else {
                    rng.below(MAX_FRAME as u64 + 1)
                } as usize;
                let mut flags = 0;
                if rng.chance(40) {
                    flags |= END_STREAM;
                }
                let mut payload = Vec::with_capacity(len + 1);
                if rng.chance(10) && len > 0 {
                    flags |= PADDED;
                    payload.push(rng.below(len as u64) as u8);
                }
                payload.resize(len, 7);
                frame(&mut out, DATA, flags, id, &payload);
            }
            60..=74 => {
                windows_raised = true;
                let id = if rng.chance(40) {
                    0
                } else {
                    id(&mut rng, &opened)
                };
                let increment: u32 = if rng.chance(bad) {
                    rng.pick(&[0, 0x7fff_ffff, 0xffff_ffff])
                } else {
                    rng.pick(&[1, 1000, 65_535, 1 << 20])
                };
                let mut p = increment.to_be_bytes().to_vec();
                if rng.chance(bad / 4) {
                    p.pop();
                }
                frame(&mut out, WINDOW_UPDATE, 0, id, &p);
            }
            75..=81 => {
                if rng.chance(20) {
                    frame(&mut out, SETTINGS, ACK, 0, &[]);
                } else {
                    let p = settings_payload(&mut rng, bad, &mut windows_raised);
                    frame(&mut out, SETTINGS, 0, 0, &p);
                }
            }
            82..=87 => {
                let ack = if rng.chance(30) { ACK } else { 0 };
                let p = rng.bytes(8);
                frame(&mut out, PING, ack, 0, &p);
            }
            88..=92 => {
                let id = id(&mut rng, &opened);
                let code: u32 = rng.pick(&[0, 8, 0xdead]);
                frame(&mut out, RST_STREAM, 0, id, &code.to_be_bytes());
            }
            93..=96 => {
                let id = id(&mut rng, &opened);
                let len = if rng.chance(bad) { 4 } else { 5 };
                let p = rng.bytes(len);
                frame(&mut out, PRIORITY, 0, id, &p);
            }
            97 => {
                // Going away: no new streams, but those open finish.
                let mut p = vec![0; 8];
                p.extend(rng.some_bytes(8));
                frame(&mut out, GOAWAY, 0, 0, &p);
            }
            _ => {
                // An unknown frame type, which is ignored.
                let kind = 0x0a + rng.below(0xf6) as u8;
                let flags = rng.next() as u8;
                let p = rng.some_bytes(32);
                frame(&mut out, kind, flags, rng.below(8) as u32, &p);
            }
        }
    }
    if rng.chance(bad / 3) {
        windows_raised = true;
        for _ in 0..=rng.below(3) {
            let at = PREFACE.len() + rng.below((out.len() - PREFACE.len()) as u64) as usize;
            out[at] ^= 1 << rng.below(8);
        }
    }
    Case {
        bytes: out,
        windows_raised,
    }
}

/// Panics on this test's threads (the server's tasks run on them too).
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            if name.contains("random_frames") {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

type Body = tonic::body::Body;

/// A server whose handler answers by path: echo the body, echo it with
/// trailers, send 200 KiB (more than any window), or never answer.
async fn server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handler: Handler = Arc::new(|request: Request<RecvBody>| {
        Box::pin(async move {
            let path = request.uri().path().to_string();
            if path == "/slow" {
                std::future::pending::<()>().await;
            }
            let Ok(body) = request.into_body().collect().await else {
                return Ok(Response::new(Body::empty()));
            };
            let body = body.to_bytes();
            let response = match path.as_str() {
                "/big" => Body::new(Full::new(Bytes::from(vec![b'x'; 200 * 1024]))),
                "/trailers" => {
                    let mut trailers = HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    let frames = vec![
                        Ok::<_, Infallible>(Frame::data(body)),
                        Ok(Frame::trailers(trailers)),
                    ];
                    Body::new(StreamBody::new(futures_util::stream::iter(frames)))
                }
                _ => Body::new(Full::new(body)),
            };
            Ok(Response::new(response))
        })
    });
    let settings = Settings {
        keepalive_interval: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(5),
    };
    tokio::spawn(serve(listener, handler, settings, std::future::pending()));
    addr
}

/// Checks what the server wrote on one connection; the reason if it is wrong.
fn check_output(out: &[u8], clean_eof: bool, case: &Case) -> Result<(), String> {
    let mut rest = out;
    let mut decoder = hpack::Decoder::new();
    let mut block: Option<(u32, Vec<u8>)> = None;
    let mut answered: Vec<u32> = Vec::new();
    let mut data_sent = 0usize;
    let mut first = true;
    let mut error_goaway = false;
    while !rest.is_empty() {
        if rest.len() < 9 {
            return if clean_eof {
                Err("a partial frame header at the end".into())
            } else {
                Ok(())
            };
        }
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        let (kind, flags) = (rest[3], rest[4]);
        let id = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
        if rest.len() < 9 + len {
            return if clean_eof {
                Err(format!("a partial frame at the end (type {kind})"))
            } else {
                Ok(())
            };
        }
        let payload = &rest[9..9 + len];
        rest = &rest[9 + len..];
        if error_goaway {
            return Err(format!("frame type {kind} after a GOAWAY for an error"));
        }
        if first && (kind, flags, id) != (SETTINGS, 0, 0) {
            return Err(format!("the first frame is type {kind}, not SETTINGS"));
        }
        first = false;
        if block.is_some() && kind != CONTINUATION {
            return Err(format!("type {kind} in the middle of a header block"));
        }
        match kind {
            HEADERS | CONTINUATION => {
                if id.is_multiple_of(2) {
                    return Err(format!("a header block on stream {id}"));
                }
                let mut b = match (kind, block.take()) {
                    (HEADERS, None) => (id, Vec::new()),
                    (CONTINUATION, Some(b)) if b.0 == id => b,
                    _ => return Err("a CONTINUATION out of place".into()),
                };
                b.1.extend_from_slice(payload);
                if flags & END_HEADERS == 0 {
                    block = Some(b);
                    continue;
                }
                let mut names = Vec::new();
                decoder
                    .decode(&b.1, usize::MAX, |name, _| names.push(name))
                    .map_err(|e| format!("a header block that does not decode: {}", e.0))?;
                let is_trailers = answered.contains(&id);
                if !is_trailers && names.first().map(Vec::as_slice) != Some(b":status") {
                    return Err("response headers without :status first".into());
                }
                answered.push(id);
            }
            DATA => {
                if !answered.contains(&id) {
                    return Err(format!("DATA on stream {id} before its headers"));
                }
                data_sent += len;
            }
            GOAWAY => {
                let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                error_goaway = code != NO_ERROR;
            }
            SETTINGS | PING | RST_STREAM | WINDOW_UPDATE => {
                if kind == RST_STREAM && id == 0 {
                    return Err("RST_STREAM on stream 0".into());
                }
            }
            _ => {
                return Err(format!(
                    "a frame of type {kind}, which the server never sends"
                ))
            }
        }
    }
    if !case.windows_raised && data_sent > WINDOW as usize {
        return Err(format!(
            "{data_sent} bytes of DATA with the peer's window at {WINDOW}"
        ));
    }
    Ok(())
}

/// One case on one connection: send, close our side, read until the server
/// closes; the reason if anything is wrong.
async fn run_case(addr: std::net::SocketAddr, seed: u64) -> Result<(), String> {
    let case = random_case(seed);
    let io = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut read, mut write) = io.into_split();
    let bytes = case.bytes.clone();
    let writer = tokio::spawn(async move {
        // Some cases in pieces, to split frames across reads.
        let mut rng = Rng(seed ^ 0xffff);
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = if rng.chance(20) {
                1 + rng.below(rest.len() as u64) as usize
            } else {
                rest.len()
            };
            if write.write_all(&rest[..n]).await.is_err() {
                return; // the server closed first
            }
            tokio::task::yield_now().await;
            rest = &rest[n..];
        }
        let _ = write.shutdown().await;
        // Keep the write half (and so the socket's FIN) until the read ends.
        std::future::pending::<()>().await;
    });
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut out)).await;
    writer.abort();
    let clean_eof = match read {
        Err(_) => return Err("the server did not close within 10 s of the peer closing".into()),
        Ok(Ok(_)) => true,
        // A reset may cut the end of what the server wrote; check the rest.
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => false,
        Ok(Err(e)) => return Err(format!("reading: {e}")),
    };
    check_output(&out, clean_eof, &case)
}

#[tokio::test(flavor = "current_thread")]
async fn random_frames_never_panic_hang_or_garble_the_output() {
    count_panics();
    let addr = server().await;
    let cases: u64 = std::env::var("MINIMESH_HTTP2_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_500);
    // Eight connections at a time.
    let mut failures = Vec::new();
    let seeds: Vec<u64> = (0..cases).collect();
    for chunk in seeds.chunks(8) {
        let runs = chunk
            .iter()
            .map(|&seed| async move { (seed, run_case(addr, seed).await) });
        for (seed, result) in futures_util::future::join_all(runs).await {
            if let Err(reason) = result {
                failures.push((seed, reason));
            }
        }
    }
    if let Some((seed, _)) = failures.first() {
        let list: Vec<String> = failures
            .iter()
            .take(5)
            .map(|(seed, reason)| format!("  seed {seed}: {reason}"))
            .collect();
        let bytes: String = random_case(*seed)
            .bytes
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        panic!(
            "{} of {cases} cases failed; the first five:\n{}\nbytes sent for seed {seed}: {bytes}",
            failures.len(),
            list.join("\n")
        );
    }
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        0,
        "the server panicked (see above)"
    );

    // And it still serves a well-behaved client.
    let mut sender = super::tests::hyper_client(addr).await;
    let request = Request::post("http://cp/trailers")
        .body(Full::new(Bytes::from_static(b"still here")))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let body = response.into_body().collect().await.unwrap();
    assert_eq!(body.trailers().unwrap()["grpc-status"], "0");
    assert_eq!(body.to_bytes(), "still here");
}
