//! The nftables rules that hand a pod's TCP connections to its sidecar,
//! written from [`CaptureSettings`] as one `nft -f` script: a pure function,
//! so every option set has a golden file (`testdata/*.nft`).
//!
//! The script replaces the table `ip minimesh` whole in one transaction
//! (created if absent, deleted, defined again), so running the init step
//! twice leaves one copy of each rule, and a crash halfway leaves the old
//! table or the new one, never a mix.

use std::fmt::Write as _;

use minimesh_proto::capture::{CaptureSettings, Include};

/// The table every rule lives in.
pub const TABLE: &str = "ip minimesh";

/// A `{ a, b }` set of ports or ranges.
fn set<T: std::fmt::Display>(items: &[T]) -> String {
    let items: Vec<String> = items.iter().map(ToString::to_string).collect();
    format!("{{ {} }}", items.join(", "))
}

/// The `nft -f` script that installs the capture rules.
pub fn ruleset(s: &CaptureSettings) -> String {
    let mut out = String::new();
    out.push_str("# minimesh traffic capture (`sidecar init-capture`; docs/capture.md)\n");
    let _ = writeln!(out, "table {TABLE}\ndelete table {TABLE}\ntable {TABLE} {{");
    if s.include_inbound_ports != Include::Only(Vec::new()) {
        out.push_str(&inbound(s));
    }
    if s.include_outbound_ip_ranges != Include::Only(Vec::new()) {
        out.push_str(&outbound(s));
    }
    out.push_str("}\n");
    out
}

/// The script that removes the capture rules (and does nothing when there
/// are none).
pub fn removal() -> String {
    format!("table {TABLE}\ndelete table {TABLE}\n")
}

/// Inbound: connections to the pod, but to the sidecar's own ports and the
/// excluded ones, go to the inbound capture port.
fn inbound(s: &CaptureSettings) -> String {
    let mut c = String::new();
    c.push_str("\tchain prerouting {\n");
    c.push_str("\t\ttype nat hook prerouting priority -100; policy accept;\n");
    c.push_str("\t\tmeta l4proto tcp jump inbound\n\t}\n");
    c.push_str("\tchain inbound {\n");
    if !s.proxy_ports.is_empty() {
        let _ = writeln!(
            c,
            "\t\ttcp dport {} return comment \"the sidecar's own ports\"",
            set(&s.proxy_ports)
        );
    }
    if !s.exclude_inbound_ports.is_empty() {
        let _ = writeln!(
            c,
            "\t\ttcp dport {} return comment \"excludeInboundPorts\"",
            set(&s.exclude_inbound_ports)
        );
    }
    let only = match &s.include_inbound_ports {
        Include::All => "meta l4proto tcp ".to_string(),
        Include::Only(ports) => format!("tcp dport {} ", set(ports)),
    };
    let _ = writeln!(
        c,
        "\t\t{only}redirect to :{} comment \"to the sidecar's inbound capture port\"",
        s.inbound_port
    );
    c.push_str("\t}\n");
    c
}

