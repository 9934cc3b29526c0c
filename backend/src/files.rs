//! Files the daemon creates for itself (the capture, the state journal).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;

/// Options for a file only the daemon's user may read or write: created mode 0600, and
/// never through a symlink (`O_NOFOLLOW`), so a link another local user planted at the
/// path cannot redirect the daemon's writes. Add the access mode and creation flags.
pub(crate) fn owner_only() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}
