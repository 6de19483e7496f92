//! End-to-end tests: real control plane, sidecars and fake-service backends
//! on loopback, real HTTP and gRPC traffic.

mod admission;
mod authorization;
mod balancing;
mod bench;
mod capture;
mod capture_rules;
mod config;
mod connection_pool;
mod deploy;
mod edge;
mod fake_kube;
mod gateway_api;
mod grpc_interop;
mod harness;
mod hashing;
mod inbound;
mod k8s_identity;
mod kubernetes;
mod load_reports;
mod local_mesh;
mod mtls;
mod nack;
mod pod_security;
mod protocol;
mod rapid_reset;
mod replicas;
mod resilience;
mod routes;
mod scope;
mod slow_clients;
mod timeouts;
mod upstream_http;
mod virtual_service;
mod xds_v3;
mod xds_v3_envoy;
