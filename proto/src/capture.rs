//! What a pod's traffic capture hands to its sidecar: the settings of the
//! capture rules, and the pod annotations that set them, with Istio's names
//! and meanings (`traffic.sidecar.istio.io/*`; minimesh's own prefix
//! `traffic.minimesh.io/` is read the same). The injector checks the
//! annotations (a bad value refuses the pod, naming the annotation and the
//! reason); the init step turns the settings into rules. Both read this one
//! grammar, so a value the injector let through is one the init step takes.

use std::fmt;
use std::net::Ipv4Addr;

/// The sidecar's user id: its own connections are never captured (Istio's
/// 1337, so that a pod's security context reads the same in both meshes).
pub const PROXY_UID: u32 = 1337;
/// The sidecar's group id, excluded as its user id is.
pub const PROXY_GID: u32 = 1337;
/// The sidecar's port for captured outbound connections (Istio's 15001).
pub const OUTBOUND_CAPTURE_PORT: u16 = 15001;
/// The sidecar's port for captured inbound connections (Istio's 15006).
pub const INBOUND_CAPTURE_PORT: u16 = 15006;
/// The sidecar's admin port (health, readiness, metrics): never captured
/// inbound, so the kubelet and Prometheus reach it.
pub const ADMIN_PORT: u16 = 15000;

/// The two annotation prefixes read, Istio's first.
pub const PREFIXES: [&str; 2] = ["traffic.sidecar.istio.io/", "traffic.minimesh.io/"];

/// The annotations (after a prefix) that set capture, each with what it means.
pub const KEYS: [(&str, &str); 5] = [
    (
        "includeInboundPorts",
        "inbound ports captured: `*` (every port, the default), a comma-separated list, or empty (none)",
    ),
    (
        "excludeInboundPorts",
        "inbound ports never captured (comma-separated), with `*` above",
    ),
    (
        "includeOutboundIPRanges",
        "destinations captured: `*` (every address, the default), comma-separated IPv4 CIDRs, or empty (none)",
    ),
    (
        "excludeOutboundIPRanges",
        "destinations never captured (comma-separated IPv4 CIDRs)",
    ),
    (
        "excludeOutboundPorts",
        "destination ports never captured (comma-separated)",
    ),
];

/// An IPv4 network, `a.b.c.d/len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    /// The network's address (host bits cleared).
    pub addr: Ipv4Addr,
    /// Prefix length, 0 to 32.
    pub len: u8,
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl Cidr {
    /// Parses `a.b.c.d/len` or a lone address (a /32); host bits are
    /// cleared, as the kernel reads a network.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, len),
            None => (s, "32"),
        };
        let ip: Ipv4Addr = ip.parse().map_err(|_| {
            if ip.contains(':') {
                format!("{s:?} is an IPv6 range: minimesh captures IPv4 only")
            } else {
                format!("{s:?} is not an IPv4 CIDR (a.b.c.d/len)")
            }
        })?;
        let len: u8 = len
            .parse()
            .ok()
            .filter(|l| *l <= 32)
            .ok_or_else(|| format!("{s:?}: the prefix length must be 0 to 32"))?;
        let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
        Ok(Cidr {
            addr: Ipv4Addr::from(u32::from(ip) & mask),
            len,
        })
    }

    /// True when `ip` is in this network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
        u32::from(ip) & mask == u32::from(self.addr)
    }
}

/// Every item (`*`), or only those listed (none when empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Include<T> {
    /// Every port or address.
    All,
    /// Only these.
    Only(Vec<T>),
}

/// The settings of one pod's capture rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureSettings {
    /// Connections made by this user are the sidecar's own: not captured.
    pub proxy_uid: u32,
    /// Connections made by this group are the sidecar's own: not captured.
    pub proxy_gid: u32,
    /// Where captured outbound connections go.
    pub outbound_port: u16,
    /// Where captured inbound connections go.
    pub inbound_port: u16,
    /// The sidecar's own listening ports: never captured inbound.
    pub proxy_ports: Vec<u16>,
    /// Inbound ports captured.
    pub include_inbound_ports: Include<u16>,
    /// Inbound ports not captured (with `Include::All`).
    pub exclude_inbound_ports: Vec<u16>,
    /// Destinations captured.
    pub include_outbound_ip_ranges: Include<Cidr>,
    /// Destinations not captured.
    pub exclude_outbound_ip_ranges: Vec<Cidr>,
    /// Destination ports not captured.
    pub exclude_outbound_ports: Vec<u16>,
}

impl Default for CaptureSettings {
    /// Everything captured both ways, but the sidecar's own traffic and ports.
    fn default() -> CaptureSettings {
        CaptureSettings {
            proxy_uid: PROXY_UID,
            proxy_gid: PROXY_GID,
            outbound_port: OUTBOUND_CAPTURE_PORT,
            inbound_port: INBOUND_CAPTURE_PORT,
            proxy_ports: vec![ADMIN_PORT, OUTBOUND_CAPTURE_PORT, INBOUND_CAPTURE_PORT],
            include_inbound_ports: Include::All,
            exclude_inbound_ports: Vec::new(),
            include_outbound_ip_ranges: Include::All,
            exclude_outbound_ip_ranges: Vec::new(),
            exclude_outbound_ports: Vec::new(),
        }
    }
}

