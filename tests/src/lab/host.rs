//! Hosts: real `pvcm-backend` processes.
//!
//! The `pvcm-lab` binary re-executes itself as `pvcm-lab __backend <pvcm-backend
//! arguments>`; [`backend_main`] then calls `pvcm_backend::run_cli`, the very entry the
//! `pvcm-backend` binary's `main` calls.
//! The child asks to get SIGTERM when the lab dies (`PR_SET_PDEATHSIG`), so no backend
//! outlives a crashed lab.

use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use pvcm_backend::control;
use pvcm_backend::mux::Policy;
use pvcm_backend::stats::Snapshot;
use pvcm_wire::Gid;

/// The hidden subcommand that runs a backend.
pub const BACKEND_SUBCOMMAND: &str = "__backend";

/// `pvcm-lab __backend ARGS...`: the `pvcm-backend` command line, run in this process
/// by the backend library's own entry point.
pub fn backend_main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong);
    }
    pvcm_backend::run_cli(args)
}

/// One VM of a host, as the host is configured for it.
#[derive(Debug, Clone)]
pub struct VmSlot {
    /// Host index (0-based).
    pub host: usize,
    /// VM index within the host (0-based).
    pub vm: usize,
    /// Global VM index (host-major).
    pub global: usize,
    /// Name (`h1v1`).
    pub name: String,
    /// Its address (the GID is IPv4-mapped).
    pub addr: Ipv4Addr,
    /// Its vhost-user socket.
    pub socket: PathBuf,
    /// Its quota of live entries (`None`: the backend's default).
    pub quota: Option<u32>,
}

impl VmSlot {
    /// A VM of a standalone lab command (`hostile`, `restart`): VM `vm` of host `host`
    /// at 127.`net`.(host+1).(vm+1), its socket `dir/NAME.sock`, the default quota.
    pub fn loopback(dir: &Path, host: usize, vm: usize, name: &str, net: u8) -> VmSlot {
        VmSlot {
            host,
            vm,
            global: host * 64 + vm,
            name: name.to_string(),
            addr: Ipv4Addr::new(127, net, host as u8 + 1, vm as u8 + 1),
            socket: dir.join(format!("{name}.sock")),
            quota: None,
        }
    }

    /// The VM's GID.
    pub fn gid(&self) -> Gid {
        Gid::from_ipv4(self.addr)
    }
}

/// A host's configuration.
#[derive(Debug, Clone)]
pub struct HostSpec {
    /// Host index (0-based).
    pub index: usize,
    /// Name (`h1`).
    pub name: String,
    /// Its VMs.
    pub vms: Vec<VmSlot>,
    /// Mux policy.
    pub policy: Policy,
    /// Mux seed (`--seed`).
    pub seed: u64,
    /// UDP port the host binds and sends to.
    pub bind_port: u16,
    /// Control socket.
    pub control: PathBuf,
    /// Capture file.
    pub pcap: Option<PathBuf>,
    /// `--rx-backlog`.
    pub rx_backlog: usize,
    /// The backend's log (its stderr).
    pub log: PathBuf,
    /// More backend options (e.g. `--state-dir DIR`).
    pub extra: Vec<String>,
}

impl HostSpec {
    /// Host `index` (`h1`, ...) of a standalone lab command: the default policy and rx
    /// budget, control socket and log in `dir`.
    pub fn standalone(dir: &Path, index: usize, vms: Vec<VmSlot>, seed: u64) -> HostSpec {
        HostSpec {
            index,
            name: format!("h{}", index + 1),
            vms,
            policy: Policy::Default,
            seed,
            bind_port: pvcm_wire::roce::UDP_PORT,
            control: dir.join(format!("h{}.ctl", index + 1)),
            pcap: None,
            // The default budget (32 MiB per VM) as messages.
            rx_backlog: pvcm_backend::backlog::DEFAULT_VM_BYTES / pvcm_backend::backlog::MSG_COST,
            log: dir.join(format!("h{}.log", index + 1)),
            extra: Vec::new(),
        }
    }

