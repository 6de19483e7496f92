//! `minimesh up --capture`: pod networking as a cluster's CNI gives it.
//! Each pod is a network namespace of its own on a bridge, with a pod IP,
//! a default route through the bridge, and an `/etc/hosts` that resolves
//! every Service name to its virtual IP (`ip netns exec` mounts
//! `/etc/netns/<namespace>/hosts` over `/etc/hosts` for the processes it
//! starts). Every address comes from 198.18.0.0/15 (RFC 2544's benchmarking
//! range, routed nowhere): network `K` takes pod IPs from `198.18.K.0/24`
//! (the host's end of the bridge is `198.18.K.1`) and Service IPs from
//! `198.19.K.0/24`.
//!
//! What a network made is removed when it is dropped, and, should its
//! owner be killed (SIGKILL leaves no chance to clean up), by the next
//! `minimesh up --capture`: each network's owner writes its process id in
//! `/run/minimesh/netns/<K>`, and a network whose owner is gone is removed
//! before a new one is made.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

/// Where each network's owner is recorded.
const OWNERS: &str = "/run/minimesh/netns";

/// Where `ip netns exec` finds a namespace's own `/etc` files.
const NETNS_ETC: &str = "/etc/netns";

/// Each pod's `/etc/resolv.conf`: Service names resolve from its hosts file.
const RESOLV_CONF: &str = "# Written by minimesh up --capture: no DNS server runs in the pod network;\n# Service names resolve from /etc/hosts.\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n";

/// One mesh's pod network.
pub struct PodNetwork {
    index: u8,
    namespaces: Vec<String>,
    removed: bool,
}

/// Why capture mode cannot run here, or None when it can: it needs Linux,
/// root (network namespaces, nftables) and the `ip` and `nft` commands.
pub fn unavailable() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return Some("--capture needs Linux (network namespaces and nftables)".into());
    }
    match effective_uid() {
        Some(0) => {}
        _ => {
            return Some(
                "--capture needs root: it makes network namespaces and writes nftables rules (run as root, or without --capture for the loopback mesh)".into(),
            )
        }
    }
    for (tool, package) in [("ip", "iproute2"), ("nft", "nftables")] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!(
                "--capture needs the {tool} command (Debian: apt-get install {package})"
            ));
        }
    }
    None
}

/// This process's effective user id, from `/proc/self/status`.
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Runs `ip ARGS`, failing with what it said.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The bridge of network `k`.
fn bridge(k: u8) -> String {
    format!("mmbr{k}")
}

