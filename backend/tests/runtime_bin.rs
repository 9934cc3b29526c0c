//! The real `pvcm-backend` binary with VMs that come and go: `pvcm-backend vm ...`
//! against a running daemon, SIGHUP reloading its config file, and the runtime changes
//! kept in `--state-dir` across a restart.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pvcm-backend");

/// `pvcm-backend vm --control CTL ARGS...`: (success, stdout, stderr).
fn vm(ctl: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .arg("vm")
        .arg("--control")
        .arg(ctl)
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(ctl: &Path, args: &[&str]) -> String {
    let (good, out, err) = vm(ctl, args);
    assert!(good, "vm {args:?}: {err}");
    assert!(out.starts_with("ok: ") || out.starts_with('['), "{out}");
    out
}

fn refused(ctl: &Path, args: &[&str], want: &str) {
    let (good, _, err) = vm(ctl, args);
    assert!(!good, "vm {args:?} was accepted");
    assert!(err.contains(want), "vm {args:?}: {err}");
}

/// `vm list`: (name, quota, origin) per VM, in index order.
fn list(ctl: &Path) -> Vec<(String, u64, String)> {
    let v: serde_json::Value = serde_json::from_str(&ok(ctl, &["list"])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["name"].as_str().unwrap().to_string(),
                x["quota"].as_u64().unwrap(),
                x["origin"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn names(ctl: &Path) -> Vec<String> {
    list(ctl).into_iter().map(|(n, _, _)| n).collect()
}

/// A daemon this test started: killed and reaped when dropped, so that a failing test
/// leaves no daemon behind (holding the test harness's output open).
struct Daemon(Child);

impl std::ops::Deref for Daemon {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Daemon {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Kill and reap it unless it was waited for already (then both do nothing).
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[&std::ffi::OsStr], ctl: &Path) -> Daemon {
    let child = Command::new(BIN)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let child = Daemon(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ctl.exists() {
        assert!(Instant::now() < deadline, "daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: signals our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, sig) };
}

/// SIGTERM, then the exit status and the log.
fn stop(mut child: Daemon) -> String {
    use std::io::Read;
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    let mut log = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut log);
    }
    assert!(status.success(), "{status:?}\n{log}");
    log
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn toml_vm(dir: &Path, name: &str, gid: &str, extra: &str) -> String {
    format!(
        "[[vm]]\nname = \"{name}\"\nsocket = \"{}\"\ngid = \"{gid}\"\n{extra}\n",
        dir.join(format!("{name}.sock")).display()
    )
}

#[test]
fn sighup_applies_the_config_files_difference_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let conf = d.join("backend.toml");
    let head = format!("control = \"{}\"\n", ctl.display());
    std::fs::write(
        &conf,
        head.clone()
            + &toml_vm(d, "a", "127.31.1.1", "")
            + &toml_vm(d, "b", "127.31.1.2", "quota = 100")
            + &toml_vm(d, "r", "127.31.1.4", ""),
    )
    .unwrap();
    let child = spawn(&["--config".as_ref(), conf.as_os_str()], &ctl);
    assert_eq!(names(&ctl), ["a", "b", "r"]);
    // A VM added through the control socket is not the file's: a reload leaves it be.
    // It has two GIDs (addresses).
    let e_spec = format!(
        "name=e,socket={},gid=127.31.1.5,gid=127.31.2.5",
        d.join("e.sock").display()
    );
    ok(&ctl, &["add", &e_spec]);
    assert!(d.join("e.sock").exists());
    // The file now: a gone, b's quota changed, r's GID changed (removed and added
    // anew), c new.
    std::fs::write(
        &conf,
        head.clone()
            + &toml_vm(d, "b", "127.31.1.2", "quota = 200")
            + &toml_vm(d, "r", "127.31.1.14", "")
            + &toml_vm(d, "c", "127.31.1.3", ""),
    )
    .unwrap();
    signal(&child, libc::SIGHUP);
    until("the reload", || {
        let l = list(&ctl);
        l.iter().map(|(n, _, _)| n.as_str()).collect::<Vec<_>>() == ["b", "e", "r", "c"]
            && l[0].1 == 200
    });
    let l = list(&ctl);
    assert_eq!(l[1].2, "runtime");
    assert_eq!(l[3].2, "config");
    assert!(!d.join("a.sock").exists(), "a's socket is removed");
    assert!(d.join("c.sock").exists() && d.join("r.sock").exists());
    let v: serde_json::Value = serde_json::from_str(&ok(&ctl, &["list"])).unwrap();
    assert_eq!(v[2]["gid"], "::ffff:127.31.1.14", "{v}");
    assert_eq!(
        v[1]["gids"],
        serde_json::json!(["::ffff:127.31.1.5", "::ffff:127.31.2.5"]),
        "{v}"
    );
    // A file that does not parse, and one whose VMs clash (two with one GID): logged,
    // nothing changes, the daemon goes on.
    for bad in [
        "[[vm]]\nname = \n".to_string(),
        head.clone() + &toml_vm(d, "b", "127.31.1.2", "") + &toml_vm(d, "x", "127.31.1.2", ""),
    ] {
        std::fs::write(&conf, bad).unwrap();
        signal(&child, libc::SIGHUP);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(list(&ctl), l);
    }
    let log = stop(child);
    assert!(log.contains("nothing changed"), "{log}");
    assert!(log.contains("removed and added anew"), "{log}");
}

/// `pvcm-backend reload` (what `systemctl reload` runs): waits for the outcome, exits 1
/// with the reason when the file does not load (nothing changes), names the options that
/// need a restart, and the last reload shows in `stat --json` and the metrics.
#[test]
fn reload_reports_its_outcome_and_fails_on_a_file_that_does_not_load() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let conf = d.join("backend.toml");
    let head = format!("control = \"{}\"\n", ctl.display());
    std::fs::write(&conf, head.clone() + &toml_vm(d, "a", "127.31.20.1", "")).unwrap();
    let child = spawn(&["--config".as_ref(), conf.as_os_str()], &ctl);
    let reload = || {
        let out = Command::new(BIN)
            .args(["reload", "--config"])
            .arg(&conf)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A VM more: applied, and nothing that needs a restart.
    std::fs::write(
        &conf,
        head.clone() + &toml_vm(d, "a", "127.31.20.1", "") + &toml_vm(d, "b", "127.31.20.2", ""),
    )
    .unwrap();
    let (good, out, err) = reload();
    assert!(good, "{out}{err}");
    assert!(out.contains("1 change(s) to the VMs applied"), "{out}");
    assert!(!out.contains("next start"), "{out}");
    assert_eq!(names(&ctl), ["a", "b"]);
    // An option that only a restart applies: named.
    std::fs::write(
        &conf,
        head.clone()
            + "rx-coalesce-us = 200\n"
            + &toml_vm(d, "a", "127.31.20.1", "")
            + &toml_vm(d, "b", "127.31.20.2", ""),
    )
    .unwrap();
    let (good, out, err) = reload();
    assert!(good, "{out}{err}");
    assert!(out.contains("next start only: rx-coalesce-us"), "{out}");
    // stat and vm find the daemon through its config file too.
    for args in [&["stat"][..], &["vm"][..]] {
        let mut c = Command::new(BIN);
        c.args(args).arg("--config").arg(&conf);
        if args == ["vm"] {
            c.arg("list");
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A file that does not parse: exit 1, the reason, nothing changed.
    std::fs::write(&conf, "[[vm]]\nname = \n").unwrap();
    let out = Command::new(BIN)
        .args(["reload", "--control"])
        .arg(&ctl)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("does not read or check") && err.contains("nothing changed"),
        "{err}"
    );
    assert_eq!(names(&ctl), ["a", "b"]);
    let s = pvcm_backend::control::query(&ctl).unwrap();
    assert_eq!(
        (s.reloads.ok, s.reloads.failed, s.reloads.last_ok),
        (2, 1, false)
    );
    assert!(s.reloads.last_unix_seconds > 0);
    let m = s.prometheus();
    assert!(m.contains("pvcm_reloads_total{result=\"failed\"} 1"), "{m}");
    assert!(m.contains("pvcm_reload_last_success 0"), "{m}");
    // Without --config or --control: a usage error.
    let out = Command::new(BIN).arg("reload").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    stop(child);
}

#[test]
fn runtime_changes_are_checked_and_survive_a_restart_with_a_state_dir() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let state = d.join("state");
    let sock = |n: &str| d.join(format!("{n}.sock")).display().to_string();
    let args: Vec<std::ffi::OsString> = vec![
        "--vm".into(),
        format!("name=a,socket={},gid=127.31.2.1", sock("a")).into(),
        "--vm".into(),
        format!("name=b,socket={},gid=127.31.2.2", sock("b")).into(),
        "--control".into(),
        ctl.clone().into(),
        "--state-dir".into(),
        state.clone().into(),
    ];
    let argv: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let child = spawn(&argv, &ctl);
    ok(
        &ctl,
        &[
            "add",
            &format!("name=c,socket={},gid=127.31.2.3,quota=50", sock("c")),
        ],
    );
    ok(
        &ctl,
        &[
            "add",
            &format!(
                "name=x,socket={},gid=127.31.2.9,id-range=0x80000000/16,quota=1000",
                sock("x")
            ),
        ],
    );
    // What the config is checked by is what a runtime change is checked by.
    for (args, want) in [
        (
            vec![
                "add".to_string(),
                format!("name=d,socket={},gid=127.31.2.2", sock("d")),
            ],
            "two VMs use GID",
        ),
        (
            vec![
                "add".to_string(),
                format!("name=c,socket={},gid=127.31.2.4", sock("d")),
            ],
            "two VMs use name",
        ),
        (
            vec![
                "add".to_string(),
                format!("name=d,socket={},gid=127.31.2.4", sock("a")),
            ],
            "two VMs use socket",
        ),
        (
            vec![
                "add".to_string(),
                format!(
                    "name=y,socket={},gid=127.31.2.10,id-range=0x80008000/17,quota=1000",
                    sock("y")
                ),
            ],
            "overlap",
        ),
        (
            vec!["add".to_string(), format!("name=d,socket={}", sock("d"))],
            "gid=GID is required",
        ),
        (
            vec![
                "add".to_string(),
                format!("socket={},gid=127.31.2.4,quota=0", sock("d")),
            ],
            "quota",
        ),
        (
            vec!["remove".to_string(), "zz".to_string()],
            "no VM named \"zz\"",
        ),
        (
            vec!["quota".to_string(), "b".to_string(), "0".to_string()],
            "expected a number",
        ),
        (
            vec!["quota".to_string(), "zz".to_string(), "5".to_string()],
            "no VM named",
        ),
        (
            vec!["quota".to_string(), "x".to_string(), "40000".to_string()],
            "65536 IDs",
        ),
    ] {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&ctl, &a, want);
    }
    let out = ok(&ctl, &["remove", "a"]);
    assert!(out.contains("released on its behalf"), "{out}");
    let out = ok(&ctl, &["quota", "b", "77"]);
    assert!(out.contains("quota 77"), "{out}");
    assert!(!d.join("a.sock").exists());
    let before = list(&ctl);
    assert_eq!(
        before,
        [
            ("b".to_string(), 77, "config".to_string()),
            ("c".to_string(), 50, "runtime".to_string()),
            ("x".to_string(), 1000, "runtime".to_string()),
        ]
    );
    stop(child);
    let kept = std::fs::read_to_string(state.join("vms.toml")).unwrap();
    assert!(kept.contains("removed = [\"a\"]"), "{kept}");
    // The restart applies them over the same command line.
    let child = spawn(&argv, &ctl);
    assert_eq!(list(&ctl), before);
    assert!(!d.join("a.sock").exists() && d.join("c.sock").exists());
    // Back to the host's default quota; the removal of a runtime VM is kept too.
    ok(&ctl, &["quota", "b", "default"]);
    ok(&ctl, &["remove", "x"]);
    stop(child);
    let child = spawn(&argv, &ctl);
    assert_eq!(
        list(&ctl),
        [
            ("b".to_string(), 65536, "config".to_string()),
            ("c".to_string(), 50, "runtime".to_string()),
        ]
    );
    stop(child);
}

/// SIGTERM, then the exit within `limit` (the child is killed and the test fails past
/// it); returns the log.
fn stop_within(mut child: Daemon, limit: Duration) -> String {
    use std::io::Read;
    signal(&child, libc::SIGTERM);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut log = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut log);
    }
    let status = status.unwrap_or_else(|| panic!("no exit {limit:?} after SIGTERM\n{log}"));
    assert!(status.success(), "{status:?}\n{log}");
    log
}

/// `pvcm-backend vm ARGS` and how long the answer took.
fn vm_timed(ctl: &Path, args: &[&str]) -> (Duration, (bool, String, String)) {
    let t0 = Instant::now();
    let r = vm(ctl, args);
    (t0.elapsed(), r)
}

/// A daemon with VMs a and b (udp receive) at 127.31.`net`.1 and .2 and a control
/// socket in `d`.
fn two_vm_daemon(d: &Path, net: u8) -> Daemon {
    let ctl = d.join("ctl");
    let args: Vec<std::ffi::OsString> = vec![
        "--vm".into(),
        format!(
            "name=a,socket={},gid=127.31.{net}.1",
            d.join("a.sock").display()
        )
        .into(),
        "--vm".into(),
        format!(
            "name=b,socket={},gid=127.31.{net}.2",
            d.join("b.sock").display()
        )
        .into(),
        "--wire-rx".into(),
        "udp".into(),
        "--control".into(),
        ctl.clone().into(),
    ];
    let argv: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    spawn(&argv, &ctl)
}

const STOP_LIMIT: Duration = Duration::from_secs(2);

#[test]
fn sigterm_stops_within_2s_with_the_vm_sockets_removed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let child = two_vm_daemon(d, 3);
    std::fs::remove_file(d.join("a.sock")).unwrap();
    std::fs::remove_file(d.join("b.sock")).unwrap();
    let log = stop_within(child, STOP_LIMIT);
    assert!(log.contains("stopped"), "{log}");
}

#[test]
fn vm_remove_and_list_answer_with_the_socket_removed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let child = two_vm_daemon(d, 4);
    std::fs::remove_file(d.join("a.sock")).unwrap();
    let (t_remove, remove) = vm_timed(&ctl, &["remove", "a"]);
    let (t_list, list) = vm_timed(&ctl, &["list"]);
    // b still serves.
    let b_serves = std::os::unix::net::UnixStream::connect(d.join("b.sock")).is_ok();
    stop_within(child, STOP_LIMIT);
    assert!(
        t_remove < STOP_LIMIT,
        "vm remove took {t_remove:?}: {remove:?}"
    );
    assert!(t_list < STOP_LIMIT, "vm list took {t_list:?}: {list:?}");
    let (good, out, err) = remove;
    assert!(good && out.starts_with("ok: "), "{out}{err}");
    let (good, out, err) = list;
    assert!(good, "{err}");
    assert!(!out.contains("\"a\"") && out.contains("\"b\""), "{out}");
    assert!(b_serves);
}

#[test]
fn sigterm_stops_within_2s_with_a_control_request_in_flight() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let child = two_vm_daemon(d, 5);
    std::fs::remove_file(d.join("b.sock")).unwrap();
    // A client that connected and has sent half a request: its answer is pending.
    let mut half = std::os::unix::net::UnixStream::connect(&ctl).unwrap();
    half.write_all(b"vm li").unwrap();
    // And requests racing the stop.
    let racing: Vec<_> = ["list", "remove b"]
        .into_iter()
        .map(|r| {
            let ctl = ctl.clone();
            std::thread::spawn(move || {
                let args: Vec<&str> = r.split(' ').collect();
                vm(&ctl, &args)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    stop_within(child, STOP_LIMIT);
    for t in racing {
        // Answered or refused, but not left hanging: the client's own timeout is 10 s.
        let _ = t.join().unwrap();
    }
    drop(half);
}

#[test]
fn vm_add_refuses_a_path_it_did_not_create_and_vm_remove_leaves_anothers_socket() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ctl = d.join("ctl");
    let state = d.join("state");
    let sock = |n: &str| d.join(format!("{n}.sock"));
    let args: Vec<std::ffi::OsString> = vec![
        "--vm".into(),
        format!("name=a,socket={},gid=127.31.10.1", sock("a").display()).into(),
        "--vm".into(),
        format!("name=b,socket={},gid=127.31.10.2", sock("b").display()).into(),
        "--control".into(),
        ctl.clone().into(),
        "--state-dir".into(),
        state.clone().into(),
    ];
    let argv: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let child = spawn(&argv, &ctl);
    let precious = d.join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let live = sock("live");
    let other = std::os::unix::net::UnixListener::bind(&live).unwrap();
    let journal = state.join("mux.journal");
    let add = |socket: &Path| {
        vm(
            &ctl,
            &[
                "add",
                &format!("name=c,socket={},gid=127.31.10.3", socket.display()),
            ],
        )
    };
    let refusals = [
        (add(&precious), "not a socket"),
        (add(&live), "another process listens"),
        (add(&journal), "state directory"),
    ];
    // vm remove: a's socket file was replaced by another process's; it stays.
    let tmp = d.join("tmp");
    let theirs = std::os::unix::net::UnixListener::bind(&tmp).unwrap();
    std::fs::rename(&tmp, sock("a")).unwrap();
    let removed = vm(&ctl, &["remove", "a"]);
    let b_removed = vm(&ctl, &["remove", "b"]);
    let listed = vm(&ctl, &["list"]);
    stop(child);
    for ((good, _, err), want) in refusals {
        assert!(!good && err.contains(want), "{err}");
    }
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    assert!(std::fs::symlink_metadata(&journal).unwrap().is_file());
    let _c = std::os::unix::net::UnixStream::connect(&live).unwrap();
    other.accept().unwrap();
    assert!(removed.0 && b_removed.0, "{removed:?} {b_removed:?}");
    assert!(listed.1.trim() == "[]", "{listed:?}");
    assert!(sock("a").exists(), "another's socket stays");
    let _c = std::os::unix::net::UnixStream::connect(sock("a")).unwrap();
    theirs.accept().unwrap();
    assert!(!sock("b").exists(), "its own socket is removed");
}
