//! Leader election with a `coordination.k8s.io/v1` Lease, as client-go's
//! leaderelection does: the holder renews `spec.renewTime` every retry
//! period; another replica takes the lease only once it has not been renewed
//! for `leaseDurationSeconds`. Every write carries the resourceVersion it
//! read, so two replicas racing for an expired lease cannot both win (the
//! loser gets 409 Conflict). A leader that has not renewed within the renew
//! deadline (shorter than the lease duration) steps down, even while its
//! request hangs, so that it has stopped writing before another replica may
//! take the lease. Every replica serves sidecars; only the leader writes
//! rule status.
//!
//! Expiry is judged on this replica's own clock, as client-go judges it: not
//! by comparing `renewTime` (another node's clock) with this node's time,
//! but by when this replica last saw the lease's record change. A lease
//! whose record has not changed for `leaseDurationSeconds`, by the local
//! monotonic clock, has expired; so clocks skewed between nodes, by any
//! amount, can neither elect two leaders nor leave none. (A replica that has
//! just started waits one lease duration before taking a lease it found
//! held, as client-go's does; a released lease is taken at once.)

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::Client;
use tokio::sync::watch;
use tracing::{info, warn};

/// Election settings.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Namespace of the Lease (the control plane's own).
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a lease holds without renewal.
    pub duration: Duration,
    /// How often the holder renews and the others check.
    pub retry: Duration,
    /// A leader that has not renewed for this long steps down.
    pub renew_deadline: Duration,
    /// Where the other replicas reach this one's load-report service, set
    /// on the Lease while this replica holds it (see `lrs::replicas`).
    pub advertise: Option<String>,
}

/// The Lease annotation with the holder's load-report address.
pub const ADDRESS_ANNOTATION: &str = "minimesh.io/load-address";

impl LeaseConfig {
    /// The order client-go requires: retry < renew deadline < duration.
    pub fn check(&self) -> Result<(), String> {
        if self.renew_deadline >= self.duration {
            return Err(format!(
                "--lease-renew-deadline ({:?}) must be shorter than --lease-duration ({:?}): a leader must step down before another replica may take the lease",
                self.renew_deadline, self.duration
            ));
        }
        if self.retry >= self.renew_deadline {
            return Err(format!(
                "--lease-retry ({:?}) must be shorter than --lease-renew-deadline ({:?}): the leader needs more than one try to renew",
                self.retry, self.renew_deadline
            ));
        }
        Ok(())
    }
}

/// The lease's record as last seen, and when (this replica's monotonic
/// clock): what expiry is judged on.
struct Observed {
    /// Holder, renew time, transitions: any write by a holder changes it.
    record: (Option<String>, Option<Timestamp>, Option<i32>),
    at: tokio::time::Instant,
}

/// Campaigns forever; `leader` says whether this replica holds the lease,
/// `leader_addr` where the holder takes load reports (when it says).
pub async fn run(
    client: Client,
    cfg: LeaseConfig,
    leader: watch::Sender<bool>,
    leader_addr: watch::Sender<Option<String>>,
) {
    campaign(client, cfg, leader, leader_addr, Timestamp::now).await
}

/// [`run`] with the wall clock the renewals are stamped with (a test's,
/// skewed): nothing is decided on it.
async fn campaign(
    client: Client,
    cfg: LeaseConfig,
    leader: watch::Sender<bool>,
    leader_addr: watch::Sender<Option<String>>,
    wall_clock: impl Fn() -> Timestamp,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut last_renewed: Option<tokio::time::Instant> = None;
    let mut observed: Option<Observed> = None;
    loop {
        // A leader has until the renew deadline of its last renewal; a
        // request that hangs past it is given up.
        let budget = match last_renewed {
            Some(t) => cfg.renew_deadline.saturating_sub(t.elapsed()),
            None => cfg.renew_deadline,
        };
        let round = try_acquire_or_renew(&api, &cfg, &mut observed, wall_clock());
        let held = match tokio::time::timeout(budget, round).await {
            Ok(Ok((held, addr))) => {
                if held {
                    last_renewed = Some(tokio::time::Instant::now());
                }
                leader_addr.send_if_modified(|a| {
                    let changed = *a != addr;
                    *a = addr;
                    changed
                });
                held
            }
            Ok(Err(e)) => {
                warn!(lease = %cfg.name, error = %e, "lease update failed");
                // Keep leading only within the renew deadline.
                last_renewed.is_some_and(|t| t.elapsed() < cfg.renew_deadline)
            }
            Err(_) => {
                if last_renewed.is_some() {
                    warn!(lease = %cfg.name, deadline = ?cfg.renew_deadline, "lease not renewed within the renew deadline; stepping down");
                }
                false
            }
        };
        if !held {
            last_renewed = None;
        }
        if *leader.borrow() != held {
            info!(identity = %cfg.identity, lease = %cfg.name, leader = held, "leadership changed");
            if leader.send(held).is_err() {
                return;
            }
        }
        tokio::time::sleep(cfg.retry).await;
    }
}

