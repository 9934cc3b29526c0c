//! The daemon's error type.

use std::io;

use crate::config::ConfigError;

/// A daemon error: what failed, for the operator, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid (the message names the option).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `--state-dir` could not be used.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The VMs changed at runtime could not be restored or served.
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    /// An OS call failed while setting up (binding a socket, creating an fd).
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the VM or option concerned.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A socket could not be put at its path (`what`: the VM's vhost-user socket, or
    /// the control socket).
    #[error("{what}: {source}")]
    Socket {
        /// Which socket: `VM NAME: vhost-user socket`, `--control`.
        what: String,
        /// Why.
        #[source]
        source: crate::files::SocketPathError,
    },
    /// The wire port could not be opened, or a VM's address not bound for it.
    #[error(transparent)]
    Port(#[from] crate::port::Error),
}
