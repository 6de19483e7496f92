//! Authorization as the real API server does it with RBAC: the request's
//! attributes (verb, API group, resource and subresource, namespace, name)
//! read from its method, path and query as the server's request-info
//! resolver reads them, then granted by a rule of a Role or ClusterRole bound
//! to the caller, or refused 403 with the server's message word for word.
//!
//! The roles are read from the manifests users apply (`deploy/base/rbac.yaml`),
//! so a verb the control plane needs and the file lacks fails a test here, as
//! it would on a cluster. Known answers of the real server are this module's
//! tests (messages from `k8s.io/apiserver`'s `forbiddenMessage` and
//! `NewForbidden`, resolution from `k8s.io/apiserver`'s `RequestInfoFactory`).

use std::collections::BTreeMap;

use serde_json::Value;

/// What a request asks to do, as the authorizer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attributes {
    pub verb: String,
    pub group: String,
    pub resource: String,
    pub subresource: String,
    /// Empty for a cluster-scoped request.
    pub namespace: String,
    /// Empty for a request on a collection (a create, a list or watch
    /// without `fieldSelector=metadata.name=...`).
    pub name: String,
}

/// Reads a resource request's attributes from its method, path and query;
/// `None` for a request that is no resource request (discovery, OpenAPI),
/// which every authenticated user may make (`system:discovery`).
pub fn attributes(
    method: &str,
    path: &str,
    query: &BTreeMap<String, String>,
) -> Option<Attributes> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", _version, rest @ ..] if !rest.is_empty() => ("", rest),
        ["apis", group, _version, rest @ ..] if !rest.is_empty() => (*group, rest),
        _ => return None,
    };
    // `namespaces/NS/...` is the namespace's; `namespaces/NS` alone is the
    // Namespace object itself.
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (ns.to_string(), rest),
        _ => (String::new(), rest),
    };
    let (resource, name, subresource) = match rest {
        [r] => (*r, "", ""),
        [r, n] => (*r, *n, ""),
        [r, n, s] => (*r, *n, *s),
        _ => return None,
    };
    let watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let mut name = name.to_string();
    let verb = match (method, name.is_empty()) {
        ("GET" | "HEAD", false) => "get",
        ("GET" | "HEAD", true) => {
            // A list or watch of one name is authorized as that name.
            if let Some(n) = query
                .get("fieldSelector")
                .and_then(|f| f.strip_prefix("metadata.name="))
                .filter(|n| !n.is_empty() && !n.contains(','))
            {
                name = n.to_string();
            }
            if watch {
                "watch"
            } else {
                "list"
            }
        }
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", false) => "delete",
        ("DELETE", true) => "deletecollection",
        _ => return None,
    };
    Some(Attributes {
        verb: verb.to_string(),
        group: group.to_string(),
        resource: resource.to_string(),
        subresource: subresource.to_string(),
        namespace,
        name,
    })
}

/// The real server's 403 message for `user` asking `a`.
pub fn forbidden_message(user: &str, a: &Attributes) -> String {
    let mut resource = a.resource.clone();
    if !a.subresource.is_empty() {
        resource = format!("{resource}/{}", a.subresource);
    }
    let reason = if a.namespace.is_empty() {
        format!(
            "User {user:?} cannot {} resource {resource:?} in API group {:?} at the cluster scope",
            a.verb, a.group
        )
    } else {
        format!(
            "User {user:?} cannot {} resource {resource:?} in API group {:?} in the namespace {:?}",
            a.verb, a.group, a.namespace
        )
    };
    let qualified = if a.group.is_empty() {
        a.resource.clone()
    } else {
        format!("{}.{}", a.resource, a.group)
    };
    if a.name.is_empty() {
        format!("{qualified} is forbidden: {reason}")
    } else {
        format!("{qualified} {:?} is forbidden: {reason}", a.name)
    }
}

/// One rule of a role.
#[derive(Clone, Debug)]
struct Rule {
    groups: Vec<String>,
    resources: Vec<String>,
    verbs: Vec<String>,
    names: Vec<String>,
}

