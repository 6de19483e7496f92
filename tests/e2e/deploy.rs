//! The Kubernetes manifests in deploy/ and crds/: every object validates
//! against the Kubernetes schemas (deploy/validate.py, which installs
//! `kubernetes-validate` from PyPI when missing), the kustomizations build,
//! the demo has what the walkthrough needs, and the kind quickstart is
//! sound shell.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub fn validate(extra: &[&Path]) -> (bool, String) {
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("deploy/validate.py"));
    if !extra.is_empty() {
        cmd.arg("--extra").args(extra);
    }
    let out = cmd.output().expect("python3 runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    let (ok, out) = validate(&[]);
    println!("{out}");
    assert!(ok, "{out}");
    for k in ["crds:", "deploy/base:", "deploy/examples/demo:"] {
        assert!(out.contains(k), "{k} not built: {out}");
    }
    for object in [
        "CustomResourceDefinition /destinationrules.minimesh.io",
        "Deployment minimesh-system/minimesh-control-plane",
        "PodDisruptionBudget minimesh-system/minimesh-control-plane",
        "ClusterRole /minimesh-control-plane",
        "Role minimesh-system/minimesh-leader-election",
        "ValidatingWebhookConfiguration /minimesh-validator",
        "MutatingWebhookConfiguration /minimesh-injector",
        "Deployment istioinaction/simple-backend-2",
        "Service istioinaction/ingress-gateway",
        "DestinationRule /simple-backend-dr [CRD schema, unknown fields refused]",
    ] {
        assert!(
            out.contains(&format!(": {object}")),
            "{object} missing: {out}"
        );
    }
    assert!(out.contains(" valid, 0 invalid"), "{out}");

    // The validator rejects what the API server would, naming the field.
    let dir = std::env::temp_dir().join(format!("minimesh-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: two\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec:\n      containers: [{name: c, image: i}]\n---\napiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: r}\nspec:\n  host: b\n  trafficPolicy: {loadBalancer: {simple: ROUND_ROBBIN}}\n---\napiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: typo}\nspec:\n  host: b\n  trafficPolicy: {loadBalancer: {simpel: RANDOM}}\n---\napiVersion: monitoring.coreos.com/v1\nkind: PodMonitor\nmetadata: {name: m}\nspec:\n  selector: {}\n  podMetricEndpoints: [{port: http}]\n",
    )
    .expect("write");
    let (ok, out) = validate(&[&bad]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!ok, "{out}");
    assert!(
        out.contains("Deployment /x: spec/replicas: 'two' is not of type 'integer'"),
        "{out}"
    );
    assert!(
        out.contains("DestinationRule /r: spec/trafficPolicy/loadBalancer/simple: 'ROUND_ROBBIN' is not one of"),
        "{out}"
    );
    assert!(
        out.contains("PodMonitor /m: spec: Additional properties are not allowed ('podMetricEndpoints' was unexpected)"),
        "{out}"
    );
    // Unknown fields are refused, as the API server's strict field
    // validation refuses them.
    assert!(
        out.contains("DestinationRule /typo: spec/trafficPolicy/loadBalancer: Additional properties are not allowed ('simpel' was unexpected)"),
        "{out}"
    );
}

fn docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join(path)).expect("manifest");
    serde_saphyr::from_multiple(&text).expect("YAML")
}

/// The pod a Deployment's template makes, as the injector (the control
/// plane's own code, as its webhook runs it) changes it in the demo's
/// namespace, labelled for injection.
fn injected_pod(deployment: &Value) -> Value {
    let template = &deployment["spec"]["template"];
    let mut pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("{}-0", deployment["metadata"]["name"].as_str().unwrap_or("")),
                     "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    });
    if template["metadata"]["annotations"].is_object() {
        pod["metadata"]["annotations"] = template["metadata"]["annotations"].clone();
    }
    // As deploy/base runs the control plane: with its CA.
    let t = minimesh_control_plane::webhook::inject::Template {
        image: "minimesh:dev".into(),
        init_image: "minimesh-init:dev".into(),
        xds_addr: "https://minimesh-control-plane.minimesh-system.svc:15010".into(),
        identity: Some(minimesh_control_plane::webhook::inject::Identity {
            root_pem: "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n".into(),
            trust_domain: "cluster.local".into(),
            audience: "minimesh".into(),
        }),
    };
    if let Some(ops) = minimesh_control_plane::webhook::inject::patch(&pod, &t).expect("injectable")
    {
        crate::fake_kube::wire::json_patch(&mut pod, &ops).expect("the patch applies");
    }
    pod
}

