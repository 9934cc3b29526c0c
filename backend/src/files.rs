//! Files the daemon creates for itself (the capture, the state journal, its sockets),
//! and the users and groups its sockets are given to.
//!
//! A socket is put only where nothing is, or where a stale socket is (one nobody
//! listens on: a connect is refused); a file of another kind, or a socket another
//! process listens on, is refused (`check_socket_path`). The daemon removes only the
//! socket files it created, and only while they are still the files it created
//! (`SocketFile`).

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Who may connect to a Unix socket the daemon listens on: the socket file's owner,
/// group and permission bits (the IDs resolved; `None` leaves the daemon's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketAccess {
    /// The file's owner.
    pub owner: Option<u32>,
    /// The file's group.
    pub group: Option<u32>,
    /// The permission bits (at most 0o777).
    pub mode: u32,
}

impl SocketAccess {
    /// The VMs' vhost-user sockets by default: the daemon's user and group may connect,
    /// nobody else.
    pub const VM_DEFAULT: SocketAccess = SocketAccess {
        owner: None,
        group: None,
        mode: 0o660,
    };
    /// The control socket by default: the daemon's user only.
    pub const CONTROL_DEFAULT: SocketAccess = SocketAccess {
        owner: None,
        group: None,
        mode: 0o600,
    };
}

/// Why the daemon does not put a socket at a path.
#[derive(Debug, thiserror::Error)]
pub enum SocketPathError {
    /// A file that is not a socket is at the path.
    #[error(
        "{}: a file that is not a socket is there; the daemon replaces nothing but a stale \
         socket: move the file away or choose another path",
        .0.display()
    )]
    NotASocket(PathBuf),
    /// Another process listens on the socket at the path.
    #[error(
        "{}: another process listens on this socket (another pvcm-backend?); the daemon \
         does not take a live socket over: stop that process or choose another path",
        .0.display()
    )]
    Live(PathBuf),
    /// A socket is at the path and a connect to it failed otherwise than refused.
    #[error(
        "{}: cannot tell whether the socket there is live ({source}); the daemon replaces \
         only a socket that refuses connections",
        path.display()
    )]
    Probe {
        /// The path.
        path: PathBuf,
        /// What the connect returned.
        #[source]
        source: io::Error,
    },
    /// The socket could not be created.
    #[error(
        "{}: {source}; check that its directory exists and the daemon may create files \
         there",
        path.display()
    )]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// What is at a socket's path that the daemon may put its socket at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SocketPlace {
    /// Nothing.
    Free,
    /// A socket nobody listens on (a connect is refused).
    Stale,
}