/// A capture annotation with a value that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnnotationError {
    /// The annotation's full key.
    pub key: String,
    /// Why its value cannot be used.
    pub reason: String,
}

impl fmt::Display for AnnotationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "annotation {}: {}", self.key, self.reason)
    }
}

impl std::error::Error for AnnotationError {}

/// Parses a comma-separated port list (blanks around items allowed).
pub fn parse_ports(s: &str) -> Result<Vec<u16>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{p:?} is not a port (1 to 65535)"))
        })
        .collect()
}

/// Parses a comma-separated list of IPv4 CIDRs.
pub fn parse_ranges(s: &str) -> Result<Vec<Cidr>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .map(Cidr::parse)
        .collect()
}

/// Parses `*` (all), empty (none) or a list, with `item` for each element.
pub fn parse_include<T>(
    s: &str,
    items: impl Fn(&str) -> Result<Vec<T>, String>,
) -> Result<Include<T>, String> {
    if s.trim() == "*" {
        Ok(Include::All)
    } else {
        items(s).map(Include::Only)
    }
}

impl CaptureSettings {
    /// True when a connection to the pod's `port` is captured inbound (goes
    /// through its sidecar).
    pub fn captures_inbound(&self, port: u16) -> bool {
        if self.proxy_ports.contains(&port) || self.exclude_inbound_ports.contains(&port) {
            return false;
        }
        match &self.include_inbound_ports {
            Include::All => true,
            Include::Only(ports) => ports.contains(&port),
        }
    }

    /// The `sidecar init-capture` flags that write these settings' rules
    /// (what the injector gives the init container, and `minimesh up
    /// --capture` the init step of each pod).
    pub fn init_args(&self) -> Vec<String> {
        fn list<T: fmt::Display>(items: &[T]) -> String {
            items
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        }
        fn include<T: fmt::Display>(i: &Include<T>) -> String {
            match i {
                Include::All => "*".to_string(),
                Include::Only(items) => list(items),
            }
        }
        vec![
            format!("--proxy-uid={}", self.proxy_uid),
            format!("--proxy-gid={}", self.proxy_gid),
            format!("--outbound-port={}", self.outbound_port),
            format!("--inbound-port={}", self.inbound_port),
            format!("--proxy-ports={}", list(&self.proxy_ports)),
            format!(
                "--include-inbound-ports={}",
                include(&self.include_inbound_ports)
            ),
            format!(
                "--exclude-inbound-ports={}",
                list(&self.exclude_inbound_ports)
            ),
            format!(
                "--include-outbound-ip-ranges={}",
                include(&self.include_outbound_ip_ranges)
            ),
            format!(
                "--exclude-outbound-ip-ranges={}",
                list(&self.exclude_outbound_ip_ranges)
            ),
            format!(
                "--exclude-outbound-ports={}",
                list(&self.exclude_outbound_ports)
            ),
        ]
    }

