//! The discovery client: one aggregated state-of-the-world stream to the
//! control plane, ACK/NACK per type, reconnect with jittered backoff.

pub mod client;
pub mod load_report;
