//! The validated desired state every config source feeds: rules, services,
//! endpoint slices, and the errors and warnings found on the way.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::config::gateway::ValidGateway;
use crate::config::gateway_api::{self, ValidHttpRoute};
use crate::config::kube::{EndpointSlice, Service};
use crate::config::parse::{ObjectKey, ValidRule};
use crate::config::security::{PeerAuthentication, Pod};
use crate::config::virtual_service::ValidVirtualService;
use crate::config::{ConfigError, Object};
use minimesh_proto::v1::MtlsMode;

/// Where an object came from: a file path locally, `kubernetes` otherwise.
pub type Origin = PathBuf;

/// Desired state, rebuilt by a source whenever its input changes.
#[derive(Clone, Debug, Default)]
pub struct Store {
    /// Valid rules (the last good version of each).
    pub rules: BTreeMap<ObjectKey, (Arc<ValidRule>, Origin)>,
    /// Services.
    pub services: BTreeMap<ObjectKey, Arc<Service>>,
    /// Endpoint slices.
    pub slices: BTreeMap<ObjectKey, Arc<EndpointSlice>>,
    /// PeerAuthentications, with the mode each sets.
    pub peer_auth: BTreeMap<ObjectKey, (Arc<PeerAuthentication>, MtlsMode)>,
    /// Pods (whether each runs a sidecar).
    pub pods: BTreeMap<ObjectKey, Arc<Pod>>,
    /// VirtualServices applied (one per Service, one per Gateway host).
    pub virtual_services: BTreeMap<ObjectKey, (Arc<ValidVirtualService>, Origin)>,
    /// Istio's Gateways.
    pub gateways: BTreeMap<ObjectKey, Arc<ValidGateway>>,
    /// The Gateway API's HTTPRoutes.
    pub http_routes: BTreeMap<ObjectKey, Arc<ValidHttpRoute>>,
    /// The Gateway API's Gateways of class `minimesh` (None: another class's).
    pub k8s_gateways: BTreeMap<ObjectKey, Option<Arc<gateway_api::ValidGateway>>>,
    /// AuthorizationPolicies (minimesh's and Istio's), as sidecars enforce
    /// them.
    pub authorizations: BTreeMap<ObjectKey, Arc<minimesh_proto::v1::Authorization>>,
    /// Rejected input; the previous good version of each object stays in force.
    pub errors: Vec<ConfigError>,
    /// The objects the Kubernetes source holds that were rejected, by key
    /// (also in `errors`): what a refused object's status says. Empty for
    /// the file source.
    pub rejected: BTreeMap<ObjectKey, ConfigError>,
    /// Accepted input with a caveat (fields without effect, ignored kinds).
    pub warnings: Vec<String>,
    /// Every rule object the Kubernetes source sees, valid or not: what its
    /// status is written from. Empty for the file source.
    pub rule_objects: BTreeMap<ObjectKey, RuleObject>,
}

/// A rule object as the API server holds it now.
#[derive(Clone, Debug, PartialEq)]
pub struct RuleObject {
    /// `apiVersion` (status is written only on minimesh's own group).
    pub api_version: String,
    /// `metadata.generation` of the version seen.
    pub generation: Option<i64>,
    /// `metadata.uid` (what its Events refer to).
    pub uid: Option<String>,
    /// Why this version was rejected, if it was (an older good version may
    /// still be in force).
    pub error: Option<ConfigError>,
}

impl Store {
    /// Adds an object from `origin`; a second definition of the same object
    /// is rejected with an error naming both places.
    pub fn insert(&mut self, key: ObjectKey, object: Object, origin: &Origin) {
        let duplicate = |first: &Origin| ConfigError {
            file: origin.clone(),
            object: Some(key.to_string()),
            field: Some("metadata.name".into()),
            reason: format!(
                "already defined in {}; this definition is ignored",
                first.display()
            ),
        };
        match object {
            Object::Rule(r) => {
                if let Some((_, first)) = self.rules.get(&key) {
                    self.errors.push(duplicate(first));
                } else {
                    self.warnings.extend(
                        r.warnings
                            .iter()
                            .map(|w| format!("{}: {key}: {w}", origin.display())),
                    );
                    self.rules.insert(key, (r, origin.clone()));
                }
            }
            Object::Service(s) => match self.services.entry(key.clone()) {
                std::collections::btree_map::Entry::Occupied(_) => {
                    self.errors.push(duplicate(origin))
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(s);
                }
            },
            Object::Slice(s) => match self.slices.entry(key.clone()) {
                std::collections::btree_map::Entry::Occupied(_) => {
                    self.errors.push(duplicate(origin))
                }
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(s);
                }
            },
            Object::PeerAuth(p, mode) => {
                // One per namespace, as Istio applies the oldest: here the
                // first read, the others refused with a reason.
                let other = self
                    .peer_auth
                    .keys()
                    .find(|k| k.namespace == key.namespace && *k != &key);
                match other {
                    Some(first) => self.errors.push(ConfigError {
                        file: origin.clone(),
                        object: Some(key.to_string()),
                        field: Some("metadata.name".into()),
                        reason: format!(
                            "namespace {} already has PeerAuthentication {}; only one applies, this one is ignored",
                            key.namespace, first.name
                        ),
                    }),
                    None => {
                        self.peer_auth.insert(key, (p, mode));
                    }
                }
            }
            Object::Pod(p) => {
                self.pods.insert(key, p);
            }
            Object::VirtualService(v) => {
                // One per Service, as Istio merges none for sidecars: the
                // first read applies, the others are refused saying so.
                let other = self.virtual_services.iter().find_map(|(k, (o, _))| {
                    if *k == key {
                        return None;
                    }
                    if let Some(s) = v.services.iter().find(|s| o.services.contains(s)) {
                        return Some((k, format!("service {}.{}", s.0, s.1)));
                    }
                    let g = v.gateways.iter().find(|g| o.gateways.contains(g))?;
                    let h = v
                        .gateway_hosts
                        .iter()
                        .find(|h| o.gateway_hosts.contains(h))?;
                    Some((k, format!("host {h} of Gateway {}/{}", g.0, g.1)))
                });
                match other {
                    Some((first, what)) => self.errors.push(ConfigError {
                        file: origin.clone(),
                        object: Some(key.to_string()),
                        field: Some("spec.hosts".into()),
                        reason: format!(
                            "{what} already has VirtualService {}/{}; only one applies, this one is not applied",
                            first.namespace, first.name
                        ),
                    }),
                    None => {
                        self.virtual_services.insert(key, (v, origin.clone()));
                    }
                }
            }
            Object::Gateway(g) => {
                self.gateways.insert(key, g);
            }
            Object::HttpRoute(r) => {
                self.http_routes.insert(key, r);
            }
            Object::K8sGateway(g) => {
                self.k8s_gateways.insert(key, g);
            }
            Object::Authorization(a) => {
                self.authorizations.insert(key, a);
            }
        }
    }
}
