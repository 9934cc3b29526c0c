//! A VM's backend state on the move (live migration, docs/migration.md): what
//! vhost-user's device-state transfer (`SET_DEVICE_STATE_FD`, `CHECK_DEVICE_STATE`)
//! carries from the host a VM leaves to the host it arrives at.
//!
//! The state is the mux's export of the VM ([`crate::mux::Mux::export_vm`]: entries,
//! quarantine, timers as time left, the ID counter) followed by the VM's rx backlog (the
//! messages accepted for it and not yet in its rx ring), one record each, so nothing
//! already accepted is lost. The source gives the VM's address up; the destination
//! takes it over, imports, and the VM goes on with the same `pv_cm_id`s.

use std::io;

use pvcm_wire::Gid;

use crate::mux::{FIRST_FOREIGN_KIND, MigrateError, VmId, put_record, records};
use crate::port::PortError;
use crate::rx::RxMsg;
use crate::shared::Shared;
use crate::vm_port::{Lifecycle, VmPort};

/// One rx backlog message (its bytes as they go into an rx buffer).
const REC_BACKLOG: u8 = FIRST_FOREIGN_KIND;

/// Why a VM's state could not leave or arrive (a vhost-user device-state transfer).
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The front-end asked for a transfer in a phase other than STOPPED.
    #[error("state transfer in phase {0}: only STOPPED")]
    Phase(String),
    /// CHECK_DEVICE_STATE came without SET_DEVICE_STATE_FD.
    #[error("no device state transfer was started")]
    NotStarted,
    /// Writing the saved state to the front-end failed.
    #[error("writing the state: {0}")]
    Write(#[source] io::Error),
    /// Reading the state to load failed.
    #[error("reading the state: {0}")]
    Read(#[source] io::Error),
    /// The thread writing the state panicked.
    #[error("the state writer panicked")]
    WriterPanicked,
    /// The thread reading the state panicked.
    #[error("the state reader panicked")]
    ReaderPanicked,
    /// Save: the VM has no session here.
    #[error("the VM is not attached (nothing to save)")]
    NotAttached,
    /// Load: the VM is attached here already.
    #[error("the VM is already attached here")]
    AlreadyAttached,
    /// The state's records end inside one.
    #[error("VM state truncated at byte {0}")]
    Truncated(usize),
    /// A backlog record is not an rx message.
    #[error("a bad rx backlog message")]
    BadBacklogMessage,
    /// A record of a kind this version does not know.
    #[error("unknown VM state record {0:#x}")]
    UnknownRecord(u8),
    /// The port could not take the VM's address over.
    #[error(transparent)]
    Claim(#[from] PortError),
    /// The mux refused to export or import the VM's entries.
    #[error(transparent)]
    Mux(#[from] MigrateError),
    /// The state is another VM's.
    #[error("the state is VM {found:?}'s, not this port's ({name} {gid})")]
    OtherVm {
        /// The VM the state is of, if the mux knew it.
        found: Option<String>,
        /// This port's VM.
        name: String,
        /// Its GID.
        gid: Gid,
    },
}

impl Shared {
    /// Takes the port's VM out (export, backlog, address) and returns its state. The VM
    /// is no longer this host's; its vhost-user session ending later releases nothing.
    pub(crate) fn migrate_out(&self, port: &VmPort) -> Result<Vec<u8>, MigrationError> {
        let mut life = port.lifecycle();
        let Some(vm) = life.vm() else {
            return Err(MigrationError::NotAttached);
        };
        let (mut blob, next) = {
            let mut core = self.lock_core();
            let blob = core.mux.export_vm(vm)?;
            core.by_vm.remove(&vm);
            core.commit();
            (blob, core.mux.next_deadline())
        };
        let mut rx = port.lock_rx();
        let mut queued = 0;
        while let Some(m) = rx.pop_front() {
            put_record(&mut blob, REC_BACKLOG, m.bytes());
            queued += 1;
        }
        drop(rx);
        self.port.release(port.index);
        *life = Lifecycle::Departed {
            state: blob.clone(),
        };
        drop(life);
        self.note_deadline(next);
        tracing::info!(parent: &port.span, bytes = blob.len(), queued, "VM state saved: the VM leaves this host");
        Ok(blob)
    }

    /// Takes the port's VM in from `blob` ([`Shared::migrate_out`] on another host):
    /// takes its address over, imports its entries, queues its backlog.
    pub(crate) fn migrate_in(&self, port: &VmPort, blob: &[u8]) -> Result<VmId, MigrationError> {
        let mut mux_part = Vec::with_capacity(blob.len());
        let mut backlog = Vec::new();
        for r in records(blob) {
            let (kind, p) = r.map_err(MigrationError::Truncated)?;
            if kind == REC_BACKLOG {
                backlog.push(RxMsg::from_bytes(p).ok_or(MigrationError::BadBacklogMessage)?);
            } else if kind < FIRST_FOREIGN_KIND {
                put_record(&mut mux_part, kind, p);
            } else {
                return Err(MigrationError::UnknownRecord(kind));
            }
        }
        let mut life = port.lifecycle();
        if life.vm().is_some() {
            return Err(MigrationError::AlreadyAttached);
        }
        let bound_now = self.port.claim(port.index)?;
        let (vm, next) = {
            let mut core = self.lock_core();
            let vm = match core.mux.import_vm(&mux_part) {
                Ok(vm) => vm,
                Err(e) => {
                    drop(core);
                    if bound_now {
                        self.port.release(port.index);
                    }
                    return Err(e.into());
                }
            };
            let cfg = core.mux.vm_config(vm).cloned();
            if cfg.as_ref().map(|c| (c.gid, &c.more_gids, c.id_range))
                != Some((
                    port.spec.vm.gid,
                    &port.spec.vm.more_gids,
                    port.spec.vm.id_range,
                ))
            {
                // Not this port's VM: undo (export puts it back out) and refuse.
                let _ = core.mux.export_vm(vm);
                core.commit();
                drop(core);
                if bound_now {
                    self.port.release(port.index);
                }
                return Err(MigrationError::OtherVm {
                    found: cfg.map(|c| c.name),
                    name: port.spec.vm.name.clone(),
                    gid: port.spec.vm.gid,
                });
            }
            core.by_vm.insert(vm, port.index);
            core.commit();
            (vm, core.mux.next_deadline())
        };
        *life = Lifecycle::Attached {
            vm,
            tx_resume: None,
        };
        drop(life);
        let queued = backlog.len();
        for m in backlog {
            port.push_rx(m);
        }
        port.wake_rx();
        self.note_deadline(next);
        tracing::info!(parent: &port.span, mux_vm = vm.0, queued, "VM state loaded: the VM continues on this host");
        Ok(vm)
    }
}