    /// The settings a pod's annotations ask for, from the defaults. An
    /// annotation under either prefix that is not one of [`KEYS`] is
    /// refused rather than ignored (it would do nothing), and so is a key
    /// set under both prefixes to different values.
    pub fn from_annotations<'a>(
        annotations: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<CaptureSettings, AnnotationError> {
        let mut s = CaptureSettings::default();
        let mut seen: Vec<(&str, &str, &str)> = Vec::new();
        for (key, value) in annotations {
            let Some(name) = PREFIXES.iter().find_map(|p| key.strip_prefix(p)) else {
                continue;
            };
            let err = |reason: String| AnnotationError {
                key: key.to_string(),
                reason,
            };
            if !KEYS.iter().any(|(k, _)| *k == name) {
                let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                return Err(err(format!(
                    "not an annotation minimesh implements (it reads {})",
                    known.join(", ")
                )));
            }
            if let Some((other, _, v)) = seen.iter().find(|(_, n, _)| *n == name) {
                if *v != value {
                    return Err(err(format!(
                        "{value:?} differs from {other}'s {v:?}: set one of the two"
                    )));
                }
                continue;
            }
            seen.push((key, name, value));
            match name {
                "includeInboundPorts" => {
                    s.include_inbound_ports = parse_include(value, parse_ports).map_err(err)?;
                }
                "excludeInboundPorts" => {
                    s.exclude_inbound_ports = parse_ports(value).map_err(err)?
                }
                "includeOutboundIPRanges" => {
                    s.include_outbound_ip_ranges =
                        parse_include(value, parse_ranges).map_err(err)?;
                }
                "excludeOutboundIPRanges" => {
                    s.exclude_outbound_ip_ranges = parse_ranges(value).map_err(err)?;
                }
                _ => s.exclude_outbound_ports = parse_ports(value).map_err(err)?,
            }
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(pairs: &[(&'static str, &'static str)]) -> Result<CaptureSettings, String> {
        CaptureSettings::from_annotations(pairs.iter().copied()).map_err(|e| e.to_string())
    }

    #[test]
    fn no_annotation_captures_everything_but_the_sidecars_own_traffic() {
        let s = from(&[("sidecar.istio.io/inject", "true")]).expect("defaults");
        assert_eq!(s, CaptureSettings::default());
        assert_eq!(s.include_inbound_ports, Include::All);
        assert_eq!(s.proxy_ports, [15000, 15001, 15006]);
    }

    #[test]
    fn istios_annotations_and_minimeshs_prefix_are_read() {
        let s = from(&[
            (
                "traffic.sidecar.istio.io/excludeOutboundPorts",
                "5432, 6379",
            ),
            ("traffic.minimesh.io/excludeInboundPorts", "9000"),
            (
                "traffic.sidecar.istio.io/includeOutboundIPRanges",
                "198.19.0.0/16,198.18.1.7",
            ),
            (
                "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                "198.18.0.0/24",
            ),
            ("traffic.sidecar.istio.io/includeInboundPorts", ""),
        ])
        .expect("valid");
        assert_eq!(s.exclude_outbound_ports, [5432, 6379]);
        assert_eq!(s.exclude_inbound_ports, [9000]);
        assert_eq!(
            s.include_outbound_ip_ranges,
            Include::Only(vec![
                Cidr::parse("198.19.0.0/16").unwrap(),
                Cidr::parse("198.18.1.7/32").unwrap()
            ])
        );
        assert_eq!(s.exclude_outbound_ip_ranges[0].to_string(), "198.18.0.0/24");
        assert_eq!(s.include_inbound_ports, Include::Only(vec![]));
        // The same value under both prefixes is one setting.
        from(&[
            ("traffic.sidecar.istio.io/excludeOutboundPorts", "1"),
            ("traffic.minimesh.io/excludeOutboundPorts", "1"),
        ])
        .expect("agreeing");
    }

    #[test]
    fn a_bad_value_is_refused_naming_the_annotation_and_the_reason() {
        for (pairs, want) in [
            (
                [("traffic.sidecar.istio.io/excludeOutboundPorts", "80,http")],
                r#"annotation traffic.sidecar.istio.io/excludeOutboundPorts: "http" is not a port (1 to 65535)"#,
            ),
            (
                [("traffic.sidecar.istio.io/excludeInboundPorts", "0")],
                r#"annotation traffic.sidecar.istio.io/excludeInboundPorts: "0" is not a port (1 to 65535)"#,
            ),
            (
                [("traffic.sidecar.istio.io/includeOutboundIPRanges", "198.18.0.0/33")],
                r#"annotation traffic.sidecar.istio.io/includeOutboundIPRanges: "198.18.0.0/33": the prefix length must be 0 to 32"#,
            ),
            (
                [("traffic.minimesh.io/excludeOutboundIPRanges", "fd00::/8")],
                r#"annotation traffic.minimesh.io/excludeOutboundIPRanges: "fd00::/8" is an IPv6 range: minimesh captures IPv4 only"#,
            ),
            (
                [("traffic.sidecar.istio.io/includeOutboundPorts", "80")],
                "annotation traffic.sidecar.istio.io/includeOutboundPorts: not an annotation minimesh implements (it reads includeInboundPorts, excludeInboundPorts, includeOutboundIPRanges, excludeOutboundIPRanges, excludeOutboundPorts)",
            ),
        ] {
            assert_eq!(from(&pairs).unwrap_err(), want);
        }
        assert_eq!(
            from(&[
                ("traffic.sidecar.istio.io/excludeOutboundPorts", "1"),
                ("traffic.minimesh.io/excludeOutboundPorts", "2"),
            ])
            .unwrap_err(),
            r#"annotation traffic.minimesh.io/excludeOutboundPorts: "2" differs from traffic.sidecar.istio.io/excludeOutboundPorts's "1": set one of the two"#
        );
    }

    #[test]
    fn inbound_ports_are_captured_but_the_sidecars_and_the_excluded() {
        let all = CaptureSettings::default();
        assert!(all.captures_inbound(8080));
        assert!(!all.captures_inbound(15000));
        let some = from(&[
            ("traffic.sidecar.istio.io/includeInboundPorts", "8080,9000"),
            ("traffic.sidecar.istio.io/excludeInboundPorts", "9000"),
        ])
        .expect("valid");
        assert!(some.captures_inbound(8080));
        assert!(!some.captures_inbound(9000));
        assert!(!some.captures_inbound(7000));
    }

    #[test]
    fn networks_clear_host_bits_and_contain_their_addresses() {
        let n = Cidr::parse("198.18.3.9/16").expect("cidr");
        assert_eq!(n.to_string(), "198.18.0.0/16");
        assert!(n.contains("198.18.255.1".parse().unwrap()));
        assert!(!n.contains("198.19.0.1".parse().unwrap()));
        assert_eq!(Cidr::parse("0.0.0.0/0").unwrap().to_string(), "0.0.0.0/0");
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
    }
}
