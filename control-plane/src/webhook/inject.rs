//! Sidecar injection: the mutating webhook's answer for a Pod about to be
//! created in a namespace labelled `minimesh.io/inject=enabled` (or a pod
//! labelled so). The sidecar is added as a native sidecar (an init
//! container with `restartPolicy: Always`, Kubernetes ≥ 1.29): it starts,
//! and is listening, before the app's containers and stops after them.
//!
//! By default the pod's traffic is captured, as Istio and Linkerd do it:
//! an init container (`minimesh-init`, `sidecar init-capture`, with only
//! `NET_ADMIN` and `NET_RAW`) writes the rules that hand the pod's TCP
//! connections to the sidecar, which runs as user and group 1337 (the ones
//! the rules exclude); the app's containers are left as they are but for
//! their HTTP probes, pointed at the sidecar (`inject/probes.rs`). Istio's
//! `traffic.sidecar.istio.io/*` annotations set what is captured; a bad
//! value refuses the pod naming the annotation.
//!
//! `minimesh.io/capture: disabled` (or Istio's
//! `sidecar.istio.io/interceptionMode: NONE`) keeps the explicit mode, for
//! clusters that forbid `NET_ADMIN`: every app container gets `HTTP_PROXY`
//! pointing at the sidecar (and `NO_PROXY` for its loopback), and the pod's
//! annotations choose the ports (`minimesh.io/inbound-port`, the Service's
//! `targetPort`, 9090; `minimesh.io/app-port`, where the app listens on
//! 127.0.0.1, 8080).
//!
//! The pod is labelled `minimesh.io/proxy=sidecar` and annotated
//! `minimesh.io/injected`. A pod with a sidecar of its own is left alone.
//! One injected already is seen again when a later webhook changed it
//! (`reinvocationPolicy: IfNeeded`): the app containers that webhook added
//! are treated as the others were, and nothing else changes.
//!
//! With the control plane's CA, the sidecar also gets its identity: a
//! projected service-account token (audience `minimesh`, an hour, renewed
//! by the kubelet) and the mesh's root (the pod's `minimesh.io/ca-root`
//! annotation, as a file through the Downward API) in one volume, and dials
//! discovery over TLS. A pod labelled `minimesh.io/inject=gateway` (a proxy
//! itself, as the demo's ingress gateway) gets that identity in its first
//! container and no sidecar.

use base64::Engine;
use serde_json::{json, Value};

use super::review::Verdict;

mod capture;
mod identity;
mod probes;

use capture::{captured, captures};
use identity::{gateway, identity};

/// Annotation set on every injected pod.
pub const INJECTED: &str = "minimesh.io/injected";
/// Label set on every injected pod (`sidecar`; the demo's gateway carries
/// `gateway`): what the PodMonitor of `deploy/monitoring` selects.
pub const PROXY_LABEL: &str = "minimesh.io/proxy";
/// The sidecar container's name.
pub const SIDECAR: &str = "minimesh-sidecar";
/// The capture init container's name.
pub const INIT: &str = "minimesh-init";
/// The pod annotation that turns capture off (`disabled`); the injector
/// sets it to `enabled` on the pods it captures, which the control plane
/// reads to call every captured port of them over mutual TLS.
pub const CAPTURE_ANNOTATION: &str = "minimesh.io/capture";
/// Istio's annotation with the same purpose: `NONE` is no capture.
pub const INTERCEPTION_MODE: &str = "sidecar.istio.io/interceptionMode";
/// The sidecar's admin port (readiness, metrics).
pub const ADMIN_PORT: u16 = 15000;
/// The sidecar's outbound listener (the apps' `HTTP_PROXY`).
pub const OUTBOUND: &str = "127.0.0.1:15001";

/// The annotation that carries the mesh's root certificate to the
/// sidecar (a file through the Downward API).
pub const CA_ROOT_ANNOTATION: &str = "minimesh.io/ca-root";
/// Where the sidecar finds its token and the root.
pub const IDENTITY_DIR: &str = "/var/run/secrets/minimesh";
/// The pod volume that holds them.
pub const IDENTITY_VOLUME: &str = "minimesh-identity";
/// How long a projected token lasts (the kubelet renews it at 80%).
pub const TOKEN_SECONDS: u32 = 3600;

