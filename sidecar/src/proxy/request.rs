//! What the proxy reads from a request before it forwards it: the authority
//! it is routed by, the hash key of consistent-hash clusters, and the
//! headers that stop at this hop.

use super::*;

/// The request's hash for a consistent-hash cluster, and the cookie to set
/// when the policy hashes on a cookie the request does not carry. A request
/// without the key gets no hash: it is balanced at random, never refused.
pub(crate) fn hash_key(
    policy: &HashPolicy,
    req: &Request<Incoming>,
    peer: SocketAddr,
    trust_forwarded_for: bool,
) -> (Option<u64>, Option<HeaderValue>) {
    match policy {
        HashPolicy::SourceIp if trust_forwarded_for => {
            let hop = req
                .headers()
                .get("x-forwarded-for")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(',').next())
                .map(str::trim)
                .filter(|h| !h.is_empty());
            match hop {
                Some(h) => (Some(xxh64(h.as_bytes(), 0)), None),
                None => (Some(xxh64(peer.ip().to_string().as_bytes(), 0)), None),
            }
        }
        HashPolicy::Header(name) => (
            req.headers().get(name).map(|v| xxh64(v.as_bytes(), 0)),
            None,
        ),
        HashPolicy::SourceIp => (Some(xxh64(peer.ip().to_string().as_bytes(), 0)), None),
        HashPolicy::Query(param) => {
            let value = req.uri().query().and_then(|q| {
                q.split('&').find_map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    (k == param).then_some(v)
                })
            });
            (value.map(|v| xxh64(v.as_bytes(), 0)), None)
        }
        HashPolicy::Cookie { name, path, ttl } => {
            let found = req
                .headers()
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .find_map(|c| {
                    let (k, v) = c.trim().split_once('=')?;
                    (k == name).then_some(v)
                });
            if let Some(v) = found {
                return (Some(xxh64(v.as_bytes(), 0)), None);
            }
            let value = format!("{:016x}", crate::balance::rng::next());
            let mut cookie = format!("{name}={value}");
            if !path.is_empty() {
                cookie.push_str(&format!("; Path={path}"));
            }
            if let Some(t) = ttl {
                cookie.push_str(&format!("; Max-Age={}", t.as_secs().max(1)));
            }
            cookie.push_str("; HttpOnly");
            (
                Some(xxh64(value.as_bytes(), 0)),
                HeaderValue::from_str(&cookie).ok(),
            )
        }
    }
}

/// Where a request is going: the URI's authority (absolute form, HTTP/2),
/// else the Host header. Either is a reference-counted clone, not a copy.
pub(crate) enum Authority {
    Uri(http::uri::Authority),
    Host(HeaderValue),
}

impl Authority {
    pub(crate) fn as_str(&self) -> &str {
        match self {
            Authority::Uri(a) => a.as_str(),
            // Only visible ASCII is kept (see request_authority).
            Authority::Host(h) => h.to_str().unwrap_or_default(),
        }
    }
}

pub(crate) fn request_authority(req: &Request<Incoming>) -> Option<Authority> {
    if let Some(a) = req.uri().authority() {
        return Some(Authority::Uri(a.clone()));
    }
    req.headers()
        .get(header::HOST)
        .filter(|h| h.to_str().is_ok())
        .map(|h| Authority::Host(h.clone()))
}

pub(crate) static HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names, compared as
    // strings (a length test, then at most one memcmp), instead of a hash
    // lookup per hop-by-hop name. (Comparing with HOP_BY_HOP's HeaderNames
    // cost twice the instructions.)
    let hop = |k: &HeaderName| {
        matches!(
            k.as_str(),
            "connection"
                | "keep-alive"
                | "proxy-connection"
                | "proxy-authorization"
                | "te"
                | "trailer"
                | "upgrade"
                | "transfer-encoding"
        )
    };
    if !headers.keys().any(hop) {
        return;
    }
    if let Some(conn) = headers.get(header::CONNECTION).cloned() {
        if let Ok(list) = conn.to_str() {
            for name in list.split(',') {
                if let Ok(n) = HeaderName::from_bytes(name.trim().as_bytes()) {
                    headers.remove(n);
                }
            }
        }
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
    headers.remove(header::TRANSFER_ENCODING);
}

/// Removes every mesh header (`x-minimesh-*`) from `headers`, allocating
/// only when there is one.
pub(crate) fn strip_mesh_headers(headers: &mut HeaderMap) {
    let is_mesh = |name: &HeaderName| name.as_str().starts_with(headers::PREFIX);
    if !headers.keys().any(is_mesh) {
        return;
    }
    let names: Vec<HeaderName> = headers.keys().filter(|n| is_mesh(n)).cloned().collect();
    for name in names {
        headers.remove(name);
    }
}
