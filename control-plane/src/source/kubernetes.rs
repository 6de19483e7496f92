//! The Kubernetes source: watchers (list, then watch from the list's
//! resourceVersion; a `410 Gone` or a broken stream relists, with backoff) on
//! DestinationRules (minimesh.io, and networking.istio.io when that CRD is
//! installed), Services and `discovery.k8s.io/v1` EndpointSlices,
//! PeerAuthentications (minimesh.io, security.istio.io: each when its CRD is
//! installed) and, with a CA, the Pods that run a sidecar. Objects go
//! through the same parser and validation as local files and feed the same
//! [`Store`]. Nothing is published until every watcher has completed its
//! first list, and a relist replaces a kind's objects only once it is whole.
//! A [`Scope`] narrows what is served: watches in listed namespaces only
//! (`--watch-namespaces`), and objects of namespaces whose labels match a
//! selector only (`--namespace-selector`, as Istio's discoverySelectors).

pub mod lease;
pub mod route_status;
pub mod secret;
pub mod status;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use futures_util::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::config::parse::{parse_object, ObjectKey, ValidRule, ISTIO_RULE_KIND};
use crate::config::Object;
use crate::store::{RuleObject, Store};

/// What the Kubernetes source watches, one entry per kind.
#[derive(Clone, Debug)]
pub struct Watched {
    /// API resource (group, version, kind, plural).
    pub resource: ApiResource,
    /// False when the kind is watched only if its CRD is installed.
    pub required: bool,
}

/// The kinds minimesh watches. Pods are all watched, meshed or not: their
/// labels choose DestinationRule subsets' endpoints; those that run a
/// sidecar (`minimesh.io/proxy=sidecar`), with a CA, are called over
/// mutual TLS.
pub fn watched() -> Vec<Watched> {
    let ar = |group: &str, version: &str, kind: &str, plural: &str| {
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
    };
    vec![
        Watched {
            resource: ar(
                "minimesh.io",
                "v1alpha1",
                "DestinationRule",
                "destinationrules",
            ),
            required: true,
        },
        Watched {
            resource: ar(
                "networking.istio.io",
                "v1",
                "DestinationRule",
                "destinationrules",
            ),
            required: false,
        },
        Watched {
            resource: ar(
                "minimesh.io",
                "v1alpha1",
                "VirtualService",
                "virtualservices",
            ),
            required: false,
        },
        Watched {
            resource: ar(
                "networking.istio.io",
                "v1",
                "VirtualService",
                "virtualservices",
            ),
            required: false,
        },
        Watched {
            resource: ar("networking.istio.io", "v1", "Gateway", "gateways"),
            required: false,
        },
        Watched {
            resource: ar("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
            required: false,
        },
        Watched {
            resource: ar("gateway.networking.k8s.io", "v1", "Gateway", "gateways"),
            required: false,
        },
        Watched {
            resource: ar("", "v1", "Service", "services"),
            required: true,
        },
        Watched {
            resource: ar("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"),
            required: true,
        },
        Watched {
            resource: ar(
                "minimesh.io",
                "v1alpha1",
                "PeerAuthentication",
                "peerauthentications",
            ),
            required: false,
        },
        Watched {
            resource: ar(
                "security.istio.io",
                "v1",
                "PeerAuthentication",
                "peerauthentications",
            ),
            required: false,
        },
        Watched {
            resource: ar(
                "minimesh.io",
                "v1alpha1",
                "AuthorizationPolicy",
                "authorizationpolicies",
            ),
            required: false,
        },
        Watched {
            resource: ar(
                "security.istio.io",
                "v1",
                "AuthorizationPolicy",
                "authorizationpolicies",
            ),
            required: false,
        },
        Watched {
            resource: ar("", "v1", "Pod", "pods"),
            required: true,
        },
    ]
}

/// Which namespaces the control plane serves.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    /// Watch only these namespaces (None: the whole cluster).
    pub namespaces: Option<Vec<String>>,
    /// Serve only objects of namespaces whose labels match this selector
    /// (kubectl's `-l` syntax, evaluated by the API server on a watch of
    /// Namespaces).
    pub selector: Option<String>,
}

impl Scope {
    /// Refuses, at start, a selector the API server cannot parse (rather
    /// than a watch that fails forever) and an empty namespace list.
    pub async fn check(&self, client: &Client) -> anyhow::Result<()> {
        if self
            .namespaces
            .as_ref()
            .is_some_and(|n| n.iter().any(String::is_empty))
        {
            anyhow::bail!("--watch-namespaces: an empty namespace name");
        }
        let Some(selector) = &self.selector else {
            return Ok(());
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &namespaces());
        match api
            .list_metadata(&ListParams::default().labels(selector).limit(1))
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 400 => {
                anyhow::bail!("--namespace-selector {selector:?}: {}", s.message)
            }
            // Anything else (forbidden, unreachable) is the watch's to retry and log.
            _ => Ok(()),
        }
    }
}

