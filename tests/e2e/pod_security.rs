//! The Pod Security Standards' `restricted` profile (which includes
//! `baseline`), written from the Kubernetes page "Pod Security Standards",
//! control by control, as the admission controller applies it to a Pod or a
//! workload's pod template: what a namespace labelled
//! `pod-security.kubernetes.io/enforce: restricted` would refuse. Each
//! control is checked on every container, init container and ephemeral
//! container, and the answer names the container, the field and the value.

use serde_json::Value;

/// The sysctls `baseline` calls safe.
const SAFE_SYSCTLS: [&str; 10] = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
];

/// The volume types `restricted` allows.
const RESTRICTED_VOLUMES: [&str; 8] = [
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];

/// SELinux types `baseline` allows.
const SELINUX_TYPES: [&str; 5] = [
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
];

/// Every way `pod` (a Pod, or an object with `spec.template`) breaks the
/// `restricted` profile, as "<where>: <field> <why>"; empty when it passes.
pub fn restricted_violations(pod: &Value) -> Vec<String> {
    let (meta, spec) = match pod["spec"]["template"].is_object() {
        true => (
            &pod["spec"]["template"]["metadata"],
            &pod["spec"]["template"]["spec"],
        ),
        false => (&pod["metadata"], &pod["spec"]),
    };
    let mut out = Vec::new();
    let psc = &spec["securityContext"];
    // baseline: host namespaces, hostProcess, hostPath, sysctls, pod-level profiles.
    for field in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[field] == true {
            out.push(format!("pod: spec.{field} must be unset or false"));
        }
    }
    if psc["windowsOptions"]["hostProcess"] == true {
        out.push("pod: securityContext.windowsOptions.hostProcess must be unset or false".into());
    }
    for v in spec["volumes"].as_array().into_iter().flatten() {
        let name = v["name"].as_str().unwrap_or("?");
        if v["hostPath"].is_object() {
            out.push(format!("volume {name}: hostPath is not allowed"));
        }
        // restricted: only the listed volume types.
        let kind = v
            .as_object()
            .and_then(|o| o.keys().find(|k| k.as_str() != "name"))
            .map(String::as_str)
            .unwrap_or("");
        if !RESTRICTED_VOLUMES.contains(&kind) {
            out.push(format!("volume {name}: type {kind} is not allowed"));
        }
    }
    for s in psc["sysctls"].as_array().into_iter().flatten() {
        let name = s["name"].as_str().unwrap_or("");
        if !SAFE_SYSCTLS.contains(&name) {
            out.push(format!(
                "pod: securityContext.sysctls {name} is not a safe sysctl"
            ));
        }
    }
    check_profiles("pod", psc, &mut out);
    for (key, value) in meta["annotations"].as_object().into_iter().flatten() {
        if key.starts_with("container.apparmor.security.beta.kubernetes.io/") {
            let v = value.as_str().unwrap_or("");
            if v != "runtime/default" && !v.starts_with("localhost/") {
                out.push(format!("pod: annotation {key} {v} is not allowed"));
            }
        }
    }
    let pod_non_root = psc["runAsNonRoot"] == true;
    let pod_seccomp = matches!(
        psc["seccompProfile"]["type"].as_str(),
        Some("RuntimeDefault" | "Localhost")
    );
    if psc["runAsUser"] == 0 {
        out.push("pod: securityContext.runAsUser must not be 0".into());
    }
    for list in ["initContainers", "containers", "ephemeralContainers"] {
        for (i, c) in spec[list].as_array().into_iter().flatten().enumerate() {
            let at = format!("{list}[{i}] {}", c["name"].as_str().unwrap_or("?"));
            let sc = &c["securityContext"];
            // baseline
            if sc["privileged"] == true {
                out.push(format!(
                    "{at}: securityContext.privileged must be unset or false"
                ));
            }
            if sc["windowsOptions"]["hostProcess"] == true {
                out.push(format!(
                    "{at}: securityContext.windowsOptions.hostProcess must be unset or false"
                ));
            }
            for p in c["ports"].as_array().into_iter().flatten() {
                if p["hostPort"].as_u64().is_some_and(|h| h != 0) {
                    out.push(format!(
                        "{at}: ports[].hostPort {} is not allowed",
                        p["hostPort"]
                    ));
                }
            }
            if sc["procMount"].as_str().is_some_and(|m| m != "Default") {
                out.push(format!("{at}: securityContext.procMount must be Default"));
            }
            check_profiles(&at, sc, &mut out);
            // restricted
            if sc["allowPrivilegeEscalation"] != false {
                out.push(format!(
                    "{at}: securityContext.allowPrivilegeEscalation must be false"
                ));
            }
            let non_root = match &sc["runAsNonRoot"] {
                Value::Bool(b) => *b,
                _ => pod_non_root,
            };
            if !non_root {
                out.push(format!("{at}: securityContext.runAsNonRoot must be true"));
            }
            if sc["runAsUser"] == 0 {
                out.push(format!("{at}: securityContext.runAsUser must not be 0"));
            }
            let seccomp = match sc["seccompProfile"]["type"].as_str() {
                Some(t) => matches!(t, "RuntimeDefault" | "Localhost"),
                None => pod_seccomp,
            };
            if !seccomp {
                out.push(format!(
                    "{at}: securityContext.seccompProfile.type must be RuntimeDefault or Localhost"
                ));
            }
            let caps = &sc["capabilities"];
            let drops_all = caps["drop"]
                .as_array()
                .is_some_and(|d| d.iter().any(|c| c == "ALL"));
            if !drops_all {
                out.push(format!(
                    "{at}: securityContext.capabilities.drop must include ALL"
                ));
            }
            for add in caps["add"].as_array().into_iter().flatten() {
                let cap = add.as_str().unwrap_or("");
                // baseline allows a few more; restricted only this one.
                if cap != "NET_BIND_SERVICE" {
                    out.push(format!(
                        "{at}: securityContext.capabilities.add {cap} is not allowed"
                    ));
                }
            }
        }
    }
    out
}

