//! Sidecar injection through the real `kubectl` and the fake API server:
//! a labelled namespace's new pods get a native sidecar (a Deployment's
//! `generateName` pods too), the shipped pods meet Pod Security's
//! restricted profile, and no pod is refused while a replica restarts.

use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::admission::{kubectl, shipped, CP_NS};
use crate::fake_kube::FakeKube;
use crate::harness::*;
use crate::kubernetes::control_plane;

const DEPLOYMENT: &str = "apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: demo
spec:
  replicas: 1
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      containers:
      - name: web
        image: minimesh:dev
        command: [/usr/local/bin/fake-service]
        env:
        - {name: LISTEN_ADDR, value: 127.0.0.1:8080}
        readinessProbe: {httpGet: {path: /health, port: 8080}}
";

/// The pods of namespace `demo`, as `kubectl get pods -o json` lists them.
async fn pods(net: &Net) -> Vec<Value> {
    let (ok, out, err) = kubectl(net, &["get", "pods", "-n", "demo", "-o", "json"], None).await;
    assert!(ok, "{out}{err}");
    let list: Value = serde_json::from_str(&out).expect("JSON");
    list["items"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labelling_a_namespace_gives_its_new_pods_a_native_sidecar() {
    let net = Net::new(112);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    for c in shipped("deploy/base/injector.yaml", "MutatingWebhookConfiguration") {
        fake.apply(c);
    }
    fake.route_service(CP_NS, "minimesh-control-plane", net.addr(254, 15017));
    let webhook = net.addr(254, 15017).to_string();
    let _cp = control_plane(&net, &fake, "cp-0", 254, &["--webhook-addr", &webhook]).await;
    let config = fake
        .get(
            "admissionregistration.k8s.io/v1",
            "MutatingWebhookConfiguration",
            "",
            "minimesh-injector",
        )
        .expect("configuration");
    for hook in config["webhooks"].as_array().expect("webhooks") {
        assert!(
            hook["clientConfig"]["caBundle"].is_string(),
            "the CA is set before the control plane is ready: {config:#}"
        );
    }

    // Not labelled yet: the pod is created as written.
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: demo\n"),
    )
    .await;
    assert!(ok, "{out}{err}");
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(DEPLOYMENT)).await;
    assert!(ok, "{out}{err}");
    let before = pods(&net).await;
    assert_eq!(before.len(), 1, "{before:#?}");
    assert!(
        before[0]["spec"]["initContainers"].is_null(),
        "{:#}",
        before[0]
    );

    // Labelled: the next rollout's pod has the sidecar.
    let (ok, out, err) = kubectl(
        &net,
        &["label", "namespace", "demo", "minimesh.io/inject=enabled"],
        None,
    )
    .await;
    assert!(ok, "{out}{err}");
    assert_eq!(out.trim(), "namespace/demo labeled");
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some(&DEPLOYMENT.replace(
            "127.0.0.1:8080}",
            "127.0.0.1:8080}\n        - {name: VERSION, value: \"2\"}",
        )),
    )
    .await;
    assert!(ok, "{out}{err}");
    let after = pods(&net).await;
    assert_eq!(after.len(), 1, "the old pod is replaced: {after:#?}");
    let pod = &after[0];
    assert!(pod["metadata"]["generateName"].is_string(), "{pod:#}");
    // The init step first, with only the capabilities its rules need.
    let init = &pod["spec"]["initContainers"][0];
    assert_eq!(init["name"], "minimesh-init", "{pod:#}");
    assert_eq!(init["image"], "minimesh-init:dev");
    assert_eq!(
        init["securityContext"]["capabilities"],
        serde_json::json!({"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]})
    );
    let sidecar = &pod["spec"]["initContainers"][1];
    assert_eq!(sidecar["name"], "minimesh-sidecar", "{pod:#}");
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert_eq!(sidecar["image"], "minimesh:dev");
    assert_eq!(sidecar["securityContext"]["runAsUser"], 1337);
    let env = |c: &Value, name: &str| {
        c["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == name))
            .map(|v| v["value"].clone())
    };
    assert_eq!(
        env(sidecar, "MINIMESH_XDS_ADDR"),
        Some("http://minimesh-control-plane.minimesh-system.svc:15010".into())
    );
    // Its HTTP probe goes to the sidecar, which makes the original (so
    // that it passes under STRICT mutual TLS too).
    assert_eq!(
        pod["spec"]["containers"][0]["readinessProbe"]["httpGet"],
        serde_json::json!({"path": "/app-health/web/readyz", "port": 15000, "scheme": "HTTP"})
    );
    assert_eq!(
        env(sidecar, "MINIMESH_APP_PROBES"),
        Some(r#"{"/app-health/web/readyz":{"path":"/health","port":8080}}"#.into())
    );
    // The app's container as written: capture needs no proxy settings.
    assert_eq!(env(&pod["spec"]["containers"][0], "HTTP_PROXY"), None);
    assert_eq!(
        pod["spec"]["containers"][0]["env"],
        serde_json::json!([{"name": "LISTEN_ADDR", "value": "127.0.0.1:8080"}, {"name": "VERSION", "value": "2"}])
    );
    assert_eq!(
        pod["metadata"]["annotations"]["minimesh.io/injected"],
        "true"
    );
    // This app sets no security context (Pod Security would refuse it for
    // that under restricted), but nothing minimesh added is refused but for
    // the init step's documented exception.
    let ours: Vec<String> = crate::pod_security::restricted_violations(pod)
        .into_iter()
        .filter(|v| v.contains("minimesh-"))
        .collect();
    assert_eq!(ours, crate::pod_security::init_step_exception(0), "{pod:#}");

    // The book's apps as the demo ships them (deploy/examples/demo/apps.yaml:
    // apps on 0.0.0.0:8080, Services targeting 8080, a readiness probe),
    // applied unchanged with the real kubectl: each pod, created by its
    // ReplicaSet with only a generateName, gets the init step and the
    // sidecar, its app container as written but for the probe.
    let apps = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples/demo/apps.yaml"),
    )
    .expect("apps.yaml");
    let (ok, out, err) = kubectl(&net, &["apply", "-n", "demo", "-f", "-"], Some(&apps)).await;
    assert!(ok, "{out}{err}");
    let book: Vec<Value> = pods(&net)
        .await
        .into_iter()
        .filter(|p| {
            p["metadata"]["labels"]["app"]
                .as_str()
                .is_some_and(|a| a.starts_with("simple-"))
        })
        .collect();
    assert_eq!(
        book.len(),
        4,
        "simple-web and three simple-backends: {book:#?}"
    );
    for pod in &book {
        let generated = pod["metadata"]["generateName"]
            .as_str()
            .expect("generateName");
        assert!(
            pod["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with(generated)),
            "{pod:#}"
        );
        let init = &pod["spec"]["initContainers"][0];
        assert_eq!(init["name"], "minimesh-init");
        assert_eq!(
            init["securityContext"]["capabilities"],
            serde_json::json!({"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]})
        );
        assert_eq!(pod["spec"]["initContainers"][1]["name"], "minimesh-sidecar");
        let app = &pod["spec"]["containers"][0];
        assert_eq!(env(app, "LISTEN_ADDR"), Some("0.0.0.0:8080".into()));
        assert_eq!(env(app, "HTTP_PROXY"), None);
        assert_eq!(app["readinessProbe"]["httpGet"]["port"], 15000, "{pod:#}");
        // Pod Security's restricted profile: refused for the init step
        // alone (root with NET_ADMIN and NET_RAW, as Istio's).
        assert_eq!(
            crate::pod_security::restricted_violations(pod),
            crate::pod_security::init_step_exception(0),
            "{pod:#}"
        );
    }

    // Without capture (the explicit mode: no init step), the same apps
    // injected meet the restricted profile whole.
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: explicit\n  labels: {minimesh.io/inject: enabled}\n"),
    )
    .await;
    assert!(ok, "{out}{err}");
    let explicit = apps.replace(
        "  template:\n    metadata:\n",
        "  template:\n    metadata:\n      annotations:\n        minimesh.io/capture: disabled\n",
    );
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-n", "explicit", "-f", "-"],
        Some(&explicit),
    )
    .await;
    assert!(ok, "{out}{err}");
    let (ok, out, err) =
        kubectl(&net, &["get", "pods", "-n", "explicit", "-o", "json"], None).await;
    assert!(ok, "{out}{err}");
    let list: Value = serde_json::from_str(&out).expect("JSON");
    let explicit_pods = list["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(explicit_pods.len(), 4, "{explicit_pods:#?}");
    for pod in &explicit_pods {
        assert_eq!(
            pod["spec"]["initContainers"][0]["name"], "minimesh-sidecar",
            "{pod:#}"
        );
        assert_eq!(
            crate::pod_security::restricted_violations(pod),
            Vec::<String>::new(),
            "{pod:#}"
        );
    }

    // A namespace labelled for Istio's injection too: its pods would get two
    // sidecars. Refused, saying why, with a Warning Event on the namespace.
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: both\n  labels: {minimesh.io/inject: enabled, istio-injection: enabled}\n"),
    )
    .await;
    assert!(ok, "{out}{err}");
    let bare = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  namespace: both\nspec:\n  containers:\n  - {name: web, image: minimesh:dev}\n";
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(bare)).await;
    assert!(!ok, "{out}{err}");
    assert!(
        err.contains("admission webhook \"istio-injection.conflict.injection.minimesh.io\" denied the request: namespace both is labelled for sidecar injection by both Istio (istio-injection=enabled or istio.io/rev) and minimesh (minimesh.io/inject=enabled): its pods would get two sidecars; remove one of the labels"),
        "{err}"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let event = loop {
        let found = fake
            .list("events.k8s.io/v1", "Event")
            .into_iter()
            .find(|e| e["reason"] == "TwoMeshesInject");
        if let Some(e) = found {
            break e;
        }
        assert!(std::time::Instant::now() < deadline, "no Event");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(event["type"], "Warning", "{event:#}");
    assert_eq!(event["regarding"]["kind"], "Namespace", "{event:#}");
    assert_eq!(event["regarding"]["name"], "both", "{event:#}");
    assert_eq!(
        event["reportingController"], "minimesh-control-plane",
        "{event:#}"
    );
    // A pod opted out of Istio's injection there is minimesh's alone.
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some(&bare.replace(
            "  namespace: both\n",
            "  namespace: both\n  labels: {sidecar.istio.io/inject: \"false\"}\n",
        )),
    )
    .await;
    assert!(ok, "{out}{err}");

    // A pod labelled out is left alone, in the labelled namespace.
    let opted_out = DEPLOYMENT
        .replace("name: web\n", "name: db\n")
        .replace("{app: web}", "{app: db, minimesh.io/inject: disabled}");
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(&opted_out)).await;
    assert!(ok, "{out}{err}");
    let db = pods(&net)
        .await
        .into_iter()
        .find(|p| p["metadata"]["labels"]["app"] == "db")
        .expect("db's pod");
    assert!(db["spec"]["initContainers"].is_null(), "{db:#}");

    // What the real webhook made validates strictly.
    let file = net.dir.join("injected-pod.json");
    std::fs::write(&file, serde_json::to_string_pretty(pod).expect("json")).expect("write");
    let (ok, out) = crate::deploy::validate(&[&file]);
    assert!(ok, "{out}");
}

#[test]
fn the_shipped_pods_meet_the_restricted_pod_security_standard() {
    let mut checked = 0;
    for (file, kind) in [
        ("deploy/base/control-plane.yaml", "Deployment"),
        ("deploy/examples/demo/apps.yaml", "Deployment"),
        ("deploy/examples/demo/ingress-gateway.yaml", "Deployment"),
    ] {
        for workload in shipped(file, kind) {
            assert_eq!(
                crate::pod_security::restricted_violations(&workload),
                Vec::<String>::new(),
                "{file}: {}",
                workload["metadata"]["name"]
            );
            checked += 1;
        }
    }
    assert_eq!(
        checked, 5,
        "the control plane, simple-web, simple-backend-1 and -2, the ingress gateway"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_created_while_a_replica_restarts_are_never_refused() {
    let net = Net::new(122);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    for c in shipped("deploy/base/injector.yaml", "MutatingWebhookConfiguration") {
        fake.apply(c);
    }
    let webhook = |host: u8| net.addr(host, 15017).to_string();
    let drain = ["--termination-drain", "3s"];
    let mut cp0 = control_plane(
        &net,
        &fake,
        "cp-0",
        254,
        &[&["--webhook-addr", &webhook(254)][..], &drain].concat(),
    )
    .await;
    let _cp1 = control_plane(
        &net,
        &fake,
        "cp-1",
        253,
        &[&["--webhook-addr", &webhook(253)][..], &drain].concat(),
    )
    .await;
    fake.route_service(CP_NS, "minimesh-control-plane", net.addr(254, 15017));
    let (ok, out, err) = kubectl(
        &net,
        &["apply", "-f", "-"],
        Some("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: demo\n  labels: {minimesh.io/inject: enabled}\n"),
    )
    .await;
    assert!(ok, "{out}{err}");
    // The endpoints controller: once cp-0 is not ready, its address leaves
    // the Service half a second later (endpoint propagation).
    let endpoints = {
        let fake = fake.clone();
        let (ready, next) = (net.addr(254, 15014), net.addr(253, 15017));
        tokio::spawn(async move {
            loop {
                let up = tokio::time::timeout(
                    Duration::from_secs(1),
                    get(ready, "localhost", "/readyz"),
                )
                .await
                .is_ok_and(|r| r.is_ok_and(|(code, _, _)| code == 200));
                if !up {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    fake.route_service(CP_NS, "minimesh-control-plane", next);
                    return Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    // Pods in a loop; cp-0 is sent SIGTERM after the fifth, and the loop
    // goes on until it has exited and five more pods were created.
    let (mut created, mut after_exit, mut signalled) = (0, 0, None);
    while after_exit < 5 {
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p-{created}\n  namespace: demo\nspec:\n  containers:\n  - {{name: app, image: app:1}}\n"
        );
        let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(&pod)).await;
        assert!(ok, "pod {created} refused: {out}{err}\n{}", cp0.log_text());
        created += 1;
        if created == 5 {
            cp0.signal("TERM");
            signalled = Some(Instant::now());
        }
        if signalled.is_some() && cp0.child.try_wait().expect("try_wait").is_some() {
            after_exit += 1;
        }
        assert!(created < 500, "cp-0 never exited: {}", cp0.log_text());
    }
    let status = cp0.exited(Duration::from_secs(1)).await;
    assert!(status.success(), "{status}: {}", cp0.log_text());
    // It stayed up, answering, until well after the endpoints dropped it.
    let dropped = endpoints.await.expect("endpoints");
    let signalled = signalled.expect("signalled");
    assert!(
        dropped - signalled < Duration::from_secs(2),
        "not ready at once"
    );
    assert!(
        cp0.log_text().contains("shutting down: not ready"),
        "{}",
        cp0.log_text()
    );
    // Every pod was injected: by cp-0 while it drained, by cp-1 after.
    let (ok, out, err) = kubectl(&net, &["get", "pods", "-n", "demo", "-o", "json"], None).await;
    assert!(ok, "{out}{err}");
    let list: Value = serde_json::from_str(&out).expect("JSON");
    let pods = list["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(pods.len(), created, "{out}");
    for p in &pods {
        assert_eq!(
            p["metadata"]["annotations"]["minimesh.io/injected"], "true",
            "{p:#}"
        );
    }
}