/// What the injected sidecar is made of.
#[derive(Clone, Debug)]
pub struct Template {
    /// Its image.
    pub image: String,
    /// The capture init container's image (the sidecar binary and `nft`).
    pub init_image: String,
    /// The control plane's discovery address, as sidecars dial it.
    pub xds_addr: String,
    /// With the control plane's CA: how the sidecar proves who it is.
    pub identity: Option<Identity>,
}

/// What a sidecar needs for its certificate.
#[derive(Clone, Debug)]
pub struct Identity {
    /// The mesh's root, PEM.
    pub root_pem: String,
    /// The trust domain.
    pub trust_domain: String,
    /// The audience of its projected token (`--token-audience`).
    pub audience: String,
}

/// An AdmissionReview with a request and its uid, or why not.
fn admission_request(body: &[u8]) -> Result<Value, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    if v["kind"] != "AdmissionReview" {
        return Err("not an AdmissionReview: kind is not AdmissionReview".into());
    }
    if !v["apiVersion"]
        .as_str()
        .is_some_and(|a| a.starts_with("admission.k8s.io/"))
    {
        return Err("not an AdmissionReview: apiVersion is not admission.k8s.io/*".into());
    }
    if !v["request"]["uid"].is_string() {
        return Err("not an AdmissionReview: request.uid is missing".into());
    }
    Ok(v)
}

/// Answers an AdmissionReview about a Pod with the patch that injects the
/// sidecar (or none).
pub fn review(body: &[u8], template: &Template) -> Result<(Verdict, Value), String> {
    let v = admission_request(body)?;
    let uid = v["request"]["uid"].as_str().unwrap_or_default();
    let pod = &v["request"]["object"];
    let mut response = json!({ "uid": uid, "allowed": true });
    let verdict = match patch(pod, template) {
        Ok(None) => Verdict::Allowed,
        Ok(Some(ops)) => {
            response["patchType"] = "JSONPatch".into();
            response["patch"] = base64::engine::general_purpose::STANDARD
                .encode(serde_json::to_vec(&ops).unwrap_or_default())
                .into();
            Verdict::Allowed
        }
        Err(message) => {
            response["allowed"] = false.into();
            response["status"] =
                json!({"status": "Failure", "code": 422, "reason": "Invalid", "message": message});
            Verdict::Denied
        }
    };
    Ok((
        verdict,
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}),
    ))
}

/// What `/inject-conflict` says: the API server calls it only for pods of a
/// namespace labelled for both Istio's injection and minimesh's
/// (`deploy/base/injector.yaml` selects them), whose pods would get two
/// sidecars fighting over the same traffic.
pub fn conflict_message(namespace: &str) -> String {
    format!(
        "namespace {namespace} is labelled for sidecar injection by both Istio (istio-injection=enabled or istio.io/rev) and minimesh (minimesh.io/inject=enabled): its pods would get two sidecars; remove one of the labels"
    )
}

/// Answers an AdmissionReview from `/inject-conflict`: refused, saying why;
/// also the namespace, for the Event.
pub fn conflict_review(body: &[u8]) -> Result<(Verdict, Value, String), String> {
    let v = admission_request(body)?;
    let uid = v["request"]["uid"].as_str().unwrap_or_default();
    let namespace = v["request"]["namespace"].as_str().unwrap_or("").to_string();
    let response = json!({
        "uid": uid,
        "allowed": false,
        "status": {"status": "Failure", "code": 403, "reason": "Forbidden", "message": conflict_message(&namespace)},
    });
    Ok((
        Verdict::Denied,
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}),
        namespace,
    ))
}

/// A port from annotation `key`, or `default`.
fn port(pod: &Value, key: &str, default: u16) -> Result<u16, String> {
    match pod["metadata"]["annotations"][key].as_str() {
        None => Ok(default),
        Some(s) => {
            s.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                format!("metadata.annotations[{key}]: {s:?} is not a port (1-65535)")
            })
        }
    }
}

