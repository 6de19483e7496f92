//! Which DestinationRule each caller gets for each service, as Istio looks
//! one up: a rule of the caller's own namespace, else one of the service's
//! namespace exported to the caller's, else one of the root namespace
//! (`minimesh-system`) exported to it. A rule's `exportTo` (`*`, `.`, `~`,
//! namespace names; none is `*`) says which namespaces may see it; its own
//! namespace sees it unless it says `~` alone or names only others. Two
//! rules of one namespace for one service conflict: the first (minimesh's
//! before Istio's, then by name) wins, and the others are reported.
//!
//! Callers differ only in the namespaces that hold rules or that an
//! `exportTo` names: every other namespace is the same, the default view
//! (`None`), which sees only rules exported to every namespace.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::kube::resolve_host;
use crate::config::parse::{ObjectKey, ValidRule, ISTIO_RULE_KIND};
use crate::config::security::ROOT_NAMESPACE;
use crate::store::Store;

use super::RuleStatus;

/// A service, `(name, namespace)`.
pub type Service = (String, String);

/// The rule each service gets in one view.
pub type RuleFor<'a> = BTreeMap<Service, (&'a ObjectKey, &'a ValidRule)>;

/// The namespaces a rule is visible to, from its `exportTo`.
#[derive(Debug, PartialEq)]
struct Export {
    /// Its own namespace sees it.
    local: bool,
    /// Every namespace sees it.
    all: bool,
    /// These namespaces (besides its own) see it.
    to: BTreeSet<String>,
}

impl Export {
    fn of(export_to: &[String], own: &str) -> Export {
        let mut e = Export {
            local: export_to.is_empty(),
            all: export_to.is_empty(),
            to: BTreeSet::new(),
        };
        for v in export_to.iter().map(|v| v.trim()) {
            match v {
                "*" => (e.all, e.local) = (true, true),
                "." => e.local = true,
                "~" => {}
                ns if ns == own => e.local = true,
                ns => {
                    e.to.insert(ns.to_string());
                }
            }
        }
        e
    }

    /// Whether callers of `view` see a rule of namespace `own`.
    fn seen_by(&self, own: &str, view: Option<&str>) -> bool {
        match view {
            Some(ns) if ns == own => self.local,
            Some(ns) => self.all || self.to.contains(ns),
            None => self.all,
        }
    }
}

/// A rule that won its namespace's place for its service.
struct Candidate<'a> {
    key: &'a ObjectKey,
    rule: &'a ValidRule,
    export: Export,
}

/// The rules sorted out: each namespace's winner per service, the losers'
/// statuses, and the views whose rules differ from the default's.
pub struct Scope<'a> {
    /// By service, then by the rule's namespace.
    winners: BTreeMap<Service, BTreeMap<&'a str, Candidate<'a>>>,
    /// The namespaces whose callers may get other rules than the default.
    namespaces: BTreeSet<String>,
}

