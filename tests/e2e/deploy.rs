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

fn validate(extra: &[&Path]) -> (bool, String) {
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
        "Deployment istioinaction/simple-backend-2",
        "Service istioinaction/ingress-gateway",
        "DestinationRule /simple-backend-dr [CRD schema]",
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
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: two\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec:\n      containers: [{name: c, image: i}]\n---\napiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata: {name: r}\nspec:\n  host: b\n  trafficPolicy: {loadBalancer: {simple: ROUND_ROBBIN}}\n",
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
}

fn docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join(path)).expect("manifest");
    serde_saphyr::from_multiple(&text).expect("YAML")
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
    for d in apps.iter().filter(|d| d["kind"] == "Deployment") {
        let containers = d["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers");
        let sidecar = containers
            .iter()
            .find(|c| c["name"] == "minimesh-sidecar")
            .unwrap_or_else(|| panic!("{} has no sidecar", d["metadata"]["name"]));
        assert_eq!(
            env_of(sidecar, "POD_NAME").expect("POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
            "metadata.name"
        );
        let app = containers
            .iter()
            .find(|c| c["name"] != "minimesh-sidecar")
            .expect("app");
        // The app listens where the sidecar's inbound listener forwards.
        assert_eq!(
            env_of(app, "LISTEN_ADDR").expect("LISTEN_ADDR")["value"],
            env_of(sidecar, "MINIMESH_APP_ADDR").expect("MINIMESH_APP_ADDR")["value"]
        );
    }
    let web = apps
        .iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == "simple-web")
        .expect("simple-web");
    let app = &web["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        env_of(app, "HTTP_PROXY").expect("HTTP_PROXY")["value"],
        "http://127.0.0.1:15001"
    );

    let ingress = docs("deploy/examples/demo/ingress-gateway.yaml");
    let svc = ingress
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("Service");
    assert_eq!(svc["spec"]["type"], "NodePort");
    assert_eq!(svc["spec"]["ports"][0]["nodePort"], 30000);
}

#[test]
fn quickstart_script_is_sound_shell() {
    let script = root().join("deploy/kind/quickstart.sh");
    let out = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match Command::new("shellcheck").arg(&script).output() {
        Ok(out) => assert!(
            out.status.success(),
            "shellcheck: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(_) => println!("shellcheck is not installed; checked with bash -n only"),
    }
    let text = std::fs::read_to_string(&script).expect("script");
    for step in [
        "kind create cluster --config deploy/kind/cluster.yaml",
        "docker build -f deploy/Dockerfile",
        "kind load docker-image",
        "kubectl apply -k deploy/base",
        "kubectl apply -k deploy/examples/demo",
        "fortio/fortio load",
        "-qps \"$QPS\" -t \"$DURATION\" -jitter",
    ] {
        assert!(text.contains(step), "quickstart lacks: {step}");
    }
}
