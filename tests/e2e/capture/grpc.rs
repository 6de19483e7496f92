//! gRPC over h2c through capture, balanced per call.

use super::{assert_network_gone, cannot_run, stdout_of, Captured};
use crate::harness::*;

/// gRPC servers (grpcio, unchanged: they listen on 0.0.0.0:8080 and know
/// nothing of the mesh) behind capture, and a grpcio client in another pod
/// dialing the Service by name with no proxy settings: one HTTP/2
/// connection, yet every call is balanced by the rule.
const GRPC: &str = r#"
apiVersion: minimesh.io/v1alpha1
kind: LocalMesh
metadata:
  name: grpc
spec:
  namespace: default
  services:
  - name: greeter
    appProtocol: grpc
    deployments:
    - name: greeter
      replicas: 3
      command: [sh, -c, 'exec python3 "$GRPC_MESH" server "$POD_NAME" 0.0.0.0:8080']
      env:
        GRPC_MESH: "@GRPC_MESH@"
  - name: client
    deployments:
    - name: client
"#;

const GRPC_ROUND_ROBIN: &str = r#"
apiVersion: minimesh.io/v1alpha1
kind: DestinationRule
metadata:
  name: greeter
  namespace: default
spec:
  host: greeter
  trafficPolicy:
    loadBalancer:
      simple: ROUND_ROBIN
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_h2c_through_capture_is_balanced_per_call() {
    if cannot_run().is_some() {
        return;
    }
    crate::grpc_interop::grpcio().await;
    let net = Net::new(143);
    let script = path_str(&crate::grpc_interop::interop("grpc_mesh.py"));
    let c = Captured::start(&net, &GRPC.replace("@GRPC_MESH@", &script)).await;
    c.apply(&net.dir, "rr.yaml", GRPC_ROUND_ROBIN);
    // The lab has no DNS server, only each namespace's /etc/hosts: gRPC's
    // own resolver (c-ares) asks DNS, the system's reads the file.
    let out = stdout_of(
        c.exec("client-0", "python3")
            .env("GRPC_DNS_RESOLVER", "native")
            .args([&script, "who", "greeter:80", "greeter", "60"]),
    );
    assert_eq!(out, "who: greeter-0=20 greeter-1=20 greeter-2=20\n");
    let k = c.stop().await;
    assert_network_gone(k);
}
