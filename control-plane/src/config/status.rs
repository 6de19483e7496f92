//! What the statuses of the config's objects should say, as translation
//! finds it: each rule's verdict, each HTTPRoute's and Gateway's status.
//! The Kubernetes source writes them (`crate::source::kubernetes::status`,
//! `route_status`) from these values, knowing nothing of how they are found.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::parse::ObjectKey;

/// Whether a rule is in force, and why not.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleStatus {
    /// True when the rule is valid and applied.
    pub accepted: bool,
    /// Short machine-readable reason (`Accepted`, `Invalid`, `Conflict`, `NoService`).
    pub reason: String,
    /// Human-readable detail.
    pub message: String,
    /// The resolved policy.
    pub policy: Option<&'static str>,
    /// Clusters the rule applies to.
    pub clusters: Vec<String>,
    /// What the rule's status should warn of besides its fields: Istio
    /// rules for the same service that it overrides.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// What one object's status should say.
#[derive(Clone, Debug, PartialEq)]
pub enum Wanted {
    /// An HTTPRoute's `status.parents` entries for minimesh's parents, each
    /// `{parentRef, conditions}` with conditions of `{type, status, reason,
    /// message}`.
    Parents(Vec<Value>),
    /// A Gateway's `status`: `{conditions, listeners: [{name,
    /// supportedKinds, attachedRoutes, conditions}]}`.
    Gateway(Value),
}

/// What each HTTPRoute's and Gateway's status should say.
pub type DesiredRouteStatus = BTreeMap<ObjectKey, Wanted>;