/// One watch: a kind, in one namespace or all.
#[derive(Clone, Debug)]
struct Source {
    watched: Watched,
    namespace: Option<String>,
}

/// The Namespace watch of a selector.
fn namespaces() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Namespace"), "namespaces")
}

/// One object as the source keeps it.
#[derive(Clone, Debug)]
enum Entry {
    /// A rule: its last good version (if any) and the state of the current one.
    Rule {
        good: Option<Arc<ValidRule>>,
        seen: RuleObject,
    },
    /// A Service or EndpointSlice.
    Plain(Object),
    /// An object minimesh cannot use (logged once, counted in errors).
    Rejected(crate::config::ConfigError),
    /// A namespace the selector selects.
    Selected,
}

#[derive(Default)]
struct KindState {
    synced: bool,
    current: BTreeMap<ObjectKey, Entry>,
    /// Objects of a list in progress (initial or relist); swapped in whole.
    relisting: Option<BTreeMap<ObjectKey, Entry>>,
}

/// A watch as readiness names it: `destinationrules.networking.istio.io in a`.
fn describe(source: &Source) -> String {
    let r = &source.watched.resource;
    let what = match r.group.as_str() {
        "" => r.plural.clone(),
        g => format!("{}.{g}", r.plural),
    };
    match &source.namespace {
        Some(ns) => format!("{what} in {ns}"),
        None => what,
    }
}

/// Where errors and warnings say the object came from.
fn origin(resource: &ApiResource) -> PathBuf {
    PathBuf::from(format!("kubernetes {}", resource.api_version))
}

/// Turns an API object into an entry. `previous` is the entry of the same
/// object before this event, whose good rule stays in force when the new
/// version is invalid.
fn entry_of(
    resource: &ApiResource,
    obj: &DynamicObject,
    previous: Option<&Entry>,
) -> Option<(ObjectKey, Entry)> {
    if resource.kind == "Namespace" {
        return Some((key_of(resource, obj)?, Entry::Selected));
    }
    let mut value = serde_json::to_value(obj).ok()?;
    // List items from the API server carry no apiVersion/kind: set them.
    value["apiVersion"] = resource.api_version.clone().into();
    value["kind"] = resource.kind.clone().into();
    if resource.kind == "EndpointSlice"
        && value.get("addressType").and_then(|t| t.as_str()) == Some("FQDN")
    {
        return None; // FQDN slices name hosts, not pods; nothing to balance over
    }
    let doc = parse_object(&origin(resource), value, "default")?;
    let key = doc.key?;
    let entry = match (doc.result, resource.kind.as_str()) {
        (Ok(Object::Rule(rule)), _) => Entry::Rule {
            seen: RuleObject {
                api_version: resource.api_version.clone(),
                generation: obj.metadata.generation,
                uid: obj.metadata.uid.clone(),
                error: None,
            },
            good: Some(rule),
        },
        (Err(e), "DestinationRule") => {
            // The good version this replica saw, else the one the leader
            // recorded in the status: every replica keeps the same one.
            let good = match previous {
                Some(Entry::Rule { good: Some(g), .. }) => Some(g.clone()),
                _ => recorded_good(resource, obj),
            };
            if good.is_some() {
                warn!("{e}; the previous good version stays in force");
            } else {
                warn!("{e}");
            }
            Entry::Rule {
                good,
                seen: RuleObject {
                    api_version: resource.api_version.clone(),
                    generation: obj.metadata.generation,
                    uid: obj.metadata.uid.clone(),
                    error: Some(e),
                },
            }
        }
        (Ok(object), _) => Entry::Plain(object),
        (Err(e), _) => {
            warn!("{e}");
            Entry::Rejected(e)
        }
    };
    Some((key, entry))
}

/// The last good version of a rule as the leader recorded it in the rule's
/// `status.lastGood` (minimesh's own rules; Istio's carry no status from
/// minimesh), read again through the same checks.
fn recorded_good(resource: &ApiResource, obj: &DynamicObject) -> Option<Arc<ValidRule>> {
    let recorded = obj.data.get("status")?.get("lastGood")?.get("spec")?;
    let mut old = serde_json::to_value(obj).ok()?;
    old["apiVersion"] = resource.api_version.clone().into();
    old["kind"] = resource.kind.clone().into();
    old["spec"] = recorded.clone();
    let doc = parse_object(&origin(resource), old, "default")?;
    match doc.result {
        Ok(Object::Rule(rule)) => {
            info!(
                rule = %format!("{}/{}", obj.metadata.namespace.as_deref().unwrap_or("default"), obj.metadata.name.as_deref().unwrap_or("")),
                generation = ?obj.data["status"]["lastGood"]["generation"].as_i64(),
                "an invalid rule: the last good version recorded in its status stays in force"
            );
            Some(rule)
        }
        _ => None,
    }
}

