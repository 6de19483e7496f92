//! HPACK (RFC 7541) for the discovery server: a full decoder for request
//! headers, and an encoder that writes response headers as literals (no
//! Huffman, no dynamic table), which every decoder must accept and which
//! leaves nothing to remember per connection.

use std::collections::VecDeque;
use std::sync::OnceLock;

/// Why a header block could not be decoded (a connection error,
/// COMPRESSION_ERROR, in HTTP/2).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("header compression: {0}")]
pub struct Error(pub &'static str);

/// The static table (RFC 7541 Appendix A), index 1 first.
const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

/// Code length in bits of each symbol of the HPACK Huffman code (RFC 7541
/// Appendix B; symbol 256 is EOS). The code is canonical: codes are assigned
/// in order of length, then symbol, so the lengths determine it.
const HUFFMAN_LENGTHS: [u8; 257] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
];

const EOS: u16 = 256;
const MAX_CODE_LEN: usize = 30;

/// Canonical decoding tables: per length, how many codes there are, and the
/// symbols in code order.
struct Canonical {
    count: [u16; MAX_CODE_LEN + 1],
    symbols: [u16; 257],
}

fn canonical() -> &'static Canonical {
    static TABLE: OnceLock<Canonical> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut count = [0u16; MAX_CODE_LEN + 1];
        for &len in &HUFFMAN_LENGTHS {
            count[usize::from(len)] += 1;
        }
        let mut order: Vec<u16> = (0..=EOS).collect();
        order.sort_by_key(|&s| (HUFFMAN_LENGTHS[usize::from(s)], s));
        let mut symbols = [0u16; 257];
        symbols.copy_from_slice(&order);
        Canonical { count, symbols }
    })
}

/// Decodes a Huffman-coded string (RFC 7541 §5.2) onto `out`.
pub fn huffman_decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
    let table = canonical();
    // The code read so far, its length, and where codes of that length start.
    let (mut code, mut len, mut first, mut index) = (0u32, 0usize, 0u32, 0usize);
    // Whether every bit of the code read so far is 1 (a prefix of EOS, the
    // only padding allowed).
    let mut all_ones = true;
    for &byte in input {
        for shift in (0..8).rev() {
            let bit = u32::from(byte >> shift) & 1;
            code = (code << 1) | bit;
            all_ones &= bit == 1;
            len += 1;
            let count = u32::from(table.count[len]);
            if code.wrapping_sub(first) < count {
                let symbol = table.symbols[index + (code - first) as usize];
                if symbol == EOS {
                    return Err(Error("EOS inside a Huffman-coded string"));
                }
                out.push(symbol as u8);
                (code, len, first, index, all_ones) = (0, 0, 0, 0, true);
                continue;
            }
            index += count as usize;
            first = (first + count) << 1;
            if len >= MAX_CODE_LEN {
                return Err(Error("invalid Huffman code"));
            }
        }
    }
    if len > 7 || !all_ones {
        return Err(Error("invalid Huffman padding"));
    }
    Ok(())
}

/// Size of the dynamic table a peer may use without asking (RFC 7541 §4.2;
/// HTTP/2's SETTINGS_HEADER_TABLE_SIZE default). The server never
/// advertises another.
pub const TABLE_SIZE: usize = 4096;

/// One header field: name and value as they came.
pub type Field = (Vec<u8>, Vec<u8>);

/// The decoding side of one connection: its dynamic table.
#[derive(Debug)]
pub struct Decoder {
    table: VecDeque<Field>,
    size: usize,
    max: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new()
    }
}