/// JSON Pointer escaping of one path segment.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The JSON Patch that injects the sidecar; None when nothing is to be done.
pub fn patch(pod: &Value, t: &Template) -> Result<Option<Vec<Value>>, String> {
    let spec = &pod["spec"];
    let names = ["containers", "initContainers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().into_iter().flatten())
        .filter_map(|c| c["name"].as_str());
    if pod["metadata"]["labels"]["minimesh.io/inject"] == "disabled" {
        return Ok(None);
    }
    if pod["metadata"]["annotations"][INJECTED].is_string() {
        return reinvoked(pod);
    }
    if names.clone().any(|n| n == SIDECAR) {
        return Ok(None);
    }
    if pod["metadata"]["labels"]["minimesh.io/inject"] == "gateway" {
        return Ok(gateway(pod, t));
    }
    if spec["hostNetwork"] == true {
        return Err("spec.hostNetwork: a pod on the node's network cannot have a sidecar (its ports would be the node's); label it minimesh.io/inject=disabled".into());
    }
    if captures(pod)? {
        return captured(pod, t).map(Some);
    }
    let inbound = port(pod, "minimesh.io/inbound-port", 9090)?;
    let app = port(pod, "minimesh.io/app-port", 8080)?;
    if inbound == app || [inbound, app].contains(&ADMIN_PORT) || [inbound, app].contains(&15001) {
        return Err(format!(
            "metadata.annotations: minimesh.io/inbound-port ({inbound}) and minimesh.io/app-port ({app}) must differ from each other and from the sidecar's own ports ({ADMIN_PORT}, 15001)"
        ));
    }
    let sidecar = sidecar_container(
        t,
        [
            env("MINIMESH_INBOUND_ADDR", format!("0.0.0.0:{inbound}")),
            env("MINIMESH_APP_ADDR", format!("127.0.0.1:{app}")),
        ]
        .into_iter()
        .chain(labels_env(pod))
        .collect(),
        json!([
            {"name": "http-mesh", "containerPort": inbound},
            {"name": "http-mesh-admin", "containerPort": ADMIN_PORT},
        ]),
        65532,
    );
    let mut sidecar = sidecar;
    let mut ops = Vec::new();
    if let Some(id) = &t.identity {
        identity(spec, id, &mut sidecar, &mut ops);
    }
    // First among the init containers: those after it may use the mesh.
    if spec["initContainers"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
    {
        ops.push(json!({"op": "add", "path": "/spec/initContainers/0", "value": sidecar}));
    } else {
        ops.push(json!({"op": "add", "path": "/spec/initContainers", "value": [sidecar]}));
    }
    ops.extend(proxy_env(spec));
    mark_injected(pod, t, Vec::new(), &mut ops);
    Ok(Some(ops))
}

/// The pod injected already, seen again because a later webhook changed it
/// (`reinvocationPolicy: IfNeeded`): the app containers that webhook added
/// get what the first pass gave the others (captured, their HTTP probes
/// pointed at the sidecar; explicit, `HTTP_PROXY` and `NO_PROXY`), and
/// nothing else changes: with nothing new, no patch.
fn reinvoked(pod: &Value) -> Result<Option<Vec<Value>>, String> {
    let spec = &pod["spec"];
    let Some((k, sidecar)) = spec["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .find(|(_, c)| c["name"] == SIDECAR)
    else {
        // A gateway (its proxy is its own container) or a sidecar removed
        // by another webhook: nothing of ours to complete.
        return Ok(None);
    };
    let vars = sidecar["env"].as_array().cloned().unwrap_or_default();
    let var = |name: &str| vars.iter().enumerate().find(|(_, e)| e["name"] == name);
    let ops = if var("MINIMESH_CAPTURE").is_some_and(|(_, e)| e["value"] == "true") {
        if !probes::wanted(pod) {
            return Ok(None);
        }
        let (mut ops, originals) = probes::rewrite(pod, ADMIN_PORT)?;
        if originals.is_empty() {
            return Ok(None);
        }
        match var("MINIMESH_APP_PROBES") {
            Some((j, e)) => {
                let mut all: serde_json::Map<String, Value> =
                    serde_json::from_str(e["value"].as_str().unwrap_or("{}")).map_err(|e| {
                        format!("spec.initContainers[{SIDECAR}].env[MINIMESH_APP_PROBES]: {e}")
                    })?;
                all.extend(originals);
                ops.push(json!({"op": "replace", "path": format!("/spec/initContainers/{k}/env/{j}/value"), "value": Value::Object(all).to_string()}));
            }
            None => ops.push(json!({"op": "add", "path": format!("/spec/initContainers/{k}/env/-"), "value": env("MINIMESH_APP_PROBES", Value::Object(originals).to_string())})),
        }
        ops
    } else {
        proxy_env(spec)
    };
    Ok((!ops.is_empty()).then_some(ops))
}

/// `HTTP_PROXY` and `NO_PROXY` for every app container that sets neither
/// (the explicit mode).
fn proxy_env(spec: &Value) -> Vec<Value> {
    let mut ops = Vec::new();
    // Plain-HTTP calls go through the sidecar; the pod's own loopback does
    // not (unless the container sets either variable itself).
    let vars = [
        env("HTTP_PROXY", format!("http://{OUTBOUND}")),
        env("NO_PROXY", "localhost,127.0.0.1".into()),
    ];
    for (i, c) in spec["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let missing: Vec<&Value> = vars
            .iter()
            .filter(|v| {
                c["env"]
                    .as_array()
                    .is_none_or(|set| !set.iter().any(|e| e["name"] == v["name"]))
            })
            .collect();
        if c["env"].as_array().is_none() {
            ops.push(
                json!({"op": "add", "path": format!("/spec/containers/{i}/env"), "value": missing}),
            );
        } else {
            for v in missing {
                ops.push(
                    json!({"op": "add", "path": format!("/spec/containers/{i}/env/-"), "value": v}),
                );
            }
        }
    }
    ops
}

/// Labels the pod as a proxy's and annotates it as injected (with `extra`
/// annotations, the mesh's root with a CA, and the sidecar's port for
/// Prometheus unless the pod names its own).
fn mark_injected(pod: &Value, t: &Template, extra: Vec<(&str, String)>, ops: &mut Vec<Value>) {
    // What a PodMonitor (deploy/monitoring) selects proxies by.
    if pod["metadata"]["labels"].is_object() {
        ops.push(json!({"op": "add", "path": format!("/metadata/labels/{}", escape(PROXY_LABEL)), "value": "sidecar"}));
    } else {
        ops.push(
            json!({"op": "add", "path": "/metadata/labels", "value": {PROXY_LABEL: "sidecar"}}),
        );
    }
    let mut annotations = vec![(INJECTED, "true".to_string())];
    annotations.extend(extra);
    if let Some(id) = &t.identity {
        annotations.push((CA_ROOT_ANNOTATION, id.root_pem.clone()));
    }
    // Scraped on the sidecar's port unless the pod says otherwise.
    if !pod["metadata"]["annotations"]["prometheus.io/scrape"].is_string() {
        annotations.extend([
            ("prometheus.io/scrape", "true".into()),
            ("prometheus.io/port", ADMIN_PORT.to_string()),
            ("prometheus.io/path", "/metrics".into()),
        ]);
    }
    annotate(pod, annotations, ops);
}

/// An environment variable of a container.
fn env(name: &str, value: String) -> Value {
    json!({"name": name, "value": value})
}

/// The pod's labels as the sidecar's `MINIMESH_LABELS` (`k=v,...`, what
/// AuthorizationPolicy selectors match), as they are when it is created;
/// None without labels.
fn labels_env(pod: &Value) -> Option<Value> {
    let labels = pod["metadata"]["labels"].as_object()?;
    let list: Vec<String> = labels
        .iter()
        .filter_map(|(k, v)| Some(format!("{k}={}", v.as_str()?)))
        .collect();
    (!list.is_empty()).then(|| env("MINIMESH_LABELS", list.join(",")))
}

/// The sidecar container: the common settings, `extra_env`, `ports`, and
/// the user and group it runs as.
fn sidecar_container(t: &Template, extra_env: Vec<Value>, ports: Value, id: u32) -> Value {
    let field = |name: &str, path: &str| json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}});
    let mut vars = vec![
        field("POD_NAME", "metadata.name"),
        field("POD_NAMESPACE", "metadata.namespace"),
        env("MINIMESH_XDS_ADDR", t.xds_addr.clone()),
        env("MINIMESH_OUTBOUND_ADDR", OUTBOUND.into()),
        env("MINIMESH_ADMIN_ADDR", format!("0.0.0.0:{ADMIN_PORT}")),
    ];
    vars.extend(extra_env);
    json!({
        "name": SIDECAR,
        "image": t.image,
        "imagePullPolicy": "IfNotPresent",
        // A native sidecar: started before the app, stopped after it.
        "restartPolicy": "Always",
        "command": ["/usr/local/bin/sidecar"],
        "env": vars,
        "ports": ports,
        // The app starts once the sidecar listens.
        "startupProbe": {"httpGet": {"path": "/healthz", "port": ADMIN_PORT}, "periodSeconds": 1, "failureThreshold": 60},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": ADMIN_PORT}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": ADMIN_PORT}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "runAsNonRoot": true,
            "runAsUser": id,
            "runAsGroup": id,
            "capabilities": {"drop": ["ALL"]},
            // Pod Security's restricted profile, whatever the pod sets.
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    })
}

