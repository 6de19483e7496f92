//! The app's HTTP probes pointed at the sidecar, as Istio rewrites them: a
//! captured pod's app port takes only mutual TLS under STRICT, and the
//! kubelet probes in plaintext, so each `httpGet` probe goes to the
//! sidecar's admin port at `/app-health/<container>/<kind>`, and the
//! sidecar (`--app-probes`, `sidecar/src/app_probe.rs`) sends the original
//! to the app over loopback. `sidecar.istio.io/rewriteAppHTTPProbers:
//! "false"` (or `minimesh.io/rewrite-probes: "false"`) keeps them as
//! written; an HTTPS probe is kept as written (the sidecar probes in
//! plaintext only), and so are `tcpSocket`, `grpc` and `exec` probes
//! (a TCP connect is answered by the sidecar's capture in every mode).

use serde_json::{json, Map, Value};

/// The three probes of a container and the names of their admin paths.
const KINDS: [(&str, &str); 3] = [
    ("livenessProbe", "livez"),
    ("readinessProbe", "readyz"),
    ("startupProbe", "startupz"),
];

/// True unless the pod opts out of the rewrite.
pub fn wanted(pod: &Value) -> bool {
    let a = &pod["metadata"]["annotations"];
    ![
        "sidecar.istio.io/rewriteAppHTTPProbers",
        "minimesh.io/rewrite-probes",
    ]
    .iter()
    .any(|k| {
        a[*k]
            .as_str()
            .is_some_and(|v| v.eq_ignore_ascii_case("false"))
    })
}

/// The JSON Patch operations that point the app containers' HTTP probes at
/// the sidecar's `admin_port`, and what the sidecar must send for each
/// (its `--app-probes`); Err names the probe that cannot be rewritten.
pub fn rewrite(pod: &Value, admin_port: u16) -> Result<(Vec<Value>, Map<String, Value>), String> {
    let mut ops = Vec::new();
    let mut originals = Map::new();
    for (i, c) in pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let name = c["name"].as_str().unwrap_or_default();
        for (field, kind) in KINDS {
            let get = &c[field]["httpGet"];
            if !get.is_object()
                || get["scheme"]
                    .as_str()
                    .is_some_and(|s| !s.eq_ignore_ascii_case("HTTP"))
            {
                continue;
            }
            // Pointed at the sidecar already (the webhook called again).
            if get["port"] == admin_port
                && get["path"]
                    .as_str()
                    .is_some_and(|p| p.starts_with("/app-health/"))
            {
                continue;
            }
            let at = format!("spec.containers[{name}].{field}.httpGet.port");
            let port = match &get["port"] {
                Value::Number(n) => n
                    .as_u64()
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("{at}: {n} is not a port"))?,
                Value::String(named) => match named.parse::<u16>() {
                    Ok(n) if n > 0 => n,
                    _ => c["ports"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|p| p["name"] == named.as_str())
                        .and_then(|p| p["containerPort"].as_u64())
                        .and_then(|n| u16::try_from(n).ok())
                        .ok_or_else(|| format!("{at}: no container port is named {named:?}"))?,
                },
                _ => return Err(format!("{at}: missing")),
            };
            let admin_path = format!("/app-health/{name}/{kind}");
            let mut original = json!({"port": port, "path": get["path"].as_str().unwrap_or("/")});
            if get["httpHeaders"].is_array() {
                original["httpHeaders"] = get["httpHeaders"].clone();
            }
            originals.insert(admin_path.clone(), original);
            ops.push(json!({
                "op": "replace",
                "path": format!("/spec/containers/{i}/{field}/httpGet"),
                "value": {"path": admin_path, "port": admin_port, "scheme": "HTTP"},
            }));
        }
    }
    Ok((ops, originals))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_probes_go_to_the_sidecar_with_their_originals() {
        let pod = json!({"spec": {"containers": [{
            "name": "web",
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": "http", "httpHeaders": [{"name": "x", "value": "1"}]}},
            "livenessProbe": {"httpGet": {"path": "/live", "port": 8081}},
            "startupProbe": {"tcpSocket": {"port": 8080}},
        }, {
            "name": "tls",
            "readinessProbe": {"httpGet": {"path": "/", "port": 8443, "scheme": "HTTPS"}},
        }]}});
        let (ops, originals) = rewrite(&pod, 15000).expect("rewritten");
        assert_eq!(
            ops,
            [
                json!({"op": "replace", "path": "/spec/containers/0/livenessProbe/httpGet", "value": {"path": "/app-health/web/livez", "port": 15000, "scheme": "HTTP"}}),
                json!({"op": "replace", "path": "/spec/containers/0/readinessProbe/httpGet", "value": {"path": "/app-health/web/readyz", "port": 15000, "scheme": "HTTP"}}),
            ]
        );
        assert_eq!(
            originals["/app-health/web/livez"],
            json!({"port": 8081, "path": "/live"})
        );
        assert_eq!(
            originals["/app-health/web/readyz"],
            json!({"port": 8080, "path": "/ready", "httpHeaders": [{"name": "x", "value": "1"}]})
        );
        assert_eq!(
            originals.len(),
            2,
            "TCP and HTTPS probes are kept as written"
        );
    }

    #[test]
    fn an_unknown_named_port_is_refused_and_the_opt_out_is_read() {
        let pod = json!({"spec": {"containers": [{"name": "web", "readinessProbe": {"httpGet": {"port": "web"}}}]}});
        assert_eq!(
            rewrite(&pod, 15000).unwrap_err(),
            "spec.containers[web].readinessProbe.httpGet.port: no container port is named \"web\""
        );
        assert!(wanted(&json!({"metadata": {}})));
        assert!(!wanted(
            &json!({"metadata": {"annotations": {"sidecar.istio.io/rewriteAppHTTPProbers": "false"}}})
        ));
    }
}
