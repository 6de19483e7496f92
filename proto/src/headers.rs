//! The headers sidecars set on responses for each other (and for people
//! reading a response): one caller's sidecar reads what an endpoint's
//! sidecar wrote, so both take the names from here.

/// Prefix of every mesh header. The inbound listener strips every header
/// with it that an app sets, so that an app cannot speak for its sidecar.
pub const PREFIX: &str = "x-minimesh-";

/// On every response minimesh generates itself, with the reason.
pub const ERROR: &str = "x-minimesh-error";

/// Names the endpoint that served a proxied response.
pub const ENDPOINT: &str = "x-minimesh-endpoint";

/// On a response minimesh generates itself when no endpoint can have seen
/// the request (every attempt was refused a connection or a stream, or none
/// was made): the caller may send it again whatever its method.
pub const UNPROCESSED: &str = "x-minimesh-unprocessed";

/// On a 503 for a cluster's connection-pool or pending-request limit.
pub const OVERFLOW: &str = "x-minimesh-overflow";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_header_has_the_prefix() {
        for h in [ERROR, ENDPOINT, UNPROCESSED, OVERFLOW] {
            assert!(h.starts_with(PREFIX), "{h}");
        }
    }
}
