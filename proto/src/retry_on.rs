//! Istio's `retryOn` tokens, as a rule writes them, and the wire bits
//! ([`crate::v1::RetryOn`]) a sidecar tests.

use crate::v1::RetryOn;

/// Retry conditions when a rule names none: Istio's mesh default (503
/// among them, as a retriable status code: a replica that sheds part of its
/// requests costs its callers nothing while others can serve), plus `reset`
/// so that a replica killed with idempotent requests in flight costs no
/// user-visible error.
pub const DEFAULT: &str =
    "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes,503,reset";

/// `retryOn` tokens and their wire conditions.
pub const TOKENS: [(&str, RetryOn); 8] = [
    ("connect-failure", RetryOn::ConnectFailure),
    ("refused-stream", RetryOn::RefusedStream),
    ("unavailable", RetryOn::Unavailable),
    ("cancelled", RetryOn::Cancelled),
    ("5xx", RetryOn::ServerError),
    ("gateway-error", RetryOn::GatewayError),
    ("reset", RetryOn::Reset),
    ("retriable-status-codes", RetryOn::RetriableStatusCodes),
];

/// A parsed `retryOn`: the wire bits, and the status codes retried under
/// `retriable-status-codes`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    /// Bits of [`RetryOn`].
    pub bits: u32,
    /// Retriable status codes, in the order written.
    pub codes: Vec<u32>,
}

/// Parses Istio's comma-separated `retryOn`: condition tokens, and status
/// codes (`503`), which are retried as Istio retries them (a code alone
/// implies `retriable-status-codes`).
pub fn parse(s: &str) -> Result<Parsed, String> {
    let mut parsed = Parsed::default();
    for token in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        if token.bytes().all(|b| b.is_ascii_digit()) {
            let code: u32 = token
                .parse()
                .ok()
                .filter(|c| (100..=599).contains(c))
                .ok_or_else(|| format!("{token:?} is not an HTTP status code (100-599)"))?;
            if !parsed.codes.contains(&code) {
                parsed.codes.push(code);
            }
            parsed.bits |= RetryOn::RetriableStatusCodes as u32;
            continue;
        }
        let Some((_, cond)) = TOKENS.iter().find(|(name, _)| *name == token) else {
            let known: Vec<&str> = TOKENS.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "unknown token {token:?} (known: {}, or a status code such as 503)",
                known.join(", ")
            ));
        };
        parsed.bits |= *cond as u32;
    }
    if parsed.bits & RetryOn::RetriableStatusCodes as u32 != 0 && parsed.codes.is_empty() {
        return Err(
            "retriable-status-codes names no status code: add the codes, e.g. \"retriable-status-codes,503\""
                .into(),
        );
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_become_bits_and_a_typo_names_the_known_ones() {
        let bits = |s| parse(s).map(|p| p.bits);
        assert_eq!(bits("5xx, reset"), Ok(16 | 64));
        assert_eq!(
            parse(DEFAULT),
            Ok(Parsed {
                bits: 1 | 2 | 4 | 8 | 64 | 128,
                codes: vec![503]
            })
        );
        assert_eq!(
            parse("502,503,502"),
            Ok(Parsed {
                bits: 128,
                codes: vec![502, 503]
            })
        );
        assert_eq!(
            bits("5xx,connect-faillure"),
            Err("unknown token \"connect-faillure\" (known: connect-failure, refused-stream, unavailable, cancelled, 5xx, gateway-error, reset, retriable-status-codes, or a status code such as 503)".to_string())
        );
        assert_eq!(
            bits("retriable-status-codes"),
            Err("retriable-status-codes names no status code: add the codes, e.g. \"retriable-status-codes,503\"".to_string())
        );
        assert_eq!(
            bits("5030"),
            Err("\"5030\" is not an HTTP status code (100-599)".to_string())
        );
    }
}