/// Gives the lease up if this replica holds it, as client-go's
/// `ReleaseOnCancel`: no holder, renewed now for one second, so that another
/// replica takes it at its next check instead of waiting out the lease
/// (status writes would pause that long after every rollout). Called on
/// shutdown, once the campaign has stopped.
pub async fn release(client: Client, cfg: &LeaseConfig) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let result = async {
        let Some(mut lease) = api.get_opt(&cfg.name).await? else {
            return Ok(false);
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
            return Ok(false);
        }
        spec.holder_identity = Some(String::new());
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        api.replace(&cfg.name, &PostParams::default(), &lease)
            .await
            .map(|_| true)
    };
    match tokio::time::timeout(cfg.retry.max(Duration::from_secs(1)), result).await {
        Ok(Ok(true)) => info!(lease = %cfg.name, "lease released"),
        Ok(Ok(false)) => {}
        Ok(Err(e)) => {
            warn!(lease = %cfg.name, error = %e, "releasing the lease failed; it expires by itself")
        }
        Err(_) => warn!(lease = %cfg.name, "releasing the lease timed out; it expires by itself"),
    }
}

/// The holder's load-report address on a Lease.
fn address_of(lease: &Lease) -> Option<String> {
    lease
        .metadata
        .annotations
        .as_ref()?
        .get(ADDRESS_ANNOTATION)
        .filter(|a| !a.is_empty())
        .cloned()
}

/// This replica's address as its Lease annotations.
fn annotations(cfg: &LeaseConfig) -> Option<std::collections::BTreeMap<String, String>> {
    cfg.advertise
        .as_ref()
        .map(|a| std::collections::BTreeMap::from([(ADDRESS_ANNOTATION.to_string(), a.clone())]))
}

