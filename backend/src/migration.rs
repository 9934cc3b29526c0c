//! A VM's backend state on the move (live migration, docs/migration.md): what
//! vhost-user's device-state transfer (`SET_DEVICE_STATE_FD`, `CHECK_DEVICE_STATE`)
//! carries from the host a VM leaves to the host it arrives at.
//!
//! The state is the mux's export of the VM ([`crate::mux::Mux::export_vm`]: entries,
//! quarantine, timers as time left, the ID counter) followed by the VM's rx backlog (the
//! messages accepted for it and not yet in its rx ring), one record each, so nothing
//! already accepted is lost. The source gives the VM's address up; the destination
//! takes it over, imports, and the VM goes on with the same `pv_cm_id`s.

use std::sync::atomic::Ordering;

use crate::mux::{FIRST_FOREIGN_KIND, VmId, put_record, records};
use crate::rx::RxMsg;
use crate::shared::Shared;
use crate::vm_port::{VmPort, lock};

/// One rx backlog message (its bytes as they go into an rx buffer).
const REC_BACKLOG: u8 = FIRST_FOREIGN_KIND;

impl Shared {
    /// Takes the port's VM out (export, backlog, address) and returns its state. The VM
    /// is no longer this host's; its vhost-user session ending later releases nothing.
    pub(crate) fn migrate_out(&self, port: &VmPort) -> Result<Vec<u8>, String> {
        let mut cur = lock(&port.current);
        let Some(vm) = *cur else {
            return Err("the VM is not attached (nothing to save)".into());
        };
        let (mut blob, next) = {
            let mut core = self.lock_core();
            let blob = core.mux.export_vm(vm).map_err(|e| e.to_string())?;
            core.by_vm.remove(&vm);
            core.commit();
            (blob, core.mux.next_deadline())
        };
        *cur = None;
        drop(cur);
        let mut rx = port.lock_rx();
        let mut queued = 0;
        while let Some(m) = rx.pop_front() {
            put_record(&mut blob, REC_BACKLOG, m.bytes());
            queued += 1;
        }
        drop(rx);
        self.port.release(port.index);
        *lock(&port.migrated_out) = Some(blob.clone());
        self.note_deadline(next);
        tracing::info!(parent: &port.span, bytes = blob.len(), queued, "VM state saved: the VM leaves this host");
        Ok(blob)
    }

    /// Takes the port's VM in from `blob` ([`Shared::migrate_out`] on another host):
    /// takes its address over, imports its entries, queues its backlog.
    pub(crate) fn migrate_in(&self, port: &VmPort, blob: &[u8]) -> Result<VmId, String> {
        let mut mux_part = Vec::with_capacity(blob.len());
        let mut backlog = Vec::new();
        for r in records(blob) {
            let (kind, p) = r.map_err(|at| format!("VM state truncated at byte {at}"))?;
            if kind == REC_BACKLOG {
                backlog.push(RxMsg::from_bytes(p).ok_or("a bad rx backlog message")?);
            } else if kind < FIRST_FOREIGN_KIND {
                put_record(&mut mux_part, kind, p);
            } else {
                return Err(format!("unknown VM state record {kind:#x}"));
            }
        }
        let mut cur = lock(&port.current);
        if cur.is_some() {
            return Err("the VM is already attached here".into());
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
                    return Err(e.to_string());
                }
            };
            let cfg = core.mux.vm_config(vm).cloned();
            if cfg.as_ref().map(|c| (c.gid, c.id_range))
                != Some((port.spec.vm.gid, port.spec.vm.id_range))
            {
                // Not this port's VM: undo (export puts it back out) and refuse.
                let _ = core.mux.export_vm(vm);
                core.commit();
                drop(core);
                if bound_now {
                    self.port.release(port.index);
                }
                return Err(format!(
                    "the state is VM {:?}'s, not this port's ({} {})",
                    cfg.map(|c| c.name),
                    port.spec.vm.name,
                    port.spec.vm.gid
                ));
            }
            core.by_vm.insert(vm, port.index);
            core.commit();
            (vm, core.mux.next_deadline())
        };
        *cur = Some(vm);
        drop(cur);
        port.awaiting.store(false, Ordering::Release);
        *lock(&port.migrated_out) = None;
        let queued = backlog.len();
        for m in backlog {
            port.push_rx(m);
        }
        port.wake_rx();
        self.note_deadline(next);
        tracing::info!(parent: &port.span, ?vm, queued, "VM state loaded: the VM continues on this host");
        Ok(vm)
    }
}
