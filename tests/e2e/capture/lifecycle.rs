//! A capture mesh's life: refused clearly without root, what a killed
//! mesh left removed at the next start, every golden rule file accepted by
//! nft.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{assert_network_gone, cannot_run, stdout_of, Captured, STARTS};
use crate::harness::*;

/// Without root, `minimesh up --capture` refuses at once and says why.
#[test]
fn without_root_capture_is_refused_clearly() {
    if cannot_run().is_some() {
        return;
    }
    use std::os::unix::process::CommandExt;
    let dir = std::env::temp_dir().join(format!("minimesh-capture-nonroot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let topology = dir.join("topology.yaml");
    std::fs::write(&topology, SMALL).expect("topology");
    let mut perms = std::fs::metadata(&dir).expect("dir").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o777);
    std::fs::set_permissions(&dir, perms).expect("chmod");
    let out = Command::new(bin("minimesh"))
        .args([
            "--home",
            &path_str(&dir.join("home")),
            "up",
            &path_str(&topology),
            "--capture",
        ])
        .uid(65534)
        .gid(65534)
        .output()
        .expect("minimesh up");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--capture needs root: it makes network namespaces and writes nftables rules (run as root, or without --capture for the loopback mesh)"),
        "{err}"
    );
}

const SMALL: &str = r#"
apiVersion: minimesh.io/v1alpha1
kind: LocalMesh
metadata:
  name: small
spec:
  namespace: default
  services:
  - name: echo
    deployments:
    - name: echo
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_killed_mesh_left_is_removed_at_the_next_start() {
    if cannot_run().is_some() {
        return;
    }
    let net = Net::new(142);
    let c = Captured::start(&net, SMALL).await;
    let k = c.network;
    let home = c.home.clone();
    let mut up = c.up;
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(&home).join("mesh.json")).expect("mesh.json"),
    )
    .expect("json");
    // No other test's start may clean up before this test's next one, nor
    // take the indexes before the end checks they are gone.
    let exclusive = STARTS.write().await;
    // SIGKILL: no chance to clean up; its children exit with it.
    up.kill();
    let netns = stdout_of(Command::new("ip").args(["netns", "list"]));
    assert!(netns.contains(&format!("mm{k}-echo-0")), "{netns}");
    // Its processes see their parent gone within a quarter of a second.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for pid in state["pids"].as_object().expect("pids").values() {
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "process {pid} outlived its mesh"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let again = Captured::start_alone(&net, SMALL).await;
    let err = std::fs::read_to_string(net.dir.join("logs/up.err")).unwrap_or_default();
    assert!(
        err.contains(&format!(
            "removed pod network {k} left by a minimesh up that was killed"
        )),
        "{err}"
    );
    let code = stdout_of(again.exec("echo-0", "curl").args([
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "http://echo/",
    ]));
    assert_eq!(code, "200");
    let k2 = again.stop().await;
    // Checked before any other start may take the indexes again.
    assert_network_gone(k);
    assert_network_gone(k2);
    drop(exclusive);
}

/// Every golden rule file (`sidecar/src/capture/testdata`) is a script
/// the kernel's nftables takes (checked, not applied).
#[test]
fn every_golden_rule_file_is_accepted_by_nft() {
    if cannot_run().is_some() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sidecar/src/capture/testdata");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("testdata") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "nft") {
            let out = Command::new("nft")
                .args(["-c", "-f"])
                .arg(&path)
                .output()
                .expect("nft");
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "{checked} golden files");
}
