//! The captured mode (the default): whether a pod's annotations keep it,
//! and its patch: the init container that writes the capture rules with
//! only `NET_ADMIN` and `NET_RAW`, the sidecar as user 1337 taking captured
//! connections, the app's HTTP probes pointed at the sidecar.

use minimesh_proto::capture::{CaptureSettings, INBOUND_CAPTURE_PORT, PROXY_GID, PROXY_UID};
use serde_json::{json, Value};

use super::identity::identity;
use super::{
    env, labels_env, mark_injected, probes, sidecar_container, Template, ADMIN_PORT,
    CAPTURE_ANNOTATION, INIT, INTERCEPTION_MODE,
};

/// Whether the pod's traffic is captured: yes unless its annotations turn
/// capture off; Err for a value neither mode takes.
pub(super) fn captures(pod: &Value) -> Result<bool, String> {
    let a = &pod["metadata"]["annotations"];
    let ours = match a[CAPTURE_ANNOTATION].as_str() {
        None | Some("enabled") => true,
        Some("disabled") => false,
        Some(other) => {
            return Err(format!(
                "metadata.annotations[{CAPTURE_ANNOTATION}]: {other:?} is not enabled or disabled"
            ))
        }
    };
    let istio = match a[INTERCEPTION_MODE].as_str() {
        None | Some("REDIRECT") => true,
        Some("NONE") => false,
        Some("TPROXY") => {
            return Err(format!(
                "metadata.annotations[{INTERCEPTION_MODE}]: TPROXY is not supported (minimesh captures with REDIRECT, which keeps the caller's address visible to the sidecar); use REDIRECT, or NONE for no capture"
            ))
        }
        Some(other) => {
            return Err(format!(
                "metadata.annotations[{INTERCEPTION_MODE}]: {other:?} is not REDIRECT or NONE"
            ))
        }
    };
    Ok(ours && istio)
}

/// The patch for a pod whose traffic is captured: the init step first, the
/// sidecar as user 1337 taking captured connections, the app's HTTP probes
/// pointed at the sidecar, nothing else of the app touched.
pub(super) fn captured(pod: &Value, t: &Template) -> Result<Vec<Value>, String> {
    let spec = &pod["spec"];
    let annotations = pod["metadata"]["annotations"].as_object();
    let pairs = annotations
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.as_str(), v.as_str()?)));
    let settings = CaptureSettings::from_annotations(pairs)
        .map_err(|e| format!("metadata.annotations[{}]: {}", e.key, e.reason))?;
    let mut command = vec![json!("/usr/local/bin/sidecar"), json!("init-capture")];
    command.extend(settings.init_args().into_iter().map(Value::from));
    let init = json!({
        "name": INIT,
        "image": t.init_image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "resources": {"requests": {"cpu": "10m", "memory": "10Mi"}, "limits": {"memory": "50Mi"}},
        // Root in the pod's own network namespace, with the two
        // capabilities rules need and no other (Istio's istio-init).
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": false,
            "runAsUser": 0,
            "runAsGroup": 0,
            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    });
    let (probe_ops, originals) = if probes::wanted(pod) {
        probes::rewrite(pod, ADMIN_PORT)?
    } else {
        (Vec::new(), serde_json::Map::new())
    };
    let mut extra = vec![
        env("MINIMESH_CAPTURE", "true".into()),
        env(
            "MINIMESH_INBOUND_CAPTURE_ADDR",
            format!("0.0.0.0:{INBOUND_CAPTURE_PORT}"),
        ),
    ];
    extra.extend(labels_env(pod));
    if !originals.is_empty() {
        extra.push(env(
            "MINIMESH_APP_PROBES",
            Value::Object(originals).to_string(),
        ));
    }
    debug_assert_eq!(PROXY_UID, PROXY_GID);
    let mut sidecar = sidecar_container(
        t,
        extra,
        json!([{"name": "http-mesh-admin", "containerPort": ADMIN_PORT}]),
        PROXY_UID,
    );
    let mut ops = Vec::new();
    if let Some(id) = &t.identity {
        identity(spec, id, &mut sidecar, &mut ops);
    }
    // The rules first, then the sidecar, then the pod's own init containers.
    match spec["initContainers"].as_array() {
        Some(a) if !a.is_empty() => {
            ops.push(json!({"op": "add", "path": "/spec/initContainers/0", "value": sidecar}));
            ops.push(json!({"op": "add", "path": "/spec/initContainers/0", "value": init}));
        }
        _ => {
            ops.push(json!({"op": "add", "path": "/spec/initContainers", "value": [init, sidecar]}))
        }
    }
    ops.extend(probe_ops);
    let captured = vec![(CAPTURE_ANNOTATION, "enabled".to_string())];
    mark_injected(pod, t, captured, &mut ops);
    Ok(ops)
}
