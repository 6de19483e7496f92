//! What `minimesh up` prints once the mesh is up: what runs where.

use std::collections::BTreeMap;

use super::{MeshState, Pod};

/// Prints what runs where.
pub fn print_summary(s: &MeshState) {
    println!("mesh {:?} is up (namespace {}):", s.name, s.namespace);
    println!(
        "  control plane   xds {}  admin http://{}",
        s.control_plane_xds, s.control_plane_admin
    );
    if let (Some(i), Some(a)) = (s.ingress, s.ingress_admin) {
        println!("  ingress         http://{i}  admin http://{a}");
    }
    let mut by_svc: BTreeMap<&str, Vec<&Pod>> = BTreeMap::new();
    for p in &s.pods {
        by_svc.entry(&p.service).or_default().push(p);
    }
    for (svc, pods) in by_svc {
        for p in pods {
            let netns = s
                .capture
                .as_ref()
                .and_then(|c| c.namespaces.get(&p.name))
                .map_or(String::new(), |n| format!("  netns {n}"));
            println!(
                "  {svc:<15} pod {:<20} endpoint {}:{}  app {}  sidecar admin http://{}{netns}",
                p.name,
                p.ip,
                p.port,
                p.app(),
                p.admin()
            );
        }
    }
    if let Some(c) = &s.capture {
        for (svc, ip) in &c.service_ips {
            println!("  {svc:<15} service IP {ip}");
        }
        println!(
            "Pods are network namespaces (`ip netns exec NETNS curl http://SERVICE/`); their traffic is captured (docs/capture.md)."
        );
    }
    println!("  config dir      {}", s.config_dir.display());
    match s.restart_after_ms {
        Some(ms) => println!(
            "A process that exits is started again after {}s (--restart-after); try `minimesh kill POD`.",
            ms as f64 / 1000.0
        ),
        None => println!("A process that exits stays down (--restart-after never); try `minimesh kill POD`."),
    }
    println!("Ctrl-C stops everything.");
}
