//! Istio's `retryOn` tokens, as a rule writes them, and the wire bits
//! ([`crate::v1::RetryOn`]) a sidecar tests.

use crate::v1::RetryOn;

/// Retry conditions when a rule names none: Istio's mesh default, plus
/// `reset` so that a replica killed with idempotent requests in flight costs
/// no user-visible error.
pub const DEFAULT: &str = "connect-failure,refused-stream,unavailable,cancelled,reset";

/// `retryOn` tokens and their wire conditions.
pub const TOKENS: [(&str, RetryOn); 7] = [
    ("connect-failure", RetryOn::ConnectFailure),
    ("refused-stream", RetryOn::RefusedStream),
    ("unavailable", RetryOn::Unavailable),
    ("cancelled", RetryOn::Cancelled),
    ("5xx", RetryOn::ServerError),
    ("gateway-error", RetryOn::GatewayError),
    ("reset", RetryOn::Reset),
];

/// Parses Istio's comma-separated `retryOn` into the wire bits.
pub fn parse(s: &str) -> Result<u32, String> {
    let mut bits = 0;
    for token in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let Some((_, cond)) = TOKENS.iter().find(|(name, _)| *name == token) else {
            let known: Vec<&str> = TOKENS.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "unknown token {token:?} (known: {})",
                known.join(", ")
            ));
        };
        bits |= *cond as u32;
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_become_bits_and_a_typo_names_the_known_ones() {
        assert_eq!(parse("5xx, reset"), Ok(16 | 64));
        assert_eq!(parse(DEFAULT), Ok(1 | 2 | 4 | 8 | 64));
        assert_eq!(
            parse("5xx,connect-faillure"),
            Err("unknown token \"connect-faillure\" (known: connect-failure, refused-stream, unavailable, cancelled, 5xx, gateway-error, reset)".to_string())
        );
    }
}
