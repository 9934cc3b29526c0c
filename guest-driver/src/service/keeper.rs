//! The device's keeper: a second process that holds the service's end of CUSE, so that
//! the callers' files are answered even when the service is killed outright.
//!
//! A service that stops on a signal answers its callers' files until they close
//! ([`super::closing`]). One killed outright (SIGKILL, the OOM killer, a crash) cannot:
//! the kernel then fails the calls on its files, but answers their `poll()` with POLLERR
//! alone and never wakes a poller, so a program that waits in `poll()` for POLLIN and
//! reads only then (rping 59 and later, most event loops) spins or waits on. So the
//! service starts a keeper (`pvcm-guestd keep`, the same executable) that holds a
//! duplicate of its `/dev/cuse` descriptor and a page shared with it, where the service
//! keeps the highest poll handle the kernel gave it and how many files are open. The
//! keeper sleeps on the service's pidfd. When the service ends cleanly it dismisses the
//! keeper first (dropping its [`Keeper`]); when it dies, the keeper wakes every poll handle
//! up to that highest one (the kernel numbers them from 1 per connection and ignores
//! those it no longer knows) and answers the files as a stopped service does
//! ([`Closing`]), until they are closed or [`CLOSE_GRACE`] is over. Then it exits, and
//! with its descriptor the device goes, so a restarted service can create it again.
//!
//! The keeper ignores SIGTERM and SIGINT: systemd's stop of the unit after its main
//! process died sends them to it, and waits for it, which is the order wanted (the
//! device goes before the service starts again). Both killed at once (`systemctl kill
//! -s KILL`) leave nothing to answer: the kernel fails the files' calls, and pollers
//! are not woken.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::closing::{self, CLOSE_GRACE, Closing};
use super::cuse::{CuseDev, Reply};

/// The keeper's end of `/dev/cuse` (a duplicate of the service's).
const KEEPER_CUSE_FD: RawFd = 3;
/// The shared page, in the keeper.
const KEEPER_PAGE_FD: RawFd = 4;
/// The shared page's first word.
const MAGIC: u64 = u64::from_le_bytes(*b"pvcmkeep");
/// The most poll handles the keeper wakes (a bound on a corrupt page).
const MAX_WAKES: u64 = 1 << 20;

/// Errors of the keeper.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    /// A system call failed.
    #[error("keeper: {what}: {err}")]
    Sys {
        /// What was being done.
        what: &'static str,
        /// The error.
        err: io::Error,
    },
    /// The shared page is not the service's.
    #[error("keeper: descriptor {KEEPER_PAGE_FD} is not the service's shared page")]
    NotShared,
}

fn sys(what: &'static str) -> impl FnOnce(io::Error) -> KeeperError {
    move |err| KeeperError::Sys { what, err }
}

/// The page the service and its keeper share: atomics only.
#[repr(C)]
struct Page {
    magic: AtomicU64,
    /// The highest poll handle the kernel gave the service.
    max_kh: AtomicU64,
    /// Files open at the service.
    open: AtomicU64,
    /// Nonzero once the service ended cleanly: the keeper has nothing to do.
    clean: AtomicU64,
}

/// A shared mapping of a [`Page`].
struct Mapping {
    page: NonNull<Page>,
}

// SAFETY: the mapping is only read and written through the atomics of `Page`, which
// may be used from any thread; the pointer stays valid until `Drop` unmaps it.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps the page of `fd` (a memfd of at least one page).
    fn map(fd: RawFd) -> io::Result<Mapping> {
        // SAFETY: maps a new shared region of one page of `fd`; no existing memory is
        // touched, and the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page_len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast::<Page>())
            .map(|page| Mapping { page })
            .ok_or_else(|| io::Error::other("mmap returned null"))
    }

    fn page(&self) -> &Page {
        // SAFETY: `page` points to a live mapping of at least one page, which holds a
        // `Page` (atomics, any bit pattern valid), until `Drop`.
        unsafe { self.page.as_ref() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps the region `map` mapped; no reference to it outlives `self`.
        unsafe { libc::munmap(self.page.as_ptr().cast(), page_len()) };
    }
}

fn page_len() -> usize {
    // SAFETY: sysconf takes an integer name and returns a value.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n)
        .unwrap_or(4096)
        .max(std::mem::size_of::<Page>())
}

/// The service's side: the keeper process and the shared page. Dropping it dismisses
/// the keeper (the service ends cleanly, or did not start).
pub struct Keeper {
    map: Mapping,
    child: Option<Child>,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("pid", &self.child.as_ref().map(Child::id))
            .finish()
    }
}