impl Rule {
    fn allows(&self, a: &Attributes) -> bool {
        let any = |list: &[String], v: &str| list.iter().any(|x| x == "*" || x == v);
        let resource = if a.subresource.is_empty() {
            a.resource.clone()
        } else {
            format!("{}/{}", a.resource, a.subresource)
        };
        any(&self.verbs, &a.verb)
            && any(&self.groups, &a.group)
            && (self.resources.iter().any(|r| {
                r == "*"
                    || *r == resource
                    // `*/scale`, `pods/*`: every resource's subresource, or
                    // every subresource of one.
                    || (!a.subresource.is_empty()
                        && (*r == format!("*/{}", a.subresource)
                            || *r == format!("{}/*", a.resource)))
            }))
            && (self.names.is_empty() || self.names.contains(&a.name))
    }
}

/// A role's rules bound to a user: everywhere (a ClusterRoleBinding) or in
/// one namespace (a RoleBinding, of a Role or of a ClusterRole).
#[derive(Clone, Debug)]
struct Grant {
    user: String,
    /// Empty: every namespace and the cluster scope.
    namespace: String,
    /// "ClusterRole minimesh-control-plane", for what granted a request.
    role: String,
    rules: Vec<Rule>,
}

/// The RBAC objects of a set of manifests.
#[derive(Clone, Debug, Default)]
pub struct Rbac {
    grants: Vec<Grant>,
}

