//! A request's path as Istio's default normalization (`BASE`, Envoy's
//! `normalize_path`) leaves it, before authorization sees it and the app
//! gets it, so that both read the same path: a percent-encoded unreserved
//! character (`%2e`, `%41`, ...) decoded (again while decoding spells a new
//! one, as `%%364` does `%64`: Envoy's single pass would leave `/%64eny`
//! for an app to read as `/deny`); a backslash made a slash;
//! dot segments (`/./`, `/../`) resolved (RFC 3986 §5.2.4). `%2F` and `%5C`
//! stay encoded and `//` stays as it is (Istio's `DECODE_AND_MERGE_SLASHES`
//! and `MERGE_SLASHES`, not its default); a path carrying `%00` is refused.

/// Puts `req`'s path in its normal form, which routes, authorization and
/// the app all see (its query as sent); Err is why it is refused (400).
#[inline]
pub(crate) fn normalize_request<B>(req: &mut http::Request<B>) -> Result<(), &'static str> {
    let Some(normal) = normalize(req.uri().path())? else {
        return Ok(());
    };
    let mut parts = std::mem::take(req.uri_mut()).into_parts();
    let with_query = match parts.path_and_query.as_ref().and_then(|p| p.query()) {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    parts.path_and_query = Some(
        http::uri::PathAndQuery::try_from(with_query)
            .map_err(|_| "the request path is not valid once normalized")?,
    );
    *req.uri_mut() =
        http::Uri::from_parts(parts).map_err(|_| "the request URI is not valid once normalized")?;
    Ok(())
}

/// Why a path is refused (answered 400).
pub(crate) const NUL: &str = "the request path carries %00";

/// The normal form of `path` (without its query), None when it already is
/// normal; Err when the request must be refused.
#[inline]
pub(crate) fn normalize(path: &str) -> Result<Option<String>, &'static str> {
    let b = path.as_bytes();
    // Most paths need nothing: one pass, no allocation.
    let special = |w: &[u8]| w[0] == b'%' || w[0] == b'\\' || (w[0] == b'/' && w[1] == b'.');
    let last = b.last().copied();
    if !b.windows(2).any(special) && !matches!(last, Some(b'%' | b'\\')) {
        return Ok(None);
    }
    let mut decoded = decode_unreserved(b)?;
    // A pass can spell a new escape (`%%364` gives `%64`), which an app
    // that decodes its path would read as `d`: decode again until nothing
    // changes, so that no decoding of what the app gets differs from what
    // authorization read (each pass that changes the path shortens it).
    // Without a `%` left (a dot segment, a backslash) there is nothing to
    // decode again, and no second allocation.
    while decoded.contains('%') {
        let again = decode_unreserved(decoded.as_bytes())?;
        if again == decoded {
            break;
        }
        decoded = again;
    }
    let out = remove_dot_segments(&decoded);
    Ok((out != path).then_some(out))
}

/// Decodes `%HH` where HH is an unreserved character (RFC 3986 §2.3), once;
/// turns `\` into `/`; keeps every other byte as it is.
fn decode_unreserved(b: &[u8]) -> Result<String, &'static str> {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(0), Some(0)) => return Err(NUL),
                (Some(h), Some(l)) => {
                    let c = h << 4 | l;
                    if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') {
                        out.push(c);
                    } else {
                        out.extend_from_slice(&b[i..i + 3]);
                    }
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'\\' => out.push(b'/'),
            c => out.push(c),
        }
        i += 1;
    }
    // Only ASCII was decoded into a valid UTF-8 string's bytes.
    String::from_utf8(out).map_err(|_| "the request path is not UTF-8")
}

/// RFC 3986 §5.2.4 on a path that starts with `/` (other forms, `*`, are
/// left alone).
fn remove_dot_segments(path: &str) -> String {
    if !path.starts_with('/') {
        return path.to_string();
    }
    let mut segments: Vec<&str> = Vec::new();
    let mut parts = path[1..].split('/').peekable();
    let mut trailing = false;
    while let Some(seg) = parts.next() {
        let last = parts.peek().is_none();
        match seg {
            "." => trailing = last,
            ".." => {
                segments.pop();
                trailing = last;
            }
            s => {
                segments.push(s);
                trailing = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if trailing || out.is_empty() {
        out.push('/');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> String {
        match normalize(p) {
            Ok(Some(s)) => s,
            Ok(None) => p.to_string(),
            Err(e) => format!("Err({e})"),
        }
    }

    #[test]
    fn paths_normalize_as_istio_base_does() {
        // Istio's normalization reference, BASE column.
        assert_eq!(n("/some%2fdata/%61%62%63"), "/some%2fdata/abc");
        assert_eq!(n("/some\\data"), "/some/data");
        assert_eq!(n("/some//data///abc"), "/some//data///abc");
        assert_eq!(n("/public/./data/abc/../xyz"), "/public/data/xyz");
        assert_eq!(n("/a/../b"), "/b");
        assert_eq!(n("\\da"), "/da");
        assert_eq!(n("/%2e%2e/admin"), "/admin");
        assert_eq!(n("/%2E/b"), "/b");
        assert_eq!(n("/%64eny"), "/deny");
        assert_eq!(n("/x%5cy"), "/x%5cy");
        assert_eq!(n("/a%00b"), format!("Err({NUL})"));
        // Decoded once: %2561 is "%61" after, not "a".
        assert_eq!(n("/%2561"), "/%2561");
        // Dot segments at the ends, and above the root.
        assert_eq!(n("/a/b/.."), "/a/");
        assert_eq!(n("/a/."), "/a/");
        assert_eq!(n("/.."), "/");
        assert_eq!(n("/../../x"), "/x");
        assert_eq!(n("/a/.b/..c"), "/a/.b/..c");
        // Incomplete or invalid escapes stay.
        assert_eq!(n("/a%"), "/a%");
        assert_eq!(n("/a%4"), "/a%4");
        assert_eq!(n("/a%zz"), "/a%zz");
        assert_eq!(n("*"), "*");
        // What needs nothing is not copied.
        for p in ["/", "/api/v1/items", "/a.b/c.d", "//x", "/a%2Fb"] {
            assert_eq!(normalize(p), Ok(None), "{p}");
        }
    }

    #[test]
    fn a_request_keeps_its_query_and_authority() {
        let mut req = http::Request::get("http://web:80/a/../b%2e?x=/../y")
            .body(())
            .expect("req");
        assert_eq!(normalize_request(&mut req), Ok(()));
        assert_eq!(req.uri(), "http://web:80/b.?x=/../y");
        let mut req = http::Request::get("/a%00").body(()).expect("req");
        assert_eq!(normalize_request(&mut req), Err(NUL));
    }

    #[test]
    fn a_normal_path_stays_normal() {
        // The last two spell a new escape when decoded once (found by the
        // request_path fuzz target).
        for p in [
            "/a/../b/%2e/c",
            "\\..\\x",
            "/%2e%2e%2f",
            "/a/%2E%2E/%2E",
            "/%2e%2%64eny",
            "/%%364eny",
        ] {
            let once = n(p);
            assert_eq!(normalize(&once), Ok(None), "{p} -> {once}");
        }
        // What an app that decodes its path once more would read is what
        // authorization read.
        assert_eq!(n("/%%364eny"), "/deny");
        assert_eq!(n("/%2e%2%64eny"), "/.-eny");
    }
}
