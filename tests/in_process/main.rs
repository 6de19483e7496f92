//! The in-process tier: the control plane, sidecars and fake-service apps
//! as libraries in this one test process (no binary started, no state
//! shared between them), real sockets on loopback and real HTTP between
//! them. Each test owns `127.1.N.0/24` with N from 200 up (the end-to-end
//! tier's nets are below). A request-path case runs here in a second or
//! two, where the binary tier spends more starting and stopping processes;
//! what needs a process (a kill, a signal, a binary's flags and exit) stays
//! in `tests/e2e`.

// Shared with the end-to-end tier; each tier uses part of it.
#[allow(dead_code)]
#[path = "../support/client.rs"]
mod client;
#[allow(dead_code)]
#[path = "../support/loopback.rs"]
mod loopback;
#[allow(dead_code)]
#[path = "../support/views.rs"]
mod views;
#[allow(dead_code)]
#[path = "../support/yaml.rs"]
mod yaml;

mod connection_pool;
mod edge;
mod harness;
mod load_report_identity;
mod mtls;
mod one_process;
mod outlier;
mod retries;
mod secure_naming;
mod timeouts;
mod workload;
