//! A request over its attempts: what the attempts so far came to (the
//! endpoints tried, the last error, whether one may have reached an app), what each
//! counts towards its endpoint (backoff, outlier detection, counters), and
//! the answer when the request stops without a response to pass on.

use std::sync::Arc;

use http::header::{HeaderName, HeaderValue};
use http::{Response, StatusCode};
use tracing::{debug, info};

use super::admission::{admit_retry, InflightGuard};
use super::attempt::Upstream;
use super::respond::{local, source_chain, unprocessed};
use super::{ResponseBody, ERROR_HEADER, OVERFLOW_HEADER};
use crate::endpoint::EndpointState;
use crate::outlier::Outcome;
use crate::retry::{Action, Attempted, Standing, GRPC_STATUS};
use crate::routing::ClusterHandle;
use crate::{outlier, retry};

/// What one attempt came to, at the transport.
// The response is the common case and lives on the request's stack: boxing
// it would allocate per request to shrink the rare variants.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Sent {
    /// The endpoint answered.
    Answered(Response<Upstream>),
    /// No response: no connection, a refused stream, a reset, a bad response.
    Failed(crate::upstream::UpstreamError),
    /// No response within the per-try timeout.
    TimedOut,
}

impl Sent {
    /// How the attempt reads for the retry decision, and what follows it.
    pub(crate) fn decide(
        &self,
        h2: bool,
        at: Standing,
        retry_on: &retry::Conditions,
    ) -> (Attempted, Action) {
        let outcome = match self {
            Sent::Answered(r) => {
                return retry::decide_response(r.status().as_u16(), r.headers(), h2, at, retry_on)
            }
            Sent::TimedOut => Attempted::TimedOut,
            Sent::Failed(e) if e.is_connect() => Attempted::ConnectFailed,
            Sent::Failed(e) if e.is_refused_stream() => Attempted::RefusedStream,
            Sent::Failed(_) => Attempted::Reset,
        };
        (outcome, retry::decide(outcome, at, retry_on))
    }
}

/// The attempts of one request so far.
#[derive(Default)]
pub(crate) struct Tries {
    /// The endpoints the attempts so far failed on, in order (the next pick
    /// avoids them while another can serve, as Istio's default retry policy
    /// does with Envoy's `previous_hosts` predicate). Empty, and not
    /// allocated, until an attempt fails.
    tried: Vec<Arc<EndpointState>>,
    /// Why the last attempt failed.
    last_error: String,
    /// An attempt may have reached an app. Until one has, a failure is
    /// answered with the unprocessed header (any method may go elsewhere).
    delivered: bool,
    /// The cluster's `maxRetries` slot this request holds, once it retried.
    retry_slot: Option<InflightGuard>,
}

impl Tries {
    /// True when an attempt may have reached an app.
    pub(crate) fn delivered(&self) -> bool {
        self.delivered
    }

    /// Admits a retry: a `maxRetries` slot (held until the request ends)
    /// and a token from the retry budget. Some is the answer when either is
    /// refused.
    pub(crate) fn retry_refused(
        &mut self,
        cluster: &ClusterHandle,
    ) -> Option<Response<ResponseBody>> {
        if self.retry_slot.is_none() {
            match admit_retry(cluster) {
                Ok(slot) => self.retry_slot = slot,
                Err(max) => {
                    let reason = format!(
                        "cluster {} has {max} retries in flight (connectionPool.http.maxRetries); last: {}",
                        cluster.name, self.last_error
                    );
                    let r = self.fail(StatusCode::SERVICE_UNAVAILABLE, &reason);
                    return Some(overflow(r, "max retries", max));
                }
            }
        }
        if !cluster.budget.try_retry(crate::clock::now_ms()) {
            let reason = format!("retry budget exhausted; last: {}", self.last_error);
            return Some(self.fail(StatusCode::SERVICE_UNAVAILABLE, &reason));
        }
        None
    }

    /// Admits the HTTP/1.1 pool's resend of this attempt on a fresh
    /// connection (a reused one closed as the request went out) as a retry
    /// is admitted: a `maxRetries` slot and a token of the retry budget.
    pub(crate) fn admit_resend(&mut self, cluster: &ClusterHandle) -> bool {
        if self.retry_slot.is_none() {
            match admit_retry(cluster) {
                Ok(slot) => self.retry_slot = slot,
                Err(_) => return false,
            }
        }
        cluster.budget.try_retry(crate::clock::now_ms())
    }

    /// The endpoints the attempts so far failed on.
    pub(crate) fn tried(&self) -> &[Arc<EndpointState>] {
        &self.tried
    }

    /// True when an attempt of this request already failed on `ep` (then the
    /// retry backs off first: no other endpoint could take it).
    pub(crate) fn has_tried(&self, ep: &Arc<EndpointState>) -> bool {
        self.tried.iter().any(|t| Arc::ptr_eq(t, ep))
    }

    /// An answer of minimesh's own, marked unprocessed while no attempt may
    /// have reached an app.
    pub(crate) fn fail(&self, status: StatusCode, reason: &str) -> Response<ResponseBody> {
        let r = local(status, reason);
        if self.delivered {
            r
        } else {
            unprocessed(r)
        }
    }

