//! The `pvcm-guest` binary's behaviour without a device: clear errors and exit codes.
//! (Argument parsing itself is unit-tested in `src/bin/pvcm-guest.rs`.)

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_pvcm-guest"))
}

#[test]
fn no_device_is_a_clear_error_with_exit_status_1() {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(t.path().join("bus/pci/devices")).unwrap();
    let out = cli()
        .args(["--sysfs", t.path().to_str().unwrap(), "info"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no virtio-pci device 1af4:107f (virtio ID 63)"),
        "{err}"
    );
    assert!(err.contains("hint:"), "{err}");

    // Another ID, JSON: the error is also a JSON object on stdout.
    let out = cli()
        .args([
            "--sysfs",
            t.path().to_str().unwrap(),
            "--device",
            "pci:41",
            "--json",
            "cmtime",
            "--server",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["error"].as_str().unwrap().contains("1af4:1069"), "{v}");
    assert!(v["hint"].is_string());

    // No PCI tree at all (not inside a VM).
    let out = cli()
        .args(["--sysfs", t.path().join("none").to_str().unwrap(), "info"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bus/pci/devices") && err.contains("hint:"),
        "{err}"
    );
}

#[test]
fn usage_errors_exit_with_status_2() {
    for args in [
        vec!["--device", "lab:vm1", "info"],
        vec!["cmtime"],
        vec!["cmtime", "--server", "--rounds", "0"],
        vec!["cmtime", "--server", "--pause", "1"],
        vec!["connect", "--dest", "not-a-gid", "--port", "1"],
        vec!["listen"],
        vec![],
    ] {
        let out = cli().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(!out.stderr.is_empty());
    }
    let out = cli().args(["--device", "lab", "info"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("pvcm-lab"));
    let out = cli().arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in ["info", "listen", "connect", "connect-destroy", "cmtime"] {
        assert!(help.contains(cmd), "{help}");
    }
}
