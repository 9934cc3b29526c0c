//! The real `pvcm-backend` binary: command-line errors, `stat`, SIGTERM.

#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pvcm-backend");

#[test]
fn bad_command_lines_are_clear_errors() {
    for (args, want) in [
        (&[][..], "no VM"),
        (&["--vm", "socket=/tmp/x"][..], "gid=GID is required"),
        (&["--vm", "socket=/tmp/x,gid=fe80::1"][..], "link-local"),
        (
            &["--vm", "socket=/tmp/x,gid=127.0.0.1,qpn-base=banana"][..],
            "not a number",
        ),
        (
            &["--vm", "socket=/tmp/x,gid=127.0.0.1", "--policy", "mlx5"][..],
            "unknown policy",
        ),
        (
            &["--vm", "socket=/tmp/x,gid=127.0.0.1", "--rx-backlog", "0"][..],
            "--rx-backlog",
        ),
        (
            &[
                "--vm",
                "socket=/tmp/x,gid=127.0.0.1",
                "--metrics",
                "nowhere",
            ][..],
            "--metrics",
        ),
        (
            &["--config", "/nonexistent/pvcm.conf"][..],
            "/nonexistent/pvcm.conf",
        ),
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // A wire address that is not local is an error at start, not a panic.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let out = Command::new(BIN)
        .arg("--vm")
        .arg(format!("socket={},gid=192.0.2.1", sock.display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("192.0.2.1"), "{err}");
}

#[test]
fn serves_stat_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let ctl = dir.path().join("ctl");
    let conf = dir.path().join("pvcm.conf");
    std::fs::write(
        &conf,
        format!(
            "# test host\nvm socket={},gid=::ffff:127.31.0.1,name=alpha\nrx-backlog 8\n",
            sock.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .arg("--config")
        .arg(&conf)
        .arg("--control")
        .arg(&ctl)
        .env("RUST_LOG", "debug")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(ctl.exists() && sock.exists()) {
        assert!(Instant::now() < deadline, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A frontend that connects and goes away: one session.
    drop(UnixStream::connect(&sock).unwrap());
    let stat = |json: bool| {
        let mut c = Command::new(BIN);
        c.arg("stat").arg("--control").arg(&ctl);
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let j: serde_json::Value = serde_json::from_str(&stat(true)).unwrap();
        if j["vms"][0]["figures"]["io"]["sessions"] == 1 && j["vms"][0]["attached"] == false {
            assert_eq!(j["vms"][0]["name"], "alpha");
            assert_eq!(j["policy"], "default");
            break;
        }
        assert!(Instant::now() < deadline, "{j}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = stat(false);
    assert!(t.contains("vm alpha (::ffff:127.31.0.1"), "{t}");
    assert!(t.contains("host (policy default"), "{t}");
    // SIGTERM: a clean exit, sockets removed.
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("stopped"), "{log}");
    assert!(!sock.exists() && !ctl.exists());
    let out = Command::new(BIN)
        .arg("stat")
        .arg("--control")
        .arg(&ctl)
        .output()
        .unwrap();
    assert!(!out.status.success());
}
