//! The real `kubectl` against the fake API server, with the control plane's
//! admission webhook called over HTTPS as the API server calls it: a good
//! rule is applied and shows Accepted in `kubectl get` and `kubectl wait`; a
//! bad one is refused with the field and the reason; every replica serves
//! the one certificate whose CA is in the configuration's caBundle.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::fake_kube::FakeKube;
use crate::harness::*;
use crate::kubernetes::{control_plane, service, slice};

pub(crate) const CP_NS: &str = "minimesh-system";

pub(crate) fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The shipped manifest's documents of `kind`.
pub(crate) fn shipped(file: &str, kind: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo().join(file)).expect("manifest");
    serde_saphyr::from_multiple::<Value>(&text)
        .expect("YAML")
        .into_iter()
        .filter(|d| d["kind"] == kind)
        .collect()
}

/// Runs the real kubectl against the fake; (success, stdout, stderr).
pub async fn kubectl(net: &Net, args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let kubeconfig = net.dir.join("kubeconfig");
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let stdin = stdin.map(str::to_string);
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .args(&args)
            .args(std::env::var("KUBECTL_V").ok().map(|v| format!("-v={v}")))
            .env("KUBECONFIG", &kubeconfig)
            .env("KUBECACHEDIR", kubeconfig.with_file_name("kube-cache"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kubectl is installed (.ci/run installs it)");
        if let Some(text) = stdin {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())
                .expect("write");
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().expect("kubectl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .expect("join")
}

const GOOD: &str = "apiVersion: minimesh.io/v1alpha1
kind: DestinationRule
metadata:
  name: backend-dr
  namespace: default
spec:
  host: backend
  trafficPolicy:
    loadBalancer:
      simple: RANDOM
";

/// Refused by minimesh's webhook (the CRD's schema takes it).
const BAD: &str = "apiVersion: minimesh.io/v1alpha1
kind: DestinationRule
metadata:
  name: backend-dr
  namespace: default
spec:
  host: backend
  trafficPolicy:
    loadBalancer:
      simple: PASSTHROUGH
";

const VS: &str = "apiVersion: minimesh.io/v1alpha1
kind: VirtualService
metadata:
  name: backend-vs
  namespace: default
spec:
  hosts: [backend]
  http:
  - timeout: 0.5s
    route:
    - destination: {host: backend}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_apply_of_a_bad_rule_is_refused_by_the_schema_or_the_webhook_with_field_and_reason()
{
    let net = Net::new(110);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    // Busy, as a real API server can be: kubectl and the control plane
    // retry a 429 after its Retry-After.
    fake.throttle_every(9);
    fake.apply(service("backend"));
    fake.apply(slice(&net, "backend", &[(1, true), (2, true)]));
    for c in shipped("deploy/base/webhook.yaml", "ValidatingWebhookConfiguration") {
        fake.apply(c);
    }
    // The API server reaches the webhook through the control plane's
    // Service: here, the first replica's webhook port.
    fake.route_service(CP_NS, "minimesh-control-plane", net.addr(254, 15017));
    let webhook = |host: u8| net.addr(host, 15017).to_string();
    let _cp0 = control_plane(&net, &fake, "cp-0", 254, &["--webhook-addr", &webhook(254)]).await;

    // The control plane made the certificate, stored it, and set the CA.
    let deadline = Instant::now() + Duration::from_secs(20);
    let bundle = loop {
        let config = fake
            .get(
                "admissionregistration.k8s.io/v1",
                "ValidatingWebhookConfiguration",
                "",
                "minimesh-validator",
            )
            .expect("configuration");
        if let Some(b) = config["webhooks"][0]["clientConfig"]["caBundle"].as_str() {
            break b.to_string();
        }
        assert!(Instant::now() < deadline, "caBundle never set: {config:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let secret = fake
        .get("v1", "Secret", CP_NS, "minimesh-webhook-tls")
        .expect("the certificate's Secret");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    assert_eq!(secret["data"]["ca.crt"].as_str(), Some(bundle.as_str()));

    // A second replica serves the same certificate: its CA is the bundle's.
    let _cp1 = control_plane(&net, &fake, "cp-1", 253, &["--webhook-addr", &webhook(253)]).await;

    // A good rule goes in and is accepted.
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(GOOD)).await;
    assert!(ok, "{out}{err}");
    assert_eq!(
        out.trim(),
        "destinationrule.minimesh.io/backend-dr created",
        "{err}"
    );
    let (ok, out, err) = kubectl(
        &net,
        &[
            "wait",
            "--for=condition=Accepted",
            "destinationrule.minimesh.io/backend-dr",
            "--timeout=20s",
        ],
        None,
    )
    .await;
    assert!(ok, "{out}{err}");

    // A bad one is refused, named by field and reason, through either replica.
    for host in [254, 253] {
        fake.route_service(CP_NS, "minimesh-control-plane", net.addr(host, 15017));
        let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(BAD)).await;
        assert!(!ok, "{out}{err}");
        assert!(
            err.contains("admission webhook \"validation.minimesh.io\" denied the request: spec.trafficPolicy.loadBalancer.simple: PASSTHROUGH is not supported"),
            "{err}"
        );
    }
    // What the CRD's schema can tell is refused by the API server itself,
    // before any webhook (the denials counted below stay the webhook's):
    // a policy name it does not list, a misspelled field (kubectl asks for
    // strict field validation).
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some(&GOOD.replace("RANDOM", "FASTEST")),
    )
    .await;
    assert!(!ok, "{out}{err}");
    assert!(
        err.contains("The DestinationRule \"backend-dr\" is invalid: spec.trafficPolicy.loadBalancer.simple: Unsupported value: \"FASTEST\": supported values: \"UNSPECIFIED\", \"ROUND_ROBIN\", \"RANDOM\""),
        "{err}"
    );
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some(&GOOD.replace("  host: backend", "  host: backend\n  hots: backend")),
    )
    .await;
    assert!(!ok, "{out}{err}");
    assert!(
        err.contains("strict decoding error: unknown field \"spec.hots\""),
        "{err}"
    );
    // The stored rule is still the good one, and `kubectl get mdr` says so
    // in the CRD's columns.
    let (ok, out, err) = kubectl(&net, &["get", "mdr"], None).await;
    assert!(ok && err.is_empty(), "{out}{err}");
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines[0],
        ["NAME", "HOST", "POLICY", "ACCEPTED", "WARNINGS", "AGE"],
        "{out}"
    );
    assert_eq!(
        lines[1][..5],
        ["backend-dr", "backend", "RANDOM", "True", "False"],
        "{out}"
    );
    assert!(lines[1][5].ends_with('s'), "an age in seconds: {out}");
    let stored = fake
        .get("minimesh.io/v1alpha1", "DestinationRule", NS, "backend-dr")
        .expect("rule");
    assert_eq!(
        stored["spec"]["trafficPolicy"]["loadBalancer"]["simple"],
        "RANDOM"
    );

    // A field accepted without effect is applied, with kubectl's warning.
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some(&format!(
            "{GOOD}    connectionPool:\n      http:\n        h2UpgradePolicy: UPGRADE\n"
        )),
    )
    .await;
    assert!(ok, "{out}{err}");
    assert_eq!(
        out.trim(),
        "destinationrule.minimesh.io/backend-dr configured"
    );
    assert!(
        err.starts_with("Warning: spec.trafficPolicy.connectionPool.http.h2UpgradePolicy: UPGRADE is accepted but not enforced"),
        "{err}"
    );

    // minimesh's own VirtualService is checked by the same webhook: a good
    // one goes in (and is applied), one with a field minimesh does not
    // implement is refused naming it; kubectl lists them by short name.
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(VS)).await;
    assert!(ok, "{out}{err}");
    assert_eq!(out.trim(), "virtualservice.minimesh.io/backend-vs created");
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some(&format!("{VS}    mirror: {{host: backend}}\n")),
    )
    .await;
    assert!(!ok, "{out}{err}");
    assert!(
        err.contains("admission webhook \"validation.minimesh.io\" denied the request: spec.http[0].mirror: mirroring is not implemented yet"),
        "{err}"
    );
    let (ok, out, err) = kubectl(&net, &["get", "mvs"], None).await;
    assert!(ok && err.is_empty(), "{out}{err}");
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0], ["NAME", "GATEWAYS", "HOSTS", "AGE"], "{out}");
    assert_eq!(lines[1][0], "backend-vs", "{out}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, _, config) = get(net.addr(254, 15014), "localhost", "/debug/config")
            .await
            .expect("config");
        let config: Value = serde_json::from_str(&config).expect("JSON");
        if config["virtualServices"][0]["name"] == "backend-vs" {
            assert_eq!(config["virtualServices"][0]["routes"][0]["timeout_ms"], 500);
            break;
        }
        assert!(Instant::now() < deadline, "not applied: {config:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Server-side apply: a rule created, changed, and a field it no
    // longer lists removed (its manager owned it).
    let ssa = GOOD
        .replace("backend-dr", "frontend-dr")
        .replace("host: backend", "host: frontend");
    let (ok, out, err) = kubectl(&net, &["apply", "--server-side", "-f", "-"], Some(&ssa)).await;
    assert!(ok, "{out}{err}");
    assert_eq!(
        out.trim(),
        "destinationrule.minimesh.io/frontend-dr serverside-applied",
        "{err}"
    );
    let stored = fake
        .get("minimesh.io/v1alpha1", "DestinationRule", NS, "frontend-dr")
        .expect("created by server-side apply");
    assert_eq!(
        stored["spec"]["trafficPolicy"]["loadBalancer"]["simple"],
        "RANDOM"
    );
    assert_eq!(
        stored["spec"]["exportTo"],
        serde_json::json!([]),
        "the schema's default"
    );
    let without_policy = ssa
        .split("  trafficPolicy:")
        .next()
        .unwrap_or("")
        .to_string();
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "--server-side", "-f", "-"],
        Some(&without_policy),
    )
    .await;
    assert!(ok, "{out}{err}");
    let stored = fake
        .get("minimesh.io/v1alpha1", "DestinationRule", NS, "frontend-dr")
        .expect("rule");
    assert!(stored["spec"].get("trafficPolicy").is_none(), "{stored:#}");
    assert_eq!(stored["metadata"]["generation"], 2, "{stored:#}");

    // Both replicas counted what they answered.
    let mut denied = 0.0;
    for host in [254, 253] {
        let (_, _, metrics) = get(net.addr(host, 15014), "localhost", "/metrics")
            .await
            .expect("metrics");
        denied += metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(
                    "minimesh_admission_reviews_total{webhook=\"validate\",verdict=\"denied\"} ",
                )
            })
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no denied count:\n{metrics}"));
    }
    assert_eq!(denied, 3.0);
    assert!(fake.count("THROTTLED") > 0, "no request was throttled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cert_managers_certificate_the_webhook_serves_it_and_writes_nothing() {
    use base64::Engine;
    let net = Net::new(118);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    // What cert-manager leaves: the Certificate's Secret mounted as files,
    // and the CA injected into the configuration.
    let names = minimesh_control_plane::webhook::certs::names("minimesh-control-plane", CP_NS);
    let tls = minimesh_control_plane::webhook::certs::generate(&names).expect("certificate");
    let dir = net.dir.join("webhook-tls");
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("tls.crt"), &tls.cert).expect("write");
    std::fs::write(dir.join("tls.key"), &tls.key).expect("write");
    for mut c in shipped("deploy/base/webhook.yaml", "ValidatingWebhookConfiguration") {
        c["webhooks"][0]["clientConfig"]["caBundle"] = base64::engine::general_purpose::STANDARD
            .encode(&tls.ca)
            .into();
        fake.apply(c);
    }
    let before = fake
        .get(
            "admissionregistration.k8s.io/v1",
            "ValidatingWebhookConfiguration",
            "",
            "minimesh-validator",
        )
        .expect("configuration");
    fake.route_service(CP_NS, "minimesh-control-plane", net.addr(254, 15017));
    let webhook = net.addr(254, 15017).to_string();
    let tls_dir = dir.display().to_string();
    let _cp = control_plane(
        &net,
        &fake,
        "cp-0",
        254,
        &["--webhook-addr", &webhook, "--webhook-tls-dir", &tls_dir],
    )
    .await;
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(BAD)).await;
    assert!(!ok, "{out}{err}");
    assert!(
        err.contains("admission webhook \"validation.minimesh.io\" denied the request: spec.trafficPolicy.loadBalancer.simple: "),
        "{err}"
    );
    // No Secret made, the configuration as cert-manager left it.
    assert!(fake
        .get("v1", "Secret", CP_NS, "minimesh-webhook-tls")
        .is_none());
    let after = fake
        .get(
            "admissionregistration.k8s.io/v1",
            "ValidatingWebhookConfiguration",
            "",
            "minimesh-validator",
        )
        .expect("configuration");
    assert_eq!(
        before["metadata"]["resourceVersion"],
        after["metadata"]["resourceVersion"]
    );
}
