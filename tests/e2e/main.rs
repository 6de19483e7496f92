//! End-to-end tests: real control plane, sidecars and fake-service backends
//! on loopback, real HTTP and gRPC traffic.

// Shared with the in-process tier.
#[path = "../support/client.rs"]
mod client;
#[path = "../support/loopback.rs"]
mod loopback;
#[path = "../support/views.rs"]
mod views;
#[path = "../support/yaml.rs"]
mod yaml;

mod admission;
mod authorization;
mod balancing;
mod bench;
mod bench_overhead;
mod capture;
mod capture_rules;
mod config;
mod debug_views;
mod deploy;
mod fake_kube;
mod gateway_api;
mod grpc_interop;
mod harness;
mod hashing;
mod inbound;
mod injection;
mod k8s_identity;
mod kubernetes;
mod kubernetes_watches;
mod load_reports;
mod local_mesh;
mod nack;
mod pod_security;
mod protocol;
mod rapid_reset;
mod replicas;
mod resilience;
mod routes;
mod scope;
mod server_side_apply;
mod slow_clients;
mod upstream_http;
mod virtual_service;
mod watchdog;
mod xds_v3;
mod xds_v3_envoy;
mod xds_v3_load;
