//! The config model: DestinationRule, Service and EndpointSlice objects, parsed
//! from YAML documents and validated, with errors that name the file, the
//! object, the field path and the reason.

pub mod authorization;
pub mod crd;
pub mod gateway;
pub mod gateway_api;
pub mod kube;
pub mod parse;
pub mod route;
pub mod rule;
pub mod security;
pub mod status;
pub mod virtual_service;

pub use parse::{parse_documents, ConfigError, Object};