/// One round: whether this replica holds the lease afterwards, and the
/// holder's load-report address.
async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    observed: &mut Option<Observed>,
    now: Timestamp,
) -> Result<(bool, Option<String>), kube::Error> {
    let duration_secs = cfg.duration.as_secs().max(1) as i32;
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                namespace: Some(cfg.namespace.clone()),
                annotations: annotations(cfg),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(duration_secs),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok((true, cfg.advertise.clone())),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok((false, None)), // another replica was first
            Err(e) => Err(e),
        };
    };
    let holder_addr = address_of(&lease);
    let spec = lease.spec.get_or_insert_with(Default::default);
    let mine = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
    let record = (
        spec.holder_identity.clone(),
        spec.renew_time.as_ref().map(|t| t.0),
        spec.lease_transitions,
    );
    let local_now = tokio::time::Instant::now();
    if observed.as_ref().is_none_or(|o| o.record != record) {
        *observed = Some(Observed {
            record,
            at: local_now,
        });
    }
    let expired = match (observed.as_ref(), spec.lease_duration_seconds) {
        (Some(o), Some(secs)) => {
            local_now.duration_since(o.at) > Duration::from_secs(u64::try_from(secs).unwrap_or(0))
        }
        _ => true,
    };
    let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
    if !mine && !expired && !free {
        return Ok((false, holder_addr));
    }
    if !mine {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(duration_secs);
    spec.renew_time = Some(MicroTime(now));
    let a = lease
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    match &cfg.advertise {
        Some(addr) => a.insert(ADDRESS_ANNOTATION.to_string(), addr.clone()),
        None => a.remove(ADDRESS_ANNOTATION),
    };
    // `lease` still carries the resourceVersion read above.
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok((true, cfg.advertise.clone())),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok((false, None)),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use http::{Request, Response};

    use super::*;

    fn cfg() -> LeaseConfig {
        LeaseConfig {
            namespace: "minimesh-system".into(),
            name: "minimesh-control-plane".into(),
            identity: "cp-0".into(),
            duration: Duration::from_secs(15),
            retry: Duration::from_secs(2),
            renew_deadline: Duration::from_secs(10),
            advertise: Some("http://10.0.0.1:15010".into()),
        }
    }

    /// An API server that answers the first `answered` requests (no Lease:
    /// 404, then the create: 201) and never answers again.
    fn api_that_hangs_after(answered: usize) -> Client {
        let seen = Arc::new(AtomicUsize::new(0));
        let svc = tower::service_fn(move |req: Request<kube::client::Body>| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            async move {
                if n >= answered {
                    std::future::pending::<()>().await;
                }
                let (code, body) = if req.method() == http::Method::GET {
                    (404, r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#.to_string())
                } else {
                    (201, r#"{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","metadata":{"name":"minimesh-control-plane","namespace":"minimesh-system","resourceVersion":"1"},"spec":{"holderIdentity":"cp-0"}}"#.to_string())
                };
                Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                        .expect("response"),
                )
            }
        });
        Client::new(svc, "default")
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_renewal_hangs_steps_down_at_the_renew_deadline() {
        let (tx, mut rx) = watch::channel(false);
        let (addr_tx, addr) = watch::channel(None);
        let start = tokio::time::Instant::now();
        tokio::spawn(run(api_that_hangs_after(2), cfg(), tx, addr_tx));
        rx.wait_for(|l| *l).await.expect("elected");
        let elected = start.elapsed();
        assert!(elected < Duration::from_millis(10), "{elected:?}");
        assert_eq!(addr.borrow().as_deref(), Some("http://10.0.0.1:15010"));
        // The next renewal (at 2 s) hangs: leadership ends 10 s after the
        // last renewal, well before the 15 s lease could pass to another.
        rx.wait_for(|l| !*l).await.expect("stepped down");
        let led = start.elapsed() - elected;
        assert!(
            led >= Duration::from_secs(10) && led < Duration::from_millis(10_100),
            "led for {led:?}"
        );
    }

    /// An API server holding one Lease as the real one does: 404 before it
    /// is created, 409 for a second create or a write with a stale
    /// resourceVersion.
    fn lease_api() -> Client {
        let stored: Arc<std::sync::Mutex<Option<serde_json::Value>>> = Default::default();
        let svc = tower::service_fn(move |req: Request<kube::client::Body>| {
            let stored = stored.clone();
            async move {
                use http_body_util::BodyExt;
                let method = req.method().clone();
                let body = req.into_body().collect().await.expect("body").to_bytes();
                let mut lease = stored.lock().expect("lease");
                let conflict = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Conflict","code":409}"#;
                let (code, answer) = match method {
                    http::Method::GET => match &*lease {
                        Some(l) => (200, l.to_string()),
                        None => (404, r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#.to_string()),
                    },
                    _ => {
                        let mut new: serde_json::Value = serde_json::from_slice(&body).expect("lease");
                        let current = lease.as_ref().map(|l| l["metadata"]["resourceVersion"].clone());
                        let fresh = match (&method, &current) {
                            (&http::Method::POST, None) => true,
                            (&http::Method::PUT, Some(rv)) => new["metadata"]["resourceVersion"] == *rv,
                            _ => false,
                        };
                        if fresh {
                            let rv = current
                                .and_then(|v| v.as_str().and_then(|v| v.parse::<u64>().ok()))
                                .unwrap_or(0);
                            new["metadata"]["resourceVersion"] = (rv + 1).to_string().into();
                            *lease = Some(new.clone());
                            (if method == http::Method::POST { 201 } else { 200 }, new.to_string())
                        } else {
                            (409, conflict.to_string())
                        }
                    }
                };
                Ok::<_, std::convert::Infallible>(
                    Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(http_body_util::Full::new(bytes::Bytes::from(answer)))
                        .expect("response"),
                )
            }
        });
        Client::new(svc, "default")
    }

    #[tokio::test(start_paused = true)]
    async fn replicas_with_skewed_clocks_elect_exactly_one_leader() {
        let client = lease_api();
        let mut replicas = Vec::new();
        // One node's clock an hour ahead, the other's an hour behind: by
        // renewTime, each would find the other's lease long expired.
        for (identity, skew) in [("cp-0", 3600), ("cp-1", -3600)] {
            let (tx, rx) = watch::channel(false);
            let (addr_tx, _addr) = watch::channel(None);
            let cfg = LeaseConfig {
                identity: identity.into(),
                ..cfg()
            };
            let clock =
                move || Timestamp::now() + k8s_openapi::jiff::SignedDuration::from_secs(skew);
            tokio::spawn(campaign(client.clone(), cfg, tx, addr_tx, clock));
            replicas.push(rx);
        }
        let mut first = None;
        for tick in 0..1200 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let leaders: Vec<usize> = (0..2).filter(|i| *replicas[*i].borrow()).collect();
            assert!(leaders.len() <= 1, "two leaders at {tick}00 ms");
            if tick >= 10 {
                // From the first second on: the first leader, and only it.
                assert_eq!(leaders.len(), 1, "no leader at {tick}00 ms");
                assert_eq!(
                    *first.get_or_insert(leaders[0]),
                    leaders[0],
                    "leadership moved at {tick}00 ms"
                );
            }
        }
    }

    #[test]
    fn the_deadline_must_sit_between_the_retry_and_the_duration() {
        assert_eq!(cfg().check(), Ok(()));
        let mut c = cfg();
        c.renew_deadline = Duration::from_secs(15);
        assert!(c.check().unwrap_err().starts_with(
            "--lease-renew-deadline (15s) must be shorter than --lease-duration (15s)"
        ));
        let mut c = cfg();
        c.retry = Duration::from_secs(10);
        assert!(c
            .check()
            .unwrap_err()
            .starts_with("--lease-retry (10s) must be shorter than --lease-renew-deadline (10s)"));
    }
}
