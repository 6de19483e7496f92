//! LOAD_AWARE with several control-plane replicas: one truth. Each sidecar
//! reports to the replica it is connected to; followers pass every report on
//! to the leader ([`forward`], over the leader's own load-report service,
//! on one stream whose reports each name their sidecar), so the leader's
//! controller sees every endpoint as all callers see it. The leader
//! publishes the weights it computes in a ConfigMap ([`publish_weights`]);
//! every follower takes them from there ([`follow_weights`]) instead of
//! computing its own, so sidecars on any replica balance with the same
//! weights, and a new leader starts from the last ones.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use minimesh_proto::v1::load_reporting_service_client::LoadReportingServiceClient;
use minimesh_proto::v1::{LoadStatsRequest, Node};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{debug, info, warn};

use crate::load_aware::LoadAwareState;

/// Reports waiting to be passed on; beyond, they are dropped (and counted):
/// the leader unreachable must not make a follower hold reports without
/// bound.
pub const FORWARD_QUEUE: usize = 4096;

/// The ConfigMap key holding the weights: JSON, cluster -> endpoint -> weight.
pub const WEIGHTS_KEY: &str = "weights.json";

/// Passes the reports `rx` receives on to the leader at `leader_addr`
/// while this replica is not the leader; drops them while it is (they are
/// counted here already) or while no leader is known.
pub async fn forward(
    mut rx: mpsc::Receiver<LoadStatsRequest>,
    identity: String,
    to_leader: Option<crate::ca::setup::ToLeader>,
    mut leader: watch::Receiver<bool>,
    mut leader_addr: watch::Receiver<Option<String>>,
) {
    let mut backoff = Duration::from_millis(250);
    loop {
        let target = (!*leader.borrow_and_update())
            .then(|| leader_addr.borrow_and_update().clone())
            .flatten();
        let Some(addr) = target else {
            // Leading, or no leader known: reports stay here.
            tokio::select! {
                r = rx.recv() => if r.is_none() { return },
                r = leader.changed() => if r.is_err() { return },
                r = leader_addr.changed() => if r.is_err() { return },
            }
            continue;
        };
        let passed = pass_on(
            &addr,
            &identity,
            to_leader.as_ref(),
            &mut rx,
            &mut leader,
            &mut leader_addr,
        );
        match passed.await {
            Ok(()) => backoff = Duration::from_millis(250),
            Err(e) => {
                warn!(leader = %addr, error = %e, "passing load reports to the leader failed; retrying");
                // Drain while waiting, so the queue holds only fresh reports.
                let until = tokio::time::Instant::now() + backoff;
                while let Ok(Some(_)) = tokio::time::timeout_at(until, rx.recv()).await {}
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// One forwarding stream, until the leader or its address changes (Ok) or
/// the stream fails (Err).
async fn pass_on(
    addr: &str,
    identity: &str,
    to_leader: Option<&crate::ca::setup::ToLeader>,
    rx: &mut mpsc::Receiver<LoadStatsRequest>,
    leader: &mut watch::Receiver<bool>,
    leader_addr: &mut watch::Receiver<Option<String>>,
) -> anyhow::Result<()> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(addr.to_string())?
        .connect_timeout(Duration::from_secs(5));
    if let Some(t) = to_leader {
        endpoint = endpoint.tls_config(t.tls())?;
    }
    let channel = endpoint.connect().await?;
    let mut client = LoadReportingServiceClient::new(channel);
    let (tx, out) = mpsc::channel(64);
    tx.send(LoadStatsRequest {
        node: Some(Node {
            id: format!("{}{identity}", minimesh_proto::FORWARDER_NODE_PREFIX),
            ..Default::default()
        }),
        cluster_stats: vec![],
    })
    .await?;
    let mut call = tonic::Request::new(ReceiverStream::new(out));
    if let Some(t) = to_leader {
        // The control plane's own token: it speaks for every namespace.
        call.metadata_mut().insert("authorization", t.bearer()?);
    }
    let mut inbound = client.stream_load_stats(call).await?.into_inner();
    info!(leader = addr, "passing load reports on to the leader");
    loop {
        tokio::select! {
            report = rx.recv() => {
                let Some(report) = report else { return Ok(()) };
                tx.send(report).await?;
            }
            msg = inbound.message() => {
                if msg?.is_none() {
                    anyhow::bail!("the leader ended the stream");
                }
            }
            r = leader.changed() => { r?; if *leader.borrow() { return Ok(()) } }
            r = leader_addr.changed() => {
                r?;
                if leader_addr.borrow().as_deref() != Some(addr) { return Ok(()) }
            }
        }
    }
}

/// While this replica leads: writes the weights in force to the ConfigMap
/// `namespace/name` whenever they change (`changed` counts changes).
pub async fn publish_weights(
    client: Client,
    namespace: String,
    name: String,
    la: Arc<LoadAwareState>,
    mut leader: watch::Receiver<bool>,
    mut changed: watch::Receiver<u64>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let mut written: Option<String> = None;
    let mut retry = tokio::time::interval(Duration::from_secs(5));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if *leader.borrow_and_update() {
            let weights = la.weights.read().unwrap_or_else(|e| e.into_inner()).clone();
            let text = serde_json::to_string(&weights).unwrap_or_default();
            if written.as_ref() != Some(&text) {
                match write(&api, &name, &text).await {
                    Ok(()) => {
                        debug!(configmap = %name, "LOAD_AWARE weights published");
                        written = Some(text);
                    }
                    Err(e) => {
                        warn!(configmap = %name, error = %e, "publishing LOAD_AWARE weights failed; will retry")
                    }
                }
            }
        } else {
            written = None;
        }
        tokio::select! {
            r = changed.changed() => if r.is_err() { return },
            r = leader.changed() => if r.is_err() { return },
            _ = retry.tick() => {}
        }
    }
}

async fn write(api: &Api<ConfigMap>, name: &str, text: &str) -> Result<(), kube::Error> {
    let data = BTreeMap::from([(WEIGHTS_KEY.to_string(), text.to_string())]);
    let patch = serde_json::json!({ "data": data });
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    labels: Some(BTreeMap::from([(
                        "app.kubernetes.io/part-of".to_string(),
                        "minimesh".to_string(),
                    )])),
                    ..Default::default()
                },
                data: Some(data),
                ..Default::default()
            };
            api.create(&PostParams::default(), &cm).await.map(|_| ())
        }
        Err(e) => Err(e),
    }
}

