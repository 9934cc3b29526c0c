//! The control socket, `pvcm-backend stat`, and the Prometheus endpoint.
//!
//! Protocol of the control socket (`--control PATH`, a Unix stream socket): the client
//! writes one line, the daemon answers and closes.
//!
//! | request | answer |
//! |---|---|
//! | `stat` | the [`Snapshot`] as JSON |
//! | `metrics` | Prometheus text |
//! | `vm list` | the VMs as a JSON array ([`Runtime::list_vms`]) |
//! | `vm add SPEC` | `ok: ...` or `error: ...`; SPEC is `--vm`'s `socket=PATH,gid=GID,...` |
//! | `vm remove NAME` | `ok: ...` (the connections released) or `error: ...` |
//! | `vm quota NAME N` | `ok: ...` (what the VM holds against it) or `error: ...`; N may be `default` |
//!
//! The `vm` requests change what the daemon serves ([`crate::runtime`]). Whoever can
//! connect to the control socket can make them: it is the owner's only (0600) unless
//! `--control-mode`/`--control-group` open it, which is the authorization they need.
//!
//! `--metrics ADDR` serves the same figures as Prometheus text over plain HTTP/1.1
//! (`GET /metrics`; any other path is 404).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::config::VmSpec;
use crate::runtime::Runtime;
use crate::shared::Shared;
use crate::stats::Snapshot;

const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Requests (control and metrics together) answered at once, each on its own short
/// thread; a connection past this is closed unanswered, so a local client that opens
/// connections without end cannot make the daemon grow threads without end.
pub(crate) const MAX_SERVING: usize = 4;

/// The count of requests being answered.
#[derive(Debug, Default)]
pub(crate) struct Serving(AtomicUsize);

/// One request's place among [`MAX_SERVING`]; given back when dropped.
pub(crate) struct ServingSlot(Arc<Serving>);

impl Drop for ServingSlot {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Serving {
    /// A place, or `None` when [`MAX_SERVING`] requests are being answered.
    pub(crate) fn take(self: &Arc<Self>) -> Option<ServingSlot> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_SERVING).then_some(n + 1)
            })
            .ok()
            .map(|_| ServingSlot(self.clone()))
    }
}

/// Binds the control socket at `path` with the owner, group and mode `access` asks for
/// (by default 0600: only the daemon's user; root can always connect). It is bound
/// where nobody else can reach it, given its permissions, then renamed into place, so
/// there is no moment when another local user could connect.
pub(crate) fn bind_control(
    path: &Path,
    access: &crate::config::SocketAccess,
) -> Result<(UnixListener, crate::files::SocketFile), crate::files::SocketPathError> {
    crate::files::bind_socket(path, access)
}

/// Answers one control connection.
pub(crate) fn serve_control(runtime: &Runtime, mut s: UnixStream) {
    let shared = runtime.shared();
    let _ = s.set_read_timeout(Some(IO_TIMEOUT));
    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
    let req = match read_line(&mut s, 1024) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "control read failed");
            return;
        }
    };
    let reply = match req.as_str() {
        "stat" | "stat json" | "" => {
            serde_json::to_string(&shared.snapshot()).unwrap_or_else(|e| format!("error: {e}"))
        }
        "metrics" => shared.snapshot().prometheus(),
        vm if vm.starts_with("vm ") || vm == "vm" => vm_request(runtime, vm),
        "reload" => match runtime.reload() {
            Ok(r) => {
                let mut text = format!(
                    "reloaded: {} change(s) to the VMs applied, {} failed",
                    r.report.applied.len(),
                    r.report.failed.len()
                );
                for c in &r.report.applied {
                    text += &format!("\n  applied: {c}");
                }
                for c in &r.report.failed {
                    text += &format!("\n  failed: {c}");
                }
                if !r.restart_needed.is_empty() {
                    text += &format!(
                        "\nchanged, and taking effect at the next start only: {}",
                        r.restart_needed.join(", ")
                    );
                }
                text + "\n"
            }
            Err(e) => format!("error: reload: {e}; nothing changed\n"),
        },
        other => format!(
            "error: unknown request {other:?} (expected stat, metrics, reload, vm list, \
             vm add SPEC, vm remove NAME or vm quota NAME N)\n"
        ),
    };
    write_all(&mut s, reply.as_bytes());
}