fn env_of<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

#[test]
fn the_demo_runs_every_app_with_a_sidecar_and_the_control_plane_highly_available() {
    let cp = docs("deploy/base/control-plane.yaml");
    let deployment = cp
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("Deployment");
    assert_eq!(deployment["spec"]["replicas"], 2);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert!(container["args"]
        .as_array()
        .expect("args")
        .contains(&"--source=kubernetes".into()));
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    // The mesh's CA, its root shared by the replicas through a Secret.
    assert!(container["args"]
        .as_array()
        .expect("args")
        .contains(&"--ca-secret=minimesh-ca".into()));
    assert!(cp.iter().any(|d| d["kind"] == "PodDisruptionBudget"));

    let apps = docs("deploy/examples/demo/apps.yaml");
    let replicas: Vec<(String, i64)> = apps
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .map(|d| {
            (
                d["metadata"]["name"].as_str().unwrap_or("").to_string(),
                d["spec"]["replicas"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        replicas,
        [
            ("simple-web".to_string(), 1),
            ("simple-backend-1".to_string(), 1),
            ("simple-backend-2".to_string(), 2)
        ]
    );
    // The namespace asks for injection; no app names its sidecar.
    let ns = docs("deploy/examples/demo/namespace.yaml");
    assert_eq!(ns[0]["metadata"]["labels"]["minimesh.io/inject"], "enabled");
    for d in apps.iter().filter(|d| d["kind"] == "Deployment") {
        let name = &d["metadata"]["name"];
        let written = serde_json::to_string(d).expect("json");
        assert!(
            !written.contains("minimesh-sidecar"),
            "{name} writes its sidecar by hand"
        );
        let pod = injected_pod(d);
        let spec = &pod["spec"];
        // The init step first: the capture rules, with only the two
        // capabilities they need.
        let init = &spec["initContainers"][0];
        assert_eq!(init["name"], "minimesh-init", "{name}: {pod:#}");
        assert_eq!(init["command"][1], "init-capture");
        assert_eq!(
            init["securityContext"]["capabilities"],
            serde_json::json!({"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]})
        );
        let sidecar = &spec["initContainers"][1];
        assert_eq!(sidecar["name"], "minimesh-sidecar", "{name}: {pod:#}");
        assert_eq!(sidecar["restartPolicy"], "Always", "a native sidecar");
        assert_eq!(
            sidecar["securityContext"]["runAsUser"], 1337,
            "the user capture excludes"
        );
        assert_eq!(
            env_of(sidecar, "POD_NAME").expect("POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.name"
        );
        assert_eq!(
            env_of(sidecar, "MINIMESH_CAPTURE").expect("capture")["value"],
            "true"
        );
        // The app as the book writes it: untouched but for its HTTP probe,
        // which the sidecar makes for the kubelet; on 0.0.0.0:8080, no proxy.
        let app = &spec["containers"][0];
        let mut written = d["spec"]["template"]["spec"]["containers"][0].clone();
        let container = written["name"].as_str().unwrap_or_default().to_string();
        written["readinessProbe"]["httpGet"] = serde_json::json!({
            "path": format!("/app-health/{container}/readyz"), "port": 15000, "scheme": "HTTP"});
        assert_eq!(app, &written, "{name}: the app was changed");
        assert_eq!(
            env_of(sidecar, "MINIMESH_APP_PROBES").expect("probes")["value"],
            format!(r#"{{"/app-health/{container}/readyz":{{"path":"/health","port":8080}}}}"#)
        );
        assert_eq!(
            env_of(app, "LISTEN_ADDR").expect("LISTEN_ADDR")["value"],
            "0.0.0.0:8080"
        );
        assert!(env_of(app, "HTTP_PROXY").is_none());
        // Its identity: its own service account's projected token.
        assert_eq!(
            env_of(sidecar, "MINIMESH_TOKEN_FILE").expect("MINIMESH_TOKEN_FILE")["value"],
            "/var/run/secrets/minimesh/token"
        );
        assert!(
            spec["serviceAccountName"]
                .as_str()
                .is_some_and(|sa| sa.starts_with("simple-")),
            "{name} runs as its own service account"
        );
        // Its Service targets the app's own port, as the book's.
        let app_label = &d["spec"]["template"]["metadata"]["labels"]["app"];
        let svc = apps
            .iter()
            .find(|s| s["kind"] == "Service" && s["spec"]["selector"]["app"] == *app_label)
            .expect("its Service");
        assert_eq!(svc["spec"]["ports"][0]["targetPort"], 8080, "{name}");
    }
    // The gateway is a proxy itself: no sidecar, but a sidecar's identity
    // (to call the apps over mutual TLS) and discovery over TLS.
    let gateway = docs("deploy/examples/demo/ingress-gateway.yaml");
    let gw = gateway
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("gateway");
    assert_eq!(
        gw["spec"]["template"]["metadata"]["labels"]["minimesh.io/inject"],
        "gateway"
    );
    let gw_pod = injected_pod(gw);
    assert!(gw_pod["spec"]["initContainers"].is_null());
    let gw_proxy = &gw_pod["spec"]["containers"][0];
    assert_eq!(
        env_of(gw_proxy, "MINIMESH_XDS_ADDR").map(|e| &e["value"]),
        Some(&Value::from(
            "https://minimesh-control-plane.minimesh-system.svc:15010"
        ))
    );
    assert!(env_of(gw_proxy, "MINIMESH_CA_ROOT").is_some());
    assert_eq!(
        gw_pod["spec"]["volumes"][0]["projected"]["sources"][0]["serviceAccountToken"]["audience"],
        "minimesh"
    );
    assert_eq!(gw_pod["spec"]["serviceAccountName"], "ingress-gateway");

    // deploy/monitoring's PodMonitor selects every injected pod and the
    // gateway on a port each names.
    let monitors = docs("deploy/monitoring/proxies.yaml");
    let values = &monitors[0]["spec"]["selector"]["matchExpressions"][0]["values"];
    let ports: Vec<&Value> = monitors[0]["spec"]["podMetricsEndpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .map(|e| &e["port"])
        .collect();
    let port_names = |pod: &Value| -> Vec<Value> {
        ["containers", "initContainers"]
            .iter()
            .flat_map(|k| pod["spec"][*k].as_array().cloned().unwrap_or_default())
            .flat_map(|c| c["ports"].as_array().cloned().unwrap_or_default())
            .map(|p| p["name"].clone())
            .collect()
    };
    for d in apps
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .chain([gw])
    {
        let pod = if d == gw {
            d["spec"]["template"].clone()
        } else {
            injected_pod(d)
        };
        let label = &pod["metadata"]["labels"]["minimesh.io/proxy"];
        assert!(
            values.as_array().is_some_and(|v| v.contains(label)),
            "{pod:#}"
        );
        assert!(
            port_names(&pod).iter().any(|p| ports.contains(&p)),
            "{pod:#}"
        );
    }
    // Its other PodMonitor scrapes the control plane's admin port, which
    // the Service workloads reach leaves out.
    let pm = &docs("deploy/monitoring/control-plane.yaml")[0];
    assert_eq!(pm["kind"], "PodMonitor");
    let deployment = cp
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("Deployment");
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
        pod["metadata"]["labels"]["app.kubernetes.io/name"]
    );
    let admin = &pm["spec"]["podMetricsEndpoints"][0]["port"];
    assert!(port_names(pod).contains(admin), "{pod:#}");
    let svc = cp.iter().find(|d| d["kind"] == "Service").expect("Service");
    let svc_ports: Vec<&Value> = svc["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| &p["targetPort"])
        .collect();
    assert!(
        !svc_ports.contains(&admin),
        "the Service exposes the admin port: {svc:#}"
    );

    // The injected pod validates strictly against the Kubernetes schemas.
    let dir = std::env::temp_dir().join(format!("minimesh-injected-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("injected-pod.yaml");
    let web = apps
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "simple-web")
        .expect("simple-web");
    let mut pod = injected_pod(web);
    pod["metadata"]["namespace"] = "istioinaction".into();
    std::fs::write(&file, serde_json::to_string_pretty(&pod).expect("json")).expect("write");
    let (ok, out) = validate(&[&file]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(ok, "{out}");
    assert!(out.contains("Pod istioinaction/simple-web-0"), "{out}");

    let ingress = docs("deploy/examples/demo/ingress-gateway.yaml");
    let svc = ingress
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("Service");
    assert_eq!(svc["spec"]["type"], "NodePort");
    assert_eq!(svc["spec"]["ports"][0]["nodePort"], 30000);
}

/// `bash -n` and, where it is installed, shellcheck pass on `script`.
fn assert_sound_shell(script: &std::path::Path) {
    let out = Command::new("bash")
        .arg("-n")
        .arg(script)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match Command::new("shellcheck").arg(script).output() {
        Ok(out) => assert!(
            out.status.success(),
            "shellcheck: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(_) => println!("shellcheck is not installed; checked with bash -n only"),
    }
}

/// The script that shows every RBAC rule is needed (run by hand: about 20
/// minutes) is sound shell.
#[test]
fn rbac_rules_script_is_sound_shell() {
    assert_sound_shell(&root().join("scripts/rbac-rules-needed.sh"));
}

/// The PGO build script (run whole by `.ci/run`): sound shell, its usage
/// from `--help`, and a clear error for an argument it does not know.
#[test]
fn pgo_build_script_is_sound_shell_and_says_what_it_takes() {
    let script = root().join("scripts/pgo-build.sh");
    assert_sound_shell(&script);
    let help = Command::new("bash")
        .arg(&script)
        .arg("--help")
        .output()
        .expect("bash runs");
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{text}");
    assert!(
        text.starts_with("Builds the sidecar with profile-guided optimisation"),
        "{text}"
    );
    assert!(
        text.contains("bash scripts/pgo-build.sh [--out DIR] [--network A.B.C.0]"),
        "{text}"
    );
    assert!(!text.contains("set -euo"), "{text}");
    let bad = Command::new("bash")
        .arg(&script)
        .arg("--fast")
        .output()
        .expect("bash runs");
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&bad.stderr),
        "pgo-build: unknown argument '--fast' (see --help)\n"
    );
}

#[test]
fn quickstart_script_is_sound_shell() {
    let script = root().join("deploy/kind/quickstart.sh");
    assert_sound_shell(&script);
    let text = std::fs::read_to_string(&script).expect("script");
    for step in [
        "kind create cluster --config deploy/kind/cluster.yaml",
        "--provenance=false",
        "kind load image-archive",
        "need curl",
        "apply_kustomization deploy/base",
        "apply_kustomization deploy/examples/demo",
        "image: minimesh:dev|image: $IMAGE",
        "fortio/fortio load",
        "quickstart: fortio failed",
        "-qps \"$QPS\" -t \"$DURATION\" -jitter",
    ] {
        assert!(text.contains(step), "quickstart lacks: {step}");
    }
}

/// Every series the Grafana dashboard (deploy/dashboards/minimesh.json)
/// queries is one a live mesh exposes, with the labels the query groups and
/// filters by: a panel over a renamed metric would show nothing, silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_series_the_mesh_exposes() {
    use crate::harness::*;
    use std::collections::{BTreeMap, BTreeSet};

    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/dashboards/minimesh.json"))
            .expect("dashboard"),
    )
    .expect("dashboard JSON");
    let mut exprs: Vec<String> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_string))
        .collect();
    exprs.push(
        dash["templating"]["list"][0]["definition"]
            .as_str()
            .expect("cluster variable")
            .to_string(),
    );
    assert!(exprs.len() >= 15, "{exprs:?}");

    // A mesh with traffic, a retry and load reports.
    let net = Net::new(95);
    let _b1 = net.backend(1, &[]).await;
    net.service("backend", &[1]);
    let _cp = net
        .control_plane_with(&["--load-report-interval", "200ms"])
        .await;
    let _sc = net.sidecar(100, &[]).await;
    wait_sidecar(
        net.addr(100, 15000),
        std::time::Duration::from_secs(5),
        |v| endpoints_of(v, "backend").len() == 1,
    )
    .await;
    let c = load(net.addr(100, 15001), "backend", 2, 50).await;
    assert!(c.failed.is_empty(), "{:?}", c.failed);
    // The load reports reached the control plane.
    let ep = net.addr(1, 9090).to_string();
    wait_cp_json(&net, "/debug/load", |v| {
        v["clusters"]["backend.default.svc.cluster.local:80"][&ep]["requests"]
            .as_u64()
            .is_some_and(|n| n >= 50)
    })
    .await;

    // Series name -> every label name it carries, from both /metrics.
    let mut series: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for admin in [net.addr(100, 15000), net.cp_admin()] {
        let (_, _, text) = get(admin, "localhost", "/metrics").await.expect("metrics");
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (name, rest) = line.split_at(line.find(['{', ' ']).unwrap_or(line.len()));
            let labels = series.entry(name.to_string()).or_default();
            if let Some(inner) = rest.strip_prefix('{').and_then(|r| r.split('}').next()) {
                for pair in inner.split(',') {
                    if let Some((k, _)) = pair.split_once('=') {
                        labels.insert(k.to_string());
                    }
                }
            }
        }
    }
    let ident = |s: &str| -> Vec<String> {
        s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect()
    };
    for expr in &exprs {
        let names: Vec<String> = ident(expr)
            .into_iter()
            .filter(|w| w.starts_with("minimesh_"))
            .collect();
        assert!(!names.is_empty(), "{expr}");
        let mut have = BTreeSet::new();
        for n in &names {
            let labels = series
                .get(n)
                .unwrap_or_else(|| panic!("{expr}: no series {n} on a live mesh"));
            have.extend(labels.iter().cloned());
        }
        // Labels it groups by (`by (...)`) or matches (`{label=...}`).
        let mut used = Vec::new();
        for part in expr.split("by (").skip(1) {
            used.extend(ident(part.split(')').next().unwrap_or("")));
        }
        for part in expr.split('{').skip(1) {
            for m in part.split('}').next().unwrap_or("").split(',') {
                if let Some((k, _)) = m.split_once(['=', '!']) {
                    used.push(k.trim().trim_end_matches('~').to_string());
                }
            }
        }
        for l in used {
            assert!(
                have.contains(&l),
                "{expr}: no label {l} on {names:?} ({have:?})"
            );
        }
    }
}

/// Every pod of the control plane and of the demo says where its metrics
/// are (the usual `prometheus.io/*` annotations), on a port it listens on,
/// so that a cluster's Prometheus scrapes them and the dashboard has data.
#[test]
fn every_pod_is_annotated_for_scraping_on_a_port_it_serves() {
    for path in [
        "deploy/base/control-plane.yaml",
        "deploy/examples/demo/apps.yaml",
        "deploy/examples/demo/ingress-gateway.yaml",
    ] {
        for d in docs(path).iter().filter(|d| d["kind"] == "Deployment") {
            // The pod as created: the demo's apps get their sidecar (and
            // its scrape annotations) by injection.
            let pod = if path.contains("demo") {
                injected_pod(d)
            } else {
                d["spec"]["template"].clone()
            };
            let template = &pod;
            let a = &template["metadata"]["annotations"];
            let name = &d["metadata"]["name"];
            assert_eq!(a["prometheus.io/scrape"], "true", "{path} {name}");
            assert_eq!(a["prometheus.io/path"], "/metrics", "{path} {name}");
            let port: u64 = a["prometheus.io/port"]
                .as_str()
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("{path} {name}: prometheus.io/port"));
            let served = ["containers", "initContainers"]
                .iter()
                .flat_map(|k| template["spec"][*k].as_array().into_iter().flatten())
                .flat_map(|c| c["ports"].as_array().into_iter().flatten())
                .any(|p| p["containerPort"] == port);
            assert!(served, "{path} {name}: no container listens on {port}");
        }
    }
}
