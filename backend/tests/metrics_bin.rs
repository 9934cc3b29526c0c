//! The real `pvcm-backend` binary's metrics endpoint: only `/metrics` answers, and what
//! it serves passes `promtool check metrics` (Prometheus' own linter).
//!
//! promtool is taken from `$PROMTOOL`, the `PATH`, or `$PVCM_CACHE/promtool/` (default
//! `~/.cache/pvcm`); failing those, the test unpacks it from Debian's `prometheus`
//! package (`apt-get download`, nothing installed). If none of that works the promtool
//! check prints SKIP; the rest of the test still runs.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pvcm-backend");

/// Kills the daemon when the test ends, whatever happens.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP request; the status code and the body.
fn http(port: u16, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

fn cache_dir() -> PathBuf {
    std::env::var_os("PVCM_CACHE").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pvcm"),
        PathBuf::from,
    )
}

fn runs(p: &Path) -> bool {
    Command::new(p)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// promtool, found or unpacked from Debian's `prometheus` package; why not otherwise.
fn promtool() -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    if let Some(p) = std::env::var_os("PROMTOOL") {
        tried.push(PathBuf::from(p));
    }
    tried.push(PathBuf::from("promtool"));
    let cached = cache_dir().join("promtool");
    tried.push(cached.join("promtool"));
    if let Some(p) = tried.iter().find(|p| runs(p)) {
        return Ok(p.clone());
    }
    // apt-get download: the .deb only, into the cache; dpkg-deb -x: its files, there.
    std::fs::create_dir_all(&cached).map_err(|e| format!("{}: {e}", cached.display()))?;
    let have_deb = |d: &Path| {
        std::fs::read_dir(d).ok().and_then(|r| {
            r.filter_map(Result::ok)
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "deb"))
        })
    };
    if have_deb(&cached).is_none() {
        let st = Command::new("apt-get")
            .args(["download", "-q", "prometheus"])
            .current_dir(&cached)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| format!("apt-get: {e}"))?;
        if !st.success() {
            return Err(format!("apt-get download prometheus: {st}"));
        }
    }
    let deb = have_deb(&cached).ok_or("no prometheus .deb")?;
    let root = cached.join("root");
    let st = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&root)
        .status()
        .map_err(|e| format!("dpkg-deb: {e}"))?;
    if !st.success() {
        return Err(format!("dpkg-deb -x {}: {st}", deb.display()));
    }
    std::fs::copy(root.join("usr/bin/promtool"), cached.join("promtool"))
        .map_err(|e| format!("promtool from {}: {e}", deb.display()))?;
    let _ = std::fs::remove_dir_all(&root);
    let p = cached.join("promtool");
    if runs(&p) {
        Ok(p)
    } else {
        Err(format!("{} does not run", p.display()))
    }
}

#[test]
fn metrics_endpoint_serves_only_metrics_and_passes_promtool() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("ctl");
    // A free port, given back for the daemon to bind.
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    let child = Command::new(BIN)
        .arg("--vm")
        .arg(format!(
            "socket={},gid=::ffff:127.31.40.1,name=vm1",
            dir.path().join("a.sock").display()
        ))
        .arg("--vm")
        .arg(format!(
            "socket={},gid=::ffff:127.31.40.2,name=vm2,quota=7",
            dir.path().join("b.sock").display()
        ))
        .args([
            "--wire-rx",
            "udp",
            "--metrics",
            &port.to_string(),
            "--control",
        ])
        .arg(&ctl)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let _running = Running(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err()
        || pvcm_backend::control::query(&ctl).is_err()
    {
        assert!(
            Instant::now() < deadline,
            "daemon did not come up: {}",
            std::fs::read_to_string(dir.path().join("log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let (code, body) = http(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(code, 200, "{body}");
    for want in [
        "pvcm_build_info{version=\"",
        "\npvcm_host_cm_messages_total{group=\"cm_tx_msgs\",msg=\"req\"} 0\n",
        "\npvcm_cm_messages_total{vm=\"vm1\",group=\"cm_tx_msgs\",msg=\"req\"} 0\n",
        "\npvcm_vm_quota_connections{vm=\"vm2\"} 7\n",
        "\npvcm_wire_rx_mode{mode=\"udp\",configured=\"udp\"} 1\n",
        "\nprocess_cpu_seconds_total ",
        "\nprocess_resident_memory_bytes ",
        "\nprocess_open_fds ",
        "\nprocess_start_time_seconds ",
    ] {
        assert!(body.contains(want), "no {want:?} in:\n{body}");
    }
    assert!(
        !body.contains("_host\""),
        "host totals inside a per-VM family:\n{body}"
    );
    for path in ["/", "/metricsx", "/favicon.ico", "/metrics/x"] {
        let (code, _) = http(port, &format!("GET {path} HTTP/1.1\r\n\r\n"));
        assert_eq!(code, 404, "GET {path}");
    }
    let (code, _) = http(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(code, 405);
    let (code, head_body) = http(port, "HEAD /metrics HTTP/1.1\r\n\r\n");
    assert_eq!((code, head_body.as_str()), (200, ""));

    match promtool() {
        Err(why) => println!("SKIP promtool check metrics: no promtool ({why})"),
        Ok(tool) => {
            let mut c = Command::new(&tool)
                .args(["check", "metrics"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            c.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
            let out = c.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                out.status.success() && text.trim().is_empty(),
                "{} check metrics: {}\n{text}",
                tool.display(),
                out.status
            );
        }
    }
}
