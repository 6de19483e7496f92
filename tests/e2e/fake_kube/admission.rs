//! Admission as the API server runs it: before a create or an update is
//! stored, every MutatingWebhookConfiguration's matching webhooks are called
//! and their JSON patches applied, then every ValidatingWebhookConfiguration's.
//! A webhook matches by its rules, its `namespaceSelector` (on the labels of
//! the object's Namespace) and its `objectSelector`. It is called over HTTPS
//! at its Service (resolved to the address the test routes the Service to,
//! as the API server resolves it to a ready endpoint), trusting only the
//! configuration's `caBundle`, with the name `svc.ns.svc`. A denial or a
//! failed call (under `failurePolicy: Fail`) is answered as the API server
//! answers it; warnings come back as `Warning` headers.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};

/// What is being admitted.
pub struct Attempt<'a> {
    pub group: &'a str,
    pub version: &'a str,
    pub resource: &'a str,
    pub kind: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    /// `CREATE` or `UPDATE`.
    pub operation: &'a str,
    pub old_object: Option<&'a Value>,
}

/// A refusal: the HTTP code and the Status object the API server sends.
pub struct Refused {
    pub code: u16,
    pub status: Value,
}

/// Runs the matching mutating webhooks (patching `object`), then the
/// validating ones; Ok(warnings) to go on.
pub async fn admit(
    mutating: &[Value],
    validating: &[Value],
    services: &BTreeMap<String, SocketAddr>,
    namespace_labels: &Value,
    a: &Attempt<'_>,
    object: &mut Value,
) -> Result<Vec<String>, Refused> {
    let mut warnings = Vec::new();
    for (configurations, mutate) in [(mutating, true), (validating, false)] {
        for config in configurations {
            for hook in config["webhooks"].as_array().into_iter().flatten() {
                if !matches(hook, a, namespace_labels, object) {
                    continue;
                }
                let name = hook["name"].as_str().unwrap_or("");
                match call(hook, services, a, object).await {
                    Ok(response) => {
                        warnings.extend(
                            response["warnings"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .filter_map(|w| w.as_str().map(str::to_string)),
                        );
                        if response["allowed"] != true {
                            return Err(denied(name, &response["status"]));
                        }
                        if let (true, Some(patch)) = (mutate, response["patch"].as_str()) {
                            let ops: Vec<Value> = base64::engine::general_purpose::STANDARD
                                .decode(patch)
                                .ok()
                                .and_then(|p| serde_json::from_slice(&p).ok())
                                .unwrap_or_default();
                            if let Err(e) = super::wire::json_patch(object, &ops) {
                                return Err(internal(
                                    name,
                                    &format!("the webhook's patch does not apply: {e}"),
                                ));
                            }
                        }
                    }
                    Err(e) if hook["failurePolicy"] == "Ignore" => {
                        eprintln!("fake API: webhook {name} failed, ignored: {e}");
                    }
                    Err(e) => return Err(internal(name, &e)),
                }
            }
        }
    }
    Ok(warnings)
}

fn internal(name: &str, e: &str) -> Refused {
    let message = format!("Internal error occurred: failed calling webhook \"{name}\": {e}");
    Refused {
        code: 500,
        status: json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": "InternalError",
            "details": {"causes": [{"message": message}]}, "code": 500
        }),
    }
}

