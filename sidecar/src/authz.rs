//! Authorization: the AuthorizationPolicies that apply to this workload
//! (its namespace's, and the mesh-wide ones, whose selector its labels
//! carry), evaluated on every inbound request as Istio evaluates them: a
//! matching DENY policy denies; else, with no ALLOW policy the request is
//! allowed; else it is allowed only when some ALLOW policy matches. The
//! caller is who its mutual TLS certificate says (plaintext: nobody).
//! Until the control plane has sent the policies, nothing is allowed: the
//! sidecar is not ready then, and a caller that reaches it anyway gets 503
//! (`--inbound-before-config allow` lets everything in instead, for a
//! sidecar run without a control plane).

use std::sync::Arc;

use arc_swap::ArcSwap;
use minimesh_proto::v1::{Authorization, AuthzAction, AuthzOperation, AuthzRule, AuthzSource};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// An Istio value pattern: exact, `prefix*`, `*suffix`, or `*` (any).
#[derive(Clone, Debug, PartialEq)]
enum Pattern {
    Any,
    Exact(String),
    Prefix(String),
    Suffix(String),
}

impl Pattern {
    fn of(v: &str) -> Pattern {
        if v == "*" {
            Pattern::Any
        } else if let Some(p) = v.strip_suffix('*') {
            Pattern::Prefix(p.to_string())
        } else if let Some(s) = v.strip_prefix('*') {
            Pattern::Suffix(s.to_string())
        } else {
            Pattern::Exact(v.to_string())
        }
    }

    fn matches(&self, v: &str) -> bool {
        match self {
            Pattern::Any => true,
            Pattern::Exact(e) => v == e,
            Pattern::Prefix(p) => v.starts_with(p.as_str()),
            Pattern::Suffix(s) => v.ends_with(s.as_str()),
        }
    }
}

/// A list and its negation: set lists must match (any value), not_ lists
/// must not (no value). A missing value (no principal) matches no pattern.
#[derive(Clone, Debug, Default, PartialEq)]
struct Values {
    any_of: Vec<Pattern>,
    none_of: Vec<Pattern>,
}

impl Values {
    fn of(any_of: &[String], none_of: &[String]) -> Values {
        Values {
            any_of: any_of.iter().map(|v| Pattern::of(v)).collect(),
            none_of: none_of.iter().map(|v| Pattern::of(v)).collect(),
        }
    }

    fn matches(&self, v: Option<&str>) -> bool {
        let hit = |ps: &[Pattern]| v.is_some_and(|v| ps.iter().any(|p| p.matches(v)));
        (self.any_of.is_empty() || hit(&self.any_of)) && !hit(&self.none_of)
    }
}

#[derive(Clone, Debug, PartialEq)]
struct Source {
    principals: Values,
    namespaces: Values,
}

#[derive(Clone, Debug, PartialEq)]
struct Operation {
    methods: Values,
    paths: Values,
    ports: Vec<u32>,
    not_ports: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq)]
struct Rule {
    from: Vec<Source>,
    to: Vec<Operation>,
}

/// One policy, compiled.
#[derive(Clone, Debug, PartialEq)]
struct Policy {
    /// `namespace/name`, for the denial's count and log.
    name: String,
    rules: Vec<Rule>,
}

/// What is asked of the workload.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// The caller's SPIFFE ID (`spiffe://td/ns/x/sa/y`); None: plaintext.
    pub peer: Option<&'a str>,
    /// The method.
    pub method: &'a str,
    /// The path, without its query.
    pub path: &'a str,
    /// The workload's (the app's) port.
    pub port: u16,
}

impl Request<'_> {
    /// Istio's principal: the SPIFFE ID without `spiffe://`.
    fn principal(&self) -> Option<&str> {
        self.peer.and_then(|p| p.strip_prefix("spiffe://"))
    }

    /// The caller's namespace, from its principal.
    fn namespace(&self) -> Option<&str> {
        let p = self.principal()?;
        let rest = &p[p.find("/ns/")? + 4..];
        Some(rest.split('/').next().unwrap_or(rest))
    }
}

impl Rule {
    fn matches(&self, r: &Request<'_>) -> bool {
        let from = self.from.is_empty()
            || self.from.iter().any(|s| {
                s.principals.matches(r.principal()) && s.namespaces.matches(r.namespace())
            });
        let port = u32::from(r.port);
        from && (self.to.is_empty()
            || self.to.iter().any(|o| {
                o.methods.matches(Some(r.method))
                    && o.paths.matches(Some(r.path))
                    && (o.ports.is_empty() || o.ports.contains(&port))
                    && !o.not_ports.contains(&port)
            }))
    }
}

impl Policy {
    fn matches(&self, r: &Request<'_>) -> bool {
        self.rules.iter().any(|rule| rule.matches(r))
    }
}

/// The decision on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Allowed.
    Allow,
    /// Denied by this DENY policy (`namespace/name`).
    DeniedBy(String),
    /// ALLOW policies apply and none matched.
    NotAllowed,
    /// The policies have not been received yet.
    Unknown,
}

