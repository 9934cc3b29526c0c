//! Files the daemon creates for itself (the capture, the state journal, its sockets),
//! and the users and groups its sockets are given to.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::config::{Account, SocketAccess};

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
/// for. The socket is bound inside a fresh directory next to `path` that only the
/// daemon's user can enter (mode 0700), given its owner, group and mode there, then
/// renamed into place (replacing a stale socket): nobody can connect to it before it
/// has the asked permissions, whatever the umask.
pub(crate) fn bind_socket(path: &Path, access: &SocketAccess) -> io::Result<UnixListener> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    // A short name: a Unix socket's path is limited to 107 bytes, and the temporary one
    // should be no longer than the socket's own.
    let dir = path.with_file_name(format!(
        ".{:x}.{:x}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let tmp = dir.join("s");
    let placed = UnixListener::bind(&tmp).and_then(|l| {
        if access.owner.is_some() || access.group.is_some() {
            std::os::unix::fs::lchown(&tmp, access.owner, access.group)?;
        }
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(access.mode))?;
        std::fs::rename(&tmp, path)?;
        Ok(l)
    });
    if placed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    let _ = std::fs::remove_dir(&dir);
    placed
}

/// A socket file the daemon created, removed when this is dropped.
#[derive(Debug)]
pub(crate) struct SocketFile(pub(crate) PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A user's ID: the number given, or the name looked up (NSS included); `None` when no
/// such user exists.
pub(crate) fn resolve_user(a: &Account) -> Option<u32> {
    match a {
        Account::Id(n) => Some(*n),
        Account::Name(name) => lookup(name, true),
    }
}

/// A group's ID: the number given, or the name looked up; `None` when no such group
/// exists.
pub(crate) fn resolve_group(a: &Account) -> Option<u32> {
    match a {
        Account::Id(n) => Some(*n),
        Account::Name(name) => lookup(name, false),
    }
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
        std::fs::write(&p, b"stale").unwrap();
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

    #[test]
    fn users_and_groups_resolve_by_name_and_number() {
        assert_eq!(resolve_user(&Account::Name("root".into())), Some(0));
        assert_eq!(resolve_group(&Account::Name("root".into())), Some(0));
        assert_eq!(resolve_user(&Account::Id(4242)), Some(4242));
        assert_eq!(
            resolve_group(&Account::Name("no-such-group-pvcm".into())),
            None
        );
        assert_eq!(
            resolve_user(&Account::Name("no-such-user-pvcm".into())),
            None
        );
    }
}