/// While this replica follows: takes the weights the leader published in
/// the ConfigMap `namespace/name` as its own, and says so on `changed` so
/// that they are pushed to its sidecars.
pub async fn follow_weights(
    client: Client,
    namespace: String,
    name: String,
    la: Arc<LoadAwareState>,
    leader: watch::Receiver<bool>,
    changed: watch::Sender<u64>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    while let Some(event) = stream.next().await {
        let cm = match event {
            Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => cm,
            Ok(_) => continue,
            Err(e) => {
                warn!(configmap = %name, error = %e, "watching the LOAD_AWARE weights failed; retrying");
                continue;
            }
        };
        let Some(text) = cm.data.as_ref().and_then(|d| d.get(WEIGHTS_KEY)) else {
            continue;
        };
        let Ok(weights) = serde_json::from_str::<BTreeMap<String, BTreeMap<String, u32>>>(text)
        else {
            warn!(configmap = %name, "the published LOAD_AWARE weights are not JSON of cluster -> endpoint -> weight; ignored");
            continue;
        };
        // The leader computes its own; every replica keeps the last
        // published ones, so that a new leader starts from them.
        if *leader.borrow() {
            continue;
        }
        let mut current = la.weights.write().unwrap_or_else(|e| e.into_inner());
        if *current != weights {
            *current = weights;
            drop(current);
            changed.send_modify(|v| *v += 1);
        }
    }
}
