//! The real `pvcm-backend` binary: command-line errors, `stat`, SIGTERM.

#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
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
    let (status, log) = wait_exit(&mut child);
    assert!(status.success(), "{status:?}\n{log}");
    assert!(log.contains("stopped"), "{log}");
    // stderr is a pipe here: plain text, no ANSI colour.
    assert!(!log.contains('\x1b'), "{log}");
    assert!(!sock.exists() && !ctl.exists());
    let out = Command::new(BIN)
        .arg("stat")
        .arg("--control")
        .arg(&ctl)
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// Waits for the child to exit (at most 10 s) and returns its status and stderr.
fn wait_exit(child: &mut std::process::Child) -> (std::process::ExitStatus, String) {
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
    (status, log)
}

#[test]
fn tells_systemd_it_is_ready_once_its_sockets_listen_with_the_asked_permissions() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let ctl = dir.path().join("ctl");
    let notify = dir.path().join("notify");
    let rx = UnixDatagram::bind(&notify).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A group the test may give files to: its own (root may give any).
    // SAFETY: getegid has no preconditions.
    let gid = unsafe { libc::getegid() };
    let mut child = Command::new(BIN)
        .arg("--vm")
        .arg(format!("socket={},gid=127.31.0.2,name=n", sock.display()))
        .args(["--wire-rx", "udp", "--control"])
        .arg(&ctl)
        .args(["--socket-mode", "0640", "--socket-group"])
        .arg(gid.to_string())
        .args(["--control-mode", "0660", "--log-format", "json"])
        .env("NOTIFY_SOCKET", &notify)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut b = [0u8; 256];
    let n = rx.recv(&mut b).expect("no READY=1 within 10 s");
    let msg = String::from_utf8_lossy(&b[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    // Ready means every socket is there, with its permissions, and answers.
    for (p, mode) in [(&sock, 0o640), (&ctl, 0o660)] {
        let m = std::fs::metadata(p).unwrap();
        assert_eq!(m.mode() & 0o777, mode, "{}", p.display());
        if p == &sock {
            assert_eq!(m.gid(), gid);
        }
    }
    // A frontend that connects and goes away: one session, logged in the VM's span.
    drop(UnixStream::connect(&sock).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while pvcm_backend::control::query(&ctl)
        .map(|s| s.vms[0].figures.io("sessions"))
        .unwrap_or(0)
        == 0
    {
        assert!(Instant::now() < deadline, "no session");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let n = rx.recv(&mut b).expect("no STOPPING=1");
    assert_eq!(&b[..n], b"STOPPING=1");
    let (status, log) = wait_exit(&mut child);
    assert!(status.success(), "{status:?}\n{log}");
    // --log-format json: one JSON object per line, each with a level and a message.
    let mut lines = 0;
    for l in log.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{l}");
        lines += 1;
    }
    assert!(lines >= 2 && log.contains("pvcm-backend started"), "{log}");
    // A VM's events name it in their span (no key twice: serde_json keeps the last).
    let session = log
        .lines()
        .find(|l| l.contains("vhost-user session started"))
        .unwrap_or_else(|| panic!("{log}"));
    assert_eq!(session.matches("\"name\"").count(), 1, "{session}");
    let v: serde_json::Value = serde_json::from_str(session).unwrap();
    assert_eq!(v["span"]["vm"], "n", "{session}");
    assert_eq!(v["span"]["gid"], "::ffff:127.31.0.2", "{session}");
    // Fields are plain values, never Rust's debug text; a VM leaving is no warning.
    assert!(!log.contains("Some(") && !log.contains("VmId("), "{log}");
    assert!(!log.contains("\"WARN\""), "{log}");
}

/// Under systemd stderr is the journal (`JOURNAL_STREAM` names its device and inode):
/// every line then starts with its syslog priority, which journald keeps as the entry's
/// (`journalctl -p err` shows errors only), and a VM that disconnects is information.
#[test]
fn journald_gets_each_lines_priority_and_a_vm_leaving_is_no_warning() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, ctl, log) = (
        dir.path().join("j.sock"),
        dir.path().join("ctl"),
        dir.path().join("stderr"),
    );
    std::fs::File::create(&log).unwrap();
    let m = std::fs::metadata(&log).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(vm_arg(&sock, "127.31.0.7"))
        .args(["--wire-rx", "udp", "--control"])
        .arg(&ctl)
        .env("JOURNAL_STREAM", format!("{}:{}", m.dev(), m.ino()))
        .env("RUST_LOG", "info");
    let running = start_with_log(cmd, &ctl, &log);
    drop(UnixStream::connect(&sock).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("session ended")
    {
        assert!(Instant::now() < deadline, "no session ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    sigterm_and_wait(running);
    let text = std::fs::read_to_string(&log).unwrap();
    for l in text.lines() {
        let prio = l
            .strip_prefix('<')
            .and_then(|r| r.split_once('>'))
            .map(|(p, _)| p);
        assert!(matches!(prio, Some("3" | "4" | "6" | "7")), "{l}\n{text}");
    }
    let ended = text
        .lines()
        .find(|l| l.contains("session ended"))
        .unwrap_or_default();
    assert!(
        ended.starts_with("<6>") && ended.contains("the VM disconnected"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("<6>") && l.contains("pvcm-backend started"))
    );
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("<4>") || l.starts_with("<3>")),
        "{text}"
    );
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn check_config(file: &Path) -> (bool, Option<i32>, String, String) {
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(file)
        .output()
        .unwrap();
    (
        out.status.success(),
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_validates_the_shipped_examples_and_names_a_bad_key() {
    // The full example validates as it is.
    let full = repo().join("packaging/host/backend.example.toml");
    let (ok, _, out, err) = check_config(&full);
    assert!(ok, "{err}");
    assert!(out.contains(": ok") && out.contains("vm vm1:"), "{out}");
    // The installed config file holds no VM; with one added it validates.
    let dir = tempfile::tempdir().unwrap();
    let shipped = std::fs::read_to_string(repo().join("packaging/host/backend.toml")).unwrap();
    let f = dir.path().join("backend.toml");
    std::fs::write(
        &f,
        format!("{shipped}\n[[vm]]\nsocket = \"/run/pvcm/x.sock\"\ngid = \"192.0.2.9\"\n"),
    )
    .unwrap();
    let (ok, _, _, err) = check_config(&f);
    assert!(ok, "{err}");
    // Without, it says there is no VM.
    std::fs::write(&f, &shipped).unwrap();
    let (ok, code, _, err) = check_config(&f);
    assert!(!ok && code == Some(2) && err.contains("no VM"), "{err}");
    // A bad value: exit 2, the file and the key named, no panic.
    std::fs::write(
        &f,
        "rx-backlog-bytes = \"12Q\"\n[[vm]]\nsocket = \"/tmp/x\"\ngid = \"192.0.2.9\"\n",
    )
    .unwrap();
    let (ok, code, _, err) = check_config(&f);
    assert!(!ok && code == Some(2), "{err}");
    assert!(
        err.contains("backend.toml") && err.contains("rx-backlog-bytes=\"12Q\""),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (ok, code, _, err) = check_config(&dir.path().join("missing.toml"));
    assert!(
        !ok && code == Some(2) && err.contains("missing.toml"),
        "{err}"
    );
}

/// Runs the daemon with `args` and returns its exit code and stderr if it exits within
/// 5 s; a daemon still running then is killed and `None` returned with its stderr.
fn exit_of(args: &[std::ffi::OsString]) -> (Option<i32>, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (code, err)
}

fn vm_arg(socket: &Path, gid: &str) -> [std::ffi::OsString; 2] {
    [
        "--vm".into(),
        format!("socket={},gid={gid}", socket.display()).into(),
    ]
}

#[test]
fn a_file_that_is_not_a_socket_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let precious = dir.path().join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let (code, err) = exit_of(&vm_arg(&precious, "127.31.6.1"));
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&precious.display().to_string()) && err.contains("not a socket"),
        "{err}"
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    // The control socket too.
    let mut args = vm_arg(&dir.path().join("a.sock"), "127.31.6.1").to_vec();
    args.extend(["--control".into(), precious.clone().into()]);
    let (code, err) = exit_of(&args);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--control") && err.contains("not a socket"),
        "{err}"
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    assert!(
        !dir.path().join("a.sock").exists(),
        "its own socket removed"
    );
}

#[test]
fn a_second_daemon_does_not_take_a_live_socket_over() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let ctl = dir.path().join("ctl");
    let mut first = Command::new(BIN)
        .args(vm_arg(&sock, "127.31.7.1"))
        .arg("--control")
        .arg(&ctl)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pvcm_backend::control::query(&ctl).is_err() {
        assert!(Instant::now() < deadline, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, err) = exit_of(&vm_arg(&sock, "127.31.7.2"));
    // SAFETY: signals our own child process.
    unsafe { libc::kill(first.id() as libc::pid_t, libc::SIGTERM) };
    let (status, log) = wait_exit(&mut first);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&sock.display().to_string()) && err.contains("another process listens"),
        "{err}"
    );
    assert!(status.success(), "{log}");
    assert!(
        !sock.exists(),
        "the first removed its own socket at its stop"
    );
}

#[test]
fn a_socket_replaced_under_the_daemon_is_left_at_its_stop() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let ctl = dir.path().join("ctl");
    let mut child = Command::new(BIN)
        .args(vm_arg(&sock, "127.31.8.1"))
        .arg("--control")
        .arg(&ctl)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pvcm_backend::control::query(&ctl).is_err() {
        assert!(Instant::now() < deadline, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Another process's socket put at the daemon's paths (as a second daemon that
    // renames its socket into place would).
    let tmp = dir.path().join("other");
    let other = std::os::unix::net::UnixListener::bind(&tmp).unwrap();
    std::fs::rename(&tmp, &sock).unwrap();
    std::fs::write(&tmp, b"not the control socket").unwrap();
    std::fs::rename(&tmp, &ctl).unwrap();
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let (status, log) = wait_exit(&mut child);
    assert!(status.success(), "{log}");
    assert!(sock.exists(), "another's socket is not removed\n{log}");
    assert_eq!(std::fs::read(&ctl).unwrap(), b"not the control socket");
    let _c = UnixStream::connect(&sock).unwrap();
    other.accept().unwrap();
}

#[test]
fn a_socket_path_that_is_a_state_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let journal = state.join("mux.journal");
    std::fs::write(&journal, b"journal").unwrap();
    for (socket, control) in [
        (journal.clone(), dir.path().join("ctl")),
        (dir.path().join("a.sock"), state.join("vms.toml")),
    ] {
        let mut args = vm_arg(&socket, "127.31.9.1").to_vec();
        args.extend([
            "--control".into(),
            control.into(),
            "--state-dir".into(),
            state.clone().into(),
        ]);
        let (code, err) = exit_of(&args);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("state directory"), "{err}");
    }
    assert_eq!(std::fs::read(&journal).unwrap(), b"journal");
    assert!(!state.join("vms.toml").exists());
}

#[test]
fn check_config_refuses_what_the_daemon_would_refuse_at_its_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let state = d.join("state");
    std::fs::create_dir(&state).unwrap();
    let precious = d.join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let live = d.join("live.sock");
    let _l = std::os::unix::net::UnixListener::bind(&live).unwrap();
    let stale = d.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let file = d.join("backend.toml");
    let toml = |socket: &Path, extra: &str| {
        format!(
            "state-dir = \"{}\"\n{extra}[[vm]]\nsocket = \"{}\"\ngid = \"127.31.9.2\"\n",
            state.display(),
            socket.display()
        )
    };
    for (socket, want) in [
        (&precious, "not a socket"),
        (&live, "another process listens"),
        (&state.join("mux.journal"), "state directory"),
    ] {
        std::fs::write(&file, toml(socket, "")).unwrap();
        let (ok, code, _, err) = check_config(&file);
        assert!(!ok && code == Some(2), "{err}");
        assert!(
            err.contains(&socket.display().to_string()) && err.contains(want),
            "{err}"
        );
    }
    std::fs::write(&file, toml(&stale, "")).unwrap();
    let (ok, _, _, err) = check_config(&file);
    assert!(ok, "a stale socket may be replaced: {err}");
    std::fs::write(
        &file,
        toml(&stale, &format!("control = \"{}\"\n", precious.display())),
    )
    .unwrap();
    let (ok, _, _, err) = check_config(&file);
    assert!(!ok && err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
}

/// A daemon process, killed if the test ends (fails) before it was stopped.
struct Running(Option<std::process::Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `cmd` (the daemon, perhaps under setpriv) with stderr to `log` and waits
/// until its control socket `ctl` answers.
fn start_with_log(mut cmd: Command, ctl: &Path, log: &Path) -> Running {
    let child = Running(Some(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while pvcm_backend::control::query(ctl).is_err() {
        assert!(Instant::now() < deadline, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn sigterm_and_wait(mut running: Running) {
    let Some(mut child) = running.0.take() else {
        return;
    };
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            assert!(s.success(), "{s:?}");
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether this process may open raw sockets and drop capabilities for a child
/// (setpriv): the tests of degraded settings need both.
fn can_drop_capabilities() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("setpriv")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn a_backend_with_no_vm_keeps_the_configured_receive_mode() {
    if !can_drop_capabilities() {
        eprintln!("skipped: needs root (raw sockets)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    for (mode, n) in [("raw", 1), ("auto", 2)] {
        let state = d.join(format!("state-{mode}"));
        let cmd = || {
            let mut c = Command::new(BIN);
            c.args(vm_arg(&d.join("a.sock"), &format!("127.31.11.{n}")))
                .args(["--wire-rx", mode, "--control"])
                .arg(&ctl)
                .arg("--state-dir")
                .arg(&state);
            c
        };
        let child = start_with_log(cmd(), &ctl, &d.join("log"));
        let vm = |args: &[&str]| {
            let out = Command::new(BIN)
                .arg("vm")
                .arg("--control")
                .arg(&ctl)
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        vm(&["remove", &format!("vm-127.31.11.{n}")]);
        sigterm_and_wait(child);
        // Started again with no VM left: the mode configured, not udp.
        let child = start_with_log(cmd(), &ctl, &d.join("log"));
        let s = pvcm_backend::control::query(&ctl).unwrap();
        assert!(s.vms.is_empty(), "{s:?}");
        assert_eq!(
            (s.wire_rx.as_str(), s.wire_rx_configured.as_str()),
            ("raw", mode)
        );
        assert!(s.degraded.iter().all(|x| x.setting != "wire_rx"), "{s:?}");
        // A VM added now is received in raw mode.
        vm(&[
            "add",
            &format!(
                "name=b,socket={},gid=127.31.11.{}",
                d.join("b.sock").display(),
                n + 10
            ),
        ]);
        let s = pvcm_backend::control::query(&ctl).unwrap();
        assert_eq!(s.wire_rx, "raw");
        sigterm_and_wait(child);
    }
}

#[test]
fn degraded_settings_are_logged_and_shown_in_stat_and_metrics() {
    if !can_drop_capabilities() {
        eprintln!("skipped: needs root and setpriv");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let log = d.join("log");
    let rmem_max: u64 = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // Without CAP_NET_ADMIN: raw receive, the buffer capped by net.core.rmem_max.
    let mut c = Command::new("setpriv");
    c.args(["--bounding-set", "-net_admin", BIN])
        .args(vm_arg(&d.join("a.sock"), "127.31.12.1"))
        .args(["--wire-rx", "raw", "--control"])
        .arg(&ctl);
    let child = start_with_log(c, &ctl, &log);
    let s = pvcm_backend::control::query(&ctl).unwrap();
    let metrics = pvcm_backend::control::request(&ctl, "metrics").unwrap();
    let json = Command::new(BIN)
        .args(["stat", "--json", "--control"])
        .arg(&ctl)
        .output()
        .unwrap();
    sigterm_and_wait(child);
    let text = std::fs::read_to_string(&log).unwrap();
    let b = s.wire_rx_buffer.unwrap_or_else(|| panic!("{s:?}"));
    assert_eq!(b.wanted, 64 << 20);
    assert!(metrics.contains("pvcm_wire_rx_mode{mode=\"raw\",configured=\"raw\"} 1"));
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(j["wire_rx_buffer"]["wanted"], 64 << 20, "{j}");
    if rmem_max < 64 << 20 {
        assert!(b.effective < b.wanted, "{b:?}");
        assert_eq!(s.degraded.len(), 1, "{s:?}");
        assert_eq!(s.degraded[0].setting, "wire_rx_buffer");
        assert!(s.degraded[0].why.contains("CAP_NET_ADMIN"), "{s:?}");
        assert!(
            metrics.contains("pvcm_degraded{setting=\"wire_rx_buffer\""),
            "{metrics}"
        );
        assert_eq!(j["degraded"][0]["setting"], "wire_rx_buffer", "{j}");
        assert!(
            text.lines()
                .any(|l| l.contains("WARN") && l.contains("receive buffer smaller")),
            "{text}"
        );
    }
    // Without CAP_NET_RAW either: auto receives in udp mode, and says so; raw refuses
    // to start.
    let mut c = Command::new("setpriv");
    c.args(["--bounding-set", "-net_admin,-net_raw", BIN])
        .args(vm_arg(&d.join("a.sock"), "127.31.12.1"))
        .args(["--wire-rx", "auto", "--control"])
        .arg(&ctl);
    let child = start_with_log(c, &ctl, &log);
    let s = pvcm_backend::control::query(&ctl).unwrap();
    let metrics = pvcm_backend::control::request(&ctl, "metrics").unwrap();
    let table = pvcm_backend::control::stat(&ctl, false).unwrap();
    sigterm_and_wait(child);
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        (s.wire_rx.as_str(), s.wire_rx_configured.as_str()),
        ("udp", "auto")
    );
    assert!(s.wire_rx_buffer.is_none(), "{s:?}");
    assert_eq!(s.degraded.len(), 1, "{s:?}");
    assert_eq!(
        (
            s.degraded[0].setting.as_str(),
            s.degraded[0].effective.as_str()
        ),
        ("wire_rx", "udp")
    );
    assert!(
        metrics
            .contains("pvcm_degraded{setting=\"wire_rx\",configured=\"auto\",effective=\"udp\"} 1"),
        "{metrics}"
    );
    assert!(table.contains("DEGRADED wire_rx"), "{table}");
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains("receiving in udp mode")),
        "{text}"
    );
    let out = Command::new("setpriv")
        .args(["--bounding-set", "-net_raw", BIN])
        .args(vm_arg(&d.join("a.sock"), "127.31.12.1"))
        .args(["--wire-rx", "raw"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("CAP_NET_RAW"), "{err}");
}

/// check-config names every place the daemon could not create its files in (each with
/// the file, the option and the VM), and both VMs of a clash.
#[test]
fn check_config_names_every_place_the_daemon_cannot_write_and_both_vms_of_a_clash() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let f = d.join("c.toml");
    std::fs::write(
        &f,
        format!(
            "control = \"{0}/nodir/ctl\"\n[[vm]]\nname = \"a\"\nsocket = \"rel.sock\"\n\
             gid = \"127.31.9.1\"\n",
            d.display()
        ),
    )
    .unwrap();
    let (ok, code, _, err) = check_config(&f);
    assert!(!ok && code == Some(2), "{err}");
    assert_eq!(err.matches(&*f.display().to_string()).count(), 2, "{err}");
    assert!(
        err.contains("VM \"a\" socket rel.sock: a relative path"),
        "{err}"
    );
    assert!(
        err.contains("control") && err.contains("nodir does not exist"),
        "{err}"
    );
    std::fs::write(
        &f,
        format!(
            "[[vm]]\nname = \"a\"\nsocket = \"{0}/a.sock\"\ngid = \"127.31.9.1\"\n\
             [[vm]]\nname = \"b\"\nsocket = \"{0}/b.sock\"\ngid = \"127.31.9.1\"\n",
            d.display()
        ),
    )
    .unwrap();
    let (ok, _, _, err) = check_config(&f);
    assert!(!ok && err.contains("VM \"a\" and VM \"b\""), "{err}");
    assert!(err.contains(&*f.display().to_string()), "{err}");
}

/// A VM address whose port another process holds is named as such, not as an address
/// missing from the host.
#[test]
fn a_taken_wire_port_says_so() {
    let _held = std::net::UdpSocket::bind("127.31.8.9:4791").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (code, err) = exit_of(&[
        "--vm".into(),
        format!(
            "socket={},gid=127.31.8.9",
            dir.path().join("t.sock").display()
        )
        .into(),
        "--wire-rx".into(),
        "udp".into(),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("Address already in use") && err.contains("another --bind-port"),
        "{err}"
    );
    assert!(!err.contains("not on this host"), "{err}");
}