/// Answers a `vm ...` request.
fn vm_request(runtime: &Runtime, req: &str) -> String {
    let mut words = req.split_whitespace().skip(1);
    let op = words.next().unwrap_or("");
    let args: Vec<&str> = words.collect();
    let answer = match (op, args.as_slice()) {
        ("list", []) => {
            return serde_json::to_string(&runtime.list_vms())
                .map(|j| j + "\n")
                .unwrap_or_else(|e| format!("error: {e}\n"));
        }
        ("add", [spec]) => match spec.parse::<VmSpec>() {
            Ok(spec) => {
                let (name, socket) = (spec.vm.name.clone(), spec.socket.clone());
                runtime
                    .add_vm(spec)
                    .map(|()| format!("added VM {name:?}: {} listens", socket.display()))
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        },
        ("remove", [name]) => runtime
            .remove_vm(name)
            .map(|live| {
                format!(
                    "removed VM {name:?}: its {live} live connections were released on its \
                     behalf"
                )
            })
            .map_err(|e| e.to_string()),
        ("quota", [name, q]) => match parse_quota(q) {
            Ok(quota) => runtime
                .set_vm_quota(name, quota)
                .map(|live| quota_answer(name, quota, runtime.shared().default_quota(), live))
                .map_err(|e| e.to_string()),
            Err(e) => Err(e),
        },
        _ => Err(format!(
            "bad vm request {req:?} (expected vm list, vm add SPEC, vm remove NAME or vm \
             quota NAME N)"
        )),
    };
    match answer {
        Ok(a) => format!("ok: {a}\n"),
        Err(e) => format!("error: {e}\n"),
    }
}

/// A quota as `vm quota` takes it: a number from 1, or `default`.
fn parse_quota(q: &str) -> Result<Option<u32>, String> {
    if q == "default" {
        return Ok(None);
    }
    q.parse::<u32>()
        .ok()
        .filter(|&n| n > 0)
        .map(Some)
        .ok_or_else(|| format!("quota {q:?}: expected a number from 1 to 4294967295, or default"))
}

fn quota_answer(name: &str, quota: Option<u32>, default: u32, live: u64) -> String {
    let q = quota.unwrap_or(default);
    let mut a = format!("VM {name:?} quota {q}; it holds {live} live connections");
    if live > u64::from(q) {
        a.push_str(
            ": above the new quota, its connections stay and new ones are refused \
             (over_quota) until it holds fewer",
        );
    }
    a
}

/// Answers one HTTP request on the metrics listener.
pub(crate) fn serve_metrics(shared: &Shared, mut s: TcpStream) {
    let _ = s.set_read_timeout(Some(IO_TIMEOUT));
    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
    let _ = s.set_nonblocking(false);
    // Read the request head (bounded).
    let mut head = Vec::new();
    let mut b = [0u8; 1024];
    while head.len() < 16 * 1024 && !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&b[..n]),
        }
    }
    let (status, body) = match crate::stats::metrics_route(&head) {
        crate::stats::Route::Metrics => ("200 OK", shared.snapshot().prometheus()),
        crate::stats::Route::NotFound => ("404 Not Found", "only /metrics\n".to_string()),
        crate::stats::Route::BadMethod => ("405 Method Not Allowed", "only GET\n".to_string()),
    };
    let head_only = head.starts_with(b"HEAD ");
    let resp = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if head_only { "" } else { body.as_str() }
    );
    write_all(&mut s, resp.as_bytes());
}

/// Asks a running daemon for its figures.
pub fn query(control: &Path) -> io::Result<Snapshot> {
    let text = request(control, "stat")?;
    serde_json::from_str(&text).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad answer from {}: {e}", control.display()),
        )
    })
}

/// Sends one request line and returns the whole answer.
pub fn request(control: &Path, req: &str) -> io::Result<String> {
    let mut s = UnixStream::connect(control)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", control.display())))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write_all(&mut s, format!("{req}\n").as_bytes());
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// `pvcm-backend vm ...`: sends the request and returns the answer; an `error: ...`
/// answer is an error.
pub fn vm(control: &Path, op: &crate::config::VmOp) -> io::Result<String> {
    use crate::config::VmOp;
    let req = match op {
        VmOp::List => "vm list".to_string(),
        VmOp::Add { spec } => format!("vm add {spec}"),
        VmOp::Remove { name } => format!("vm remove {name}"),
        VmOp::Quota { name, quota } => format!("vm quota {name} {quota}"),
    };
    if req.contains('\n') || req.len() >= 1024 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a request is one line of less than 1024 bytes",
        ));
    }
    let a = request(control, &req)?;
    match a.strip_prefix("error: ") {
        Some(e) => Err(io::Error::other(e.trim_end().to_string())),
        None => Ok(a),
    }
}

/// `pvcm-backend reload`: asks the daemon to read its configuration again and returns
/// its answer; an `error: ...` answer is an error. A reload waits for the VMs it adds
/// or removes, so the answer may take longer than other requests.
pub fn reload(control: &Path) -> io::Result<String> {
    let a = request(control, "reload")?;
    match a.strip_prefix("error: ") {
        Some(e) => Err(io::Error::other(e.trim_end().to_string())),
        None => Ok(a),
    }
}

/// `pvcm-backend stat`: prints the table (or JSON).
pub fn stat(control: &Path, json: bool) -> io::Result<String> {
    if json {
        let text = request(control, "stat")?;
        // Re-parse so a garbled answer is an error, then pretty-print.
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        serde_json::to_string_pretty(&v)
            .map(|s| s + "\n")
            .map_err(|e| io::Error::other(e.to_string()))
    } else {
        Ok(query(control)?.render())
    }
}

/// Reads one request line from a stream (bounded), for the control socket.
pub(crate) fn read_line<R: Read>(r: &mut R, max: usize) -> io::Result<String> {
    let mut buf = Vec::new();
    let mut b = [0u8; 256];
    while buf.len() < max {
        let n = r.read(&mut b)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&b[..n]);
        if buf.contains(&b'\n') {
            break;
        }
    }
    let s = String::from_utf8_lossy(&buf);
    Ok(s.lines().next().unwrap_or("").trim().to_string())
}

/// Writes all of `s` (ignoring a peer that went away).
pub(crate) fn write_all<W: Write>(w: &mut W, s: &[u8]) {
    let _ = w.write_all(s);
    let _ = w.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_socket_is_the_owners_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ctl");
        let _l = bind_control(&p, &crate::config::SocketAccess::CONTROL_DEFAULT).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // No temporary name is left behind, and it answers.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        UnixStream::connect(&p).unwrap();
    }

    #[test]
    fn requests_answered_at_once_are_bounded() {
        let s: Arc<Serving> = Arc::default();
        let held: Vec<ServingSlot> = (0..MAX_SERVING).map(|_| s.take().unwrap()).collect();
        assert!(s.take().is_none(), "one more than MAX_SERVING");
        drop(held);
        assert!(s.take().is_some());
    }
}