/// Builds the store from every kind's objects (of the selected namespaces,
/// when a selector scopes them).
fn build(kinds: &[KindState], sources: &[Source]) -> Store {
    let mut store = Store::default();
    let selected: Option<std::collections::BTreeSet<&str>> = sources
        .iter()
        .position(|s| s.watched.resource.kind == "Namespace")
        .map(|i| kinds[i].current.keys().map(|k| k.name.as_str()).collect());
    for (state, source) in kinds.iter().zip(sources) {
        let origin = origin(&source.watched.resource);
        for (key, entry) in &state.current {
            if selected
                .as_ref()
                .is_some_and(|s| !s.contains(key.namespace.as_str()))
            {
                continue;
            }
            match entry {
                Entry::Rule { good, seen } => {
                    if let Some(rule) = good {
                        store.insert(key.clone(), Object::Rule(rule.clone()), &origin);
                    }
                    store.errors.extend(seen.error.clone());
                    store.rule_objects.insert(key.clone(), seen.clone());
                }
                Entry::Plain(object) => store.insert(key.clone(), object.clone(), &origin),
                Entry::Rejected(e) => {
                    store.errors.push(e.clone());
                    store.rejected.insert(key.clone(), e.clone());
                }
                Entry::Selected => {}
            }
        }
    }
    store
}

/// Whether a CRD-backed kind is served, asked of API discovery
/// (`/apis/<group>/<version>`): every authenticated client may read it
/// (`system:discovery`), so the answer holds under the narrowest RBAC,
/// namespaced Roles included, where a cluster-wide list would be forbidden
/// (and a namespaced watch of an absent kind would answer 404 forever,
/// leaving initial sync, and readiness, waiting). A discovery that fails
/// otherwise (the API server unreachable) counts as installed: the watcher
/// then retries, and its logs tell.
async fn installed(client: &Client, resource: &ApiResource) -> bool {
    match client.list_api_group_resources(&resource.api_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource.plural),
        Err(kube::Error::Api(s)) if s.code == 404 => false,
        Err(_) => true,
    }
}

/// Runs the watchers and publishes a store on every change once all kinds
/// are listed, until the receiver side is gone. Until then, `pending` names
/// what it waits for: the API discovery of an optional kind, then the
/// watches whose first list has not completed (readiness says so).
pub async fn run(
    client: Client,
    scope: Scope,
    tx: watch::Sender<Store>,
    pending: watch::Sender<Vec<String>>,
) {
    let mut sources = Vec::new();
    for w in watched() {
        if !w.required {
            pending.send_replace(vec![format!("API discovery of {}", w.resource.api_version)]);
        }
        if !w.required && !installed(&client, &w.resource).await {
            info!(
                kind = %w.resource.kind,
                api_version = %w.resource.api_version,
                "CRD not installed; not watched"
            );
            continue;
        }
        match &scope.namespaces {
            None => sources.push(Source {
                watched: w,
                namespace: None,
            }),
            Some(list) => sources.extend(list.iter().map(|ns| Source {
                watched: w.clone(),
                namespace: Some(ns.clone()),
            })),
        }
    }
    if scope.selector.is_some() {
        sources.push(Source {
            watched: Watched {
                resource: namespaces(),
                required: true,
            },
            namespace: None,
        });
    }
    let (events_tx, mut events) = mpsc::channel::<(usize, Event<DynamicObject>)>(1024);
    for (i, source) in sources.iter().enumerate() {
        let resource = &source.watched.resource;
        let api: Api<DynamicObject> = match &source.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, resource),
            None => Api::all_with(client.clone(), resource),
        };
        let mut config = watcher::Config::default();
        if resource.kind == "Namespace" {
            config = config.labels(scope.selector.as_deref().unwrap_or_default());
        }
        let events_tx = events_tx.clone();
        let kind = format!(
            "{} ({}){}",
            resource.kind,
            resource.api_version,
            source
                .namespace
                .as_ref()
                .map(|ns| format!(" in {ns}"))
                .unwrap_or_default()
        );
        tokio::spawn(async move {
            let mut stream = watcher::watcher(api, config).default_backoff().boxed();
            while let Some(item) = stream.next().await {
                match item {
                    Ok(event) => {
                        if events_tx.send((i, event)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => warn!(kind, error = %e, "watch failed; retrying with backoff"),
                }
            }
        });
    }
    drop(events_tx);
    let resources: Vec<Watched> = sources.iter().map(|s| s.watched.clone()).collect();
    let mut kinds: Vec<KindState> = sources.iter().map(|_| KindState::default()).collect();
    let mut announced = false;
    pending.send_replace(sources.iter().map(describe).collect());
    while let Some(first) = events.recv().await {
        let mut changed = apply(&mut kinds, &resources, first);
        // Take whatever else is queued, so a burst makes one store.
        while let Ok(more) = events.try_recv() {
            changed |= apply(&mut kinds, &resources, more);
        }
        let waiting: Vec<String> = kinds
            .iter()
            .zip(&sources)
            .filter(|(k, _)| !k.synced)
            .map(|(_, s)| describe(s))
            .collect();
        pending.send_if_modified(|p| {
            let changed = *p != waiting;
            *p = waiting.clone();
            changed
        });
        if !waiting.is_empty() {
            continue;
        }
        if !announced {
            announced = true;
            info!(watches = kinds.len(), "Kubernetes source synced");
            changed = true;
        }
        if changed && tx.send(build(&kinds, &sources)).is_err() {
            return;
        }
    }
}