    /// Counts an attempt that will not be passed on (`outcome`, read from
    /// `sent`) towards its endpoint, and remembers why it failed.
    pub(crate) fn failed(
        &mut self,
        cluster: &ClusterHandle,
        ep: Arc<EndpointState>,
        outcome: Attempted,
        sent: &Sent,
    ) {
        ep.counters().count_failure();
        self.delivered |= !matches!(
            outcome,
            Attempted::ConnectFailed
                | Attempted::RefusedStream
                | Attempted::AppGone {
                    unprocessed: true,
                    ..
                }
        );
        let addr = ep.addr;
        self.last_error = match (sent, outcome) {
            (Sent::Answered(resp), Attempted::AppGone { status, .. }) => {
                // Its own sidecar could not reach its app (503: dead or
                // restarting; 502: it died mid-request): skip the endpoint
                // for a while as if it had refused the connection, or every
                // request would pay a retry.
                ep.back_off();
                outlier_outcome(cluster, &ep, Outcome::Status(resp.status()));
                let why = resp
                    .headers()
                    .get(ERROR_HEADER)
                    .and_then(|v| v.to_str().ok());
                format!("{addr} answered {status}: {}", why.unwrap_or(""))
            }
            (Sent::Answered(resp), Attempted::GrpcStatus(_)) => {
                let g = resp
                    .headers()
                    .get(GRPC_STATUS)
                    .and_then(|v| v.to_str().ok());
                format!("{addr} answered grpc-status {}", g.unwrap_or(""))
            }
            (Sent::Answered(resp), _) => {
                outlier_outcome(cluster, &ep, Outcome::Status(resp.status()));
                format!("{addr} answered {}", resp.status())
            }
            (Sent::TimedOut, _) => {
                // A replica that hangs is skipped like one that refuses
                // connections, so that first attempts stop going to it.
                ep.mark_connect_failure();
                outlier_outcome(cluster, &ep, Outcome::TimedOut);
                format!("{addr} did not answer within the per-try timeout")
            }
            (Sent::Failed(e), Attempted::ConnectFailed) => {
                debug!(endpoint = %addr, cluster = %cluster.name, error = %e, "connect failed");
                ep.mark_connect_failure();
                outlier_outcome(cluster, &ep, Outcome::Failed);
                format!("connect to {addr} failed: {}", source_chain(e))
            }
            (Sent::Failed(e), Attempted::RefusedStream) => {
                outlier_outcome(cluster, &ep, Outcome::Failed);
                format!("{addr} refused the stream: {}", source_chain(e))
            }
            (Sent::Failed(e), _) => {
                debug!(endpoint = %addr, cluster = %cluster.name, error = %e, "request failed in flight");
                outlier_outcome(cluster, &ep, Outcome::Failed);
                format!("{addr} failed: {}", source_chain(e))
            }
        };
        self.tried.push(ep);
    }

    /// The answer when the request stops after `outcome` (or ran out of
    /// attempts) with no response to pass on.
    pub(crate) fn give_up(
        &self,
        outcome: Attempted,
        sent: &Sent,
        attempts: u32,
    ) -> Response<ResponseBody> {
        match (outcome, sent) {
            // A timed-out attempt may have been delivered: never unprocessed.
            (Attempted::TimedOut, _) => self.fail(StatusCode::GATEWAY_TIMEOUT, &self.last_error),
            (Attempted::RefusedStream | Attempted::Reset, Sent::Failed(e)) => {
                let addr = self
                    .tried
                    .last()
                    .map_or(String::new(), |ep| ep.addr.to_string());
                let reason = format!("upstream {addr} failed: {}", source_chain(e));
                self.fail(StatusCode::BAD_GATEWAY, &reason)
            }
            _ => self.exhausted(attempts),
        }
    }

    /// The answer when every attempt failed.
    pub(crate) fn exhausted(&self, attempts: u32) -> Response<ResponseBody> {
        let reason = match attempts {
            1 => self.last_error.clone(),
            n => format!("all {n} attempts failed; last: {}", self.last_error),
        };
        self.fail(StatusCode::SERVICE_UNAVAILABLE, &reason)
    }
}

/// Adds the overflow header (which limit refused the request) to `r`.
pub(crate) fn overflow(
    mut r: Response<ResponseBody>,
    what: &str,
    max: u32,
) -> Response<ResponseBody> {
    if let Ok(v) = HeaderValue::from_str(&format!("{what} {max}")) {
        r.headers_mut()
            .insert(HeaderName::from_static(OVERFLOW_HEADER), v);
    }
    r
}

/// Counts an attempt's outcome towards its endpoint's outlier detection
/// (the cluster's, when it has one) and logs an ejection.
pub(crate) fn outlier_outcome(cluster: &ClusterHandle, ep: &EndpointState, outcome: Outcome) {
    let Some(od) = &cluster.outlier else {
        ep.outlier().reset_on_success(outcome);
        return;
    };
    let all = cluster.balancer.endpoints().iter().map(|e| e.outlier());
    // The coarse clock, which every request advances: no clock call per
    // attempt (ejections are seconds long).
    let now = crate::clock::now_ms();
    if let Some(e) = outlier::count(od, all, ep.outlier(), outcome, now) {
        info!(endpoint = %ep.addr, cluster = %cluster.name, ejection_ms = e.ms, times = e.times, ?outcome, "endpoint ejected by outlier detection");
    }
}
