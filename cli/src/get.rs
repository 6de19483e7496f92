//! `minimesh get rules|routes|endpoints|proxies`: tables from the control plane's
//! admin API (`-o json` for the raw view).

use std::path::PathBuf;

use crate::http::get_json;
use crate::mesh::MeshState;

/// What to show.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum What {
    /// DestinationRules with status, and rejected config.
    Rules,
    /// VirtualServices (each route: match, destinations), Gateways and
    /// HTTPRoutes (their conditions per parent), with status, and the
    /// rejected ones.
    Routes,
    /// Endpoints per cluster with policy, protocol, weight, zone and health.
    Endpoints,
    /// Connected proxies and the versions they ACKed (like istioctl proxy-status).
    Proxies,
}

/// `minimesh get` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct GetArgs {
    /// rules, routes, endpoints or proxies.
    pub what: What,
    /// `table` or `json`.
    #[arg(short, long, default_value = "table", value_parser = ["table", "json"])]
    pub output: String,
    /// Admin address of the control plane to ask (host:port), for one not
    /// started by `minimesh up`; default: the local mesh's, from --home.
    #[arg(long, env = "MINIMESH_CONTROL_PLANE_ADMIN")]
    pub control_plane_admin: Option<std::net::SocketAddr>,
}

/// The control plane's admin address: `flag`, or the local mesh's.
pub fn admin_addr(
    home: &std::path::Path,
    flag: Option<std::net::SocketAddr>,
) -> anyhow::Result<String> {
    match flag {
        Some(a) => Ok(a.to_string()),
        None => Ok(MeshState::load(home)?.control_plane_admin.to_string()),
    }
}

