//! What a route matches on: a request's path, headers, method and query,
//! each compared as the route says (exactly, by prefix, by whole path
//! segments, by regular expression).

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::Method;
use minimesh_proto::v1::{self, string_match::Kind};

use super::MAX_PARTS;

/// Up to this many header names, a request's headers are scanned for the
/// one a match names rather than looked up (see `Match::find`).
const FEW_HEADERS: usize = 8;
/// The compiled size a route's regular expression may take.
const REGEX_SIZE_LIMIT: usize = 1 << 16;

#[derive(Debug)]
pub(super) struct Match {
    pub(super) path: Option<StrMatch>,
    headers: Box<[(HeaderName, Option<StrMatch>, bool)]>,
    method: Option<Method>,
    query: Box<[(String, Option<StrMatch>)]>,
}

#[derive(Debug)]
pub(super) enum StrMatch {
    Exact(Box<str>),
    Prefix(Box<str>),
    /// Whole path segments; stored without a trailing `/` (except `/`).
    PathPrefix(Box<str>),
    /// The regex, and a literal every match starts with (checked first:
    /// most values a route does not take fail there, for a fraction of
    /// the regex's own cost).
    Regex(Regex, Box<str>),
}

/// The literal text every match of `pattern` (RE2 syntax) starts with:
/// its leading characters up to the first that is not a plain literal,
/// less a last one a quantifier applies to; nothing for a pattern with an
/// alternation or flags anywhere (conservative: a shorter prefix only
/// costs the regex a call).
pub(super) fn literal_prefix(pattern: &str) -> &str {
    if pattern.contains('|') || pattern.starts_with("(?") {
        return "";
    }
    let meta = |c: char| "\\.+*?()[]{}^$".contains(c);
    let end = pattern.find(meta).unwrap_or(pattern.len());
    let lit = &pattern[..end];
    match pattern[end..].chars().next() {
        // The last literal character may occur zero times.
        Some('?' | '*' | '{') => match lit.char_indices().last() {
            Some((i, _)) => &lit[..i],
            None => "",
        },
        _ => lit,
    }
}

/// A route's regular expression, matched against a whole value: a dense
/// DFA where one fits in [`DFA_SIZE_LIMIT`] (a match walks the value's
/// bytes through a table, no cache to take), else the regex crate's lazy
/// DFA.
#[derive(Debug)]
pub(super) enum Regex {
    Dense(Box<regex_automata::dfa::dense::DFA<Vec<u32>>>),
    Lazy(regex::Regex),
}

/// The most memory one route regex's dense DFA may take.
const DFA_SIZE_LIMIT: usize = 1 << 18;

impl Regex {
    fn new(pattern: &str) -> Result<Regex, String> {
        use regex_automata::dfa::dense;
        let whole = format!("^(?:{pattern})$");
        // The lazy one first: its errors are the ones users know, and it
        // bounds what the dense one is built from.
        let lazy = regex::RegexBuilder::new(&whole)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map_err(|e| e.to_string())?;
        let dense = dense::Builder::new()
            .configure(
                dense::DFA::config()
                    .dfa_size_limit(Some(DFA_SIZE_LIMIT))
                    .determinize_size_limit(Some(DFA_SIZE_LIMIT))
                    .start_kind(regex_automata::dfa::StartKind::Anchored),
            )
            .build(&whole);
        Ok(match dense {
            Ok(d) => Regex::Dense(Box::new(d)),
            Err(_) => Regex::Lazy(lazy),
        })
    }

    #[inline]
    fn is_match(&self, s: &str) -> bool {
        use regex_automata::dfa::Automaton;
        match self {
            Regex::Dense(d) => {
                let input = regex_automata::Input::new(s)
                    .anchored(regex_automata::Anchored::Yes)
                    .earliest(true);
                matches!(d.try_search_fwd(&input), Ok(Some(_)))
            }
            Regex::Lazy(r) => r.is_match(s),
        }
    }
}

/// `s` starts with `p`. Paths share their first byte (`/`): the last byte
/// of `p` is compared first, which rejects most other paths without a
/// call to `memcmp`.
#[inline]
pub(super) fn starts_with(s: &str, p: &str) -> bool {
    let (s, p) = (s.as_bytes(), p.as_bytes());
    match p.len() {
        0 => true,
        n => s.len() >= n && s[n - 1] == p[n - 1] && s[..n] == *p,
    }
}

/// What the path match of the route a request took matched: the part a
/// prefix rewrite replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matched {
    /// A prefix of this many bytes.
    Prefix(usize),
    /// The whole path.
    Whole,
}

