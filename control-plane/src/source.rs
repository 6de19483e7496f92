//! Config sources: where desired state comes from. Each source produces
//! [`crate::store::Store`] snapshots; the rest of the control plane does not
//! know which source runs.

pub mod files;
pub mod kubernetes;
