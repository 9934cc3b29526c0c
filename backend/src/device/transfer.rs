//! Moving a VM: the device-state transfer of a live migration (`SET_DEVICE_STATE_FD`,
//! `CHECK_DEVICE_STATE`), and adoption: what a VM that starts running on this host
//! without its state is (a fresh boot, or a source resumed after a failed migration).

use std::fs::File;
use std::io::{self, Read, Write};

use vhost::vhost_user::message::{VhostTransferStateDirection, VhostTransferStatePhase};

use super::PvcmDevice;
use crate::migration::MigrationError;
use crate::vm_port::{Lifecycle, lock};

/// The largest device state accepted on load: 64-byte entries and 256-byte backlog
/// messages, far above any VM's quota and backlog budget.
pub(super) const MAX_STATE_BYTES: u64 = 1 << 30;
/// A device-state transfer in progress (`SET_DEVICE_STATE_FD` started it; the pipe is
/// served on its own thread, as the protocol wants; `CHECK_DEVICE_STATE` ends it).
#[derive(Debug)]
pub(super) enum Transfer {
    /// Writing the saved state to the front-end.
    Saving(std::thread::JoinHandle<io::Result<()>>),
    /// Reading the state to load.
    Loading(std::thread::JoinHandle<io::Result<Vec<u8>>>),
    /// Refused at the start; the check reports it.
    Failed(MigrationError),
}

impl PvcmDevice {
    /// The guest kicked a ring, so the VM runs on this host: an incoming VM whose state
    /// never came is a fresh boot (attach it); one whose state left is back because the
    /// migration failed and the source resumed (load the saved state again).
    pub(super) fn vm_runs_here(&self) {
        let mut life = self.port.lifecycle();
        match &mut *life {
            Lifecycle::Departed { state } => {
                let blob = std::mem::take(state);
                *life = Lifecycle::Detached;
                drop(life);
                match self.shared.migrate_in(&self.port, &blob) {
                    Ok(_) => {
                        tracing::warn!("the VM runs here again after leaving: its state is back")
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the VM runs here again but its state cannot come back")
                    }
                }
            }
            Lifecycle::Awaiting => {
                *life = Lifecycle::Detached;
                drop(life);
                match self.shared.port.claim(self.port.index) {
                    Ok(_) => {
                        tracing::info!("incoming VM started without a state: a fresh boot here");
                        self.shared.attach(&self.port);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "incoming VM started but its address cannot be taken")
                    }
                }
            }
            Lifecycle::Detached | Lifecycle::Restored { .. } | Lifecycle::Attached { .. } => {}
        }
    }

    /// Starts a transfer of the device state through `file` (saving: on its own thread,
    /// as the protocol wants; loading: read on its own thread, loaded at the check).
    pub(super) fn start_transfer(
        &self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: File,
    ) {
        let t = if phase != VhostTransferStatePhase::STOPPED {
            Transfer::Failed(MigrationError::Phase(format!("{phase:?}")))
        } else if direction == VhostTransferStateDirection::SAVE {
            match self.shared.migrate_out(&self.port) {
                Ok(blob) => Transfer::Saving(std::thread::spawn(move || {
                    let mut f = file;
                    f.write_all(&blob)
                })),
                Err(e) => Transfer::Failed(e),
            }
        } else {
            Transfer::Loading(std::thread::spawn(move || {
                let mut f = file;
                let mut b = Vec::new();
                // A state is a few MiB at most (64 bytes per entry); a front-end that
                // sends more is not sending pvcm state.
                (&mut f).take(MAX_STATE_BYTES + 1).read_to_end(&mut b)?;
                if b.len() as u64 > MAX_STATE_BYTES {
                    return Err(io::Error::other("device state larger than the limit"));
                }
                Ok(b)
            }))
        };
        if let Transfer::Failed(e) = &t {
            tracing::error!(error = %e, "device state transfer refused");
        }
        *lock(&self.transfer) = Some(t);
    }

    /// Ends the transfer in progress: its result, and for a load, the state loaded.
    pub(super) fn end_transfer(&self) -> io::Result<()> {
        let t = lock(&self.transfer).take();
        let r = match t {
            None => Err(MigrationError::NotStarted),
            Some(Transfer::Failed(e)) => Err(e),
            Some(Transfer::Saving(h)) => match h.join() {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(MigrationError::Write(e)),
                Err(_) => Err(MigrationError::WriterPanicked),
            },
            Some(Transfer::Loading(h)) => match h.join() {
                Ok(Ok(blob)) => self.shared.migrate_in(&self.port, &blob).map(|_| ()),
                Ok(Err(e)) => Err(MigrationError::Read(e)),
                Err(_) => Err(MigrationError::ReaderPanicked),
            },
        };
        r.map_err(|e| {
            tracing::error!(error = %e, "device state transfer failed");
            io::Error::other(e)
        })
    }
}
