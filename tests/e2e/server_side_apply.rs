//! `kubectl apply --server-side` against the fake API server, as the real
//! server answers it: fields have owners; an apply that would change
//! another manager's field is refused 409 naming the manager and the field,
//! unless forced; the same value is shared; client-side apply's fields pass
//! to the server-side applier.

use crate::admission::kubectl;
use crate::fake_kube::FakeKube;
use crate::harness::*;

/// A rule whose policy is `simple`.
fn rule(name: &str, simple: &str) -> String {
    format!(
        "apiVersion: minimesh.io/v1alpha1\nkind: DestinationRule\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  host: backend\n  trafficPolicy:\n    loadBalancer:\n      simple: {simple}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_over_another_managers_field_is_refused_unless_forced() {
    let net = Net::new(152);
    let fake = FakeKube::start(net.addr(250, 6443)).await;
    fake.write_kubeconfig(&net.dir.join("kubeconfig"));
    let apply = |manager: &'static str, yaml: String, force: bool| {
        let net = &net;
        async move {
            let mut args = vec!["apply", "--server-side", "--field-manager", manager];
            if force {
                args.push("--force-conflicts");
            }
            args.extend(["-f", "-"]);
            kubectl(net, &args, Some(&yaml)).await
        }
    };
    let simple = || {
        fake.get("minimesh.io/v1alpha1", "DestinationRule", NS, "shared")
            .expect("the rule")["spec"]["trafficPolicy"]["loadBalancer"]["simple"]
            .clone()
    };

    let (ok, out, err) = apply("team-a", rule("shared", "RANDOM"), false).await;
    assert!(ok, "{out}{err}");
    // The same value from another manager: shared, no conflict.
    let (ok, out, err) = apply("team-b", rule("shared", "RANDOM"), false).await;
    assert!(ok, "{out}{err}");
    // Another value: refused, naming team-a and the field (team-b shares it).
    let (ok, _, err) = apply("team-c", rule("shared", "ROUND_ROBIN"), false).await;
    assert!(!ok);
    assert!(
        err.starts_with("error: Apply failed with 2 conflicts: conflicts with \"team-a\":\n- .spec.trafficPolicy.loadBalancer.simple\nconflicts with \"team-b\":\n- .spec.trafficPolicy.loadBalancer.simple\n"),
        "{err}"
    );
    assert_eq!(simple(), "RANDOM");
    // Forced: team-c takes the field; team-a's old value is now the conflict.
    let (ok, out, err) = apply("team-c", rule("shared", "ROUND_ROBIN"), true).await;
    assert!(ok, "{out}{err}");
    assert_eq!(simple(), "ROUND_ROBIN");
    let (ok, _, err) = apply("team-a", rule("shared", "RANDOM"), false).await;
    assert!(!ok);
    assert!(
        err.starts_with("error: Apply failed with 1 conflict: conflict with \"team-c\": .spec.trafficPolicy.loadBalancer.simple\n"),
        "{err}"
    );

    // A rule kubectl applied client-side: a server-side apply that changes
    // it goes through (kubectl migrates the client-side manager's fields
    // to the applier), and a later update by another tool is a conflict
    // naming that tool, its API version and when.
    let (ok, out, err) = kubectl(&net, &["apply", "-f", "-"], Some(&rule("csa", "RANDOM"))).await;
    assert!(ok, "{out}{err}");
    let (ok, out, err) = apply("kubectl", rule("csa", "LEAST_REQUEST"), false).await;
    assert!(ok, "{out}{err}");
    let (ok, out, err) = kubectl(
        &net,
        &[
            "patch",
            "destinationrule.minimesh.io",
            "csa",
            "--type",
            "merge",
            "-p",
            "{\"spec\":{\"host\":\"frontend\"}}",
        ],
        None,
    )
    .await;
    assert!(ok, "{out}{err}");
    let (ok, _, err) = apply("kubectl", rule("csa", "LEAST_REQUEST"), false).await;
    assert!(!ok);
    assert!(
        err.starts_with("error: Apply failed with 1 conflict: conflict with \"kubectl-patch\" using minimesh.io/v1alpha1 at "),
        "{err}"
    );
    assert!(err.contains(": .spec.host\n"), "{err}");
}
