"""The network lab: a private network namespace with a bridge, TCG VMs on it, and the
host-side processes (pvcm-backend, captures) that tests need.

A `Lab` is a context manager. On entry it creates the namespace (bridge br0 with the
host addresses 10.99.0.1/24 and, with ipv6, fd99::1/64; the QP1 divert device
pvcm-qp1; the 9p share directory). Guests boot from the RDMA image of
`build-guest.sh --rdma` and run the image's agent: the lab hands them shell commands
through the share. On exit, normal or not (an exception, SIGINT, SIGTERM), it stops
every process it started, by PID, and deletes the namespace.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from .addr import ipv4, sysfs_gid

SCRIPTS = Path(__file__).resolve().parent.parent
REPO = SCRIPTS.parent

BRIDGE = "br0"
HOST_IP = "10.99.0.1/24"
HOST_IP6 = "fd99::1/64"
DIVERT_DEV = "pvcm-qp1"
SHARE_TAG = "host"


class LabError(Exception):
    """A lab step failed: a boot, a command, a timeout. The message carries the
    evidence (the console tail, the log tail)."""


def _tail(path, lines=40):
    try:
        text = Path(path).read_text(errors="replace").replace("\r", "")
    except OSError:
        return f"({path}: no such file)"
    return "\n".join(text.splitlines()[-lines:])


def _run(cmd, check=True, **kw):
    """Run a host command (argument list); raise LabError with its output if it fails."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if check and p.returncode != 0:
        raise LabError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stdout.strip()}")
    return p


_built = {}


def _build(what, cmd, env_name):
    """The path a build script prints (cached per process); the environment variable
    env_name, when set, gives the path instead."""
    if os.environ.get(env_name):
        return os.environ[env_name]
    if what not in _built:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            raise LabError(f"{shlex.join(cmd)} failed:\n{p.stderr[-3000:]}")
        _built[what] = p.stdout.strip().splitlines()[-1]
    return _built[what]


def qemu_path():
    """The patched QEMU (build-qemu.sh --print-path; PVCM_QEMU overrides)."""
    return _build("qemu", ["bash", str(SCRIPTS / "build-qemu.sh"), "--print-path"], "PVCM_QEMU")


def rdma_image():
    """The RDMA guest image directory (build-guest.sh --rdma; PVCM_RDMA_GUEST_DIR
    overrides)."""
    return _build(
        "image",
        ["bash", str(SCRIPTS / "build-guest.sh"), "--rdma", "--print-dir"],
        "PVCM_RDMA_GUEST_DIR",
    )


