//! systemd's readiness protocol (`sd_notify`), which `Type=notify` units wait on: one
//! datagram of `KEY=VALUE` lines to the Unix socket named by `$NOTIFY_SOCKET` (a path,
//! or an abstract name written with a leading `@`). Without the variable it does
//! nothing, so the daemon runs the same outside systemd.

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `READY=1`) to the service manager, if one listens. A failure is
/// logged, never fatal: the manager's own timeout reports a daemon it did not hear from.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!(error = %e, socket = ?path, "sd_notify failed");
    }
}

fn send(path: &std::ffi::OsStr, state: &str) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_bytes();
    let addr = match bytes.first() {
        Some(b'@') => {
            use std::os::linux::net::SocketAddrExt;
            SocketAddr::from_abstract_name(&bytes[1..])?
        }
        Some(b'/') => SocketAddr::from_pathname(path)?,
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "NOTIFY_SOCKET is neither a path nor an abstract name (@...)",
            ));
        }
    };
    let sock = UnixDatagram::unbound()?;
    let n = sock.send_to_addr(state.as_bytes(), &addr)?;
    if n != state.len() {
        return Err(io::Error::other("short write"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_and_an_abstract_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("notify");
        let rx = UnixDatagram::bind(&p).unwrap();
        send(p.as_os_str(), "READY=1").unwrap();
        let mut b = [0u8; 64];
        let n = rx.recv(&mut b).unwrap();
        assert_eq!(&b[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("pvcm-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = rx.recv(&mut b).unwrap();
        assert_eq!(&b[..n], b"STOPPING=1");

        assert!(send(std::ffi::OsStr::new("relative"), "READY=1").is_err());
    }
}