impl Decoder {
    /// A decoder with the default table size.
    pub fn new() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max: TABLE_SIZE,
        }
    }

    /// Decodes a whole header block, calling `emit` for each field in order.
    /// `max_list` bounds the decoded size (RFC 9113's header list size:
    /// names, values and 32 bytes a field).
    pub fn decode(
        &mut self,
        mut block: &[u8],
        max_list: usize,
        mut emit: impl FnMut(Vec<u8>, Vec<u8>),
    ) -> Result<(), Error> {
        let mut list = 0usize;
        let mut first = true;
        while let Some(&byte) = block.first() {
            if byte & 0x80 != 0 {
                let index = integer(&mut block, 7)?;
                let (name, value) = self.field(index)?;
                list += name.len() + value.len() + 32;
                if list > max_list {
                    return Err(Error("header list too large"));
                }
                emit(name, value);
            } else if byte & 0xe0 == 0x20 {
                // A table size update may only start a block.
                if !first {
                    return Err(Error("table size update after a field"));
                }
                let size = integer(&mut block, 5)?;
                if size > TABLE_SIZE {
                    return Err(Error("table size update above the limit"));
                }
                self.max = size;
                self.evict(0);
                if self.table.is_empty() {
                    self.table = VecDeque::new();
                }
                continue;
            } else {
                let (prefix, indexing) = if byte & 0xc0 == 0x40 {
                    (6, true)
                } else {
                    (4, false)
                };
                let index = integer(&mut block, prefix)?;
                let name = if index == 0 {
                    string(&mut block, max_list)?
                } else {
                    self.field(index)?.0
                };
                let value = string(&mut block, max_list)?;
                list += name.len() + value.len() + 32;
                if list > max_list {
                    return Err(Error("header list too large"));
                }
                if indexing {
                    self.insert(name.clone(), value.clone());
                }
                emit(name, value);
            }
            first = false;
        }
        Ok(())
    }

    fn field(&self, index: usize) -> Result<Field, Error> {
        match index {
            0 => Err(Error("index 0")),
            1..=61 => {
                let (name, value) = STATIC[index - 1];
                Ok((name.as_bytes().to_vec(), value.as_bytes().to_vec()))
            }
            _ => self
                .table
                .get(index - 62)
                .cloned()
                .ok_or(Error("index beyond the table")),
        }
    }

    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + 32;
        if size > self.max {
            // RFC 7541 §4.4: an entry larger than the table empties it.
            self.table = VecDeque::new();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front((name, value));
    }

    /// Evicts the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max {
            match self.table.pop_back() {
                Some((n, v)) => self.size -= n.len() + v.len() + 32,
                None => break,
            }
        }
    }

    /// Bytes the dynamic table holds (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.len()
    }
}