/// The policies in force for this workload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Authz {
    /// False until the control plane sent the policies.
    known: bool,
    deny: Vec<Policy>,
    allow: Vec<Policy>,
}

fn compile_source(s: &AuthzSource) -> Source {
    Source {
        principals: Values::of(&s.principals, &s.not_principals),
        namespaces: Values::of(&s.namespaces, &s.not_namespaces),
    }
}

fn compile_operation(o: &AuthzOperation) -> Operation {
    let upper = |v: &[String]| v.iter().map(|m| m.to_ascii_uppercase()).collect::<Vec<_>>();
    Operation {
        methods: Values::of(&upper(&o.methods), &upper(&o.not_methods)),
        paths: Values::of(&o.paths, &o.not_paths),
        ports: o.ports.clone(),
        not_ports: o.not_ports.clone(),
    }
}

fn compile_rule(r: &AuthzRule) -> Rule {
    Rule {
        from: r.from.iter().map(compile_source).collect(),
        to: r.to.iter().map(compile_operation).collect(),
    }
}

impl Authz {
    /// The policies of `all` that apply to a workload of `namespace` with
    /// `labels`: its namespace's and the mesh-wide ones, whose selector its
    /// labels carry.
    pub fn compile<'a>(
        all: impl IntoIterator<Item = &'a Authorization>,
        namespace: &str,
        labels: &[(String, String)],
    ) -> Authz {
        let mut out = Authz {
            known: true,
            ..Authz::default()
        };
        for a in all {
            if !a.mesh_wide && a.namespace != namespace {
                continue;
            }
            let selected = a
                .selector
                .iter()
                .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v));
            if !selected {
                continue;
            }
            let policy = Policy {
                name: format!("{}/{}", a.namespace, a.name),
                rules: a.rules.iter().map(compile_rule).collect(),
            };
            match AuthzAction::try_from(a.action) {
                Ok(AuthzAction::AuthzDeny) => out.deny.push(policy),
                _ => out.allow.push(policy),
            }
        }
        out
    }

    /// Istio's evaluation: DENY first, then ALLOW.
    pub fn check(&self, r: &Request<'_>) -> Verdict {
        if !self.known {
            return Verdict::Unknown;
        }
        if let Some(p) = self.deny.iter().find(|p| p.matches(r)) {
            return Verdict::DeniedBy(p.name.clone());
        }
        if self.allow.is_empty() || self.allow.iter().any(|p| p.matches(r)) {
            return Verdict::Allow;
        }
        Verdict::NotAllowed
    }

    /// How many policies apply (DENY, ALLOW), for the log.
    pub fn counts(&self) -> (usize, usize) {
        (self.deny.len(), self.allow.len())
    }

    /// The admin view: whether the policies arrived, and which apply.
    pub fn view(&self) -> serde_json::Value {
        let names = |ps: &[Policy]| ps.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        serde_json::json!({
            "received": self.known,
            "deny": names(&self.deny),
            "allow": names(&self.allow),
        })
    }
}