impl StrMatch {
    fn compile(m: &v1::StringMatch, field: &str) -> Result<StrMatch, String> {
        Ok(match m.kind.as_ref() {
            None => return Err(format!("{field}: no exact, prefix or regex")),
            Some(Kind::Exact(s)) => StrMatch::Exact(s.as_str().into()),
            Some(Kind::Prefix(s)) => StrMatch::Prefix(s.as_str().into()),
            Some(Kind::PathPrefix(s)) => {
                let s = match s.trim_end_matches('/') {
                    "" => "/",
                    t => t,
                };
                StrMatch::PathPrefix(s.into())
            }
            Some(Kind::Regex(r)) => StrMatch::Regex(
                Regex::new(r).map_err(|e| format!("{field}: regex {r:?}: {e}"))?,
                literal_prefix(r).into(),
            ),
        })
    }

    /// Whether `s` matches, and what of it.
    #[inline]
    fn find(&self, s: &str) -> Option<Matched> {
        match self {
            StrMatch::Exact(e) => {
                (s.len() == e.len() && starts_with(s, e)).then_some(Matched::Whole)
            }
            StrMatch::Prefix(p) => starts_with(s, p).then_some(Matched::Prefix(p.len())),
            StrMatch::PathPrefix(p) => {
                if !starts_with(s, p) {
                    return None;
                }
                // `/` is kept as is (it matches every path); any other
                // prefix ends at a segment's end.
                let whole = p.len() == 1 || matches!(s.as_bytes().get(p.len()), None | Some(b'/'));
                whole.then_some(Matched::Prefix(p.len()))
            }
            StrMatch::Regex(r, lit) => {
                (starts_with(s, lit) && r.is_match(s)).then_some(Matched::Whole)
            }
        }
    }
}

impl Match {
    pub(super) fn compile(m: &v1::RouteMatch, field: &str) -> Result<Match, String> {
        if m.headers.len() > MAX_PARTS || m.query.len() > MAX_PARTS {
            return Err(format!(
                "{field}: more than {MAX_PARTS} header or query matches"
            ));
        }
        let path = m
            .path
            .as_ref()
            .map(|p| StrMatch::compile(p, &format!("{field}.path")))
            .transpose()?;
        let mut headers = Vec::with_capacity(m.headers.len());
        for (i, h) in m.headers.iter().enumerate() {
            let f = format!("{field}.headers[{i}]");
            let name = HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| format!("{f}: {:?} is not a header name", h.name))?;
            let value = h
                .value
                .as_ref()
                .map(|v| StrMatch::compile(v, &f))
                .transpose()?;
            headers.push((name, value, h.invert));
        }
        let method = match m.method.as_str() {
            "" => None,
            s => Some(
                Method::from_bytes(s.as_bytes())
                    .map_err(|_| format!("{field}.method: {s:?} is not a method"))?,
            ),
        };
        let mut query = Vec::with_capacity(m.query.len());
        for (i, q) in m.query.iter().enumerate() {
            let f = format!("{field}.query[{i}]");
            let value = q
                .value
                .as_ref()
                .map(|v| StrMatch::compile(v, &f))
                .transpose()?;
            query.push((q.name.clone(), value));
        }
        Ok(Match {
            path,
            headers: headers.into(),
            method,
            query: query.into(),
        })
    }

    /// Whether the request meets this match, and what its path match matched.
    #[inline]
    pub(super) fn find(&self, req: &RequestView<'_>) -> Option<Matched> {
        if let Some(m) = &self.method {
            if m != req.method {
                return None;
            }
        }
        let matched = match &self.path {
            Some(p) => p.find(req.path)?,
            None => Matched::Prefix(0),
        };
        for (name, value, invert) in self.headers.iter() {
            let meets = |h: &HeaderValue| match value {
                None => true,
                Some(v) => h.to_str().is_ok_and(|s| v.find(s).is_some()),
            };
            // Most requests carry a few headers: comparing each name (by
            // length first) costs less than hashing the one looked for.
            let found = if req.headers.keys_len() <= FEW_HEADERS {
                req.headers.iter().any(|(k, h)| k == name && meets(h))
            } else {
                req.headers.get_all(name).iter().any(meets)
            };
            if found == *invert {
                return None;
            }
        }
        for (name, value) in self.query.iter() {
            let found = req.query.is_some_and(|q| {
                q.split('&').any(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    k == name && value.as_ref().is_none_or(|m| m.find(v).is_some())
                })
            });
            if !found {
                return None;
            }
        }
        Some(matched)
    }
}

/// The parts of a request a route matches on.
pub struct RequestView<'a> {
    /// The method.
    pub method: &'a Method,
    /// The path, without the query.
    pub path: &'a str,
    /// The query, without `?`.
    pub query: Option<&'a str>,
    /// The headers.
    pub headers: &'a HeaderMap,
}
