//! What a VirtualService route does to a request besides choosing where it
//! goes: header changes, a redirect, injected faults, retries.

use std::time::Duration;

use super::{header_name, not_yet, Refusal, MAX_ATTEMPTS, MAX_PARTS};
use crate::config::route::{Fault, HeaderOps, Redirect, RouteRetries};
use crate::config::virtual_service::{
    HeaderOperations, Headers, HttpFault, HttpRedirect, HttpRetry, Percent,
};
use minimesh_proto::retry_on::parse as parse_retry_on;

pub(super) fn headers(h: Option<&Headers>, at: &str) -> Result<(HeaderOps, HeaderOps), Refusal> {
    let Some(h) = h else {
        return Ok(Default::default());
    };
    Ok((
        header_ops(h.request.as_ref(), &format!("{at}.request"))?,
        header_ops(h.response.as_ref(), &format!("{at}.response"))?,
    ))
}

fn header_ops(ops: Option<&HeaderOperations>, at: &str) -> Result<HeaderOps, Refusal> {
    let Some(ops) = ops else {
        return Ok(HeaderOps::default());
    };
    if ops.set.len() + ops.add.len() + ops.remove.len() > MAX_PARTS {
        return Err((at.into(), format!("more than {MAX_PARTS} header changes")));
    }
    let check = |name: &str, f: String| -> Result<(), Refusal> {
        header_name(name, &f)?;
        if name.eq_ignore_ascii_case("host") || name.starts_with(':') {
            return Err((
                f,
                format!("{name:?} cannot be changed here (rewrite.authority sets the host)"),
            ));
        }
        Ok(())
    };
    for (list, what) in [(&ops.set, "set"), (&ops.add, "add")] {
        for (name, value) in list {
            let f = format!("{at}.{what}.{name}");
            check(name, f.clone())?;
            if http::HeaderValue::from_str(value).is_err() {
                return Err((f, format!("{value:?} is not a header value")));
            }
        }
    }
    for (i, name) in ops.remove.iter().enumerate() {
        check(name, format!("{at}.remove[{i}]"))?;
    }
    let pairs = |m: &std::collections::BTreeMap<String, String>| {
        m.iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
            .collect()
    };
    Ok(HeaderOps {
        set: pairs(&ops.set),
        add: pairs(&ops.add),
        remove: ops.remove.iter().map(|n| n.to_ascii_lowercase()).collect(),
    })
}

pub(super) fn redirect(r: &HttpRedirect, at: &str) -> Result<Redirect, Refusal> {
    if r.derive_port.is_some() {
        return Err(not_yet(
            format!("{at}.redirect.derivePort"),
            "deriving a redirect's port",
        ));
    }
    let status = match r.redirect_code {
        None => 301,
        Some(c @ (301 | 302 | 303 | 307 | 308)) => c as u16,
        Some(c) => {
            return Err((
                format!("{at}.redirect.redirectCode"),
                format!("{c} is not 301, 302, 303, 307 or 308"),
            ))
        }
    };
    if let Some(s) = r
        .scheme
        .as_deref()
        .filter(|s| !matches!(*s, "http" | "https"))
    {
        return Err((
            format!("{at}.redirect.scheme"),
            format!("{s:?} is not http or https"),
        ));
    }
    if let Some(p) = r.port.filter(|p| *p == 0 || *p > 65535) {
        return Err((format!("{at}.redirect.port"), format!("{p} is not a port")));
    }
    if let Some(u) = r.uri.as_deref().filter(|u| !u.starts_with('/')) {
        return Err((
            format!("{at}.redirect.uri"),
            format!("{u:?} does not start with /"),
        ));
    }
    if let Some(a) = r
        .authority
        .as_deref()
        .filter(|a| a.is_empty() || a.contains(['/', '?', '#', '@', ' ']))
    {
        return Err((
            format!("{at}.redirect.authority"),
            format!("{a:?} is not a host"),
        ));
    }
    Ok(Redirect {
        scheme: r.scheme.clone(),
        host: r.authority.clone(),
        port: r.port,
        path: r.uri.clone(),
        prefix: None,
        status,
    })
}

fn percent(p: Option<&Percent>, old: Option<i64>, at: &str) -> Result<f64, Refusal> {
    let v = match (p, old) {
        (Some(p), _) => p.value,
        (None, Some(i)) => i as f64,
        (None, None) => 100.0,
    };
    if !(0.0..=100.0).contains(&v) {
        return Err((
            format!("{at}.percentage.value"),
            format!("{v} is not a percentage from 0 to 100"),
        ));
    }
    Ok(v)
}

pub(super) fn fault(f: &HttpFault, at: &str) -> Result<Fault, Refusal> {
    let delay = match &f.delay {
        None => None,
        Some(d) => {
            if d.exponential_delay.is_some() {
                return Err(not_yet(
                    format!("{at}.delay.exponentialDelay"),
                    "exponential delays",
                ));
            }
            let Some(fixed) = &d.fixed_delay else {
                return Err((format!("{at}.delay.fixedDelay"), "is required".into()));
            };
            let dur: Duration = minimesh_proto::duration::parse(fixed)
                .map_err(|e| (format!("{at}.delay.fixedDelay"), e))?;
            Some((
                percent(d.percentage.as_ref(), d.percent, &format!("{at}.delay"))?,
                dur,
            ))
        }
    };
    let abort = match &f.abort {
        None => None,
        Some(a) => {
            if a.grpc_status.is_some() {
                return Err(not_yet(
                    format!("{at}.abort.grpcStatus"),
                    "aborting with a gRPC status",
                ));
            }
            if a.http2_error.is_some() {
                return Err(not_yet(
                    format!("{at}.abort.http2Error"),
                    "aborting with an HTTP/2 error",
                ));
            }
            let status = match a.http_status {
                Some(s @ 200..=599) => s as u16,
                Some(s) => {
                    return Err((
                        format!("{at}.abort.httpStatus"),
                        format!("{s} is not an HTTP status from 200 to 599"),
                    ))
                }
                None => return Err((format!("{at}.abort.httpStatus"), "is required".into())),
            };
            Some((
                percent(a.percentage.as_ref(), None, &format!("{at}.abort"))?,
                status,
            ))
        }
    };
    Ok(Fault { delay, abort })
}

pub(super) fn retries(r: &HttpRetry, at: &str) -> Result<RouteRetries, Refusal> {
    if r.retry_remote_localities.is_some() {
        return Err(not_yet(
            format!("{at}.retryRemoteLocalities"),
            "choosing retry localities",
        ));
    }
    if let Some(a) = r.attempts.filter(|a| *a > MAX_ATTEMPTS) {
        return Err((
            format!("{at}.attempts"),
            format!("{a} is more than the maximum of {MAX_ATTEMPTS}"),
        ));
    }
    let per_try_timeout = match &r.per_try_timeout {
        None => None,
        Some(t) => Some(
            minimesh_proto::duration::parse_positive(t)
                .map_err(|e| (format!("{at}.perTryTimeout"), e))?,
        ),
    };
    let retry_on = match &r.retry_on {
        None => None,
        Some(on) => {
            let parsed = parse_retry_on(on).map_err(|e| (format!("{at}.retryOn"), e))?;
            Some((parsed.bits, parsed.codes))
        }
    };
    Ok(RouteRetries {
        attempts: r.attempts,
        per_try_timeout,
        retry_on,
    })
}