/// The network namespaces of network `k`, as `ip netns list` shows them.
fn namespaces_of(k: u8) -> Vec<String> {
    let prefix = format!("mm{k}-");
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

/// Removes everything network `k` made: its namespaces (their veths go
/// with them), their `/etc/netns` files, its bridge, its owner record.
fn remove_network(k: u8, namespaces: &[String]) {
    let mut all: Vec<String> = namespaces.to_vec();
    for n in namespaces_of(k) {
        if !all.contains(&n) {
            all.push(n);
        }
    }
    for n in &all {
        // Processes of a killed mesh still in it (they exit soon after
        // their parent, but a namespace lives as long as one is inside).
        if let Ok(out) = Command::new("ip").args(["netns", "pids", n]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-s", "KILL", pid]).status();
            }
        }
        let _ = ip(&["netns", "del", n]);
        let _ = std::fs::remove_dir_all(Path::new(NETNS_ETC).join(n));
    }
    // Host ends of veths whose namespace has not gone yet.
    let prefix = format!("mm{k}");
    if let Ok(out) = Command::new("ip").args(["-o", "link"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(name) = line.split(": ").nth(1).and_then(|n| n.split('@').next()) else {
                continue;
            };
            let ours = name.strip_prefix(&prefix).is_some_and(|rest| {
                rest.starts_with(['v', 'o']) && rest[1..].bytes().all(|b| b.is_ascii_digit())
            });
            if ours {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
    let _ = ip(&["link", "del", &bridge(k)]);
    let _ = std::fs::remove_file(Path::new(OWNERS).join(k.to_string()));
}

/// Whether the process whose pid `file` holds is running (false for a
/// missing or unreadable file).
fn holder_alive(file: &Path) -> bool {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

/// Takes `lock` (a file created only if absent, holding this pid); a lock
/// whose holder is gone (a cleaner killed midway) is taken over.
fn take(lock: &Path) -> bool {
    for _ in 0..2 {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(lock)
        {
            Ok(mut f) => {
                use std::io::Write as _;
                return writeln!(f, "{}", std::process::id()).is_ok();
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && !holder_alive(lock) => {
                let _ = std::fs::remove_file(lock);
            }
            Err(_) => return false,
        }
    }
    false
}

/// Removes the networks whose owner process is gone. Returns their indexes.
/// Starts running at once may all find the same dead owner: each network is
/// cleaned by one of them (`<k>.cleaning`), and its owner record, which
/// keeps its index from being claimed, goes last, so that no new network
/// takes the index while the old one is being removed.
pub fn clean_leftovers() -> Vec<u8> {
    let mut cleaned = Vec::new();
    let Ok(dir) = std::fs::read_dir(OWNERS) else {
        return cleaned;
    };
    for entry in dir.flatten() {
        let Some(k) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u8>().ok())
        else {
            continue;
        };
        if holder_alive(&entry.path()) {
            continue;
        }
        let lock = Path::new(OWNERS).join(format!("{k}.cleaning"));
        if !take(&lock) {
            continue; // another start is cleaning it
        }
        // Still there and still dead: not cleaned and claimed again since.
        if entry.path().exists() && !holder_alive(&entry.path()) {
            remove_network(k, &[]);
            cleaned.push(k);
        }
        let _ = std::fs::remove_file(&lock);
    }
    cleaned
}

impl PodNetwork {
    /// Makes a new network (its bridge, up, with the host's address), after
    /// removing those whose owner is gone.
    pub fn create() -> anyhow::Result<PodNetwork> {
        if let Some(why) = unavailable() {
            bail!("{why}");
        }
        for k in clean_leftovers() {
            eprintln!("removed pod network {k} left by a minimesh up that was killed");
        }
        std::fs::create_dir_all(OWNERS).with_context(|| format!("creating {OWNERS}"))?;
        // The record appears whole (linked from a file already written),
        // so that no other owner reads it empty and takes it for a dead one.
        let pid = std::process::id();
        let written = Path::new(OWNERS).join(format!(".{pid}.tmp"));
        std::fs::write(&written, format!("{pid}\n"))
            .with_context(|| format!("writing {}", written.display()))?;
        let claimed = (1..=254u8)
            .find(|k| std::fs::hard_link(&written, Path::new(OWNERS).join(k.to_string())).is_ok());
        let _ = std::fs::remove_file(&written);
        let Some(index) = claimed else {
            bail!("all 254 pod networks of 198.18.0.0/15 are in use (see {OWNERS})");
        };
        let net = PodNetwork {
            index,
            namespaces: Vec::new(),
            removed: false,
        };
        // A bridge left by an owner that died before writing its record.
        let _ = ip(&["link", "del", &bridge(index)]);
        let host = format!("{}/24", net.host_ip());
        ip(&["link", "add", &bridge(index), "type", "bridge"])?;
        ip(&["addr", "add", &host, "dev", &bridge(index)])?;
        ip(&["link", "set", &bridge(index), "up"])?;
        Ok(net)
    }

    /// This network's index `K`.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// The host's address on the bridge (where the pods reach the control plane).
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.index, 1)
    }

    /// The address of pod `n` (from 1).
    pub fn pod_ip(&self, n: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.index, n.saturating_add(1))
    }

    /// The virtual IP of Service `n` (from 1).
    pub fn service_ip(&self, n: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.index, n)
    }

    /// The network namespace of `pod`.
    pub fn namespace(&self, pod: &str) -> String {
        format!("mm{}-{pod}", self.index)
    }

    /// Makes pod `n`'s namespace, named for `pod`, wired to the bridge with
    /// its address and a default route through the host; `hosts` is its
    /// `/etc/hosts`. Returns the namespace's name.
    pub fn add_pod(&mut self, pod: &str, n: u8, hosts: &str) -> anyhow::Result<String> {
        let ns = self.namespace(pod);
        let veth = format!("mm{}v{n}", self.index);
        ip(&["netns", "add", &ns])?;
        self.namespaces.push(ns.clone());
        ip(&[
            "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ])?;
        ip(&["link", "set", &veth, "master", &bridge(self.index), "up"])?;
        let addr = format!("{}/24", self.pod_ip(n));
        ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        let gw = self.host_ip().to_string();
        ip(&["-n", &ns, "route", "add", "default", "via", &gw])?;
        let etc = Path::new(NETNS_ETC).join(&ns);
        std::fs::create_dir_all(&etc).with_context(|| format!("creating {}", etc.display()))?;
        std::fs::write(etc.join("hosts"), hosts)
            .with_context(|| format!("writing {}", etc.join("hosts").display()))?;
        // No DNS server runs in the pod network: a name that is no
        // Service's fails at once (nothing answers on the pod's own
        // loopback) rather than after the host's resolvers time out from a
        // network that cannot reach them.
        std::fs::write(etc.join("resolv.conf"), RESOLV_CONF)
            .with_context(|| format!("writing {}", etc.join("resolv.conf").display()))?;
        Ok(ns)
    }

    /// The namespaces made so far.
    pub fn namespaces(&self) -> &[String] {
        &self.namespaces
    }

    /// The owner record's path.
    pub fn owner_file(&self) -> PathBuf {
        Path::new(OWNERS).join(self.index.to_string())
    }

    /// Removes everything this network made.
    pub fn remove(mut self) {
        self.remove_now();
    }

    fn remove_now(&mut self) {
        if !self.removed {
            self.removed = true;
            remove_network(self.index, &self.namespaces);
        }
    }
}

impl Drop for PodNetwork {
    fn drop(&mut self) {
        self.remove_now();
    }
}

/// An `/etc/hosts` for a pod: localhost, and each Service's names (`name`,
/// `name.ns`, `name.ns.svc`, `name.ns.svc.cluster.local`) on its virtual IP.
pub fn hosts_file(namespace: &str, services: &[(String, Ipv4Addr)]) -> String {
    let mut out = String::from("# Written by minimesh up --capture.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    for (name, vip) in services {
        out.push_str(&format!(
            "{vip}\t{name} {name}.{namespace} {name}.{namespace}.svc {name}.{namespace}.svc.cluster.local\n"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_address_is_in_the_benchmarking_range() {
        let range = minimesh_proto::capture::Cidr::parse("198.18.0.0/15").expect("cidr");
        let net = PodNetwork {
            index: 254,
            namespaces: Vec::new(),
            removed: true,
        };
        for ip in [
            net.host_ip(),
            net.pod_ip(1),
            net.pod_ip(250),
            net.service_ip(1),
            net.service_ip(255),
        ] {
            assert!(range.contains(ip), "{ip}");
        }
        assert_eq!(net.pod_ip(255), Ipv4Addr::new(198, 18, 254, 255));
        assert_eq!(net.namespace("web-0"), "mm254-web-0");
    }

    #[test]
    fn pods_resolve_service_names_to_their_virtual_ips() {
        let text = hosts_file(
            "istioinaction",
            &[("simple-backend".into(), Ipv4Addr::new(198, 19, 3, 2))],
        );
        assert!(text.contains("198.19.3.2\tsimple-backend simple-backend.istioinaction simple-backend.istioinaction.svc simple-backend.istioinaction.svc.cluster.local\n"));
        assert!(text.contains("127.0.0.1\tlocalhost\n"));
    }
}
