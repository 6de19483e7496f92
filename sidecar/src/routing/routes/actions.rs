//! What a route does to a request besides choosing where it goes: header
//! changes, a redirect, a rewrite, injected faults.

use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::StatusCode;
use minimesh_proto::v1;

use super::matching::Matched;
use super::MAX_PARTS;

/// Header changes.
#[derive(Debug, Default)]
pub struct HeaderOps {
    set: Box<[(HeaderName, HeaderValue)]>,
    add: Box<[(HeaderName, HeaderValue)]>,
    remove: Box<[HeaderName]>,
}

/// A redirect.
#[derive(Debug)]
pub struct Redirect {
    scheme: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    path: Option<String>,
    prefix: Option<String>,
    status: StatusCode,
}

/// A rewrite of what is sent upstream.
#[derive(Debug)]
pub struct Rewrite {
    prefix: Option<String>,
    path: Option<String>,
    /// The authority sent upstream.
    pub authority: Option<HeaderValue>,
}

/// Injected faults.
#[derive(Debug, Clone, Copy)]
pub struct Fault {
    /// Share of requests delayed, out of 1,000,000.
    delay_ppm: u32,
    delay: Duration,
    /// Share of requests aborted, out of 1,000,000.
    abort_ppm: u32,
    abort: StatusCode,
}

pub(super) fn status(code: u32, field: &str) -> Result<StatusCode, String> {
    u16::try_from(code)
        .ok()
        .and_then(|c| StatusCode::from_u16(c).ok())
        .filter(|s| s.as_u16() >= 200)
        .ok_or_else(|| format!("{field}: {code} is not an HTTP status"))
}

impl HeaderOps {
    pub(super) fn compile(ops: Option<&v1::HeaderOps>, field: &str) -> Result<HeaderOps, String> {
        let Some(ops) = ops else {
            return Ok(HeaderOps::default());
        };
        if ops.set.len() + ops.add.len() + ops.remove.len() > MAX_PARTS {
            return Err(format!("{field}: more than {MAX_PARTS} header changes"));
        }
        let pairs = |list: &[v1::HeaderValue], what: &str| {
            list.iter()
                .map(|h| {
                    let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| {
                        format!("{field}.{what}: {:?} is not a header name", h.name)
                    })?;
                    let value = HeaderValue::from_str(&h.value).map_err(|_| {
                        format!(
                            "{field}.{what}: the value of {:?} is not a header value",
                            h.name
                        )
                    })?;
                    Ok((name, value))
                })
                .collect::<Result<Vec<_>, String>>()
        };
        let remove = ops
            .remove
            .iter()
            .map(|n| {
                HeaderName::from_bytes(n.as_bytes())
                    .map_err(|_| format!("{field}.remove: {n:?} is not a header name"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HeaderOps {
            set: pairs(&ops.set, "set")?.into(),
            add: pairs(&ops.add, "add")?.into(),
            remove: remove.into(),
        })
    }

    /// True when there is nothing to change.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }

    /// Applies the changes: set, then add, then remove.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (n, v) in self.set.iter() {
            headers.insert(n.clone(), v.clone());
        }
        for (n, v) in self.add.iter() {
            headers.append(n.clone(), v.clone());
        }
        for n in self.remove.iter() {
            headers.remove(n);
        }
    }
}

impl Redirect {
    pub(super) fn compile(r: &v1::Redirect) -> Result<Redirect, String> {
        let status = match r.status {
            0 => StatusCode::MOVED_PERMANENTLY,
            301 | 302 | 303 | 307 | 308 => status(r.status, "redirect.status")?,
            s => {
                return Err(format!(
                    "redirect.status: {s} is not 301, 302, 303, 307 or 308"
                ))
            }
        };
        if !matches!(r.scheme.as_str(), "" | "http" | "https") {
            return Err(format!(
                "redirect.scheme: {:?} is not http or https",
                r.scheme
            ));
        }
        let port = match r.port {
            0 => None,
            p => Some(u16::try_from(p).map_err(|_| format!("redirect.port: {p} is not a port"))?),
        };
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Ok(Redirect {
            scheme: nonempty(&r.scheme),
            host: nonempty(&r.host),
            port,
            path: nonempty(&r.path),
            prefix: nonempty(&r.prefix),
            status,
        })
    }