/// Whether the daemon may put a socket at `path`: nothing is there, or a stale socket
/// (a connect is refused: nobody listens). A file of another kind (a symlink included)
/// and a socket another process listens on are refused.
pub(crate) fn check_socket_path(path: &Path) -> Result<SocketPlace, SocketPathError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(SocketPlace::Free),
        Err(source) => {
            return Err(SocketPathError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    if !meta.file_type().is_socket() {
        return Err(SocketPathError::NotASocket(path.to_path_buf()));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(SocketPathError::Live(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(SocketPlace::Stale),
        Err(source) => Err(SocketPathError::Probe {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Options for a file only the daemon's user may read or write: created mode 0600, and
/// never through a symlink (`O_NOFOLLOW`), so a link another local user planted at the
/// path cannot redirect the daemon's writes. Add the access mode and creation flags.
pub(crate) fn owner_only() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}

/// Binds a Unix stream socket at `path` with the owner, group and mode `access` asks
/// for, where [`check_socket_path`] allows it. The socket is bound inside a fresh
/// directory next to `path` that only the daemon's user can enter (mode 0700), given
/// its owner, group and mode there, then renamed into place (replacing a stale socket):
/// nobody can connect to it before it has the asked permissions, whatever the umask.
/// Where the path was free, the rename does not replace what may have appeared there
/// meanwhile (`RENAME_NOREPLACE`); the path is looked at again instead. The
/// [`SocketFile`] removes the socket again.
pub(crate) fn bind_socket(
    path: &Path,
    access: &SocketAccess,
) -> Result<(UnixListener, SocketFile), SocketPathError> {
    let io = |source| SocketPathError::Io {
        path: path.to_path_buf(),
        source,
    };
    // Refused before anything is created next to the path.
    check_socket_path(path)?;
    static SEQ: AtomicU32 = AtomicU32::new(0);
    // A short name: a Unix socket's path is limited to 107 bytes, and the temporary one
    // should be no longer than the socket's own.
    let dir = path.with_file_name(format!(
        ".{:x}.{:x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(io)?;
    let tmp = dir.join("s");
    let placed = UnixListener::bind(&tmp)
        .and_then(|l| {
            if access.owner.is_some() || access.group.is_some() {
                std::os::unix::fs::lchown(&tmp, access.owner, access.group)?;
            }
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(access.mode))?;
            // The file's identity, which the rename keeps.
            let m = std::fs::symlink_metadata(&tmp)?;
            Ok((l, m))
        })
        .map_err(io)
        .and_then(|(l, m)| {
            place(&tmp, path)?;
            let file = SocketFile {
                path: path.to_path_buf(),
                dev: m.dev(),
                ino: m.ino(),
            };
            Ok((l, file))
        });
    if placed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    let _ = std::fs::remove_dir(&dir);
    placed
}

/// Renames the socket bound at `tmp` to `path` where [`check_socket_path`] allows it:
/// over a stale socket, or to a free path without replacing what appeared there since
/// the look (which is then looked at again).
fn place(tmp: &Path, path: &Path) -> Result<(), SocketPathError> {
    let io = |source| SocketPathError::Io {
        path: path.to_path_buf(),
        source,
    };
    for _ in 0..3 {
        match check_socket_path(path)? {
            SocketPlace::Stale => return std::fs::rename(tmp, path).map_err(io),
            SocketPlace::Free => match rename_noreplace(tmp, path) {
                Ok(()) => return Ok(()),
                // Something appeared at the path: look again.
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
                // A filesystem without RENAME_NOREPLACE.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    return std::fs::rename(tmp, path).map_err(io);
                }
                Err(e) => return Err(io(e)),
            },
        }
    }
    Err(io(io::Error::from_raw_os_error(libc::EEXIST)))
}

/// `renameat2(from, to, RENAME_NOREPLACE)`: fails with `EEXIST` rather than replace.
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the path"))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: both paths are NUL-terminated strings that live across the call; the
    // directory descriptors are AT_FDCWD; renameat2 reads the paths and nothing else.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A socket file the daemon created, removed when this is dropped if the path still
/// holds that file (same device and inode): a file put there since by someone else
/// stays.
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if m.file_type().is_socket() && m.dev() == self.dev && m.ino() == self.ino => {
                let _ = std::fs::remove_file(&self.path);
            }
            Ok(_) => tracing::info!(
                path = %self.path.display(),
                "the socket file was replaced by another since it was created: left in place"
            ),
            Err(_) => {}
        }
    }
}

/// The ID of the user named `name` (NSS included); `None` when no such user exists.
pub(crate) fn user_id(name: &str) -> Option<u32> {
    lookup(name, true)
}

/// The ID of the group named `name`; `None` when no such group exists.
pub(crate) fn group_id(name: &str) -> Option<u32> {
    lookup(name, false)
}

/// Looks a user (`user`) or group name up with the reentrant libc calls, growing the
/// buffer while it is too small.
fn lookup(name: &str, user: bool) -> Option<u32> {
    let cname = CString::new(name).ok()?;
    let mut buf: Vec<libc::c_char> = vec![0; 4096];
    loop {
        let (r, id) = if user {
            // SAFETY: passwd is plain data (integers and pointers), zero is a valid value.
            let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
            let mut res: *mut libc::passwd = std::ptr::null_mut();
            // SAFETY: every pointer is valid for the call: `cname` is NUL-terminated,
            // `pwd` and `res` are live locals, `buf` holds `buf.len()` bytes that the call
            // may write the record's strings into.
            let r = unsafe {
                libc::getpwnam_r(
                    cname.as_ptr(),
                    &mut pwd,
                    buf.as_mut_ptr(),
                    buf.len(),
                    &mut res,
                )
            };
            (r, (!res.is_null()).then_some(pwd.pw_uid))
        } else {
            // SAFETY: group is plain data (integers and pointers), zero is a valid value.
            let mut grp: libc::group = unsafe { std::mem::zeroed() };
            let mut res: *mut libc::group = std::ptr::null_mut();
            // SAFETY: as for getpwnam_r above.
            let r = unsafe {
                libc::getgrnam_r(
                    cname.as_ptr(),
                    &mut grp,
                    buf.as_mut_ptr(),
                    buf.len(),
                    &mut res,
                )
            };
            (r, (!res.is_null()).then_some(grp.gr_gid))
        };
        if r == libc::ERANGE && buf.len() < 1 << 20 {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        return if r == 0 { id } else { None };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_socket_gets_the_asked_mode_and_group_and_replaces_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vm.sock");
        // A stale socket: bound, nobody listening any more.
        drop(UnixListener::bind(&p).unwrap());
        // SAFETY: getegid has no preconditions.
        let gid = unsafe { libc::getegid() };
        let access = SocketAccess {
            owner: None,
            group: Some(gid),
            mode: 0o640,
        };
        let _l = bind_socket(&p, &access).unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.mode() & 0o777, 0o640);
        assert_eq!(m.gid(), gid);
        use std::os::unix::fs::FileTypeExt;
        assert!(m.file_type().is_socket());
        // Nothing else is left in the directory, and it answers.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        std::os::unix::net::UnixStream::connect(&p).unwrap();
        // A socket whose directory is missing is an error, and leaves nothing.
        let bad = dir.path().join("no/such/dir/vm.sock");
        assert!(bind_socket(&bad, &access).is_err());
    }

    fn access() -> SocketAccess {
        SocketAccess {
            owner: None,
            group: None,
            mode: 0o600,
        }
    }

    #[test]
    fn a_file_that_is_not_a_socket_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("precious.txt");
        std::fs::write(&p, b"keep me").unwrap();
        let e = bind_socket(&p, &access()).unwrap_err();
        assert!(matches!(e, SocketPathError::NotASocket(_)), "{e}");
        assert!(e.to_string().contains("precious.txt"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"keep me");
        // Nor a directory, nor a symlink (to a socket or anything else).
        let d = dir.path().join("d");
        std::fs::create_dir(&d).unwrap();
        assert!(matches!(
            bind_socket(&d, &access()),
            Err(SocketPathError::NotASocket(_))
        ));
        let stale = dir.path().join("stale.sock");
        drop(UnixListener::bind(&stale).unwrap());
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&stale, &link).unwrap();
        assert!(matches!(
            bind_socket(&link, &access()),
            Err(SocketPathError::NotASocket(_))
        ));
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        // Nothing was left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 4);
    }

    #[test]
    fn a_live_socket_is_refused_and_left_listening() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vm.sock");
        let other = UnixListener::bind(&p).unwrap();
        let e = bind_socket(&p, &access()).unwrap_err();
        assert!(matches!(e, SocketPathError::Live(_)), "{e}");
        assert!(e.to_string().contains("another process listens"), "{e}");
        // The other's socket is still the one at the path: a connect reaches it.
        let _c = UnixStream::connect(&p).unwrap();
        other.accept().unwrap();
    }

    #[test]
    fn only_the_socket_file_it_created_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vm.sock");
        let (l, file) = bind_socket(&p, &access()).unwrap();
        drop(file);
        assert!(!p.exists(), "its own file is removed");
        drop(l);
        // Replaced meanwhile by another's file (same path, another inode): left alone.
        // (Each other file is made before it is renamed over the path, so it cannot
        // reuse the inode number of the one it replaces.)
        let (l, file) = bind_socket(&p, &access()).unwrap();
        drop(l);
        let q = dir.path().join("other");
        std::fs::write(&q, b"another's").unwrap();
        std::fs::rename(&q, &p).unwrap();
        drop(file);
        assert_eq!(std::fs::read(&p).unwrap(), b"another's");
        std::fs::remove_file(&p).unwrap();
        let (_l, file) = bind_socket(&p, &access()).unwrap();
        let other = UnixListener::bind(&q).unwrap();
        std::fs::rename(&q, &p).unwrap();
        drop(file);
        assert!(p.exists());
        let _c = UnixStream::connect(&p).unwrap();
        other.accept().unwrap();
    }

    #[test]
    fn a_free_path_is_taken_without_replacing_what_appeared_there() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        let e = rename_noreplace(&a, &b).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
        assert_eq!(std::fs::read(&b).unwrap(), b"b");
        let c = dir.path().join("c");
        rename_noreplace(&a, &c).unwrap();
        assert_eq!(std::fs::read(&c).unwrap(), b"a");
        assert!(!a.exists());
    }
}