    /// The backend's command line (without the program name).
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        for v in &self.vms {
            a.push("--vm".to_string());
            let mut vm = format!(
                "socket={},gid={},name={}",
                v.socket.display(),
                v.addr,
                v.name
            );
            if let Some(q) = v.quota {
                vm.push_str(&format!(",quota={q}"));
            }
            a.push(vm);
        }
        a.extend([
            "--control".to_string(),
            self.control.display().to_string(),
            "--policy".to_string(),
            self.policy.name().to_string(),
            "--rx-backlog".to_string(),
            self.rx_backlog.to_string(),
            "--bind-port".to_string(),
            self.bind_port.to_string(),
            "--seed".to_string(),
            self.seed.to_string(),
        ]);
        if let Some(p) = &self.pcap {
            a.push("--pcap".to_string());
            a.push(p.display().to_string());
        }
        a.extend(self.extra.iter().cloned());
        a
    }
}

/// A running backend process.
#[derive(Debug)]
pub struct HostProc {
    /// Its configuration.
    pub spec: HostSpec,
    child: Option<Child>,
}

impl HostProc {
    /// Starts `exe __backend ARGS` (stderr to the spec's log file) and waits until its
    /// control socket answers and every VM socket exists.
    pub fn spawn(exe: &Path, spec: HostSpec, ready: Duration) -> io::Result<HostProc> {
        let mut h = HostProc { spec, child: None };
        h.start(exe, ready)?;
        Ok(h)
    }

    /// Starts the backend again with the same command line (after [`HostProc::kill`] or
    /// [`HostProc::stop`]); its log goes on in the same file.
    pub fn respawn(&mut self, exe: &Path, ready: Duration) -> io::Result<()> {
        if self.child.is_some() {
            return Err(io::Error::other("the backend still runs"));
        }
        self.start(exe, ready)
    }

    /// SIGKILL: the backend dies at once, saving nothing (a crash).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn start(&mut self, exe: &Path, ready: Duration) -> io::Result<()> {
        let spec = &self.spec;
        let log = File::options().create(true).append(true).open(&spec.log)?;
        let mut cmd = Command::new(exe);
        cmd.arg(BACKEND_SUBCOMMAND)
            .args(spec.args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let child = cmd.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("starting {} {BACKEND_SUBCOMMAND}: {e}", exe.display()),
            )
        })?;
        self.child = Some(child);
        self.wait_ready(ready)
    }

    fn wait_ready(&mut self, timeout: Duration) -> io::Result<()> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Some(st) = c.try_wait()? {
                    let log = std::fs::read_to_string(&self.spec.log).unwrap_or_default();
                    return Err(io::Error::other(format!(
                        "backend {} exited at start ({st}):\n{log}",
                        self.spec.name
                    )));
                }
            }
            let sockets = self.spec.vms.iter().all(|v| v.socket.exists());
            if sockets && control::query(&self.spec.control).is_ok() {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(io::Error::other(format!(
                    "backend {} not ready after {timeout:?}",
                    self.spec.name
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its process ID.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The backend's figures, from its control socket.
    pub fn stat(&self) -> io::Result<Snapshot> {
        control::query(&self.spec.control)
    }

    /// Resident memory of the backend process, in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.pid()?;
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    }

    /// The backend's threads now.
    pub fn threads(&self) -> Option<u64> {
        let pid = self.pid()?;
        let n = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.count();
        Some(n as u64)
    }

    /// CPU time the backend's threads have run so far (the sum of their
    /// `/proc/PID/task/TID/schedstat` run times; threads that already ended are not in
    /// it, so compare two readings only over a window in which no thread ends).
    pub fn cpu_time(&self) -> Option<Duration> {
        let pid = self.pid()?;
        let mut ns: u64 = 0;
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))
            .ok()?
            .flatten()
        {
            let s = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
            ns += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
        Some(Duration::from_nanos(ns))
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM, then waits up to 10 s (SIGKILL after that).
    pub fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        // SAFETY: kill(2) on our own child's PID, which we have not reaped yet.
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() > until => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

impl Drop for HostProc {
    fn drop(&mut self) {
        self.stop();
    }
}