impl<'a> Scope<'a> {
    /// Sorts the store's rules, recording in `status` the ones refused
    /// (no service name, or a conflict in their namespace) and in
    /// `overridden` the minimesh rules that override an Istio one.
    pub fn of(
        store: &'a Store,
        status: &mut BTreeMap<ObjectKey, RuleStatus>,
        overridden: &mut BTreeMap<ObjectKey, Vec<String>>,
    ) -> Scope<'a> {
        let mut winners: BTreeMap<Service, BTreeMap<&'a str, Candidate<'a>>> = BTreeMap::new();
        let mut namespaces = BTreeSet::new();
        for (key, (rule, _)) in &store.rules {
            let rule: &ValidRule = rule;
            let policy = Some(rule.resolved.policy.as_str());
            let Some(target) = resolve_host(&rule.rule.spec.host, &key.namespace) else {
                status.insert(
                    key.clone(),
                    refused(
                        "NoService",
                        format!(
                            "spec.host: {:?} is not a service name (name, name.namespace or name.namespace.svc.cluster.local)",
                            rule.rule.spec.host
                        ),
                        policy,
                    ),
                );
                continue;
            };
            let export = Export::of(&rule.rule.spec.export_to, &key.namespace);
            let in_ns = winners.entry(target.clone()).or_default();
            if let Some(other) = in_ns.get(key.namespace.as_str()) {
                // Istio's rules get no status from minimesh: the minimesh
                // rule that overrides one says so in its own.
                if key.kind == ISTIO_RULE_KIND && other.key.kind != ISTIO_RULE_KIND {
                    overridden.entry(other.key.clone()).or_default().push(format!(
                        "Istio's DestinationRule {}/{} (networking.istio.io) also names service {}.{}; this rule is applied and that one is ignored",
                        key.namespace, key.name, target.0, target.1
                    ));
                }
                status.insert(
                    key.clone(),
                    refused(
                        "Conflict",
                        format!(
                            "spec.host: service {}.{} already has rule {}/{}; this rule is not applied",
                            target.0, target.1, other.key.namespace, other.key.name
                        ),
                        policy,
                    ),
                );
                continue;
            }
            namespaces.insert(key.namespace.clone());
            namespaces.extend(export.to.iter().cloned());
            in_ns.insert(key.namespace.as_str(), Candidate { key, rule, export });
        }
        Scope {
            winners,
            namespaces,
        }
    }

    /// The namespaces whose callers may see other rules than the default
    /// view's: those holding rules, and those an `exportTo` names.
    pub fn namespaces(&self) -> impl Iterator<Item = &str> {
        self.namespaces.iter().map(String::as_str)
    }

    /// The rule each service gets for callers of `view` (None: a namespace
    /// with no rule of its own that no `exportTo` names).
    pub fn rules_for(&self, view: Option<&str>) -> RuleFor<'a> {
        let mut out = BTreeMap::new();
        for (service, by_ns) in &self.winners {
            let seen = |ns: &str| {
                by_ns
                    .get(ns)
                    .filter(|c| c.export.seen_by(ns, view))
                    .map(|c| (c.key, c.rule))
            };
            let found = view
                .and_then(|v| by_ns.get(v).filter(|c| c.export.local))
                .map(|c| (c.key, c.rule))
                .or_else(|| seen(&service.1))
                .or_else(|| seen(ROOT_NAMESPACE));
            if let Some(r) = found {
                out.insert(service.clone(), r);
            }
        }
        out
    }

    /// Every rule that won its namespace's place, with its service.
    pub fn winners(&self) -> impl Iterator<Item = (&Service, &'a ObjectKey, &'a ValidRule)> {
        self.winners
            .iter()
            .flat_map(|(s, by_ns)| by_ns.values().map(move |c| (s, c.key, c.rule)))
    }
}

/// Which rule the callers of each namespace get, per service that has
/// any: `namespace` `*` is every namespace not listed (the default view),
/// `rule` `namespace/name`, or null (none: the defaults).
pub fn view(store: &Store) -> Vec<serde_json::Value> {
    let (mut status, mut overridden) = (BTreeMap::new(), BTreeMap::new());
    let scope = Scope::of(store, &mut status, &mut overridden);
    let name = |r: Option<&(&ObjectKey, &ValidRule)>| {
        r.map(|(k, _)| format!("{}/{}", k.namespace, k.name))
    };
    let default = scope.rules_for(None);
    let views: Vec<(&str, RuleFor<'_>)> = scope
        .namespaces()
        .map(|ns| (ns, scope.rules_for(Some(ns))))
        .collect();
    scope
        .winners
        .keys()
        .map(|service| {
            let mut callers = vec![serde_json::json!({
                "namespace": "*",
                "rule": name(default.get(service)),
            })];
            for (ns, rules) in &views {
                if rules.get(service) != default.get(service) {
                    callers.push(serde_json::json!({
                        "namespace": ns,
                        "rule": name(rules.get(service)),
                    }));
                }
            }
            serde_json::json!({
                "service": format!("{}.{}", service.0, service.1),
                "callers": callers,
            })
        })
        .collect()
}

fn refused(reason: &str, message: String, policy: Option<&'static str>) -> RuleStatus {
    RuleStatus {
        accepted: false,
        reason: reason.into(),
        message,
        policy,
        clusters: vec![],
        warnings: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(v: &[&str], own: &str) -> Export {
        Export::of(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>(), own)
    }

    #[test]
    fn export_to_is_read_as_istio_reads_it() {
        let all = export(&[], "a");
        assert!(
            all.seen_by("a", Some("a")) && all.seen_by("a", Some("b")) && all.seen_by("a", None)
        );
        let dot = export(&["."], "a");
        assert!(
            dot.seen_by("a", Some("a")) && !dot.seen_by("a", Some("b")) && !dot.seen_by("a", None)
        );
        let none = export(&["~"], "a");
        assert!(!none.seen_by("a", Some("a")) && !none.seen_by("a", Some("b")));
        let named = export(&["b"], "a");
        assert!(!named.seen_by("a", Some("a")) && named.seen_by("a", Some("b")));
        assert!(!named.seen_by("a", Some("c")) && !named.seen_by("a", None));
        let own = export(&["a", "c"], "a");
        assert!(own.seen_by("a", Some("a")) && own.seen_by("a", Some("c")));
    }
}