/// Adds `annotations` to the pod's.
fn annotate(pod: &Value, annotations: Vec<(&str, String)>, ops: &mut Vec<Value>) {
    if pod["metadata"]["annotations"].is_object() {
        for (k, v) in annotations {
            ops.push(json!({"op": "add", "path": format!("/metadata/annotations/{}", escape(k)), "value": v}));
        }
    } else {
        let map: serde_json::Map<String, Value> = annotations
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect();
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": map}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> Template {
        Template {
            image: "minimesh:dev".into(),
            init_image: "minimesh-init:dev".into(),
            xds_addr: "http://minimesh-control-plane.minimesh-system.svc:15010".into(),
            identity: None,
        }
    }

    fn pod(extra: Value) -> Value {
        let mut p = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "demo", "labels": {"app": "web"}},
            "spec": {"containers": [
                {"name": "web", "image": "web:1", "env": [{"name": "A", "value": "1"}]},
                {"name": "log", "image": "log:1"},
            ]}
        });
        if let (Some(p), Some(e)) = (p.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                p.insert(k.clone(), v.clone());
            }
        }
        p
    }

    /// A pod that turns capture off (explicit mode).
    fn explicit_pod() -> Value {
        pod(
            json!({"metadata": {"name": "web-1", "namespace": "demo", "labels": {"app": "web"},
            "annotations": {CAPTURE_ANNOTATION: "disabled"}}}),
        )
    }

    #[test]
    fn without_capture_a_pod_gets_a_native_sidecar_first_and_every_container_its_proxy() {
        let ops = patch(&explicit_pod(), &template())
            .expect("ok")
            .expect("a patch");
        assert_eq!(ops[0]["path"], "/spec/initContainers");
        let sidecar = &ops[0]["value"][0];
        assert_eq!(sidecar["name"], SIDECAR);
        assert_eq!(sidecar["restartPolicy"], "Always");
        assert_eq!(sidecar["ports"][0]["containerPort"], 9090);
        assert!(sidecar["env"]
            .as_array()
            .expect("env")
            .contains(&json!({"name": "MINIMESH_APP_ADDR", "value": "127.0.0.1:8080"})));
        assert_eq!(
            ops[1],
            json!({"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "HTTP_PROXY", "value": "http://127.0.0.1:15001"}})
        );
        assert_eq!(
            ops[2],
            json!({"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": "NO_PROXY", "value": "localhost,127.0.0.1"}})
        );
        assert_eq!(ops[3]["path"], "/spec/containers/1/env");
        assert_eq!(ops[3]["value"].as_array().map(Vec::len), Some(2));
        assert_eq!(ops[4]["path"], "/metadata/labels/minimesh.io~1proxy");
        assert_eq!(
            ops[5]["path"],
            "/metadata/annotations/minimesh.io~1injected"
        );
        assert_eq!(ops[7]["path"], "/metadata/annotations/prometheus.io~1port");
        assert_eq!(ops[7]["value"], "15000");
        // Istio's annotation says the same.
        let istio =
            pod(json!({"metadata": {"name": "w", "annotations": {INTERCEPTION_MODE: "NONE"}}}));
        let ops = patch(&istio, &template()).expect("ok").expect("a patch");
        assert_eq!(ops[1]["value"]["name"], "HTTP_PROXY");
    }

    #[test]
    fn by_default_the_init_step_captures_and_the_app_is_left_as_it_is() {
        let mut p = pod(json!({"metadata": {"name": "web-1", "annotations": {
            "traffic.sidecar.istio.io/excludeOutboundPorts": "5432"}}}));
        p["spec"]["containers"][0]["readinessProbe"] =
            json!({"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 5});
        let ops = patch(&p, &template()).expect("ok").expect("a patch");
        assert_eq!(ops[0]["path"], "/spec/initContainers");
        let (init, sidecar) = (&ops[0]["value"][0], &ops[0]["value"][1]);
        assert_eq!(init["name"], INIT);
        assert_eq!(init["image"], "minimesh-init:dev");
        assert_eq!(init["command"][1], "init-capture");
        assert!(init["command"]
            .as_array()
            .expect("command")
            .contains(&json!("--exclude-outbound-ports=5432")));
        assert_eq!(
            init["securityContext"]["capabilities"],
            json!({"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]})
        );
        assert_eq!(sidecar["name"], SIDECAR);
        assert_eq!(sidecar["restartPolicy"], "Always");
        assert_eq!(sidecar["securityContext"]["runAsUser"], 1337);
        assert_eq!(sidecar["securityContext"]["runAsGroup"], 1337);
        let env = sidecar["env"].as_array().expect("env");
        assert!(env.contains(&json!({"name": "MINIMESH_CAPTURE", "value": "true"})));
        assert!(env
            .contains(&json!({"name": "MINIMESH_INBOUND_CAPTURE_ADDR", "value": "0.0.0.0:15006"})));
        assert!(env.contains(&json!({"name": "MINIMESH_APP_PROBES", "value": r#"{"/app-health/web/readyz":{"path":"/health","port":8080}}"#})));
        assert!(!env.iter().any(|e| e["name"] == "MINIMESH_APP_ADDR"));
        // The app: no proxy variables; only its HTTP probe moved.
        let app_ops: Vec<&Value> = ops
            .iter()
            .filter(|o| {
                o["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("/spec/containers"))
            })
            .collect();
        assert_eq!(
            app_ops,
            [
                &json!({"op": "replace", "path": "/spec/containers/0/readinessProbe/httpGet",
                "value": {"path": "/app-health/web/readyz", "port": 15000, "scheme": "HTTP"}})
            ]
        );
        let annotations: Vec<&str> = ops.iter().filter_map(|o| o["path"].as_str()).collect();
        assert!(
            annotations.contains(&"/metadata/annotations/minimesh.io~1capture"),
            "{annotations:?}"
        );
    }

    #[test]
    fn bad_capture_annotations_are_refused_by_name() {
        for (key, value, want) in [
            ("traffic.sidecar.istio.io/excludeInboundPorts", "ssh", r#"metadata.annotations[traffic.sidecar.istio.io/excludeInboundPorts]: "ssh" is not a port (1 to 65535)"#),
            (INTERCEPTION_MODE, "TPROXY", "metadata.annotations[sidecar.istio.io/interceptionMode]: TPROXY is not supported (minimesh captures with REDIRECT, which keeps the caller's address visible to the sidecar); use REDIRECT, or NONE for no capture"),
            (CAPTURE_ANNOTATION, "off", r#"metadata.annotations[minimesh.io/capture]: "off" is not enabled or disabled"#),
        ] {
            let p = pod(json!({"metadata": {"name": "w", "annotations": {key: value}}}));
            assert_eq!(patch(&p, &template()).unwrap_err(), want);
        }
    }

    #[test]
    fn with_a_ca_the_sidecar_gets_its_token_and_the_root_in_one_volume() {
        let mut t = template();
        t.identity = Some(Identity {
            root_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
            trust_domain: "example.org".into(),
            audience: "minimesh".into(),
        });
        let ops = patch(&explicit_pod(), &t).expect("ok").expect("a patch");
        assert_eq!(ops[0]["path"], "/spec/volumes");
        let sources = &ops[0]["value"][0]["projected"]["sources"];
        assert_eq!(
            sources[0]["serviceAccountToken"],
            json!({"audience": "minimesh", "expirationSeconds": 3600, "path": "token"})
        );
        assert_eq!(
            sources[1]["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"],
            "metadata.annotations['minimesh.io/ca-root']"
        );
        let sidecar = &ops[1]["value"][0];
        assert_eq!(sidecar["volumeMounts"][0]["mountPath"], IDENTITY_DIR);
        let env = sidecar["env"].as_array().expect("env");
        for (name, value) in [
            (
                "MINIMESH_CA_ROOT",
                "/var/run/secrets/minimesh/root-cert.pem",
            ),
            ("MINIMESH_TOKEN_FILE", "/var/run/secrets/minimesh/token"),
            ("MINIMESH_TRUST_DOMAIN", "example.org"),
        ] {
            assert!(
                env.contains(&json!({"name": name, "value": value})),
                "{name}"
            );
        }
        let root = ops
            .iter()
            .find(|o| o["path"] == "/metadata/annotations/minimesh.io~1ca-root")
            .expect("the root annotated");
        assert!(root["value"]
            .as_str()
            .is_some_and(|r| r.starts_with("-----BEGIN CERTIFICATE-----")));
    }

    #[test]
    fn ports_come_from_annotations_and_bad_ones_are_refused_by_name() {
        let p = pod(
            json!({"metadata": {"name": "w", "annotations": {CAPTURE_ANNOTATION: "disabled",
            "minimesh.io/inbound-port": "8443", "minimesh.io/app-port": "3000", "prometheus.io/scrape": "false"}}}),
        );
        let ops = patch(&p, &template()).expect("ok").expect("a patch");
        assert_eq!(ops[0]["value"][0]["ports"][0]["containerPort"], 8443);
        let paths: Vec<&str> = ops.iter().filter_map(|o| o["path"].as_str()).collect();
        assert_eq!(
            paths.last(),
            Some(&"/metadata/annotations/minimesh.io~1injected"),
            "the pod's own scrape settings are kept: {paths:?}"
        );
        let p = pod(
            json!({"metadata": {"name": "w", "annotations": {CAPTURE_ANNOTATION: "disabled", "minimesh.io/app-port": "http"}}}),
        );
        assert_eq!(
            patch(&p, &template()).unwrap_err(),
            "metadata.annotations[minimesh.io/app-port]: \"http\" is not a port (1-65535)"
        );
    }

    /// Applies the `add` and `replace` operations of a JSON Patch, as the
    /// API server does with the webhook's answer.
    fn apply(doc: &mut Value, ops: &[Value]) {
        for op in ops {
            let path = op["path"].as_str().expect("path");
            let (parent, last) = path.rsplit_once('/').expect("a pointer");
            let last = last.replace("~1", "/").replace("~0", "~");
            let target = doc.pointer_mut(parent).expect(path);
            let value = op["value"].clone();
            match (op["op"].as_str(), target) {
                (Some("add"), Value::Array(a)) if last == "-" => a.push(value),
                (Some("add"), Value::Array(a)) => a.insert(last.parse().expect("index"), value),
                (Some("replace"), Value::Array(a)) => {
                    a[last.parse::<usize>().expect("index")] = value
                }
                (Some("add" | "replace"), Value::Object(o)) => {
                    o.insert(last, value);
                }
                (op, _) => panic!("{op:?} at {path}"),
            }
        }
    }

    #[test]
    fn a_pod_seen_again_gets_only_what_a_later_webhook_added() {
        let agent = json!({"name": "agent", "image": "agent:1",
            "livenessProbe": {"httpGet": {"path": "/alive", "port": 9000}}});
        // Captured: the new container's probe goes to the sidecar, and the
        // sidecar learns its original beside the first pass's.
        let mut p = pod(json!({}));
        p["spec"]["containers"][0]["readinessProbe"] =
            json!({"httpGet": {"path": "/ready", "port": 8080}});
        let ops = patch(&p, &template()).expect("patch").expect("ops");
        apply(&mut p, &ops);
        assert_eq!(patch(&p, &template()), Ok(None), "nothing new: no patch");
        p["spec"]["containers"]
            .as_array_mut()
            .expect("containers")
            .push(agent.clone());
        let ops = patch(&p, &template()).expect("patch").expect("ops");
        apply(&mut p, &ops);
        assert_eq!(
            p["spec"]["containers"][2]["livenessProbe"]["httpGet"],
            json!({"path": "/app-health/agent/livez", "port": ADMIN_PORT, "scheme": "HTTP"})
        );
        let sidecar = &p["spec"]["initContainers"][1];
        assert_eq!(sidecar["name"], SIDECAR);
        let probes = sidecar["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == "MINIMESH_APP_PROBES"))
            .expect("probes");
        let probes: Value =
            serde_json::from_str(probes["value"].as_str().expect("JSON")).expect("JSON");
        assert_eq!(
            probes,
            json!({
                "/app-health/web/readyz": {"path": "/ready", "port": 8080},
                "/app-health/agent/livez": {"path": "/alive", "port": 9000},
            })
        );
        assert_eq!(patch(&p, &template()), Ok(None));
        // Explicit: the new container gets the proxy variables.
        let mut p = explicit_pod();
        let ops = patch(&p, &template()).expect("patch").expect("ops");
        apply(&mut p, &ops);
        assert_eq!(patch(&p, &template()), Ok(None));
        p["spec"]["containers"]
            .as_array_mut()
            .expect("containers")
            .push(agent);
        let ops = patch(&p, &template()).expect("patch").expect("ops");
        assert_eq!(
            ops,
            [
                json!({"op": "add", "path": "/spec/containers/2/env", "value": [
                    {"name": "HTTP_PROXY", "value": format!("http://{OUTBOUND}")},
                    {"name": "NO_PROXY", "value": "localhost,127.0.0.1"},
                ]})
            ]
        );
    }

    #[test]
    fn injected_opted_out_and_hand_written_pods_are_left_alone() {
        for extra in [
            // Injected, but its sidecar is not there (another webhook took it
            // out): nothing of minimesh's to complete.
            json!({"metadata": {"name": "w", "annotations": {INJECTED: "true"}}}),
            json!({"metadata": {"name": "w", "labels": {"minimesh.io/inject": "disabled"}}}),
            json!({"spec": {"containers": [{"name": SIDECAR, "image": "minimesh"}]}}),
        ] {
            assert_eq!(patch(&pod(extra.clone()), &template()), Ok(None), "{extra}");
        }
    }

    #[test]
    fn the_review_carries_the_patch_in_base64() {
        let body = serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": "CREATE", "object": pod(json!({}))}
        }))
        .expect("json");
        let (verdict, out) = review(&body, &template()).expect("review");
        assert_eq!(verdict, Verdict::Allowed);
        assert_eq!(out["response"]["uid"], "u-1");
        assert_eq!(out["response"]["patchType"], "JSONPatch");
        let patch = base64::engine::general_purpose::STANDARD
            .decode(out["response"]["patch"].as_str().expect("patch"))
            .expect("base64");
        let ops: Vec<Value> = serde_json::from_slice(&patch).expect("ops");
        assert_eq!(ops[0]["value"][0]["name"], INIT);
        assert_eq!(ops[0]["value"][1]["name"], SIDECAR);
    }
}