/// Outbound: connections the pod makes, but the sidecar's own, those over
/// loopback and those excluded, go to the outbound capture port.
fn outbound(s: &CaptureSettings) -> String {
    let mut c = String::new();
    c.push_str("\tchain output {\n");
    c.push_str("\t\ttype nat hook output priority -100; policy accept;\n");
    c.push_str("\t\tmeta l4proto tcp jump outbound\n\t}\n");
    c.push_str("\tchain outbound {\n");
    if s.include_inbound_ports != Include::Only(Vec::new()) {
        // The sidecar dialing its own pod's address (an app calling a
        // Service whose endpoint is itself) goes over loopback, where no
        // inbound rule sees it: sent to its inbound side here, as Istio does.
        for (what, id) in [("skuid", s.proxy_uid), ("skgid", s.proxy_gid)] {
            let _ = writeln!(
                c,
                "\t\toifname \"lo\" ip daddr != 127.0.0.0/8 meta {what} {id} meta l4proto tcp redirect to :{} comment \"the sidecar calling its own pod\"",
                s.inbound_port
            );
        }
    }
    let _ = writeln!(
        c,
        "\t\tmeta skuid {} return comment \"the sidecar's own connections\"",
        s.proxy_uid
    );
    let _ = writeln!(c, "\t\tmeta skgid {} return", s.proxy_gid);
    c.push_str("\t\toifname \"lo\" return comment \"loopback, and the pod's calls to itself\"\n");
    c.push_str("\t\tip daddr 127.0.0.0/8 return\n");
    if !s.exclude_outbound_ports.is_empty() {
        let _ = writeln!(
            c,
            "\t\ttcp dport {} return comment \"excludeOutboundPorts\"",
            set(&s.exclude_outbound_ports)
        );
    }
    if !s.exclude_outbound_ip_ranges.is_empty() {
        let _ = writeln!(
            c,
            "\t\tip daddr {} return comment \"excludeOutboundIPRanges\"",
            set(&s.exclude_outbound_ip_ranges)
        );
    }
    let only = match &s.include_outbound_ip_ranges {
        Include::All => "meta l4proto tcp ".to_string(),
        Include::Only(ranges) => format!("meta l4proto tcp ip daddr {} ", set(ranges)),
    };
    let _ = writeln!(
        c,
        "\t\t{only}redirect to :{} comment \"to the sidecar's outbound capture port\"",
        s.outbound_port
    );
    c.push_str("\t}\n");
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The option sets of the golden files: one per annotation (with
    /// Istio's and minimesh's prefixes), and their combinations, after
    /// istio-iptables' golden cases (`empty`, `inbound-ports-include`,
    /// `inbound-ports-wildcard`, `inbound-wildcard-exclude`, `ip-range`,
    /// `ipnets`, `loopback-outbound-iprange`, `outbound-ports-exclude`,
    /// `outbound-ports-exclude-single`; its uid/gid cases are `uid-gid`
    /// below). Its TPROXY, DNS, IPv6, interface and owner-group options
    /// are not minimesh's: their annotations are refused
    /// (`minimesh_proto::capture`).
    fn cases() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
        vec![
            ("default", vec![]),
            (
                "exclude-outbound-port-single",
                vec![("traffic.sidecar.istio.io/excludeOutboundPorts", "5432")],
            ),
            (
                "loopback-outbound-iprange",
                vec![(
                    "traffic.sidecar.istio.io/includeOutboundIPRanges",
                    "127.0.0.1/32,198.19.0.0/16",
                )],
            ),
            (
                "exclude-outbound-ports",
                vec![("traffic.sidecar.istio.io/excludeOutboundPorts", "5432,6379")],
            ),
            (
                "exclude-inbound-ports",
                vec![("traffic.minimesh.io/excludeInboundPorts", "22")],
            ),
            (
                "include-inbound-ports",
                vec![("traffic.sidecar.istio.io/includeInboundPorts", "8080,9090")],
            ),
            (
                "no-inbound",
                vec![("traffic.sidecar.istio.io/includeInboundPorts", "")],
            ),
            (
                "include-outbound-ranges",
                vec![(
                    "traffic.sidecar.istio.io/includeOutboundIPRanges",
                    "198.19.0.0/16",
                )],
            ),
            (
                "exclude-outbound-ranges",
                vec![(
                    "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                    "198.18.0.0/24,198.18.7.7/32",
                )],
            ),
            (
                "no-outbound",
                vec![("traffic.sidecar.istio.io/includeOutboundIPRanges", "")],
            ),
            (
                "all-options",
                vec![
                    ("traffic.sidecar.istio.io/includeInboundPorts", "*"),
                    ("traffic.sidecar.istio.io/excludeInboundPorts", "22,8443"),
                    (
                        "traffic.sidecar.istio.io/includeOutboundIPRanges",
                        "198.19.0.0/16,198.18.0.0/24",
                    ),
                    (
                        "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                        "198.18.0.5",
                    ),
                    ("traffic.sidecar.istio.io/excludeOutboundPorts", "3306"),
                ],
            ),
            (
                "nothing",
                vec![
                    ("traffic.sidecar.istio.io/includeInboundPorts", ""),
                    ("traffic.sidecar.istio.io/includeOutboundIPRanges", ""),
                ],
            ),
        ]
    }

    /// Each option set's rules are its golden file, byte for byte
    /// (`UPDATE_GOLDEN=1 cargo test -p minimesh-sidecar capture` writes
    /// them; review the diff).
    #[test]
    fn rules_match_the_golden_file_of_each_option_set() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/capture/testdata");
        let update = std::env::var_os("UPDATE_GOLDEN").is_some();
        let mut failed = Vec::new();
        let mut all: Vec<(&str, CaptureSettings)> = cases()
            .into_iter()
            .map(|(name, a)| {
                (
                    name,
                    CaptureSettings::from_annotations(a).expect("valid annotations"),
                )
            })
            .collect();
        // The sidecar under another user and group (istio-iptables'
        // `--proxy-uid`/`--proxy-gid`).
        all.push((
            "uid-gid",
            CaptureSettings {
                proxy_uid: 1000,
                proxy_gid: 2000,
                ..CaptureSettings::default()
            },
        ));
        for (name, settings) in all {
            let got = ruleset(&settings);
            let path = dir.join(format!("{name}.nft"));
            if update {
                std::fs::write(&path, &got).expect("write golden");
                continue;
            }
            let want = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if got != want {
                failed.push(format!("{name}:\n--- want\n{want}--- got\n{got}"));
            }
        }
        assert!(failed.is_empty(), "{}", failed.join("\n"));
    }

    /// The flags the injector (and `minimesh up --capture`) derive from
    /// the annotations give the init step the same settings back.
    #[test]
    fn init_flags_carry_every_setting_to_the_init_step() {
        use clap::Parser;
        for (name, annotations) in cases() {
            let settings = CaptureSettings::from_annotations(annotations).expect("valid");
            let mut argv = vec!["init-capture".to_string()];
            argv.extend(settings.init_args());
            let args = crate::capture::InitArgs::try_parse_from(&argv).expect("flags parse");
            assert_eq!(
                args.settings().expect("settings"),
                settings,
                "{name}: {argv:?}"
            );
        }
    }

    #[test]
    fn the_sidecars_own_traffic_is_excluded_before_any_redirect() {
        let text = ruleset(&CaptureSettings::default());
        let pos = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("{needle}"));
        assert!(pos("meta skuid 1337 return") < pos("redirect to :15001"));
        assert!(
            pos("meta skgid 1337 meta l4proto tcp redirect to :15006")
                < pos("meta skgid 1337 return")
        );
        assert!(pos("tcp dport { 15000, 15001, 15006 } return") < pos("redirect to :15006"));
        // Replaced whole: created if absent, deleted, defined again.
        assert!(text.contains("table ip minimesh\ndelete table ip minimesh\ntable ip minimesh {"));
        assert_eq!(removal(), "table ip minimesh\ndelete table ip minimesh\n");
    }
}
