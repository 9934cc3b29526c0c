//! A VM's sessions: the thread that serves one VM's vhost-user socket, one connection
//! after another, each with a fresh [`VhostUserDaemon`] and [`PvcmDevice`], attaching
//! the VM to the mux when a session begins and detaching it when the session ends.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::device::{PvcmDevice, RX_WAKE_EVENT};
use crate::shared::Shared;
use crate::stats::Io;
use crate::vm_port::{Session, VmPort, lock};

/// A VM thread's wait for its next connection: the listening socket and the port's
/// accept wake, polled together.
struct AcceptWait {
    epoll: Epoll,
}

impl AcceptWait {
    const CONNECTION: u64 = 0;
    const WAKE: u64 = 1;

    fn new(port: &VmPort, listener: &Listener) -> io::Result<AcceptWait> {
        let epoll = Epoll::new()?;
        for (fd, tok) in [
            (listener.as_raw_fd(), Self::CONNECTION),
            (port.accept_wake.as_raw_fd(), Self::WAKE),
        ] {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, tok),
            )?;
        }
        Ok(AcceptWait { epoll })
    }

    /// Waits until a connection waits to be accepted (true) or the port is woken
    /// (false: the daemon stops or the VM leaves).
    fn wait(&self) -> io::Result<bool> {
        let mut ev = [EpollEvent::default(); 2];
        loop {
            match self.epoll.wait(-1, &mut ev) {
                Ok(n) => return Ok(!ev[..n].iter().any(|e| e.data() == Self::WAKE)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// Serves one VM's socket, one connection after another, until the daemon stops or
/// the VM is removed. Between sessions it waits for a connection or the port's accept
/// wake, so it never blocks in accept where a stop cannot reach it.
pub(crate) fn vm_thread(shared: Arc<Shared>, port: Arc<VmPort>, mut listener: Listener) {
    let span = port.span.clone();
    let _g = span.enter();
    let done = || shared.stopping() || port.leaving.load(Ordering::Acquire);
    let accept = match AcceptWait::new(&port, &listener) {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "cannot poll the VM's socket: the VM is not served");
            return;
        }
    };
    loop {
        if done() {
            break;
        }
        match accept.wait() {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "waiting for a connection failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        }
        if done() {
            break;
        }
        let dev = match PvcmDevice::new(shared.clone(), port.clone()) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "cannot create the device");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let backend = Arc::new(RwLock::new(dev));
        let mut daemon = match VhostUserDaemon::new(
            format!("pvcm-{}", port.spec.vm.name),
            backend,
            GuestMemoryAtomic::new(crate::device::Mem::new()),
        ) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "cannot create the vhost-user daemon");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        for h in daemon.get_epoll_handlers() {
            if let Err(e) = h.register_listener(
                port.rx_wake.as_raw_fd(),
                EventSet::IN,
                u64::from(RX_WAKE_EVENT),
            ) {
                tracing::error!(error = %e, "cannot register the rx wake event");
            }
        }
        if let Err(e) = daemon.start(&mut listener) {
            if done() {
                break;
            }
            tracing::warn!(error = %e, "accept failed");
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        if done() {
            daemon.request_shutdown();
            let _ = daemon.wait();
            break;
        }
        port.counters.add(Io::Sessions, 1);
        // An incoming VM attaches when its state arrives (or its rings start without).
        let attached = shared.attach_session(&port);
        let vm = attached.map(|(vm, _)| vm);
        if attached.is_some_and(|(_, reconnected)| reconnected) {
            tracing::info!("restored VM reconnected: its connections continue");
            // What waited in the backlog during the gap goes to the new session now.
            port.wake_rx();
        }
        *lock(&port.session) = daemon.shutdown_handle().map(Session);
        if done() {
            daemon.request_shutdown();
        }
        match vm {
            Some(vm) => tracing::info!(mux_vm = vm.0, "vhost-user session started"),
            None => tracing::info!(
                "vhost-user session started (the VM attaches when its state arrives)"
            ),
        }
        match daemon.wait() {
            Ok(()) => tracing::info!("vhost-user session ended"),
            // The VM went away (QEMU stopped, killed or reconnecting): a normal end.
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => tracing::info!("vhost-user session ended: the VM disconnected"),
            Err(e) => tracing::warn!(error = %e, "vhost-user session ended with an error"),
        }
        *lock(&port.session) = None;
        port.publish_rx_ring(None);
        if shared.stopping() && shared.keeps_state {
            // A clean stop with --state-dir: the next daemon restores the VM's
            // connections, so they are not released.
            drop(daemon);
            break;
        }
        shared.detach(&port);
        // Dropping the daemon stops and joins its vring worker (exit event).
        drop(daemon);
    }
    tracing::debug!("VM thread done");
}
