//! The fake's writes as the real server makes them: a create or an update
//! decoded against the kind's CRD (pruned, defaulted, validated), admitted
//! by the webhooks, stored unless the object changed meanwhile; patches by
//! their content type, with `resourceVersion` preconditions; server-side
//! apply, refused on another manager's fields unless forced (`managed.rs`).

use std::collections::BTreeMap;

use http::{Response, StatusCode};
use serde_json::Value;

use super::strategic::strategic_merge;
use super::wire::{json_patch, json_response, merge, now, refused, status_response, with_warnings};
use super::{managed, Body, FakeKube, COLLECTIONS, DEPLOYMENTS};

impl FakeKube {
    /// PUT (optimistic concurrency on resourceVersion) or PATCH (JSON
    /// patch, merge patch, strategic merge patch) of an existing object.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn replace_or_patch(
        &self,
        c: usize,
        ns: Option<String>,
        name: String,
        replace: bool,
        body: &[u8],
        patch_type: Option<PatchType>,
        query: &BTreeMap<String, String>,
    ) -> Response<Body> {
        let plural = COLLECTIONS[c].2;
        let Ok(body) = serde_json::from_slice::<Value>(body) else {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
        };
        let key = (c, ns.unwrap_or_default(), name.clone());
        let Some(current) = self.inner.lock().expect("lock").objects.get(&key).cloned() else {
            return status_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{plural} \"{name}\" not found"),
            );
        };
        let obj = if replace {
            if body["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
                return conflict(plural, &name);
            }
            body
        } else {
            match self.patched(c, &current, &body, patch_type) {
                Ok(o) => o,
                Err(r) => return r,
            }
        };
        let verb = if replace { "REPLACE" } else { "PATCH" };
        self.update(key, current, obj, verb, query).await
    }

    /// A merge patch of the status subresource: only `status` changes,
    /// checked by the CRD's schema as any write.
    pub(super) fn patch_status(
        &self,
        c: usize,
        ns: Option<String>,
        name: &str,
        body: &[u8],
    ) -> Response<Body> {
        let plural = COLLECTIONS[c].2;
        let Ok(patch) = serde_json::from_slice::<Value>(body) else {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", "invalid JSON");
        };
        let mut inner = self.inner.lock().expect("lock");
        inner.log.push(format!("PATCH-STATUS {plural} {name}"));
        let key = (c, ns.unwrap_or_default(), name.to_string());
        let Some(mut obj) = inner.objects.get(&key).cloned() else {
            return status_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{plural} \"{name}\" not found"),
            );
        };
        if let Some(status) = patch.get("status") {
            merge(&mut obj["status"], status);
        }
        if let Some(crd) = self.crds.get(&c) {
            crd.prune_and_default(&mut obj);
            let errors = crd.validate(&obj, Some("status"));
            if !errors.is_empty() {
                return json_response(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &crd.invalid(name, &errors),
                );
            }
        }
        let obj = inner.commit(key, "MODIFIED", obj);
        json_response(StatusCode::OK, &obj)
    }

    /// DELETE of one object: the object as it was, at the deletion's
    /// resourceVersion.
    pub(super) fn delete_request(
        &self,
        c: usize,
        ns: Option<String>,
        name: &str,
    ) -> Response<Body> {
        let mut inner = self.inner.lock().expect("lock");
        let key = (c, ns.unwrap_or_default(), name.to_string());
        match inner.objects.get(&key).cloned() {
            Some(obj) => {
                self.owners.lock().expect("lock").remove(&key);
                let obj = inner.commit(key, "DELETED", obj);
                json_response(StatusCode::OK, &obj)
            }
            None => status_response(StatusCode::NOT_FOUND, "NotFound", "not found"),
        }
    }

    /// Creates `obj` in `ns`: decoded against its CRD's schema, admitted,
    /// stored; a Deployment's pods rolled out.
    pub(super) async fn create(
        &self,
        c: usize,
        ns: String,
        mut obj: Value,
        query: &BTreeMap<String, String>,
    ) -> Response<Body> {
        let plural = COLLECTIONS[c].2;
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        if !ns.is_empty() {
            obj["metadata"]["namespace"] = ns.clone().into();
        }
        let mut warnings = match self.decode(c, &name, &mut obj, query) {
            Ok(w) => w,
            Err(r) => return r,
        };
        match self.admit(c, "CREATE", &mut obj, None).await {
            Ok(w) => warnings.extend(w),
            Err(r) => return refused(r),
        }
        let stored = {
            let mut inner = self.inner.lock().expect("lock");
            inner.log.push(format!("CREATE {plural} {name}"));
            let key = (c, ns, name.clone());
            if inner.objects.contains_key(&key) {
                None
            } else {
                obj["metadata"]["generation"] = 1.into();
                obj["metadata"]["uid"] = format!("uid-{}", inner.rv + 1).into();
                obj["metadata"]["creationTimestamp"] = now().into();
                let obj = inner.commit(key.clone(), "ADDED", obj);
                self.record_update(key, query, &Value::Null, &obj);
                Some(obj)
            }
        };
        let Some(obj) = stored else {
            return status_response(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("{plural} \"{name}\" already exists"),
            );
        };
        if c == DEPLOYMENTS {
            self.roll_out(&obj).await;
        }
        with_warnings(json_response(StatusCode::CREATED, &obj), &warnings)
    }

    /// Stores `obj` over `current` (which it was computed from): the
    /// status kept (the status subresource's to change), the generation
    /// counted, decoded and admitted; 409 if `current` changed meanwhile.
    pub(super) async fn update(
        &self,
        key: (usize, String, String),
        current: Value,
        mut obj: Value,
        verb: &str,
        query: &BTreeMap<String, String>,
    ) -> Response<Body> {
        let (c, name) = (key.0, key.2.clone());
        let plural = COLLECTIONS[c].2;
        match current.get("status") {
            Some(st) => obj["status"] = st.clone(),
            None => {
                if let Some(m) = obj.as_object_mut() {
                    m.remove("status");
                }
            }
        }
        let mut warnings = match self.decode(c, &name, &mut obj, query) {
            Ok(w) => w,
            Err(r) => return r,
        };
        let generation = current["metadata"]["generation"].as_i64().unwrap_or(1);
        let changed = current.get("spec") != obj.get("spec");
        obj["metadata"]["generation"] = (generation + i64::from(changed)).into();
        match self.admit(c, "UPDATE", &mut obj, Some(&current)).await {
            Ok(w) => warnings.extend(w),
            Err(r) => return refused(r),
        }
        let template_changed = obj["spec"] != current["spec"];
        let stored = {
            let mut inner = self.inner.lock().expect("lock");
            inner.log.push(format!("{verb} {plural} {name}"));
            // Changed by someone else while the webhooks ran.
            if inner
                .objects
                .get(&key)
                .map(|o| &o["metadata"]["resourceVersion"])
                != Some(&current["metadata"]["resourceVersion"])
            {
                None
            } else {
                let obj = inner.commit(key.clone(), "MODIFIED", obj);
                // An apply's ownership is its own (`apply_patch`).
                if verb != "APPLY" {
                    self.record_update(key, query, &current, &obj);
                }
                Some(obj)
            }
        };
        let Some(obj) = stored else {
            return conflict(plural, &name);
        };
        if c == DEPLOYMENTS && template_changed {
            self.roll_out(&obj).await;
        }
        with_warnings(json_response(StatusCode::OK, &obj), &warnings)
    }

    /// `current` with `patch` applied as its type says; a `resourceVersion`
    /// in a patch is a precondition, as on the real server.
    #[allow(clippy::result_large_err)]
    pub(super) fn patched(
        &self,
        c: usize,
        current: &Value,
        patch: &Value,
        patch_type: Option<PatchType>,
    ) -> Result<Value, Response<Body>> {
        let name = current["metadata"]["name"].as_str().unwrap_or("");
        let mut o = current.clone();
        match patch_type {
            Some(PatchType::Json) => {
                let ops = patch.as_array().map(Vec::as_slice).unwrap_or(&[]);
                json_patch(&mut o, ops).map_err(|e| {
                    status_response(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        &format!(
                            "the server rejected our request due to an error in our request: {e}"
                        ),
                    )
                })?;
            }
            // Custom resources have no strategic merge patch: no Go struct
            // carries their merge keys.
            Some(PatchType::Strategic) if !built_in(c) => {
                return Err(status_response(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                ));
            }
            Some(PatchType::Strategic) => strategic_merge(COLLECTIONS[c].3, &mut o, patch),
            Some(PatchType::Merge) => merge(&mut o, patch),
            Some(PatchType::Apply) | None => {
                return Err(status_response(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                ));
            }
        }
        let wanted = &o["metadata"]["resourceVersion"];
        if !wanted.is_null() && *wanted != current["metadata"]["resourceVersion"] {
            return Err(conflict(COLLECTIONS[c].2, name));
        }
        Ok(o)
    }

    /// Server-side apply of `body` (the manager's whole intent for the
    /// object): created when missing; else refused 409 if it would change
    /// a field another manager owns (unless forced), and merged in, the
    /// fields this manager applied before, no longer lists and alone owns
    /// removed (`managed.rs`). With kubectl, client-side apply's fields are
    /// first the applier's, as kubectl migrates them.
    pub(super) async fn apply_patch(
        &self,
        c: usize,
        ns: String,
        name: String,
        body: &[u8],
        query: &BTreeMap<String, String>,
        kubectl: bool,
    ) -> Response<Body> {
        let Some(manager) = query.get("fieldManager").filter(|m| !m.is_empty()).cloned() else {
            return status_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
            );
        };
        let Ok(config) = serde_saphyr::from_str::<Value>(&String::from_utf8_lossy(body)) else {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", "error decoding YAML");
        };
        let force = query.get("force").is_some_and(|f| f == "true");
        let key = (c, ns.clone(), name.clone());
        let current = self.inner.lock().expect("lock").objects.get(&key).cloned();
        let Some(current) = current else {
            let response = self.create(c, ns, config.clone(), query).await;
            if response.status().is_success() {
                let mut owners = managed::Owners::default();
                owners.applied(&manager, &config, &Value::Null);
                self.owners.lock().expect("lock").insert(key, owners);
            }
            return response;
        };
        let mut owners = self
            .owners
            .lock()
            .expect("lock")
            .get(&key)
            .cloned()
            .unwrap_or_default();
        if kubectl {
            owners.migrate_client_side_apply(&manager);
        }
        let conflicts = owners.conflicts(&manager, &config, &current);
        if !conflicts.is_empty() && !force {
            return managed::conflict_response(&conflicts);
        }
        let mut obj = current.clone();
        merge(&mut obj, &config);
        for path in owners.applied(&manager, &config, &current) {
            managed::remove(&mut obj, &path);
        }
        let response = self.update(key.clone(), current, obj, "APPLY", query).await;
        // What each manager owns from now on, once stored.
        if response.status().is_success() {
            self.owners.lock().expect("lock").insert(key, owners);
        }
        response
    }

    /// An update's ownership: its field manager owns what it changed.
    fn record_update(
        &self,
        key: (usize, String, String),
        query: &BTreeMap<String, String>,
        before: &Value,
        after: &Value,
    ) {
        let manager = query.get("fieldManager").map_or("unknown", String::as_str);
        let op = managed::Op::Update {
            api_version: after["apiVersion"].as_str().unwrap_or("").to_string(),
            time: now(),
        };
        self.owners
            .lock()
            .expect("lock")
            .entry(key)
            .or_default()
            .updated(manager, op, before, after);
    }

    /// The server's decoding of a write of a custom resource: unknown
    /// fields refused (`fieldValidation=Strict`), or pruned with a warning
    /// (`Warn`, the server's default) or silently (`Ignore`); defaults
    /// filled; then the schema's validation (422 with every error).
    #[allow(clippy::result_large_err)]
    pub(super) fn decode(
        &self,
        c: usize,
        name: &str,
        obj: &mut Value,
        query: &BTreeMap<String, String>,
    ) -> Result<Vec<String>, Response<Body>> {
        let Some(crd) = self.crds.get(&c) else {
            return Ok(Vec::new());
        };
        let unknown = crd.prune_and_default(obj);
        let mut warnings = Vec::new();
        if !unknown.is_empty() {
            let fields: Vec<String> = unknown
                .iter()
                .map(|f| format!("unknown field {f:?}"))
                .collect();
            match query.get("fieldValidation").map(String::as_str) {
                Some("Strict") => {
                    let (_, version, _, kind) = COLLECTIONS[c];
                    return Err(status_response(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        &format!(
                            "{kind} in version {version:?} cannot be handled as a {kind}: strict decoding error: {}",
                            fields.join(", ")
                        ),
                    ));
                }
                Some("Ignore") => {}
                _ => warnings = fields,
            }
        }
        let errors = crd.validate(obj, None);
        if !errors.is_empty() {
            return Err(json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &crd.invalid(name, &errors),
            ));
        }
        Ok(warnings)
    }
}

/// The 409 of a write from a stale resourceVersion.
pub(super) fn conflict(plural: &str, name: &str) -> Response<Body> {
    status_response(
        StatusCode::CONFLICT,
        "Conflict",
        &format!("Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
    )
}

/// A PATCH's type, by its content type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PatchType {
    Json,
    Merge,
    Strategic,
    Apply,
}

impl PatchType {
    pub(super) fn of(content_type: &str) -> Option<PatchType> {
        let t = content_type.split(';').next().unwrap_or("").trim();
        match t {
            "application/json-patch+json" => Some(PatchType::Json),
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/strategic-merge-patch+json" => Some(PatchType::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => {
                Some(PatchType::Apply)
            }
            _ => None,
        }
    }
}

/// Whether collection `c` is a built-in kind (a Go type, with strategic
/// merge), not a custom resource (minimesh's, Istio's, the Gateway API's).
fn built_in(c: usize) -> bool {
    matches!(
        COLLECTIONS[c].0,
        "" | "apps"
            | "discovery.k8s.io"
            | "coordination.k8s.io"
            | "admissionregistration.k8s.io"
            | "events.k8s.io"
    )
}