impl Keeper {
    /// Starts `exe keep --parent PID` holding a duplicate of `cuse` and the shared page.
    pub fn spawn(exe: &str, cuse: &CuseDev) -> Result<Keeper, KeeperError> {
        let (memfd, map) = new_page()?;
        map.page().magic.store(MAGIC, Ordering::Release);
        // Above the numbers the keeper takes them at, so that no dup2 below closes the
        // other.
        let cuse_fd = dup_above(cuse.fd(), 10)?;
        let page_fd = dup_above(memfd.as_raw_fd(), 10)?;
        let (c, p) = (cuse_fd.as_raw_fd(), page_fd.as_raw_fd());
        let mut cmd = Command::new(exe);
        cmd.arg0("pvcm-guestd")
            .arg("keep")
            .arg("--parent")
            .arg(std::process::id().to_string())
            .stdin(Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec and only calls
        // dup2, which is async-signal-safe, on descriptors open in the parent (so in
        // the child); the copies it makes have no close-on-exec flag.
        unsafe {
            cmd.pre_exec(move || {
                for (from, to) in [(c, KEEPER_CUSE_FD), (p, KEEPER_PAGE_FD)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            })
        };
        let child = cmd.spawn().map_err(sys("starting the keeper"))?;
        Ok(Keeper {
            map,
            child: Some(child),
        })
    }

    /// The kernel gave poll handle `kh`.
    pub fn saw_poll(&self, kh: u64) {
        self.map.page().max_kh.fetch_max(kh, Ordering::Relaxed);
    }

    /// `n` files are open.
    pub fn set_open(&self, n: usize) {
        self.map.page().open.store(n as u64, Ordering::Relaxed);
    }
}

impl Drop for Keeper {
    /// The service ends cleanly: the keeper is stopped, with nothing to do.
    fn drop(&mut self) {
        self.map.page().clean.store(1, Ordering::Release);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A new shared page: its memfd and a mapping of it.
fn new_page() -> Result<(OwnedFd, Mapping), KeeperError> {
    let name = c"pvcm-guestd-keeper";
    // SAFETY: memfd_create takes a NUL-terminated name and flags and returns a new
    // descriptor or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(sys("memfd_create")(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sizes the memfd this function owns; no memory passed.
    if unsafe { libc::ftruncate(memfd.as_raw_fd(), page_len() as libc::off_t) } < 0 {
        return Err(sys("sizing the shared page")(io::Error::last_os_error()));
    }
    let map = Mapping::map(memfd.as_raw_fd()).map_err(sys("mapping the shared page"))?;
    Ok((memfd, map))
}

/// A close-on-exec duplicate of `fd` numbered `min` or above.
fn dup_above(fd: RawFd, min: RawFd) -> Result<OwnedFd, KeeperError> {
    // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor; no memory passed.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, min) };
    if d < 0 {
        return Err(sys("duplicating a descriptor")(io::Error::last_os_error()));
    }
    // SAFETY: `d` was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(d) })
}

/// `pvcm-guestd keep --parent PID`: waits for the service `parent` to end; if it died
/// without ending cleanly, wakes its pollers and answers its files ([`Closing`]).
pub fn keep(parent: i32) -> Result<(), KeeperError> {
    // SAFETY: ignoring signals installs no handler; the arguments are constants.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
    let map = Mapping::map(KEEPER_PAGE_FD).map_err(sys("mapping the shared page"))?;
    if map.page().magic.load(Ordering::Acquire) != MAGIC {
        return Err(KeeperError::NotShared);
    }
    // SAFETY: the service passed its CUSE descriptor at this number; this process owns
    // it from here on.
    let cuse = CuseDev::from_fd(unsafe { OwnedFd::from_raw_fd(KEEPER_CUSE_FD) });
    wait_for_exit(parent)?;
    let page = map.page();
    if page.clean.load(Ordering::Acquire) != 0 {
        return Ok(());
    }
    let max_kh = page.max_kh.load(Ordering::Relaxed).min(MAX_WAKES);
    let open = usize::try_from(page.open.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
    tracing::warn!(
        service = parent,
        open,
        poll_handles = max_kh,
        "the service died: waking its callers' pollers and answering their files until they close"
    );
    for kh in 1..=max_kh {
        cuse.write(Reply::notify_poll(kh).bytes())
            .map_err(sys("waking a poller"))?;
    }
    let mut c = Closing::new(open, Instant::now(), CLOSE_GRACE);
    closing::serve(&cuse, &mut c).map_err(sys("answering /dev/cuse"))?;
    tracing::info!(
        answered = c.answered,
        still_open = c.still_open(),
        "the dead service's files were answered until they closed"
    );
    Ok(())
}

/// Sleeps until process `pid` has exited (its pidfd readable).
fn wait_for_exit(pid: i32) -> Result<(), KeeperError> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ESRCH) => Ok(()),
            _ => Err(sys("pidfd_open")(e)),
        };
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    // The service may have ended before the pidfd was opened, and its pid been taken
    // by another process since: a parent that is no longer ours has ended.
    // SAFETY: getppid takes no arguments and cannot fail.
    if unsafe { libc::getppid() } != pid {
        return Ok(());
    }
    loop {
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, live across the call.
        let r = unsafe { libc::poll(&mut p, 1, -1) };
        if r > 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if r < 0 && e.raw_os_error() != Some(libc::EINTR) {
            return Err(sys("waiting for the service")(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_is_shared_between_two_mappings() {
        let (fd, a) = new_page().unwrap();
        let b = Mapping::map(fd.as_raw_fd()).unwrap();
        a.page().max_kh.fetch_max(9, Ordering::Relaxed);
        a.page().max_kh.fetch_max(4, Ordering::Relaxed);
        assert_eq!(b.page().max_kh.load(Ordering::Relaxed), 9);
    }

    #[test]
    fn a_process_that_has_ended_is_waited_for_at_once() {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id() as i32;
        c.wait().unwrap();
        // Reaped: the pid is gone (ESRCH), or taken by a process that is not our
        // parent.
        assert!(wait_for_exit(pid).is_ok());
    }
}
