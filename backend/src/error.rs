//! The daemon's error type.

use std::io;

use crate::config::ConfigError;

/// A daemon error: what failed, for the operator, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid (the message names the option).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An OS call failed while setting up (binding a socket, creating an fd).
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the VM or option concerned.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The wire port could not be set up or refused a VM (the message says why and,
    /// where it can, what to do: capabilities, the kernel CM, the GID table).
    #[error("{0}")]
    Port(String),
}
