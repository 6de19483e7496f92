//! The aggregated discovery service (state of the world and delta) and the
//! registry of connected proxies behind the proxy-status view.

pub mod registry;
pub mod server;
pub(crate) mod session;

#[cfg(test)]
mod tests;
