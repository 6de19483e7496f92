//! Transparent traffic capture, the init step: `sidecar init-capture`
//! writes the nftables rules ([`rules`]) in the pod's network namespace that
//! hand its TCP connections to the sidecar, as Istio's `istio-iptables` and
//! Linkerd's `proxy-init` do. The same code runs as the injected init
//! container on Kubernetes and for each pod of `minimesh up --capture`.
//! The sidecar then reads where each connection was going
//! (`listener/orig_dst.rs`).

use std::io::Write as _;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use clap::Parser;
use minimesh_proto::capture::{parse_include, parse_ports, parse_ranges, CaptureSettings};

pub mod rules;

/// Flags of `sidecar init-capture`. Each has the name and meaning of the
/// Istio pod annotation it stands for (`traffic.sidecar.istio.io/...`).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "sidecar init-capture",
    about = "Writes (or removes) the nftables rules that hand this network namespace's TCP connections to its sidecar"
)]
pub struct InitArgs {
    /// The sidecar's user id: its own connections are not captured.
    #[arg(long, env = "MINIMESH_PROXY_UID", default_value_t = minimesh_proto::capture::PROXY_UID)]
    pub proxy_uid: u32,
    /// The sidecar's group id: its own connections are not captured.
    #[arg(long, env = "MINIMESH_PROXY_GID", default_value_t = minimesh_proto::capture::PROXY_GID)]
    pub proxy_gid: u32,
    /// The sidecar's port for captured outbound connections.
    #[arg(long, env = "MINIMESH_CAPTURE_OUTBOUND_PORT", default_value_t = minimesh_proto::capture::OUTBOUND_CAPTURE_PORT)]
    pub outbound_port: u16,
    /// The sidecar's port for captured inbound connections.
    #[arg(long, env = "MINIMESH_CAPTURE_INBOUND_PORT", default_value_t = minimesh_proto::capture::INBOUND_CAPTURE_PORT)]
    pub inbound_port: u16,
    /// The sidecar's own listening ports, never captured inbound
    /// (comma-separated; default: admin 15000, 15001 and 15006).
    #[arg(
        long,
        env = "MINIMESH_CAPTURE_PROXY_PORTS",
        default_value = "15000,15001,15006"
    )]
    pub proxy_ports: String,
    /// includeInboundPorts: `*` (every port), a comma-separated list, or
    /// empty (no inbound capture).
    #[arg(
        long,
        env = "MINIMESH_CAPTURE_INCLUDE_INBOUND_PORTS",
        default_value = "*"
    )]
    pub include_inbound_ports: String,
    /// excludeInboundPorts: inbound ports never captured.
    #[arg(
        long,
        env = "MINIMESH_CAPTURE_EXCLUDE_INBOUND_PORTS",
        default_value = ""
    )]
    pub exclude_inbound_ports: String,
    /// includeOutboundIPRanges: `*` (every destination), comma-separated
    /// IPv4 CIDRs, or empty (no outbound capture).
    #[arg(
        long,
        env = "MINIMESH_CAPTURE_INCLUDE_OUTBOUND_IP_RANGES",
        default_value = "*"
    )]
    pub include_outbound_ip_ranges: String,
    /// excludeOutboundIPRanges: destinations never captured (IPv4 CIDRs).
    #[arg(
        long,
        env = "MINIMESH_CAPTURE_EXCLUDE_OUTBOUND_IP_RANGES",
        default_value = ""
    )]
    pub exclude_outbound_ip_ranges: String,
    /// excludeOutboundPorts: destination ports never captured.
    #[arg(
        long,
        env = "MINIMESH_CAPTURE_EXCLUDE_OUTBOUND_PORTS",
        default_value = ""
    )]
    pub exclude_outbound_ports: String,
    /// Print the rules instead of writing them.
    #[arg(long)]
    pub dry_run: bool,
    /// Remove the rules (the table `ip minimesh`) instead.
    #[arg(long)]
    pub remove: bool,
}

impl InitArgs {
    /// The settings these flags ask for; Err names the flag and the reason.
    pub fn settings(&self) -> anyhow::Result<CaptureSettings> {
        let flag = |name: &'static str| move |e: String| anyhow::anyhow!("--{name}: {e}");
        Ok(CaptureSettings {
            proxy_uid: self.proxy_uid,
            proxy_gid: self.proxy_gid,
            outbound_port: self.outbound_port,
            inbound_port: self.inbound_port,
            proxy_ports: parse_ports(&self.proxy_ports).map_err(flag("proxy-ports"))?,
            include_inbound_ports: parse_include(&self.include_inbound_ports, parse_ports)
                .map_err(flag("include-inbound-ports"))?,
            exclude_inbound_ports: parse_ports(&self.exclude_inbound_ports)
                .map_err(flag("exclude-inbound-ports"))?,
            include_outbound_ip_ranges: parse_include(
                &self.include_outbound_ip_ranges,
                parse_ranges,
            )
            .map_err(flag("include-outbound-ip-ranges"))?,
            exclude_outbound_ip_ranges: parse_ranges(&self.exclude_outbound_ip_ranges)
                .map_err(flag("exclude-outbound-ip-ranges"))?,
            exclude_outbound_ports: parse_ports(&self.exclude_outbound_ports)
                .map_err(flag("exclude-outbound-ports"))?,
        })
    }
}

/// Runs `sidecar init-capture`: writes, prints or removes the rules.
pub fn init(args: &InitArgs) -> anyhow::Result<()> {
    let script = if args.remove {
        rules::removal()
    } else {
        rules::ruleset(&args.settings()?)
    };
    if args.dry_run {
        print!("{script}");
        return Ok(());
    }
    nft(&script)?;
    if args.remove {
        eprintln!("init-capture: removed the table {}", rules::TABLE);
    } else {
        eprintln!(
            "init-capture: wrote the table {} (see it with `nft list table {}`)",
            rules::TABLE,
            rules::TABLE
        );
    }
    Ok(())
}

/// Runs an `nft -f -` script in this network namespace.
pub fn nft(script: &str) -> anyhow::Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                anyhow::anyhow!(
                    "nft not found: capture needs nftables (Debian: apt-get install nftables)"
                )
            } else {
                anyhow::anyhow!("starting nft: {e}")
            }
        })?;
    child
        .stdin
        .take()
        .context("nft's standard input")?
        .write_all(script.as_bytes())
        .context("writing the rules to nft")?;
    let out = child.wait_with_output().context("waiting for nft")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let hint = if err.contains("Operation not permitted") {
            " (capture needs CAP_NET_ADMIN in the pod's network namespace)"
        } else {
            ""
        };
        bail!("nft refused the capture rules{hint}: {}", err.trim());
    }
    Ok(())
}