    /// The status and `Location` for a request to `authority` (`host[:port]`)
    /// with `scheme`, `path` and `query`, whose route's path match matched
    /// `matched`.
    pub fn location(
        &self,
        scheme: &str,
        authority: &str,
        path: &str,
        query: Option<&str>,
        matched: Matched,
    ) -> (StatusCode, String) {
        let (req_host, req_port) = split_port(authority);
        let scheme_out = self.scheme.as_deref().unwrap_or(scheme);
        let host = self.host.as_deref().unwrap_or(req_host);
        // The request's port goes with it only while the scheme stays.
        let port = self
            .port
            .or(req_port.filter(|_| self.scheme.is_none() || scheme_out == scheme));
        let default = if scheme_out == "https" { 443 } else { 80 };
        let path = match (&self.path, &self.prefix) {
            (Some(p), _) => p.clone(),
            (None, Some(p)) => replace_prefix(path, p, matched),
            (None, None) => path.to_string(),
        };
        let mut out = format!("{scheme_out}://{host}");
        if let Some(p) = port.filter(|p| *p != default) {
            out.push_str(&format!(":{p}"));
        }
        out.push_str(&path);
        if let Some(q) = query {
            out.push('?');
            out.push_str(q);
        }
        (self.status, out)
    }
}

impl Rewrite {
    pub(super) fn compile(rw: &v1::Rewrite) -> Result<Rewrite, String> {
        Ok(Rewrite {
            prefix: (!rw.prefix.is_empty()).then(|| rw.prefix.clone()),
            path: (!rw.path.is_empty()).then(|| rw.path.clone()),
            authority: match rw.authority.as_str() {
                "" => None,
                a => Some(
                    HeaderValue::from_str(a)
                        .ok()
                        .filter(|_| a.parse::<http::uri::Authority>().is_ok())
                        .ok_or_else(|| format!("rewrite.authority: {a:?} is not a host"))?,
                ),
            },
        })
    }

    /// The path sent upstream for `path` (the query kept by the caller),
    /// or None when the rewrite leaves it.
    pub fn path(&self, path: &str, matched: Matched) -> Option<String> {
        match (&self.path, &self.prefix) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(p)) => Some(replace_prefix(path, p, matched)),
            (None, None) => None,
        }
    }
}

impl Fault {
    pub(super) fn compile(f: &v1::Fault) -> Result<Fault, String> {
        let ppm = |p: f64, field: &str| {
            if !(0.0..=100.0).contains(&p) {
                return Err(format!(
                    "fault.{field}: {p} is not a percentage from 0 to 100"
                ));
            }
            Ok((p * 10_000.0).round() as u32)
        };
        Ok(Fault {
            delay_ppm: ppm(f.delay_percent, "delay_percent")?,
            delay: Duration::from_millis(f.delay_ms),
            abort_ppm: ppm(f.abort_percent, "abort_percent")?,
            abort: if f.abort_percent > 0.0 {
                status(f.abort_status, "fault.abort_status")?
            } else {
                StatusCode::OK
            },
        })
    }

    /// The delay for a request drawing `draw` (uniform over u64).
    #[inline]
    pub fn delay(&self, draw: u64) -> Option<Duration> {
        ((draw % 1_000_000) < u64::from(self.delay_ppm)).then_some(self.delay)
    }

    /// The abort status for a request drawing `draw`.
    #[inline]
    pub fn abort(&self, draw: u64) -> Option<StatusCode> {
        (((draw >> 20) % 1_000_000) < u64::from(self.abort_ppm)).then_some(self.abort)
    }
}

/// `path` with the part `matched` replaced by `with`: a prefix (one `/`
/// kept between the two), or all of it.
pub(super) fn replace_prefix(path: &str, with: &str, matched: Matched) -> String {
    let rest = match matched {
        Matched::Whole => return with.to_string(),
        Matched::Prefix(n) => path.get(n..).unwrap_or(""),
    };
    match (with.ends_with('/'), rest.starts_with('/')) {
        (true, true) => format!("{with}{}", &rest[1..]),
        _ if with.is_empty() && !rest.starts_with('/') => format!("/{rest}"),
        _ => format!("{with}{rest}"),
    }
}

fn split_port(authority: &str) -> (&str, Option<u16>) {
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => match p.parse() {
            Ok(port) => (h, Some(port)),
            Err(_) => (authority, None),
        },
        _ => (authority, None),
    }
}
