//! The lab's error type: what stopped a run, for the operator running it.

use std::io;

use pvcm_guest::cm::CmError;
use pvcm_guest::device::DeviceError;

/// Why a lab run (or one VM of it) stopped.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The options ask for something the run cannot do.
    #[error("{0}")]
    Usage(String),
    /// An OS call failed (a backend process, a socket, a directory, a control socket).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// An OS call failed, in a step whose name the error's own message carries.
    #[error(transparent)]
    Os(#[from] io::Error),
    /// A VM's device or CM agent failed.
    #[error("{vm}: {source}")]
    Device {
        /// The VM (or the step) it happened in.
        vm: String,
        /// The error.
        #[source]
        source: DeviceError,
    },
    /// A device or CM agent failed, in a step whose name the error carries.
    #[error(transparent)]
    Guest(#[from] DeviceError),
    /// A CM call (connect, listen, accept, disconnect) was refused.
    #[error(transparent)]
    Cm(#[from] CmError),
    /// Something did not happen in time.
    #[error("{0}: not done in time")]
    Timeout(String),
    /// Another part of the run failed first.
    #[error("aborted")]
    Aborted,
    /// The VM's program never started (its device did not come up, or the run was
    /// aborted first).
    #[error("not started")]
    NotStarted,
    /// Several parts failed.
    #[error("{}", join(.0))]
    Several(Vec<LabError>),
    /// A thread of the run panicked.
    #[error("{0} panicked")]
    Panicked(String),
    /// The run went otherwise than it must (fewer connections, lost frames, ...).
    #[error("{0}")]
    Failed(String),
}

fn join(errors: &[LabError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A lab result.
pub type LabResult<T> = Result<T, LabError>;

impl LabError {
    /// An OS error while doing `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> LabError {
        let what = what.into();
        move |source| LabError::Io { what, source }
    }

    /// A device error in `vm` (or a step).
    pub fn device(vm: impl Into<String>) -> impl FnOnce(DeviceError) -> LabError {
        let vm = vm.into();
        move |source| LabError::Device { vm, source }
    }
}

impl From<String> for LabError {
    fn from(why: String) -> LabError {
        LabError::Failed(why)
    }
}

impl From<&str> for LabError {
    fn from(why: &str) -> LabError {
        LabError::Failed(why.to_string())
    }
}