/// Reads an integer with an `n`-bit prefix (RFC 7541 §5.1).
fn integer(block: &mut &[u8], n: u32) -> Result<usize, Error> {
    let mask = (1u8 << n) - 1;
    let (&first, rest) = block.split_first().ok_or(Error("truncated integer"))?;
    *block = rest;
    let mut value = usize::from(first & mask);
    if value < usize::from(mask) {
        return Ok(value);
    }
    let mut shift = 0u32;
    loop {
        let (&byte, rest) = block.split_first().ok_or(Error("truncated integer"))?;
        *block = rest;
        if shift > 21 {
            return Err(Error("integer too large"));
        }
        value += usize::from(byte & 0x7f) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
}

/// Reads a string literal (RFC 7541 §5.2), refusing any longer than `max`.
fn string(block: &mut &[u8], max: usize) -> Result<Vec<u8>, Error> {
    let huffman = block.first().is_some_and(|b| b & 0x80 != 0);
    let len = integer(block, 7)?;
    if len > block.len() {
        return Err(Error("truncated string"));
    }
    if len > max {
        return Err(Error("header list too large"));
    }
    let (raw, rest) = block.split_at(len);
    *block = rest;
    if huffman {
        // Huffman codes are at least 5 bits: the output is at most 8/5 of the input.
        let mut out = Vec::with_capacity(len * 8 / 5 + 1);
        huffman_decode(raw, &mut out)?;
        Ok(out)
    } else {
        Ok(raw.to_vec())
    }
}

/// Appends an integer with an `n`-bit prefix, the high bits of the first
/// byte set to `flags`.
pub fn put_integer(out: &mut Vec<u8>, mut value: usize, n: u32, flags: u8) {
    let mask = (1usize << n) - 1;
    if value < mask {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | mask as u8);
    value -= mask;
    while value >= 0x80 {
        out.push((value & 0x7f) as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    put_integer(out, s.len(), 7, 0);
    out.extend_from_slice(s);
}

/// Appends one field as a literal that the peer does not index (or, when
/// `sensitive`, must never index), naming it by its static-table index when
/// it has one.
pub fn put_field(out: &mut Vec<u8>, name: &[u8], value: &[u8], sensitive: bool) {
    let flags = if sensitive { 0x10 } else { 0 };
    match STATIC.iter().position(|(n, _)| n.as_bytes() == name) {
        Some(i) => put_integer(out, i + 1, 4, flags),
        None => {
            out.push(flags);
            put_string(out, name);
        }
    }
    put_string(out, value);
}

/// Appends `:status`, as the static table's entry for 200.
pub fn put_status(out: &mut Vec<u8>, status: u16) {
    if status == 200 {
        out.push(0x88);
    } else {
        let mut digits = [0u8; 3];
        let s = status.min(999);
        digits[0] = b'0' + (s / 100) as u8;
        digits[1] = b'0' + (s / 10 % 10) as u8;
        digits[2] = b'0' + (s % 10) as u8;
        put_field(out, b":status", &digits, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn decode_all(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, Error> {
        let mut out = Vec::new();
        d.decode(block, 64 * 1024, |n, v| {
            out.push((String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
        })?;
        Ok(out)
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn huffman_strings_of_rfc7541_appendix_c4() {
        for (coded, plain) in [
            ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
            ("a8eb 1064 9cbf", "no-cache"),
            ("25a8 49e9 5ba9 7d7f", "custom-key"),
            ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
        ] {
            let mut out = Vec::new();
            huffman_decode(&hex(coded), &mut out).unwrap();
            assert_eq!(out, plain.as_bytes());
        }
    }

    #[test]
    fn huffman_refuses_bad_padding_and_eos() {
        let mut out = Vec::new();
        // "0" is 00000; padding with zeros is not a prefix of EOS.
        assert_eq!(
            huffman_decode(&[0x00], &mut out),
            Err(Error("invalid Huffman padding"))
        );
        // Eight or more bits of padding.
        assert_eq!(
            huffman_decode(&[0x07, 0xff], &mut out),
            Err(Error("invalid Huffman padding"))
        );
        // EOS itself (30 ones).
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xff], &mut out),
            Err(Error("EOS inside a Huffman-coded string"))
        );
    }

    #[test]
    fn requests_of_rfc7541_appendix_c4_share_a_dynamic_table() {
        let mut d = Decoder::new();
        let first = decode_all(&mut d, &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")).unwrap();
        assert_eq!(
            first,
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ])
        );
        let second = decode_all(&mut d, &hex("8286 84be 5886 a8eb 1064 9cbf")).unwrap();
        assert_eq!(
            second,
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
        let third = decode_all(
            &mut d,
            &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
        )
        .unwrap();
        assert_eq!(
            third,
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(d.len(), 3);
        assert_eq!(d.size, 164);
    }

    #[test]
    fn bad_blocks_get_their_reason() {
        let mut d = Decoder::new();
        assert_eq!(decode_all(&mut d, &[0x80]), Err(Error("index 0")));
        assert_eq!(
            decode_all(&mut d, &[0xbe]),
            Err(Error("index beyond the table"))
        );
        assert_eq!(
            decode_all(&mut d, &[0x3f, 0xe2, 0x1f]),
            Err(Error("table size update above the limit"))
        );
        assert_eq!(
            decode_all(&mut d, &[0x82, 0x20]),
            Err(Error("table size update after a field"))
        );
        assert_eq!(
            decode_all(&mut d, &[0x04, 0x85, b'/']),
            Err(Error("truncated string"))
        );
        assert_eq!(
            decode_all(&mut d, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            Err(Error("integer too large"))
        );
        let mut big = vec![0x00, 0x01, b'a', 0x7f, 0x49];
        big.extend(std::iter::repeat_n(b'x', 200));
        assert_eq!(
            d.decode(&big, 100, |_, _| {}),
            Err(Error("header list too large"))
        );
    }

    #[test]
    fn size_update_to_zero_empties_the_table() {
        let mut d = Decoder::new();
        decode_all(
            &mut d,
            &hex("4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
        )
        .unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(
            decode_all(&mut d, &[0x20, 0x82]).unwrap(),
            pairs(&[(":method", "GET")])
        );
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn encoded_fields_decode_back() {
        let mut block = Vec::new();
        put_status(&mut block, 200);
        put_status(&mut block, 503);
        put_field(&mut block, b"content-type", b"application/grpc", false);
        put_field(&mut block, b"grpc-status", b"0", false);
        put_field(&mut block, b"authorization", b"secret", true);
        let long = "m".repeat(300);
        put_field(&mut block, b"grpc-message", long.as_bytes(), false);
        let mut d = Decoder::new();
        assert_eq!(
            decode_all(&mut d, &block).unwrap(),
            pairs(&[
                (":status", "200"),
                (":status", "503"),
                ("content-type", "application/grpc"),
                ("grpc-status", "0"),
                ("authorization", "secret"),
                ("grpc-message", &long),
            ])
        );
        // Literals only: nothing entered the table.
        assert_eq!(d.len(), 0);
    }
}