/// `minimesh get`.
pub async fn run(home: PathBuf, args: GetArgs) -> anyhow::Result<()> {
    let admin = admin_addr(&home, args.control_plane_admin)?;
    let path = match args.what {
        What::Rules | What::Routes => "/debug/config",
        What::Endpoints => "/debug/endpoints",
        What::Proxies => "/debug/proxies",
    };
    let v = get_json(&admin, path).await?;
    if args.output == "json" {
        println!("{v:#}");
        return Ok(());
    }
    let s = |v: &serde_json::Value| {
        v.as_str()
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string())
    };
    match args.what {
        What::Rules => {
            println!(
                "{:<16} {:<24} {:<48} {:<14} {:<9} MESSAGE",
                "NAMESPACE", "NAME", "HOST", "POLICY", "ACCEPTED"
            );
            for r in v["rules"].as_array().into_iter().flatten() {
                println!(
                    "{:<16} {:<24} {:<48} {:<14} {:<9} {}",
                    s(&r["namespace"]),
                    s(&r["name"]),
                    s(&r["host"]),
                    s(&r["policy"]),
                    s(&r["accepted"]),
                    s(&r["message"])
                );
                for (port, policy) in r["portPolicies"].as_object().into_iter().flatten() {
                    println!("  port {port}: {}", s(policy));
                }
                for w in r["warnings"].as_array().into_iter().flatten() {
                    println!("  warning: {}", s(w));
                }
            }
            let scope: Vec<_> = v["ruleScope"].as_array().into_iter().flatten().collect();
            if !scope.is_empty() {
                // Istio's lookup: the caller's namespace, then the service's,
                // then the root namespace's, as each rule's exportTo allows.
                println!("\n{:<40} {:<20} RULE", "SERVICE", "CALLERS IN");
                for sv in scope {
                    for c in sv["callers"].as_array().into_iter().flatten() {
                        let callers = match s(&c["namespace"]) {
                            ns if ns == "*" => "(other namespaces)".to_string(),
                            ns => ns,
                        };
                        let rule = match &c["rule"] {
                            serde_json::Value::Null => "(none: defaults)".to_string(),
                            r => s(r),
                        };
                        println!("{:<40} {callers:<20} {rule}", s(&sv["service"]));
                    }
                }
            }
            let errors: Vec<_> = v["errors"].as_array().into_iter().flatten().collect();
            if !errors.is_empty() {
                println!("\nREJECTED (the previous good version of each stays in force):");
                for e in errors {
                    println!("  {}", s(&e["message"]));
                }
            }
        }
        What::Routes => routes_table(&v),
        What::Endpoints => {
            println!(
                "{:<48} {:<14} {:<9} {:<22} {:<24} {:<7} {:<10} HEALTH",
                "CLUSTER", "POLICY", "PROTOCOL", "ENDPOINT", "POD", "WEIGHT", "ZONE"
            );
            for (cluster, c) in v.as_object().into_iter().flatten() {
                // A star marks clusters whose sidecars prefer their own zone.
                let policy = format!(
                    "{}{}",
                    s(&c["policy"]),
                    if c["zoneFailover"] == true { "*" } else { "" }
                );
                for e in c["endpoints"].as_array().into_iter().flatten() {
                    let zone = s(&e["zone"]);
                    println!(
                        "{cluster:<48} {policy:<14} {:<9} {:<22} {:<24} {:<7} {:<10} {}",
                        s(&c["protocol"]),
                        s(&e["address"]),
                        s(&e["pod"]),
                        s(&e["weight"]),
                        if zone.is_empty() { "-" } else { zone.as_str() },
                        s(&e["health"])
                    );
                }
            }
            if v.as_object()
                .into_iter()
                .flatten()
                .any(|(_, c)| c["zoneFailover"] == true)
            {
                println!("\n* zone failover: each sidecar prefers endpoints in its own zone (localityLbSetting)");
            }
        }
        What::Proxies => {
            println!(
                "{:<36} {:<13} {:<40} {:<40} {:<40} LAST NACK",
                "NAME", "STREAM", "CLUSTERS", "ENDPOINTS", "ROUTES"
            );
            for p in v.as_array().into_iter().flatten() {
                let t = |name: &str| {
                    let st = &p["types"][name];
                    if st.is_null() {
                        "NOT SENT".to_string()
                    } else if st["sent"] == st["acked"] {
                        format!("SYNCED {}", s(&st["acked"]))
                    } else {
                        format!("STALE sent {} acked {}", s(&st["sent"]), s(&st["acked"]))
                    }
                };
                let nack = p["types"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(ty, st)| {
                        st["last_nack"]
                            .as_object()
                            .map(|n| format!("{ty}: {}", s(&n["message"])))
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                // An xDS v3 client (Envoy, proxyless gRPC) routes with
                // Envoy's RouteConfiguration (reached through a Listener).
                let v3 = s(&p["protocol"]).starts_with("xds-v3");
                println!(
                    "{:<36} {:<13} {:<40} {:<40} {:<40} {}",
                    s(&p["id"]),
                    s(&p["protocol"]),
                    t("Cluster"),
                    t("ClusterLoadAssignment"),
                    t(if v3 { "RouteConfiguration" } else { "Route" }),
                    nack
                );
            }
        }
    }
    Ok(())
}

/// `minimesh get routes`: each VirtualService with its routes, each
/// Gateway with what it binds, then what was refused.
fn routes_table(v: &serde_json::Value) {
    let s = |v: &serde_json::Value| {
        v.as_str()
            .map(str::to_string)
            .unwrap_or_else(|| v.to_string())
    };
    let list = |v: &serde_json::Value| {
        v.as_array()
            .into_iter()
            .flatten()
            .map(s)
            .collect::<Vec<_>>()
            .join(",")
    };
    println!(
        "{:<16} {:<28} {:<40} {:<28} {:<6} ACCEPTED",
        "NAMESPACE", "VIRTUALSERVICE", "HOSTS", "GATEWAYS", "ROUTES"
    );
    for vs in v["virtualServices"].as_array().into_iter().flatten() {
        let hosts: Vec<String> = vs["services"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(vs["gateway_hosts"].as_array().into_iter().flatten())
            .map(s)
            .collect();
        let gateways = match list(&vs["gateways"]) {
            g if g.is_empty() => "mesh".to_string(),
            g => g,
        };
        let routes = vs["routes"].as_array().map_or(0, Vec::len);
        println!(
            "{:<16} {:<28} {:<40} {:<28} {:<6} true",
            s(&vs["namespace"]),
            s(&vs["name"]),
            hosts.join(","),
            gateways,
            routes
        );
        for r in vs["routes"].as_array().into_iter().flatten() {
            let matches: Vec<String> = r["matches"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| {
                    let mut parts = Vec::new();
                    if !m["path"].is_null() {
                        parts.push(format!("path {}", s(&m["path"])));
                    }
                    if !m["method"].is_null() {
                        parts.push(format!("method {}", s(&m["method"])));
                    }
                    for h in m["headers"].as_array().into_iter().flatten() {
                        parts.push(format!("header {}", s(h)));
                    }
                    for q in m["query"].as_array().into_iter().flatten() {
                        parts.push(format!("query {}", s(q)));
                    }
                    if !m["port"].is_null() {
                        parts.push(format!("port {}", s(&m["port"])));
                    }
                    parts.join(" and ")
                })
                .collect();
            let when = match matches.as_slice() {
                [] => "every request".to_string(),
                m => m.join(" or "),
            };
            let action = &r["action"];
            let to = if let Some(b) = action["backends"].as_array() {
                b.iter()
                    .map(|b| {
                        let mut t = s(&b["service"]);
                        if !b["subset"].is_null() {
                            t += &format!(" subset {}", s(&b["subset"]));
                        }
                        if !b["port"].is_null() {
                            t += &format!(" port {}", s(&b["port"]));
                        }
                        format!("{t} ({})", s(&b["weight"]))
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            } else if !action["redirect"].is_null() {
                format!("redirect {}", action["redirect"])
            } else {
                format!("status {}", s(&action["direct_status"]))
            };
            let mut extra = String::new();
            if !r["timeout_ms"].is_null() {
                extra += &format!(", timeout {}ms", s(&r["timeout_ms"]));
            }
            if !r["retry_attempts"].is_null() {
                extra += &format!(", {} retries", s(&r["retry_attempts"]));
            }
            if !r["fault"].is_null() {
                extra += ", fault";
            }
            println!("  {}: {when} -> {to}{extra}", s(&r["name"]));
        }
        for w in vs["warnings"].as_array().into_iter().flatten() {
            println!("  warning: {}", s(w));
        }
    }
    let http_routes: Vec<_> = v["httpRoutes"].as_array().into_iter().flatten().collect();
    if !http_routes.is_empty() {
        println!(
            "\n{:<16} {:<28} {:<40} CONDITIONS",
            "NAMESPACE", "HTTPROUTE", "PARENT"
        );
        for r in http_routes {
            for p in r["parents"].as_array().into_iter().flatten() {
                let conditions: Vec<String> = p["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| {
                        format!(
                            "{}={} ({})",
                            s(&c["type"]),
                            s(&c["status"]),
                            s(&c["reason"])
                        )
                    })
                    .collect();
                println!(
                    "{:<16} {:<28} {:<40} {}",
                    s(&r["namespace"]),
                    s(&r["name"]),
                    s(&p["parentRef"]),
                    conditions.join(", ")
                );
                for c in p["conditions"].as_array().into_iter().flatten() {
                    if c["status"] == "False" {
                        println!("  {}: {}", s(&c["type"]), s(&c["message"]));
                    }
                }
            }
        }
    }
    let gateways: Vec<_> = v["gateways"].as_array().into_iter().flatten().collect();
    if !gateways.is_empty() {
        println!(
            "\n{:<16} {:<28} {:<40} SERVERS",
            "NAMESPACE", "GATEWAY", "SELECTOR"
        );
        for g in gateways {
            let selector: Vec<String> = g["selector"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| format!("{k}={}", s(v)))
                .collect();
            println!(
                "{:<16} {:<28} {:<40} {}",
                s(&g["namespace"]),
                s(&g["name"]),
                selector.join(","),
                list(&g["servers"])
            );
        }
    }
    let refused: Vec<_> = v["errors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            let o = s(&e["object"]);
            o.starts_with("VirtualService ")
                || o.starts_with("Gateway")
                || o.starts_with("HTTPRoute ")
        })
        .collect();
    if !refused.is_empty() {
        println!("\nREJECTED (the previous good version of each stays in force):");
        for e in refused {
            println!("  {}", s(&e["message"]));
        }
    }
}
