//! Who calls the fake and what they may do: the bearer token names the
//! caller (kubectl as the cluster's admin, the control plane as its service
//! account), RBAC (`rbac.rs`, from `deploy/base/rbac.yaml`) authorizes each
//! request of the service account; and the TokenReview API, which
//! authenticates workloads' projected tokens as the real one does.

use std::collections::BTreeMap;

use http::{Method, Response, StatusCode};
use serde_json::{json, Value};

use super::wire::{json_response, route, status_response};
use super::{cluster_scoped, rbac, Body, FakeKube, COLLECTIONS};

/// The test's kubectl: the cluster's admin.
pub(super) const ADMIN_TOKEN: &str = "admin-token";
pub(super) const ADMIN_USER: &str = "kubernetes-admin";
/// The control plane's service account token.
pub(super) const CONTROL_PLANE_TOKEN: &str = "minimesh-control-plane-token";
pub(super) const CONTROL_PLANE_USER: &str =
    "system:serviceaccount:minimesh-system:minimesh-control-plane";

impl FakeKube {
    /// With [`FakeKube::namespaced_roles`], a list or watch of a namespaced
    /// kind across all namespaces: 403 whether or not the kind is served
    /// (authorization comes before routing, as in the real server).
    pub(super) fn cluster_wide_forbidden(
        &self,
        method: &Method,
        path: &str,
        query: &BTreeMap<String, String>,
    ) -> Option<Response<Body>> {
        if !self
            .namespaced_roles
            .load(std::sync::atomic::Ordering::Relaxed)
            || method != Method::GET
        {
            return None;
        }
        let Some((c, None, None, None)) = route(path) else {
            return None;
        };
        if cluster_scoped(c) {
            return None;
        }
        let (group, _, plural, _) = COLLECTIONS[c];
        let verb = match query.get("watch").is_some_and(|w| w == "true" || w == "1") {
            true => "watch",
            false => "list",
        };
        let resource = match group {
            "" => plural.to_string(),
            g => format!("{plural}.{g}"),
        };
        Some(status_response(
            StatusCode::FORBIDDEN,
            "Forbidden",
            &format!("{resource} is forbidden: User \"{CONTROL_PLANE_USER}\" cannot {verb} resource \"{plural}\" in API group \"{group}\" at the cluster scope"),
        ))
    }

    /// Who sent `req`: `None` (401) for an unknown token. kubectl sends
    /// no credentials to a plain-HTTP server (the fake's), so a request
    /// without any is the admin's: the one liberty the fake takes, and one
    /// only kubectl in the tests uses (the control plane sends its token).
    pub(super) fn authenticate(req: &http::Request<hyper::body::Incoming>) -> Option<&'static str> {
        let Some(header) = req.headers().get("authorization") else {
            return Some(ADMIN_USER);
        };
        match header.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")) {
            Some(ADMIN_TOKEN) => Some(ADMIN_USER),
            Some(CONTROL_PLANE_TOKEN) => Some(CONTROL_PLANE_USER),
            _ => None,
        }
    }

    /// RBAC's verdict on `user`'s request: `Some` is the 403's message.
    pub(super) fn forbidden(
        &self,
        user: &str,
        method: &Method,
        path: &str,
        query: &BTreeMap<String, String>,
    ) -> Option<String> {
        if user == ADMIN_USER {
            return None;
        }
        // Not a resource request (discovery, OpenAPI): every authenticated user.
        let attrs = rbac::attributes(method.as_str(), path, query)?;
        if self.rbac.grant(user, &attrs).is_some() {
            return None;
        }
        let message = rbac::forbidden_message(user, &attrs);
        eprintln!("fake API server: 403 {message}");
        self.denied.lock().expect("lock").push(message.clone());
        Some(message)
    }

    /// Makes `token` a service account's token for `audiences`, as the
    /// kubelet's projected tokens are: the TokenReview API authenticates it.
    pub fn issue_token(&self, token: &str, namespace: &str, sa: &str, audiences: &[&str]) {
        self.tokens.lock().expect("lock").insert(
            token.to_string(),
            (
                namespace.to_string(),
                sa.to_string(),
                audiences.iter().map(|a| a.to_string()).collect(),
            ),
        );
    }

    /// The TokenReview API's answer (always 201, the verdict in `status`),
    /// shaped as the real one's: an unauthenticated review has an empty
    /// `user` and the authenticators' errors in brackets.
    pub(super) fn review_token(&self, body: &[u8]) -> Response<Body> {
        let Ok(review) = serde_json::from_slice::<Value>(body) else {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
        };
        let token = review["spec"]["token"].as_str().unwrap_or("");
        let wanted: Vec<String> = review["spec"]["audiences"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        self.inner
            .lock()
            .expect("lock")
            .log
            .push("CREATE tokenreviews".into());
        let known = self.tokens.lock().expect("lock").get(token).cloned();
        let status = match known {
            None => {
                json!({"user": {}, "error": "[invalid bearer token, square/go-jose: compact JWS format must have three parts]"})
            }
            Some((_, _, has)) if !wanted.is_empty() && !wanted.iter().any(|w| has.contains(w)) => {
                json!({
                    "user": {},
                    "error": format!("[invalid bearer token, token audiences {has:?} is invalid for the target audiences {wanted:?}]"),
                })
            }
            Some((ns, sa, has)) => json!({
                "authenticated": true,
                "user": {
                    "username": format!("system:serviceaccount:{ns}:{sa}"),
                    "uid": format!("uid-sa-{ns}-{sa}"),
                    "groups": ["system:serviceaccounts", format!("system:serviceaccounts:{ns}"), "system:authenticated"],
                },
                "audiences": if wanted.is_empty() { has } else { wanted.clone() },
            }),
        };
        json_response(
            StatusCode::CREATED,
            &json!({
                "kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": null},
                "spec": review["spec"],
                "status": status,
            }),
        )
    }
}
