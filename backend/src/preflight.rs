//! What `pvcm-backend check-config` checks beyond reading the configuration: the
//! places the daemon will create files in, as this process finds them now (run it as the
//! user the daemon runs as). Each problem names the option (and the VM) it comes from;
//! all of them are reported, not the first. `/run/pvcm` and `/var/lib/pvcm` may be
//! missing: the host package's unit has systemd create them.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::config::Config;

/// Every problem the daemon would meet at its start with `cfg` in the places it writes:
/// a relative path (the daemon resolves it against its working directory, `/` under
/// systemd), a directory that does not exist or this user cannot create files in, a
/// state directory or capture file that cannot be written. Empty: none found.
pub fn problems(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    for v in &cfg.vms {
        file_place(&mut out, &format!("VM {:?} socket", v.vm.name), &v.socket);
    }
    if let Some(c) = &cfg.control {
        file_place(&mut out, "control", c);
    }
    if let Some(p) = &cfg.pcap {
        file_place(&mut out, "pcap", p);
        if p.is_dir() {
            out.push(format!("pcap {}: is a directory", p.display()));
        }
    }
    if let Some(d) = &cfg.state_dir {
        if !d.is_absolute() {
            out.push(relative("state-dir", d));
        } else if d.exists() {
            if !d.is_dir() {
                out.push(format!("state-dir {}: not a directory", d.display()));
            } else if !writable(d) {
                out.push(format!(
                    "state-dir {}: this user cannot write in it",
                    d.display()
                ));
            }
        } else {
            // The daemon creates it: its parent must take it.
            file_place(&mut out, "state-dir", d);
        }
    }
    out
}

/// Directories the host package's unit has systemd create before the daemon starts
/// (`RuntimeDirectory=pvcm`, `StateDirectory=pvcm`): missing before the first start is
/// expected.
const UNIT_DIRS: [&str; 2] = ["/run/pvcm", "/var/lib/pvcm"];

fn relative(what: &str, p: &Path) -> String {
    format!(
        "{what} {}: a relative path (the daemon resolves it against its working \
         directory, / under systemd): give an absolute one",
        p.display()
    )
}

/// A file the daemon creates at `p`: absolute, in a directory that exists and that
/// this user may create files in.
fn file_place(out: &mut Vec<String>, what: &str, p: &Path) {
    if !p.is_absolute() {
        out.push(relative(what, p));
        return;
    }
    let Some(dir) = p.parent() else {
        out.push(format!("{what} {}: no directory", p.display()));
        return;
    };
    if !dir.exists() && UNIT_DIRS.iter().any(|u| dir.starts_with(u)) {
        return;
    }
    if !dir.is_dir() {
        out.push(format!(
            "{what} {}: the directory {} does not exist (the daemon does not create it)",
            p.display(),
            dir.display()
        ));
    } else if !writable(dir) {
        out.push(format!(
            "{what} {}: this user cannot create files in {}",
            p.display(),
            dir.display()
        ));
    }
}

/// Whether this process may create and remove files in the directory `dir`.
fn writable(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call; access
    // only reads it.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeArgs;

    fn cfg(toml: &str, dir: &Path) -> Config {
        let f = dir.join("c.toml");
        std::fs::write(&f, toml).unwrap_or_else(|e| panic!("{e}"));
        Config::from_args(&ServeArgs {
            config: Some(f),
            ..ServeArgs::default()
        })
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn places_the_daemon_cannot_write_are_all_named() {
        let d = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let p = d.path();
        let good = cfg(
            &format!(
                "control = \"{0}/ctl\"\nstate-dir = \"{0}/state\"\npcap = \"{0}/c.pcap\"\n\
                 [[vm]]\nname = \"a\"\nsocket = \"{0}/a.sock\"\ngid = \"127.9.0.1\"\n",
                p.display()
            ),
            p,
        );
        assert_eq!(problems(&good), Vec::<String>::new());
        std::fs::write(p.join("file"), "").unwrap_or_else(|e| panic!("{e}"));
        let bad = cfg(
            &format!(
                "control = \"{0}/nodir/ctl\"\nstate-dir = \"{0}/file\"\npcap = \"{0}\"\n\
                 [[vm]]\nname = \"a\"\nsocket = \"rel.sock\"\ngid = \"127.9.0.1\"\n",
                p.display()
            ),
            p,
        );
        let got = problems(&bad).join("\n");
        assert!(
            got.contains("VM \"a\" socket rel.sock: a relative path"),
            "{got}"
        );
        assert!(got.contains("/nodir does not exist"), "{got}");
        assert!(
            got.contains("state-dir") && got.contains("not a directory"),
            "{got}"
        );
        assert!(
            got.contains("pcap") && got.contains("is a directory"),
            "{got}"
        );
        assert_eq!(problems(&bad).len(), 4, "{got}");
    }
}
