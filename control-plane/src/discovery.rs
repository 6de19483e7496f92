//! The aggregated discovery service (state of the world and delta) and the
//! registry of connected proxies behind the proxy-status view; [`v3`]
//! serves the same streams in Envoy's envelopes.

pub mod metrics;
pub mod registry;
pub mod server;
pub(crate) mod session;
pub mod v3;

#[cfg(test)]
mod tests;