/// Applies one watch event; true when the published view changes.
fn apply(
    kinds: &mut [KindState],
    resources: &[Watched],
    (i, event): (usize, Event<DynamicObject>),
) -> bool {
    let resource = &resources[i].resource;
    let state = &mut kinds[i];
    match event {
        Event::Init => {
            debug!(kind = %resource.kind, "listing");
            state.relisting = Some(BTreeMap::new());
            false
        }
        Event::InitApply(obj) => {
            let previous_key = key_of(resource, &obj);
            let previous = previous_key.as_ref().and_then(|k| state.current.get(k));
            if let Some((key, entry)) = entry_of(resource, &obj, previous) {
                state.relisting.get_or_insert_default().insert(key, entry);
            }
            false
        }
        Event::InitDone => {
            state.current = state.relisting.take().unwrap_or_default();
            state.synced = true;
            debug!(kind = %resource.kind, objects = state.current.len(), "listed");
            true
        }
        Event::Apply(obj) => {
            let key = key_of(resource, &obj);
            let previous = key.as_ref().and_then(|k| state.current.get(k));
            match entry_of(resource, &obj, previous) {
                Some((key, entry)) => {
                    // An update of nothing minimesh reads (a Pod's status,
                    // the status the leader wrote) changes nothing.
                    let same = matches!(
                        (&entry, state.current.get(&key)),
                        (Entry::Plain(a), Some(Entry::Plain(b))) if a == b
                    );
                    state.current.insert(key, entry);
                    if same {
                        return false;
                    }
                }
                None => {
                    if let Some(k) = key {
                        state.current.remove(&k);
                    }
                }
            }
            state.synced
        }
        Event::Delete(obj) => {
            if let Some(k) = key_of(resource, &obj) {
                state.current.remove(&k);
            }
            state.synced
        }
    }
}

fn key_of(resource: &ApiResource, obj: &DynamicObject) -> Option<ObjectKey> {
    let kind: &'static str = match resource.kind.as_str() {
        "DestinationRule" if resource.group == "networking.istio.io" => ISTIO_RULE_KIND,
        "DestinationRule" => "DestinationRule",
        "Service" => "Service",
        "EndpointSlice" => "EndpointSlice",
        "PeerAuthentication" => "PeerAuthentication",
        "AuthorizationPolicy" if resource.group == "security.istio.io" => {
            crate::config::parse::ISTIO_AUTHZ_KIND
        }
        "AuthorizationPolicy" => "AuthorizationPolicy",
        "Pod" => "Pod",
        "VirtualService" if resource.group == "networking.istio.io" => {
            crate::config::parse::ISTIO_VIRTUAL_SERVICE_KIND
        }
        "VirtualService" => "VirtualService",
        "Gateway" if resource.group == "networking.istio.io" => "Gateway",
        "Gateway" => crate::config::parse::K8S_GATEWAY_KIND,
        "HTTPRoute" => "HTTPRoute",
        "Namespace" => "Namespace",
        _ => return None,
    };
    Some(ObjectKey {
        kind,
        namespace: obj
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        name: obj.metadata.name.clone()?,
    })
}

/// The Kubernetes client: in-cluster config, or KUBECONFIG / ~/.kube/config.
pub async fn client() -> anyhow::Result<Client> {
    use anyhow::Context;
    Client::try_default().await.context(
        "no Kubernetes config: not in a pod (no service account) and no usable KUBECONFIG or ~/.kube/config",
    )
}