impl Rbac {
    /// The Roles, ClusterRoles and their bindings among `yaml`'s documents
    /// (other kinds are skipped). A binding of a role the manifests lack
    /// grants nothing, as on a real cluster.
    pub fn from_manifests(yaml: &str) -> Rbac {
        let docs: Vec<Value> = serde_saphyr::from_multiple(yaml).expect("RBAC manifests parse");
        let mut roles: BTreeMap<(String, String, String), Vec<Rule>> = BTreeMap::new();
        for d in &docs {
            let kind = d["kind"].as_str().unwrap_or("");
            if kind != "Role" && kind != "ClusterRole" {
                continue;
            }
            let ns = if kind == "Role" {
                d["metadata"]["namespace"].as_str().unwrap_or("default")
            } else {
                ""
            };
            let strings = |v: &Value| -> Vec<String> {
                v.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            };
            let rules = d["rules"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| Rule {
                    groups: strings(&r["apiGroups"]),
                    resources: strings(&r["resources"]),
                    verbs: strings(&r["verbs"]),
                    names: strings(&r["resourceNames"]),
                })
                .collect();
            let name = d["metadata"]["name"].as_str().unwrap_or("").to_string();
            roles.insert((kind.to_string(), ns.to_string(), name), rules);
        }
        let mut grants = Vec::new();
        for d in &docs {
            let kind = d["kind"].as_str().unwrap_or("");
            let namespace = match kind {
                "ClusterRoleBinding" => String::new(),
                "RoleBinding" => d["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_string(),
                _ => continue,
            };
            let role_kind = d["roleRef"]["kind"].as_str().unwrap_or("").to_string();
            let role_name = d["roleRef"]["name"].as_str().unwrap_or("").to_string();
            let role_ns = if role_kind == "Role" {
                namespace.clone()
            } else {
                String::new()
            };
            let Some(rules) = roles.get(&(role_kind.clone(), role_ns, role_name.clone())) else {
                continue;
            };
            for s in d["subjects"].as_array().into_iter().flatten() {
                let user = match s["kind"].as_str() {
                    Some("ServiceAccount") => format!(
                        "system:serviceaccount:{}:{}",
                        s["namespace"].as_str().unwrap_or(&namespace),
                        s["name"].as_str().unwrap_or("")
                    ),
                    Some("User") => s["name"].as_str().unwrap_or("").to_string(),
                    _ => continue,
                };
                grants.push(Grant {
                    user,
                    namespace: namespace.clone(),
                    role: format!("{role_kind} {role_name}"),
                    rules: rules.clone(),
                });
            }
        }
        Rbac { grants }
    }

    /// What grants `user` the request `a`: the role and the rule's index in
    /// it; `None` when nothing does (403).
    pub fn grant(&self, user: &str, a: &Attributes) -> Option<(String, usize)> {
        self.grants.iter().find_map(|g| {
            if g.user != user || (!g.namespace.is_empty() && g.namespace != a.namespace) {
                return None;
            }
            let i = g.rules.iter().position(|r| r.allows(a))?;
            Some((g.role.clone(), i))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const SA: &str = "system:serviceaccount:minimesh-system:minimesh-control-plane";

    /// The real server's answers, from its request-info resolver and its
    /// forbidden messages.
    #[test]
    fn requests_read_and_refused_as_the_real_server_does() {
        let a = attributes("GET", "/api/v1/pods", &q(&[("watch", "true")])).unwrap();
        assert_eq!((a.verb.as_str(), a.namespace.as_str()), ("watch", ""));
        assert_eq!(
            forbidden_message(SA, &a),
            "pods is forbidden: User \"system:serviceaccount:minimesh-system:minimesh-control-plane\" cannot watch resource \"pods\" in API group \"\" at the cluster scope"
        );
        let a = attributes(
            "PATCH",
            "/apis/minimesh.io/v1alpha1/namespaces/default/destinationrules/web/status",
            &q(&[]),
        )
        .unwrap();
        assert_eq!(
            forbidden_message(SA, &a),
            "destinationrules.minimesh.io \"web\" is forbidden: User \"system:serviceaccount:minimesh-system:minimesh-control-plane\" cannot patch resource \"destinationrules/status\" in API group \"minimesh.io\" in the namespace \"default\""
        );
        // A list of one name is authorized as that name.
        let a = attributes(
            "GET",
            "/api/v1/namespaces/minimesh-system/configmaps",
            &q(&[("fieldSelector", "metadata.name=minimesh-load-aware")]),
        )
        .unwrap();
        assert_eq!(
            (a.verb.as_str(), a.name.as_str()),
            ("list", "minimesh-load-aware")
        );
        // The Namespace object itself is cluster-scoped.
        let a = attributes("GET", "/api/v1/namespaces/default", &q(&[])).unwrap();
        assert_eq!(
            (a.resource.as_str(), a.name.as_str(), a.namespace.as_str()),
            ("namespaces", "default", "")
        );
        // A create names no object, whatever its body says.
        let a = attributes(
            "POST",
            "/api/v1/namespaces/minimesh-system/secrets",
            &q(&[]),
        )
        .unwrap();
        assert_eq!((a.verb.as_str(), a.name.as_str()), ("create", ""));
        assert_eq!(attributes("GET", "/apis", &q(&[])), None);
        assert_eq!(attributes("GET", "/openapi/v3", &q(&[])), None);
    }

    #[test]
    fn bindings_grant_their_roles_rules_where_they_bind() {
        let rbac = Rbac::from_manifests(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: r, namespace: ns}\nrules:\n- apiGroups: [\"\"]\n  resources: [configmaps]\n  resourceNames: [one]\n  verbs: [get]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: r, namespace: ns}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: r}\nsubjects:\n- {kind: ServiceAccount, name: sa, namespace: ns}\n",
        );
        let user = "system:serviceaccount:ns:sa";
        let get = |ns: &str, name: &str| {
            attributes(
                "GET",
                &format!("/api/v1/namespaces/{ns}/configmaps/{name}"),
                &q(&[]),
            )
            .unwrap()
        };
        assert_eq!(
            rbac.grant(user, &get("ns", "one")),
            Some(("Role r".into(), 0))
        );
        assert_eq!(rbac.grant(user, &get("ns", "two")), None);
        assert_eq!(rbac.grant(user, &get("other", "one")), None);
        assert_eq!(
            rbac.grant("system:serviceaccount:ns:else", &get("ns", "one")),
            None
        );
    }
}