/// The seccomp, AppArmor and SELinux settings of a pod's or a container's
/// security context (baseline).
fn check_profiles(at: &str, sc: &Value, out: &mut Vec<String>) {
    if sc["seccompProfile"]["type"] == "Unconfined" {
        out.push(format!(
            "{at}: securityContext.seccompProfile.type must not be Unconfined"
        ));
    }
    if sc["appArmorProfile"]["type"] == "Unconfined" {
        out.push(format!(
            "{at}: securityContext.appArmorProfile.type must not be Unconfined"
        ));
    }
    let se = &sc["seLinuxOptions"];
    if !SELINUX_TYPES.contains(&se["type"].as_str().unwrap_or("")) {
        out.push(format!(
            "{at}: securityContext.seLinuxOptions.type {} is not allowed",
            se["type"]
        ));
    }
    for field in ["user", "role"] {
        if se[field].as_str().is_some_and(|v| !v.is_empty()) {
            out.push(format!(
                "{at}: securityContext.seLinuxOptions.{field} must be unset"
            ));
        }
    }
}

/// What `restricted` refuses in capture's init step, and only there: the
/// documented exception (docs/kubernetes.md), as Istio's `istio-init`.
pub fn init_step_exception(index: usize) -> Vec<String> {
    let at = format!("initContainers[{index}] minimesh-init");
    vec![
        format!("{at}: securityContext.runAsNonRoot must be true"),
        format!("{at}: securityContext.runAsUser must not be 0"),
        format!("{at}: securityContext.capabilities.add NET_ADMIN is not allowed"),
        format!("{at}: securityContext.capabilities.add NET_RAW is not allowed"),
    ]
}

#[test]
fn the_checks_give_the_pod_security_pages_answers() {
    use serde_json::json;
    // The page's example of a restricted pod passes.
    let good = json!({
        "metadata": {"name": "ok"},
        "spec": {
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "volumes": [{"name": "t", "projected": {"sources": []}}, {"name": "e", "emptyDir": {}}],
            "containers": [{
                "name": "app",
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
                }
            }]
        }
    });
    assert_eq!(restricted_violations(&good), Vec::<String>::new());
    // One breach per control, each named.
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"hostNetwork": true}),
            "pod: spec.hostNetwork must be unset or false",
        ),
        (
            json!({"hostPID": true}),
            "pod: spec.hostPID must be unset or false",
        ),
        (
            json!({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}),
            "volume h: hostPath is not allowed",
        ),
        (
            json!({"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}),
            "volume n: type nfs is not allowed",
        ),
        (
            json!({"securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}, "sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}),
            "pod: securityContext.sysctls kernel.msgmax is not a safe sysctl",
        ),
        (
            json!({"securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "Unconfined"}}}),
            "pod: securityContext.seccompProfile.type must not be Unconfined",
        ),
    ];
    for (spec_part, want) in cases {
        let mut pod = good.clone();
        for (k, v) in spec_part.as_object().expect("object") {
            pod["spec"][k] = v.clone();
        }
        let got = restricted_violations(&pod);
        assert!(got.iter().any(|g| g == want), "{want}: {got:#?}");
    }
    let container_cases: Vec<(Value, &str)> = vec![
        (
            json!({"privileged": true}),
            "securityContext.privileged must be unset or false",
        ),
        (
            json!({"allowPrivilegeEscalation": true}),
            "securityContext.allowPrivilegeEscalation must be false",
        ),
        (
            json!({"runAsNonRoot": false}),
            "securityContext.runAsNonRoot must be true",
        ),
        (
            json!({"runAsUser": 0}),
            "securityContext.runAsUser must not be 0",
        ),
        (
            json!({"capabilities": {"drop": ["NET_RAW"]}}),
            "securityContext.capabilities.drop must include ALL",
        ),
        (
            json!({"capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}),
            "securityContext.capabilities.add CHOWN is not allowed",
        ),
        (
            json!({"procMount": "Unmasked"}),
            "securityContext.procMount must be Default",
        ),
        (
            json!({"seLinuxOptions": {"type": "spc_t"}}),
            "securityContext.seLinuxOptions.type \"spc_t\" is not allowed",
        ),
    ];
    for (sc_part, want) in container_cases {
        let mut pod = good.clone();
        for (k, v) in sc_part.as_object().expect("object") {
            pod["spec"]["containers"][0]["securityContext"][k] = v.clone();
        }
        let got = restricted_violations(&pod);
        let want = format!("containers[0] app: {want}");
        assert!(got.contains(&want), "{want}: {got:#?}");
    }
    // The pod-level seccomp and non-root settings stand for containers that
    // set none; without them each container must.
    let mut bare = good.clone();
    bare["spec"]["securityContext"] = json!({});
    let got = restricted_violations(&bare);
    assert_eq!(
        got,
        vec![
            "containers[0] app: securityContext.runAsNonRoot must be true",
            "containers[0] app: securityContext.seccompProfile.type must be RuntimeDefault or Localhost",
        ]
    );
    // A workload's pod template is read as its pod.
    let deployment = json!({"kind": "Deployment", "spec": {"template": bare}});
    assert_eq!(restricted_violations(&deployment), got);
}
