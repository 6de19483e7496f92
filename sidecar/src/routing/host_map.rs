//! The map from authorities to clusters, looked up once per request.

use std::collections::HashMap;

/// Authorities to cluster indexes, hashed with FNV-1a rather than SipHash:
/// a lookup per request hashes a short host name in a fraction of the
/// instructions. Its keys come from config, never from requests (a request's
/// host is only looked up), so an unkeyed hash gives callers no way to
/// crowd a bucket.
pub(super) type HostMap = HashMap<String, u32, std::hash::BuildHasherDefault<HostHasher>>;

/// FNV-1a, 64 bits.
pub struct HostHasher(u64);

impl Default for HostHasher {
    fn default() -> HostHasher {
        HostHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for HostHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::Hasher;

    fn fnv1a(bytes: &[u8]) -> u64 {
        let mut h = HostHasher::default();
        h.write(bytes);
        h.finish()
    }

    #[test]
    fn hashes_are_fnv_1a_64() {
        // The published FNV-1a 64-bit test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn the_map_finds_what_was_put_in() {
        let mut m = HostMap::default();
        m.insert("backend.default:80".to_string(), 3);
        m.insert("backend".to_string(), 3);
        assert_eq!(m.get("backend.default:80"), Some(&3));
        assert_eq!(m.get("backend"), Some(&3));
        assert_eq!(m.get("backend.default"), None);
    }
}