/// A `metav1.LabelSelector` on `labels` (absent: everything).
fn selects(selector: &Value, labels: &Value) -> bool {
    let label = |k: &str| labels[k].as_str();
    let by_label = selector["matchLabels"]
        .as_object()
        .is_none_or(|m| m.iter().all(|(k, v)| label(k) == v.as_str()));
    let by_expression = selector["matchExpressions"]
        .as_array()
        .into_iter()
        .flatten()
        .all(|e| {
            let key = e["key"].as_str().unwrap_or("");
            let values: Vec<&str> = e["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .collect();
            match e["operator"].as_str() {
                Some("In") => label(key).is_some_and(|v| values.contains(&v)),
                Some("NotIn") => label(key).is_none_or(|v| !values.contains(&v)),
                Some("Exists") => label(key).is_some(),
                Some("DoesNotExist") => label(key).is_none(),
                _ => false,
            }
        });
    by_label && by_expression
}

fn one_of(list: &Value, value: &str) -> bool {
    list.as_array()
        .is_some_and(|l| l.iter().any(|v| v == "*" || v == value))
}

fn matches(hook: &Value, a: &Attempt<'_>, namespace_labels: &Value, object: &Value) -> bool {
    hook["rules"].as_array().into_iter().flatten().any(|r| {
        one_of(&r["apiGroups"], a.group)
            && one_of(&r["apiVersions"], a.version)
            && one_of(&r["resources"], a.resource)
            && one_of(&r["operations"], a.operation)
    }) && selects(&hook["namespaceSelector"], namespace_labels)
        && selects(&hook["objectSelector"], &object["metadata"]["labels"])
}

/// The API server's Status for a webhook's denial: its code (at least 400;
/// 403 when it gives none) and its message after the webhook's name.
fn denied(name: &str, status: &Value) -> Refused {
    let mut status = if status.is_object() {
        status.clone()
    } else {
        json!({})
    };
    let code = status["code"].as_u64().filter(|c| *c >= 400).unwrap_or(403);
    let by = format!("admission webhook \"{name}\" denied the request");
    status["message"] = match status["message"].as_str() {
        Some(m) if !m.is_empty() => format!("{by}: {m}"),
        _ => format!("{by} without explanation"),
    }
    .into();
    status["kind"] = "Status".into();
    status["apiVersion"] = "v1".into();
    status["metadata"] = json!({});
    status["status"] = "Failure".into();
    status["code"] = code.into();
    Refused {
        code: code as u16,
        status,
    }
}

/// Sends the AdmissionReview; the webhook's `response`, or why not.
async fn call(
    hook: &Value,
    services: &BTreeMap<String, SocketAddr>,
    a: &Attempt<'_>,
    object: &Value,
) -> Result<Value, String> {
    let svc = &hook["clientConfig"]["service"];
    let (ns, name) = (
        svc["namespace"].as_str().unwrap_or(""),
        svc["name"].as_str().unwrap_or(""),
    );
    let port = svc["port"].as_u64().unwrap_or(443);
    let path = svc["path"].as_str().unwrap_or("/");
    let timeout = hook["timeoutSeconds"].as_u64().unwrap_or(10);
    let url = format!("https://{name}.{ns}.svc:{port}{path}?timeout={timeout}s");
    let fail = |e: String| format!("failed to call webhook: Post \"{url}\": {e}");
    let addr = services
        .get(&format!("{ns}/{name}"))
        .ok_or_else(|| fail(format!("service \"{name}\" not found")))?;
    let bundle = base64::engine::general_purpose::STANDARD
        .decode(hook["clientConfig"]["caBundle"].as_str().unwrap_or(""))
        .map_err(|e| fail(format!("caBundle: {e}")))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&bundle).flatten() {
        let _ = roots.add(cert);
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| fail(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let uid = format!("uid-admission-{}-{}", a.name, a.operation);
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": a.group, "version": a.version, "kind": a.kind},
            "resource": {"group": a.group, "version": a.version, "resource": a.resource},
            "requestKind": {"group": a.group, "version": a.version, "kind": a.kind},
            "requestResource": {"group": a.group, "version": a.version, "resource": a.resource},
            "name": a.name, "namespace": a.namespace, "operation": a.operation,
            "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
            "object": object, "oldObject": a.old_object, "dryRun": false,
            "options": {"kind": if a.operation == "CREATE" { "CreateOptions" } else { "UpdateOptions" }, "apiVersion": "meta.k8s.io/v1"}
        }
    });
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let server = ServerName::try_from(format!("{name}.{ns}.svc")).map_err(|e| e.to_string())?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(server, tcp)
            .await
            .map_err(|e| format!("tls: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = http::Request::post(format!("{path}?timeout={timeout}s"))
            .header("host", format!("{name}.{ns}.svc:{port}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(review.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let code = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !code.is_success() {
            return Err(format!(
                "the server responded with {code}: {}",
                String::from_utf8_lossy(&body).trim()
            ));
        }
        serde_json::from_slice::<Value>(&body).map_err(|e| e.to_string())
    };
    let out = tokio::time::timeout(Duration::from_secs(timeout), exchange)
        .await
        .map_err(|_| fail("context deadline exceeded".into()))?
        .map_err(fail)?;
    verify(&out, &uid).map_err(|e| format!("received invalid webhook response: {e}"))
}

/// The checks the API server makes of an AdmissionReview answer
/// (`VerifyAdmissionResponse`), with its messages: the group, version and
/// kind it was asked in, the request's uid, and a patch only with
/// `patchType: JSONPatch`. The `response`, or what is wrong.
fn verify(review: &Value, uid: &str) -> Result<Value, String> {
    let (api_version, kind) = (
        review["apiVersion"].as_str().unwrap_or(""),
        review["kind"].as_str().unwrap_or(""),
    );
    if api_version != "admission.k8s.io/v1" || kind != "AdmissionReview" {
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        return Err(format!(
            "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got {}, Kind={kind}",
            if group.is_empty() { version.to_string() } else { format!("{group}/{version}") }
        ));
    }
    let response = &review["response"];
    if !response.is_object() {
        return Err("webhook response was absent".into());
    }
    if response["uid"] != uid {
        return Err(format!(
            "expected response.uid=\"{uid}\", got \"{}\"",
            response["uid"].as_str().unwrap_or("")
        ));
    }
    match (response["patch"].as_str(), response["patchType"].as_str()) {
        (Some(p), None) if !p.is_empty() => {
            return Err("webhook returned response.patch but not response.patchType".into())
        }
        (_, Some(t)) if t != "JSONPatch" => {
            return Err(format!(
                "webhook returned invalid response.patchType of \"{t}\""
            ))
        }
        _ => {}
    }
    Ok(response.clone())
}

#[test]
fn an_answer_is_checked_as_the_api_server_checks_it() {
    let ok = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "response": {"uid": "u-1", "allowed": true, "patchType": "JSONPatch", "patch": "W10="}});
    assert_eq!(
        verify(&ok, "u-1").map(|r| r["allowed"].clone()),
        Ok(json!(true))
    );
    let with = |f: &dyn Fn(&mut Value)| {
        let mut r = ok.clone();
        f(&mut r);
        verify(&r, "u-1").unwrap_err()
    };
    assert_eq!(
        with(&|r| r["apiVersion"] = "admission.k8s.io/v1beta1".into()),
        "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got admission.k8s.io/v1beta1, Kind=AdmissionReview"
    );
    assert_eq!(
        with(&|r| r["kind"] = "Status".into()),
        "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got admission.k8s.io/v1, Kind=Status"
    );
    assert_eq!(
        with(&|r| r["response"]["uid"] = "u-2".into()),
        "expected response.uid=\"u-1\", got \"u-2\""
    );
    assert_eq!(
        with(&|r| r["response"]
            .as_object_mut()
            .map(|o| o.remove("patchType"))
            .map(drop)
            .unwrap_or_default()),
        "webhook returned response.patch but not response.patchType"
    );
    assert_eq!(
        with(&|r| r["response"]["patchType"] = "MergePatch".into()),
        "webhook returned invalid response.patchType of \"MergePatch\""
    );
    assert_eq!(
        with(&|r| {
            r.as_object_mut().map(|o| o.remove("response"));
        }),
        "webhook response was absent"
    );
}
