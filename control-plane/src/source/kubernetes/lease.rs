//! Leader election with a `coordination.k8s.io/v1` Lease, as client-go's
//! leaderelection does: the holder renews `spec.renewTime` every retry
//! period; another replica takes the lease only once it has not been renewed
//! for `leaseDurationSeconds`. Every write carries the resourceVersion it
//! read, so two replicas racing for an expired lease cannot both win (the
//! loser gets 409 Conflict). Every replica serves sidecars; only the leader
//! writes rule status.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
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
}

/// Campaigns forever; `leader` says whether this replica holds the lease.
pub async fn run(client: Client, cfg: LeaseConfig, leader: watch::Sender<bool>) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut last_renewed: Option<tokio::time::Instant> = None;
    loop {
        let held = match try_acquire_or_renew(&api, &cfg).await {
            Ok(held) => {
                if held {
                    last_renewed = Some(tokio::time::Instant::now());
                }
                held
            }
            Err(e) => {
                warn!(lease = %cfg.name, error = %e, "lease update failed");
                // Keep leading only while the lease we last renewed holds.
                last_renewed.is_some_and(|t| t.elapsed() < cfg.duration)
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

/// One round: Ok(true) when this replica holds the lease afterwards.
async fn try_acquire_or_renew(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let duration_secs = cfg.duration.as_secs().max(1) as i32;
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                namespace: Some(cfg.namespace.clone()),
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
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false), // another replica was first
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    let mine = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
    let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(MicroTime(renewed)), Some(secs)) => {
            now.duration_since(*renewed) > SignedDuration::from_secs(secs.into())
        }
        _ => true,
    };
    let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
    if !mine && !expired && !free {
        return Ok(false);
    }
    if !mine {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(duration_secs);
    spec.renew_time = Some(MicroTime(now));
    // `lease` still carries the resourceVersion read above.
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