def backend_path():
    """pvcm-backend, built by cargo (release) in this repository; PVCM_BACKEND
    overrides."""
    if os.environ.get("PVCM_BACKEND"):
        return os.environ["PVCM_BACKEND"]
    if "backend" not in _built:
        p = subprocess.run(
            ["cargo", "build", "--release", "-q", "-p", "pvcm-backend", "--bin", "pvcm-backend"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            raise LabError(f"cargo build -p pvcm-backend failed:\n{p.stdout[-3000:]}")
        target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
        _built["backend"] = str(target / "release" / "pvcm-backend")
    return _built["backend"]


def mac_of(ip):
    """The lab's MAC for a guest address: 52:54:00:99:XX:YY from the IPv4 address's
    last two bytes."""
    b = ipv4(ip).packed
    return f"52:54:00:99:{b[2]:02x}:{b[3]:02x}"


def node_guid_of(mac):
    """rxe's node GUID for a MAC: the EUI-64 (ff:fe in the middle) with the
    universal/local bit flipped, as sysfs prints it (e.g. 5054:00ff:fe99:000b)."""
    m = [int(x, 16) for x in mac.split(":")]
    e = [m[0] ^ 2, m[1], m[2], 0xFF, 0xFE, m[3], m[4], m[5]]
    return ":".join(f"{e[i]:02x}{e[i + 1]:02x}" for i in range(0, 8, 2))


class Job:
    """A command running in the background in a guest (Guest.spawn). Its output goes
    to `output` (a file in the share, readable while it runs)."""

    def __init__(self, guest, jid):
        self.guest = guest
        self.jid = jid
        base = guest.lab.share / "jobs" / f"{guest.name}.{jid}"
        self.output = Path(f"{base}.out")
        self._rc = Path(f"{base}.rc")
        self._pid = Path(f"{base}.pid")

    def done(self):
        """Has it ended?"""
        return self._rc.exists()

    def wait(self, timeout):
        """Wait until it ends; its exit status. LabError after timeout seconds."""
        deadline = time.monotonic() + timeout
        while not self._rc.exists():
            self.guest.check_alive()
            if time.monotonic() > deadline:
                raise LabError(
                    f"{self.guest.name}: job {self.jid} still running after {timeout} s; "
                    f"output:\n{_tail(self.output, 20)}")
            time.sleep(0.1)
        return int(self._rc.read_text().strip() or "255")

    def text(self):
        """Its output so far."""
        try:
            return self.output.read_text(errors="replace")
        except OSError:
            return ""

    def guest_pid(self, timeout=10):
        """The PID in the guest of the job's shell (the program's, when the command
        starts with exec). LabError if it is not known after timeout seconds."""
        deadline = time.monotonic() + timeout
        while not self._pid.exists() or not self._pid.read_text().strip():
            if time.monotonic() > deadline:
                raise LabError(f"{self.guest.name}: job {self.jid} has no PID after {timeout} s")
            time.sleep(0.1)
        return int(self._pid.read_text().strip())

    def kill(self, sig="TERM", group=True):
        """Send sig to its process group (the job runs in a session of its own), or with
        group=False to its first process only."""
        for _ in range(50):
            if self._pid.exists() or self.done():
                break
            time.sleep(0.1)
        if self.done() or not self._pid.exists():
            return
        pid = self._pid.read_text().strip()
        target = f"-{pid} 2>/dev/null || kill -{sig} {pid}" if group else pid
        self.guest.run(f"kill -{sig} {target} 2>/dev/null; true", 30)


class LocalJob(Job):
    """A job whose script, output and exit status live in the guest (/run/jobs), not in
    the share: it holds no file of the 9p mount, so it goes on while the share is
    unmounted (a live migration, Guest.pause_share). Read through Guest.run."""

    def __init__(self, guest, jid):
        self.guest = guest
        self.jid = jid
        self.base = f"/run/jobs/{guest.name}.{jid}"
        self.output = None

    def done(self):
        return self.guest.run(f"[ -e {self.base}.rc ]", 30)[0] == 0

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            _, out = self.guest.run(f"cat {self.base}.rc 2>/dev/null", 30)
            if out.strip():
                return int(out.strip() or "255")
            if time.monotonic() > deadline:
                raise LabError(
                    f"{self.guest.name}: job {self.jid} still running after {timeout} s; "
                    f"output:\n{self.text()[-2000:]}")
            time.sleep(0.5)

    def text(self):
        return self.guest.run(f"cat {self.base}.out 2>/dev/null", 60)[1]

    def kill(self, sig="TERM", group=True):
        b = self.base
        target = f"{{ kill -{sig} -$p 2>/dev/null || kill -{sig} $p 2>/dev/null; }}" if group \
            else f"kill -{sig} $p 2>/dev/null"
        self.guest.run(f"[ -e {b}.rc ] || {{ p=$(cat {b}.pid 2>/dev/null) && {target}; }}; true",
                       30)


class Destination:
    """A migration destination's QEMU (Lab.destination): its process, tap, console,
    QMP socket and divert device."""

    def __init__(self, proc, tap, console, qmp, dev):
        self.proc = proc
        self.tap = tap
        self.console = console
        self.qmp = qmp
        self.dev = dev


class Guest:
    """A VM on the lab's bridge that runs the RDMA image's agent. `run` and `spawn`
    hand it shell commands (dash) through the 9p share."""

    def __init__(self, lab, name, ip, ip6, tap, console, cm):
        self.lab = lab
        self.name = name
        self.ip = ip
        self.ip6 = ip6
        self.mac = mac_of(ip)
        self.node_guid = node_guid_of(self.mac)
        self.tap = tap
        self.console = console
        self.cm = cm
        self.qmp = None
        self.qemu_args = None
        self.proc = None
        self._seq = 0
        self._lock = threading.Lock()

    def move_to(self, dest):
        """The guest runs in dest's QEMU now (its migration completed): the source's
        QEMU is kept for the lab to stop at exit; returns it and its tap."""
        old = (self.proc, self.tap)
        self.lab._procs.append(self.proc)
        self.proc, self.tap, self.console, self.qmp = dest.proc, dest.tap, dest.console, dest.qmp
        return old

    @property
    def pid(self):
        """QEMU's PID."""
        return self.proc.pid if self.proc else None

    def wait_ready(self, timeout=180):
        """Wait for the agent's ready flag; LabError (with the console tail) if QEMU
        exits, the init reports a failed setup, or timeout seconds pass."""
        ready = self.lab.share / f"flag.ready.{self.name}"
        deadline = time.monotonic() + timeout
        while not ready.exists():
            self.check_alive()
            if self.console.exists() and "PVCM-END" in self.console.read_text(errors="replace"):
                raise LabError(f"{self.name}: setup failed; console {self.console}:\n"
                               f"{self.console_tail()}")
            if time.monotonic() > deadline:
                raise LabError(f"{self.name}: not ready after {timeout} s; console "
                               f"{self.console}:\n{self.console_tail()}")
            time.sleep(0.1)

    def console_tail(self, lines=40):
        """The last lines of the serial console."""
        return _tail(self.console, lines)

    def check_alive(self):
        """Raise LabError (with the console tail) if QEMU has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise LabError(
                f"{self.name}: QEMU exited ({self.proc.returncode}); console "
                f"{self.console}:\n{self.console_tail()}\nQEMU stderr:\n"
                f"{_tail(str(self.console) + '.qemu-stderr', 10)}")

    def _request(self, script, tag):
        with self._lock:
            self._seq += 1
            base = self.lab.share / "q" / f"{self.name}.{self._seq:06d}-{tag}"
        tmp = Path(f"{base}.tmp")
        tmp.write_text(script + "\n")
        tmp.rename(f"{base}.sh")
        return base

    def run(self, cmd, timeout=60):
        """Run cmd (sh) in the guest and wait for it: (exit status, output). The agent
        runs one request at a time. LabError after timeout seconds."""
        base = self._request(cmd, "run")
        rc = Path(f"{base}.rc")
        deadline = time.monotonic() + timeout
        while not rc.exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise LabError(
                    f"{self.name}: no answer to {cmd!r} in {timeout} s; output so far:\n"
                    f"{_tail(str(base) + '.out', 20)}\nconsole:\n{self.console_tail(20)}")
            time.sleep(0.05)
        out = Path(f"{base}.out").read_text(errors="replace")
        return int(rc.read_text().strip() or "255"), out

    def check(self, cmd, timeout=60):
        """run() that raises LabError unless the status is 0; the output."""
        rc, out = self.run(cmd, timeout)
        if rc != 0:
            raise LabError(f"{self.name}: {cmd!r} exited {rc}:\n{out[-2000:]}")
        return out

    def spawn(self, cmd, local=False):
        """Start cmd (sh) in the background, in a session of its own; a Job. local: its
        files in the guest (a LocalJob), so that it holds nothing on the share."""
        with self._lock:
            self._seq += 1
            jid = self._seq
        jobs = self.lab.share / "jobs"
        jobs.mkdir(exist_ok=True)
        g = f"/host/jobs/{self.name}.{jid}"
        if local:
            b = f"/run/jobs/{self.name}.{jid}"
            (jobs / f"{self.name}.{jid}.sh").write_text(f"echo $$ >{b}.pid\n{cmd}\n")
            (jobs / f"{self.name}.{jid}.wrap").write_text(
                f"setsid sh {b}.sh >{b}.out 2>&1 </dev/null\necho $? >{b}.rc.tmp\n"
                f"mv {b}.rc.tmp {b}.rc\n")
            # The wrapper is a program of its own (sh execs), so it keeps no descriptor
            # of the request's file on the share open.
            self.check(f"mkdir -p /run/jobs && cp {g}.sh {b}.sh && cp {g}.wrap {b}.wrap && "
                       f"{{ sh {b}.wrap >/dev/null 2>&1 </dev/null & }}", 60)
            return LocalJob(self, jid)
        (jobs / f"{self.name}.{jid}.sh").write_text(f"echo $$ >{g}.pid\n{cmd}\n")
        self._request(
            f"( setsid sh {g}.sh >{g}.out 2>&1 </dev/null; echo $? >{g}.rc.tmp; "
            f"mv {g}.rc.tmp {g}.rc ) >/dev/null 2>&1 </dev/null &", "spawn")
        return Job(self, jid)

    def pause_share(self, hold):
        """Unmount the share in the guest, for a live migration: QEMU refuses to migrate
        while a virtio-9p export is mounted, and adds that blocker back when the guest
        mounts it, refusing the mount while a migration runs. So the guest unmounts it
        (retrying while a request of the agent touches it), waits hold seconds, then
        mounts it again, every 0.5 s until QEMU lets it: on the destination once the
        migration completed, or on the source if it failed. Meanwhile the agent serves
        nothing (its requests are in the share) and nothing may hold a file there: run
        what must go on with spawn(local=True), and log to the guest's own files.
        share_back() waits for the agent."""
        script = (
            "sleep 0.5\ni=0\n"
            "until umount /host 2>/dev/null; do i=$((i + 1)); "
            "if [ $i -ge 300 ]; then echo 'umount /host failed'; grep ' /host ' /proc/mounts; "
            "exit 1; fi; sleep 0.1; done\n"
            "echo \"unmounted $(cut -d' ' -f1 /proc/uptime)\"\n"
            f"sleep {hold}\nn=0\n"
            f"until mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 {SHARE_TAG} /host "
            "2>/dev/null; do n=$((n + 1)); sleep 0.5; done\n"
            "echo \"mounted $(cut -d' ' -f1 /proc/uptime) after $n refused\"\n")
        (self.lab.share / f"share-pause.{self.name}.sh").write_text(script)
        # sh execs: the pause keeps no descriptor of the request's file open.
        self.check(f"cp /host/share-pause.{self.name}.sh /run/share-pause.sh && "
                   "{ setsid sh /run/share-pause.sh >/run/share-pause.log 2>&1 </dev/null & }", 60)

    def share_back(self, timeout=120):
        """Wait until the agent answers again after pause_share; the pause's log."""
        return self.check("cat /run/share-pause.log", timeout)

    def wait_file(self, path, timeout=60):
        """Wait until path exists in the guest (a path under /host is watched from
        the host side). LabError after timeout seconds."""
        deadline = time.monotonic() + timeout
        host = self.lab.share / path[len("/host/"):] if path.startswith("/host/") else None
        while True:
            if host is not None:
                if host.exists():
                    return
            elif self.run(f"[ -e {shlex.quote(path)} ]", timeout)[0] == 0:
                return
            self.check_alive()
            if time.monotonic() > deadline:
                raise LabError(f"{self.name}: no {path} after {timeout} s")
            time.sleep(0.2)

    def gids(self):
        """rxe0's GID table: {index: (gid, type)} for the entries in use."""
        # One grep reads the whole table (a process per entry takes minutes in a TCG
        # guest on a loaded machine: rxe has hundreds of entries). An unused entry's
        # type cannot be read: grep skips it.
        out = self.check(
            "cd /sys/class/infiniband/rxe0/ports/1 && "
            "{ grep -H . gids/* gid_attrs/types/* 2>/dev/null; true; }")
        gids, types = {}, {}
        for line in out.splitlines():
            path, _, value = line.strip().partition(":")
            kind, _, n = path.rpartition("/")
            if not n.isdigit():
                continue
            if kind == "gids":
                gids[int(n)] = value
            elif kind == "gid_attrs/types":
                types[int(n)] = value
        return {n: (g, types.get(n, "")) for n, g in gids.items()
                if g != "0000:0000:0000:0000:0000:0000:0000:0000"}

    def gid_index(self, addr=None):
        """The index of the RoCE v2 GID of addr (default: the guest's IPv4 address)."""
        want = sysfs_gid(addr or self.ip)
        for i, (g, t) in sorted(self.gids().items()):
            if g == want and t == "RoCE v2":
                return i
        raise LabError(f"{self.name}: no RoCE v2 GID {want} in {self.gids()}")


class Backend:
    """A pvcm-backend in the lab's namespace; its log is `log`, its control socket
    `control`."""

    def __init__(self, lab, name, proc, log, control):
        self.lab = lab
        self.name = name
        self.proc = proc
        self.log = log
        self.control = control

    @property
    def pid(self):
        return self.proc.pid

    def stat_json(self):
        """`pvcm-backend stat --json` of this backend, parsed."""
        p = _run([backend_path(), "stat", "--control", str(self.control), "--json"])
        return json.loads(p.stdout)

    def stop(self):
        """SIGTERM, then SIGKILL after 5 s."""
        _stop(self.proc, 5)


def _stop(proc, grace):
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


class Lab:
    """A network namespace with bridge br0 and the VMs, backends and captures of one
    test. Use it as a context manager.

    workdir: logs and the 9p share (workdir/share, with q/ for requests);
    ipv6: keep IPv6 on (br0 gets fd99::1/64); mtu: of br0, the taps and the guests;
    pcap: capture br0 into this file with dumpcap; vcpus: each guest's vCPUs (TCG
    threads on this machine's cores).
    """

    def __init__(self, workdir, ipv6=False, mtu=1500, pcap=None, vcpus=1):
        self.workdir = Path(workdir).resolve()
        self.ipv6 = ipv6
        self.mtu = mtu
        self.vcpus = vcpus
        self.pcap = pcap
        self.ns = f"pvcmlab{os.getpid()}"
        self.share = self.workdir / "share"
        self.guests = {}
        self.backends = []
        self._procs = []  # other processes to stop: captures, host commands
        self._ns_made = False
        self._old_term = None
        self._taps = 0

    # ---- the namespace ----

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _raise_on_term)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _start(self):
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespace, taps)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.share.mkdir(exist_ok=True)
        for d in ("q", "jobs"):
            shutil.rmtree(self.share / d, ignore_errors=True)
            (self.share / d).mkdir()
        for f in self.share.glob("flag.*"):
            f.unlink()
        _run(["ip", "netns", "add", self.ns])
        self._ns_made = True
        six = "0" if self.ipv6 else "1"
        self.host(f"sysctl -qw net.ipv6.conf.all.disable_ipv6={six} "
                  f"net.ipv6.conf.default.disable_ipv6={six}", check=True)
        ipn = ["ip", "-n", self.ns]
        _run(ipn + ["link", "set", "lo", "up"])
        _run(ipn + ["link", "add", BRIDGE, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
        _run(ipn + ["link", "set", BRIDGE, "mtu", str(self.mtu), "up"])
        _run(ipn + ["addr", "add", HOST_IP, "dev", BRIDGE])
        if self.ipv6:
            _run(ipn + ["addr", "add", HOST_IP6, "dev", BRIDGE, "nodad"])
        # The divert device, up from the start (qp1-divert.sh add would make it too).
        self.host(f"bash {SCRIPTS / 'qp1-divert.sh'} dev {DIVERT_DEV}", check=True)
        if self.pcap:
            if not shutil.which("dumpcap"):
                raise LabError("pcap needs dumpcap (apt-get install tshark)")
            Path(self.pcap).unlink(missing_ok=True)
            p = self._popen_ns(["dumpcap", "-q", "-i", BRIDGE, "-P", "-w", str(self.pcap)],
                               self.workdir / "dumpcap.log")
            self._procs.append(p)
            for _ in range(100):
                if Path(self.pcap).exists():
                    break
                time.sleep(0.05)

    def close(self):
        """Stop everything the lab started and delete the namespace (idempotent)."""
        try:
            (self.share / "flag.stop").touch()
        except OSError:
            pass
        for g in self.guests.values():
            _stop(g.proc, 2)
        for b in self.backends:
            _stop(b.proc, 5)
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
            _stop(p, 5)
        if self._ns_made:
            subprocess.run(["ip", "netns", "del", self.ns], stderr=subprocess.DEVNULL)
            self._ns_made = False
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def _popen_ns(self, argv, log, env=None):
        """Start argv in the namespace with nsenter, which execs in place: the PID is
        the program's own (ip netns exec forks)."""
        f = open(log, "wb")
        try:
            return subprocess.Popen(["nsenter", f"--net=/var/run/netns/{self.ns}", "--"] + argv,
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        finally:
            f.close()

    def host(self, cmd, timeout=None, env=None, check=False):
        """Run cmd (sh) in the namespace and wait: (exit status, output)."""
        p = subprocess.run(["ip", "netns", "exec", self.ns, "sh", "-c", cmd],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, env=env)
        if check and p.returncode != 0:
            raise LabError(f"in {self.ns}: {cmd!r} exited {p.returncode}: {p.stdout.strip()}")
        return p.returncode, p.stdout

    def host_start(self, argv, log, env=None):
        """Start argv in the namespace in the background (a session of its own, stopped
        at exit with its process group); the Popen."""
        p = self._popen_ns(argv, log, env)
        self._procs.append(p)
        return p

    def add_address(self, cidr):
        """Give br0 one more address (e.g. 10.99.0.250/24)."""
        self.host(f"ip addr add {cidr} dev {BRIDGE}" + (" nodad" if ":" in cidr else ""),
                  check=True)

    # ---- guests ----

    def _tap(self):
        self._taps += 1
        tap = f"tap{self._taps}"
        ipn = ["ip", "-n", self.ns]
        _run(ipn + ["tuntap", "add", tap, "mode", "tap"])
        _run(ipn + ["link", "set", tap, "mtu", str(self.mtu), "master", BRIDGE, "up"])
        return tap

    def guest(self, name, ip, ip6=None, cm="kernel", socket=None, divert=False,
              boot_timeout=180, mem="512M", append="", wait=True, qmp=None):
        """Boot a guest of the RDMA image on br0 (rxe on eth0, agent mode) and wait for
        its agent (unless wait=False: then call its wait_ready). cm: "kernel" (the
        kernel CM loaded), "pvcm" (kept out), None; socket: a pvcm-backend vhost-user
        socket to attach the pvcm device to; divert: install the QP1 divert of its tap
        to pvcm-qp1 before it boots; append: more kernel command line; qmp: a path for
        QEMU's QMP monitor (Guest.qmp)."""
        if name in self.guests:
            raise LabError(f"guest {name} exists")
        ip = ip.split("/")[0]
        ips = [f"{ip}/24"] + ([ip6 if "/" in ip6 else f"{ip6}/64"] if ip6 else [])
        ip6 = ip6.split("/")[0] if ip6 else None
        tap = self._tap()
        console = self.workdir / f"{name}.console.log"
        console.unlink(missing_ok=True)
        g = Guest(self, name, ip, ip6, tap, console, cm)
        g.qmp = qmp
        if divert:
            self.divert(g, tap, DIVERT_DEV)
        image = Path(rdma_image())
        kcmd = ["console=ttyS0", "panic=-1", "hugepages=64" if socket else "hugepages=0",
                f"pvcm.ip={','.join(ips)}", "pvcm.rxe=1", f"pvcm.share={SHARE_TAG}",
                f"pvcm.agent={name}"]
        if cm:
            kcmd.append(f"pvcm.cm={cm}")
        if ip6:
            kcmd.append("pvcm.ipv6=1")
        if self.mtu != 1500:
            kcmd.append(f"pvcm.mtu={self.mtu}")
        if append:
            kcmd.append(append)
        kernel = image / "vmlinux" if (image / "vmlinux").exists() else image / "vmlinuz"
        g.qemu_args = (str(kernel), str(image / "initramfs.img"), " ".join(kcmd), mem)
        argv = self._qemu_argv(g, tap, console, socket, qmp)
        g.proc = self._popen_ns(argv, f"{console}.qemu-stderr")
        self.guests[name] = g
        if wait:
            g.wait_ready(boot_timeout)
        return g

    def _qemu_argv(self, g, tap, console, socket, qmp, incoming=None):
        """QEMU's command line for guest g on tap, its pvcm device (if any) on socket,
        its QMP monitor (if any) at qmp; incoming: -incoming's URI (a migration's
        destination)."""
        kernel, initrd, append, mem = g.qemu_args
        argv = [qemu_path(), "-name", g.name, "-nodefaults", "-no-user-config", "-nographic",
                "-no-reboot", "-accel", "tcg",
                "-machine", "q35,memory-backend=mem",
                "-object", f"memory-backend-memfd,id=mem,size={mem},share=on",
                "-m", mem, "-smp", str(self.vcpus),
                "-serial", f"file:{console}", "-monitor", "none",
                "-kernel", kernel, "-initrd", initrd, "-append", append,
                "-netdev", f"tap,id=n0,ifname={tap},script=no,downscript=no",
                "-device", f"virtio-net-pci,netdev=n0,mac={g.mac},romfile=",
                "-virtfs", f"local,path={self.share},mount_tag={SHARE_TAG},"
                           f"security_model=none,id={SHARE_TAG}"]
        if socket:
            # As run-vm.sh's generic route attaches it.
            argv += ["-chardev", f"socket,id=pvcm,path={socket},reconnect-ms=1000",
                     "-device", "vhost-user-device-pci,chardev=pvcm,virtio-id=63,num_vqs=2,"
                                "vq_size=1024,config_size=8"]
        if qmp:
            argv += ["-qmp", f"unix:{qmp},server=on,wait=off"]
        if incoming:
            argv += ["-incoming", incoming]
        return argv

    def divert(self, g, tap, dev):
        """Install guest g's QP1 divert on tap, to dev (qp1-divert.sh add): both
        directions, its QP1 frames to dev, and what it sends checked (its MAC and
        addresses only; its own QP1 frames stopped)."""
        own = " ".join([g.ip] + ([g.ip6] if g.ip6 else []) + ["fe80::/64"])
        self.host(f"bash {SCRIPTS / 'qp1-divert.sh'} add {tap} {dev} {g.mac} {own}",
                  check=True)

    def undivert(self, tap, dev):
        """Remove a tap's QP1 divert (qp1-divert.sh del; the tap may be gone)."""
        self.host(f"bash {SCRIPTS / 'qp1-divert.sh'} del {tap} {dev}", check=True)

    def destination(self, g, socket, dev, uri, tag="dst"):
        """A live migration's destination for guest g, as a second host would run it:
        a tap of its own on br0 with g's QP1 divert to dev (installed before QEMU
        starts), and QEMU with g's machine, its pvcm device on socket (the destination
        backend's), QMP at workdir/NAME.TAG.qmp, waiting on -incoming uri. Returns a
        Destination; Guest.move_to() makes g that QEMU once the migration completed."""
        tap = self._tap()
        self.divert(g, tap, dev)
        console = self.workdir / f"{g.name}.{tag}.console.log"
        console.unlink(missing_ok=True)
        qmp = self.workdir / f"{g.name}.{tag}.qmp"
        qmp.unlink(missing_ok=True)
        argv = self._qemu_argv(g, tap, console, socket, qmp, incoming=uri)
        proc = self._popen_ns(argv, f"{console}.qemu-stderr")
        return Destination(proc, tap, console, qmp, dev)

    def kernel_guest(self, name, ip, ip6=None, **kw):
        """A kernel-CM peer: the RDMA image with pvcm.cm=kernel pvcm.rxe=1, agent mode."""
        return self.guest(name, ip, ip6, cm="kernel", **kw)

    def pvcm_vm(self, name, ip, ip6=None, socket=None, **kw):
        """A pvcm VM with its own RDMA NIC: the RDMA image in the patched QEMU, the pvcm
        device on socket (when given), rxe on its NIC with pvcm.cm=pvcm (no kernel
        CM), agent mode, and its tap's QP1 frames diverted to pvcm-qp1."""
        return self.guest(name, ip, ip6, cm="pvcm", socket=socket, divert=True, **kw)

    # ---- backends ----

    def backend(self, *args, name="backend", env=None):
        """Start pvcm-backend in the namespace with args plus --control; wait for its
        control socket. Its log is workdir/NAME.log."""
        control = self.workdir / f"{name}.ctl"
        control.unlink(missing_ok=True)
        log = self.workdir / f"{name}.log"
        e = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"), NO_COLOR="1")
        e.update(env or {})
        proc = self._popen_ns([backend_path(), *args, "--control", str(control)], log, e)
        b = Backend(self, name, proc, log, control)
        self.backends.append(b)
        deadline = time.monotonic() + 20
        while not control.exists():
            if proc.poll() is not None:
                raise LabError(f"pvcm-backend {name} exited {proc.returncode}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise LabError(f"pvcm-backend {name}: no control socket in 20 s:\n{_tail(log)}")
            time.sleep(0.05)
        return b


def _raise_on_term(signum, frame):
    raise SystemExit(128 + signum)