/// The labels of the denial counter.
type Labels = [(&'static str, String); 2];

/// The policies in force, shared by the discovery client (which replaces
/// them) and the inbound listeners (which enforce them), and the count of
/// denials.
#[derive(Debug, Default)]
pub struct Shared {
    policies: ArcSwap<Authz>,
    denied: Family<Labels, Counter>,
}

impl Shared {
    /// A new, empty state: nothing known, so nothing allowed.
    pub fn new() -> Arc<Shared> {
        Arc::new(Shared::default())
    }

    /// A state that allows everything until the policies arrive (for a
    /// sidecar run without a control plane).
    pub fn allowing_until_config() -> Arc<Shared> {
        let s = Shared::default();
        s.set(Authz::compile([], "", &[]));
        Arc::new(s)
    }

    /// Registers the denial counter on `registry`.
    pub fn register(self: &Arc<Self>, registry: &mut Registry) {
        registry.register(
            "minimesh_authz_denied",
            "Inbound requests denied by authorization: by a DENY policy (reason deny, its namespace/name), or because ALLOW policies apply and none matched (reason not_allowed), or before the policies arrived (reason unknown)",
            self.denied.clone(),
        );
    }

    /// Replaces the policies.
    pub fn set(&self, authz: Authz) {
        self.policies.store(Arc::new(authz));
    }

    /// The policies in force.
    pub fn load(&self) -> Arc<Authz> {
        self.policies.load_full()
    }

    /// Decides on a request, counting a denial.
    pub fn check(&self, r: &Request<'_>) -> Verdict {
        let v = self.policies.load().check(r);
        let labels = match &v {
            Verdict::Allow => return v,
            Verdict::DeniedBy(p) => [("reason", "deny".to_string()), ("policy", p.clone())],
            Verdict::NotAllowed => [("reason", "not_allowed".into()), ("policy", String::new())],
            Verdict::Unknown => [("reason", "unknown".into()), ("policy", String::new())],
        };
        self.denied.get_or_create(&labels).inc();
        v
    }

    /// Denials counted with `reason` and `policy` (for tests and views).
    pub fn denied(&self, reason: &str, policy: &str) -> u64 {
        self.denied
            .get_or_create(&[
                ("reason", reason.to_string()),
                ("policy", policy.to_string()),
            ])
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, action: AuthzAction, rules: Vec<AuthzRule>) -> Authorization {
        Authorization {
            namespace: "istioinaction".into(),
            name: name.into(),
            action: action as i32,
            rules,
            ..Default::default()
        }
    }

    fn from(principals: &[&str]) -> AuthzSource {
        AuthzSource {
            principals: principals.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn req<'a>(peer: Option<&'a str>, method: &'a str, path: &'a str) -> Request<'a> {
        Request {
            peer,
            method,
            path,
            port: 8080,
        }
    }

    const WEB: &str = "spiffe://cluster.local/ns/istioinaction/sa/simple-web";
    const GW: &str = "spiffe://cluster.local/ns/istio-system/sa/ingress";

    #[test]
    fn deny_first_then_allow_only_on_a_match() {
        let allow_web_get = policy(
            "allow-web",
            AuthzAction::AuthzAllow,
            vec![AuthzRule {
                from: vec![from(&["cluster.local/ns/istioinaction/sa/simple-web"])],
                to: vec![AuthzOperation {
                    methods: vec!["GET".into()],
                    ..Default::default()
                }],
            }],
        );
        let a = Authz::compile([&allow_web_get], "istioinaction", &[]);
        assert_eq!(a.check(&req(Some(WEB), "GET", "/")), Verdict::Allow);
        assert_eq!(a.check(&req(Some(WEB), "POST", "/")), Verdict::NotAllowed);
        assert_eq!(a.check(&req(Some(GW), "GET", "/")), Verdict::NotAllowed);
        assert_eq!(a.check(&req(None, "GET", "/")), Verdict::NotAllowed);
        // A DENY policy overrides the ALLOW.
        let deny_admin = policy(
            "deny-admin",
            AuthzAction::AuthzDeny,
            vec![AuthzRule {
                to: vec![AuthzOperation {
                    paths: vec!["/admin*".into()],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        );
        let a = Authz::compile([&allow_web_get, &deny_admin], "istioinaction", &[]);
        assert_eq!(
            a.check(&req(Some(WEB), "GET", "/admin/x")),
            Verdict::DeniedBy("istioinaction/deny-admin".into())
        );
        // No policy: everything allowed; `{}` (ALLOW, no rule): nothing.
        assert_eq!(
            Authz::compile([], "istioinaction", &[]).check(&req(None, "GET", "/")),
            Verdict::Allow
        );
        let nothing = policy("allow-nothing", AuthzAction::AuthzAllow, vec![]);
        assert_eq!(
            Authz::compile([&nothing], "istioinaction", &[]).check(&req(Some(WEB), "GET", "/")),
            Verdict::NotAllowed
        );
        // Nothing received yet: nothing allowed.
        assert_eq!(
            Authz::default().check(&req(Some(WEB), "GET", "/")),
            Verdict::Unknown
        );
    }

    #[test]
    fn scope_selector_and_patterns() {
        let mut p = policy(
            "deny-all",
            AuthzAction::AuthzDeny,
            vec![AuthzRule::default()],
        );
        p.selector = [("app".to_string(), "backend".to_string())].into();
        let backend = [("app".to_string(), "backend".to_string())];
        assert_eq!(
            Authz::compile([&p], "istioinaction", &backend).counts(),
            (1, 0)
        );
        assert_eq!(Authz::compile([&p], "istioinaction", &[]).counts(), (0, 0));
        assert_eq!(Authz::compile([&p], "other", &backend).counts(), (0, 0));
        p.mesh_wide = true;
        p.namespace = "minimesh-system".into();
        assert_eq!(Authz::compile([&p], "other", &backend).counts(), (1, 0));
        // Istio's values: exact, prefix*, *suffix, * (present).
        let v = Values::of(&["*".into()], &[]);
        assert!(v.matches(Some("x")) && !v.matches(None));
        let v = Values::of(
            &["/api/*".into(), "*.html".into()],
            &["/api/private*".into()],
        );
        assert!(v.matches(Some("/api/x")) && v.matches(Some("/index.html")));
        assert!(!v.matches(Some("/api/private/x")) && !v.matches(Some("/other")));
        // notPrincipals: a plaintext caller matches none of them.
        let v = Values::of(&[], &["*".into()]);
        assert!(v.matches(None) && !v.matches(Some("cluster.local/ns/a/sa/b")));
        // Namespaces come from the principal.
        let r = req(Some(GW), "GET", "/");
        assert_eq!(r.namespace(), Some("istio-system"));
    }
}
