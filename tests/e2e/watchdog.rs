//! Ends the whole test run, naming the tests' networks and logs still in
//! use, when it has run far longer than it ever does (40 minutes; a whole run
//! takes about ten on two cores; `MINIMESH_E2E_WATCHDOG_SECS` changes it): a
//! test that hangs fails the run with its logs instead of running into CI's
//! time limit unnamed. Every process the tests started is killed first, as
//! their drops would have: left running, they would hold the run's output
//! open.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};
use std::time::Duration;

static RUNNING: Mutex<BTreeMap<u8, PathBuf>> = Mutex::new(BTreeMap::new());
static START: Once = Once::new();

pub fn started(octet: u8, dir: &Path) {
    RUNNING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(octet, dir.to_path_buf());
    START.call_once(|| {
        let secs = std::env::var("MINIMESH_E2E_WATCHDOG_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2400);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(secs));
            let running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
            // Straight to the run's stderr: eprintln! from a test's
            // thread is captured with the test's output, never shown.
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "e2e: still running after {secs} s, which no run takes; the tests on these networks hang (their logs are kept):");
            for (octet, dir) in running.iter() {
                let _ = writeln!(err, "  127.1.{octet}.0/24  {}", dir.display());
                for log in std::fs::read_dir(dir.join("logs")).into_iter().flatten().flatten() {
                    let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(5).collect();
                    let _ = writeln!(err, "    {}:", log.path().display());
                    for l in tail.iter().rev() {
                        let _ = writeln!(err, "      {l}");
                    }
                }
            }
            kill_descendants(std::process::id());
            std::process::exit(101);
        });
    });
}

/// SIGKILLs every process descended from `pid`, children first found
/// from /proc (each one's parent is the fourth field of its `stat`).
fn kill_descendants(pid: u32) {
    let mut parents: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid ...: comm may hold spaces, so after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.entry(ppid).or_default().push(child);
        }
    }
    let mut stack = vec![pid];
    while let Some(p) = stack.pop() {
        for &c in parents.get(&p).map(Vec::as_slice).unwrap_or_default() {
            stack.push(c);
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &c.to_string()])
                .status();
        }
    }
}

pub fn ended(octet: u8) {
    RUNNING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&octet);
}
