//! The mesh identity a pod's proxy gets with the control plane's CA: a
//! projected service-account token and the mesh's root in one volume (the
//! root from the pod's annotation, through the Downward API), for a sidecar
//! or for a gateway pod's own proxy container.

use serde_json::{json, Value};

use super::{
    annotate, Identity, Template, CA_ROOT_ANNOTATION, IDENTITY_DIR, IDENTITY_VOLUME, INJECTED,
    TOKEN_SECONDS,
};

/// A gateway pod (labelled `minimesh.io/inject=gateway`: a proxy itself,
/// its first container the sidecar binary in gateway mode) gets no sidecar;
/// with the CA, it gets the identity a sidecar gets (to call meshed
/// endpoints over mutual TLS) and the discovery address to use it with.
pub(super) fn gateway(pod: &Value, t: &Template) -> Option<Vec<Value>> {
    let id = t.identity.as_ref()?;
    let container = &pod["spec"]["containers"][0];
    if !container.is_object() {
        return None;
    }
    let mut ops = Vec::new();
    let mut proxy = json!({"env": []});
    identity(&pod["spec"], id, &mut proxy, &mut ops);
    let env = container["env"].as_array();
    if env.is_none() {
        ops.push(json!({"op": "add", "path": "/spec/containers/0/env", "value": []}));
    }
    for var in proxy["env"].as_array().into_iter().flatten() {
        ops.push(json!({"op": "add", "path": "/spec/containers/0/env/-", "value": var}));
    }
    let xds = json!({"name": "MINIMESH_XDS_ADDR", "value": t.xds_addr});
    match env.and_then(|e| e.iter().position(|v| v["name"] == "MINIMESH_XDS_ADDR")) {
        Some(i) => ops.push(
            json!({"op": "replace", "path": format!("/spec/containers/0/env/{i}"), "value": xds}),
        ),
        None => ops.push(json!({"op": "add", "path": "/spec/containers/0/env/-", "value": xds})),
    }
    let mount = &proxy["volumeMounts"][0];
    if container["volumeMounts"].is_array() {
        ops.push(json!({"op": "add", "path": "/spec/containers/0/volumeMounts/-", "value": mount}));
    } else {
        ops.push(json!({"op": "add", "path": "/spec/containers/0/volumeMounts", "value": [mount]}));
    }
    let annotations = vec![
        (INJECTED, "true".to_string()),
        (CA_ROOT_ANNOTATION, id.root_pem.clone()),
    ];
    annotate(pod, annotations, &mut ops);
    Some(ops)
}

/// A sidecar's identity: its projected service-account token (audience
/// `id.audience`) and the root (from the pod's annotation) in one volume,
/// and the flags that use them.
pub(super) fn identity(spec: &Value, id: &Identity, sidecar: &mut Value, ops: &mut Vec<Value>) {
    let volume = json!({
        "name": IDENTITY_VOLUME,
        "projected": {"sources": [
            {"serviceAccountToken": {"audience": id.audience, "expirationSeconds": TOKEN_SECONDS, "path": "token"}},
            {"downwardAPI": {"items": [{"path": "root-cert.pem", "fieldRef": {"fieldPath": format!("metadata.annotations['{CA_ROOT_ANNOTATION}']")}}]}},
        ]},
    });
    if spec["volumes"].is_array() {
        ops.push(json!({"op": "add", "path": "/spec/volumes/-", "value": volume}));
    } else {
        ops.push(json!({"op": "add", "path": "/spec/volumes", "value": [volume]}));
    }
    sidecar["volumeMounts"] =
        json!([{"name": IDENTITY_VOLUME, "mountPath": IDENTITY_DIR, "readOnly": true}]);
    if let Some(env) = sidecar["env"].as_array_mut() {
        for (name, value) in [
            ("MINIMESH_CA_ROOT", format!("{IDENTITY_DIR}/root-cert.pem")),
            ("MINIMESH_TOKEN_FILE", format!("{IDENTITY_DIR}/token")),
            ("MINIMESH_TRUST_DOMAIN", id.trust_domain.clone()),
        ] {
            env.push(json!({"name": name, "value": value}));
        }
    }
}
