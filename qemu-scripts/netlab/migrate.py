"""Live migration of a pvcm VM running the distribution's rdma-core programs
(qemu-scripts/apps.sh --migrate runs it).

The lab: a kernel-CM guest k (10.99.0.2) and a pvcm VM m (10.99.0.11; rxe on its NIC,
pvcm-guestd serving /dev/infiniband/rdma_cm) on one bridge. Two "hosts" share the
bridge's namespace: backend A (--port packet:pvcm-qp1) serves m where it boots, backend
B (--port packet:pvcm-qp1b, m configured incoming=yes with the same id-range) waits
for it. m's QP1 frames are diverted from its tap to A's device; the destination QEMU
gets a tap of its own on the bridge, diverted to B's device before it starts.

While the distribution's programs run, m moves from A to B (QMP migrate; the patched
QEMU carries the pvcm device's state through vhost-user SET_DEVICE_STATE_FD):
  - rping -v -V -C N from m to k and from k to m, running through the migration;
  - pvcm-guest cmtime --hold: 50 connections to k's rdma-core cmtime set up before the
    move, held through it and torn down from B after it;
  - rdma-core cmtime -c 5 in a loop from m to k and from k to m, connecting while the
    VM moves;
  - rstream -T v (rsockets over rdma_cm, data verified) from m to k and from k to m:
    each one connection, set up before the move, carrying data through and after it
    and closed afterwards;
then new connections both ways. The host side follows the VM: B's divert is installed
before the destination QEMU starts; A saves the VM's state when QEMU stops it (from
then on A routes nothing to it), B loads it before the VM runs; the bridge learns the
VM's MAC on the destination tap from QEMU's announce; then the source QEMU quits, its
tap's divert goes, and A forgets the VM (vm remove).

The guest's 9p share, through which the lab hands it commands, blocks migration while
mounted: the agent unmounts it for the migration and mounts it again after
(Guest.pause_share); whatever runs in m meanwhile logs to m's own files (LocalJob).

Figures printed: QEMU's downtime and total time, the CM's pause (the last frame of the
VM through A, the first through B, from the backends' captures), the data stall rping
shows at k, the bridge's switch to the destination tap after A saved, the frames that
landed in between and where, CM retries on both sides.

--failed: first a migration the destination refuses (a third backend with the VM under
another id-range): with QEMU's return path on, the migration fails and the VM goes on
at A with its connections; then one whose stream is cut (the destination QEMU killed
while the RAM is sent): the migration fails, the VM goes on at A.

The last line reads "migrate: N passed, N failed"; exit 0 when all passed.
"""

import argparse
import ipaddress
import json
import re
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from .apps import BACKEND_LOG, QPN_WINDOW, drop_reasons, listeners, pair, short, start_guestd
from .lab import SCRIPTS, Lab, LabError, backend_path
from .results import counts, result
from .toolout import pcap_records, rocev2_packets

sys.path.insert(0, str(SCRIPTS))
from qmp import Qmp  # noqa: E402  (qemu-scripts/qmp.py)

K, M = "10.99.0.2", "10.99.0.11"
K6, M6 = "fd99::2", "fd99::11"
ID_KEYS = "0x80110000/16,quota=1000"
OTHER_KEYS = "0x80120000/16,quota=1000"
DEV_A, DEV_B = "pvcm-qp1", "pvcm-qp1b"
HELD = 50


def pings(text):
    """rping -v's iterations in its output: one more than the last rdma-ping-N it printed
    (stdout and stderr share the file, so an event line may split an earlier one)."""
    return max((int(n) for n in re.findall(r"rdma-ping-(\d+):", text)), default=-1) + 1


def server_ok(rc, out):
    """An rping server ended well: exit 0, or rping's own race at its exit: its CM event
    thread, never joined, asks for the next event after the main thread destroyed the
    event channel ("rdma_get_cm_event: Bad file descriptor", exit 255), once the client
    disconnected and every iteration was done (the caller checks those)."""
    return rc == 0 or (rc == 255 and "DISCONNECT EVENT" in out
                       and "rdma_get_cm_event: Bad file descriptor" in out)


def rstream_ok(rc, out):
    """An rstream run ended well: exit 0, its results line ("custom", the -S/-C run's
    name) and no verification failure."""
    return (rc == 0 and re.search(r"^custom\s", out, re.M) is not None
            and "verification failed" not in out)


def rstream_secs(out, default):
    """The seconds an rstream run's results line reports ("custom ... 1.52s ..."), or
    default."""
    m = re.search(r"^custom\s+\S+\s+\S+\s+\S+\s+\S+\s+([\d.]+)s", out or "", re.M)
    return max(float(m.group(1)), 0.1) if m else default


def rxe_counters(guest):
    """rxe0's hardware counters that show lost and retransmitted packets."""
    _, out = guest.run("rdma statistic show link rxe0/1", 30)
    want = ("duplicate_request", "out_of_seq_request", "rcvd_seq_err", "completer_retry_err",
            "retry_exceeded_err", "send_rnr_err", "rcvd_rnr_err", "retry_rnr_exceeded_err",
            "ack_deferred", "lcl_ack_timeout")
    return {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", out) if k in want}


def delta(after, before):
    """What changed between two {name: count} readings."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def kernel_cm(guest):
    """A kernel-CM guest's infiniband_cm retries and duplicates: {group: total}."""
    _, out = guest.run("cd /sys/class/infiniband/rxe0/ports/1 && "
                       "grep -H . cm_tx_retries/* cm_rx_duplicates/*", 30)
    tot = {}
    for line in out.splitlines():
        path, _, v = line.partition(":")
        g = path.split("/")[0]
        if v.strip().isdigit():
            tot[g] = tot.get(g, 0) + int(v)
    return tot


def guestd(vm):
    """pvcm-guestd stat --json in vm, parsed ({} if it does not answer)."""
    rc, out = vm.run("pvcm-guestd stat --json", 30)
    try:
        return json.loads(out) if rc == 0 else {}
    except ValueError:
        return {}


def agent_retries(st):
    """pvcm-guestd's CM agent: retries sent and duplicates received, in total."""
    c = st.get("counters", {})
    return {g: sum(c.get(g, {}).values()) for g in ("cm_tx_retries", "cm_rx_duplicates")}


def pcap_frames(path, addr):
    """(wall time, direction) of the frames in a backend's capture whose IPv4/IPv6
    source or destination is addr."""
    want = ipaddress.ip_address(addr).packed
    try:
        rec = pcap_records(Path(path).read_bytes())
    except OSError:
        return []
    if rec is None:
        return []
    link, frames = rec
    out = []
    for t, pkt in frames:
        if link == 1:
            pkt = pkt[14:]
        if not pkt:
            continue
        v = pkt[0] >> 4
        if v == 4 and len(pkt) >= 20:
            src, dst = pkt[12:16], pkt[16:20]
        elif v == 6 and len(pkt) >= 40:
            src, dst = pkt[8:24], pkt[24:40]
        else:
            continue
        if src == want:
            out.append((t, "tx"))
        elif dst == want:
            out.append((t, "rx"))
    return out


def data_frames(path, a, b):
    """Wall times of the RoCEv2 frames to a data QP (not QP1) from a to b in a capture
    (Ethernet) of k's tap."""
    a, b = str(ipaddress.ip_address(a)), str(ipaddress.ip_address(b))
    try:
        pkts = rocev2_packets(Path(path).read_bytes()) or []
    except OSError:
        return []
    return [t for t, src, dst, _, dqp in pkts if src == a and dst == b and dqp != 1]


def longest_gap(ts, t0, t1):
    """The longest gap between consecutive times that overlaps [t0, t1]: (seconds,
    start, end), or (None, None, None)."""
    best = (None, None, None)
    for x, y in zip(ts, ts[1:]):
        if y >= t0 and x <= t1 and (best[0] is None or y - x > best[0]):
            best = (y - x, x, y)
    return best


class Lines:
    """Watches files in the share (k's jobs' outputs) from the host: the host time of
    every growth of each file's count of a pattern, every 50 ms. (rping's stdout is a
    file, written in 4 KiB blocks: this shows it ran before and after the move, not
    its pace.)"""

    def __init__(self, files, pattern):
        self.files = files
        self.pattern = pattern
        self.seen = {f: [] for f in files}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._t.start()
        return self

    def _run(self):
        last = {f: 0 for f in self.files}
        while not self._stop.is_set():
            for f in self.files:
                try:
                    n = Path(f).read_text(errors="replace").count(self.pattern)
                except OSError:
                    n = 0
                if n != last[f]:
                    self.seen[f].append((time.time(), n))
                    last[f] = n
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        self._t.join()

    def around(self, f, t0, t1):
        """The count of f before t0 and its growth after t1."""
        before = max((n for t, n in self.seen[f] if t < t0), default=0)
        after = max((n for t, n in self.seen[f]), default=0) - max(
            (n for t, n in self.seen[f] if t <= t1), default=0)
        return before, after


def log_time(log, pattern):
    """The wall time of the last line of a backend log matching pattern (its RFC 3339
    timestamp), or None."""
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        if re.search(pattern, line):
            m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z", line)
            if m:
                s = m.group(1)
                if "." in s:
                    head, frac = s.split(".")
                    s = f"{head}.{frac[:6]}"
                return datetime.fromisoformat(s + "+00:00").timestamp()
    return None


def fdb_switch(path, mac, tap):
    """The wall time `bridge -timestamp monitor fdb` first showed mac learnt on tap, or
    None."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    stamp = None
    for line in text.splitlines():
        m = re.match(r"Timestamp: (.+ \d{4}) (\d+) usec", line)
        if m:
            t = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
            stamp = t.timestamp() + int(m.group(2)) / 1e6
        elif line.startswith(mac) and f" dev {tap} " in line:
            return stamp
    return None


def migrate_once(vm, dest, timeout=180, on_active=None):
    """Unmount m's share, start QMP migrate (again while the share still blocks it),
    wait until it ends; on_active, if given, runs once when the migration is first seen
    active. (status, query-migrate's last answer, host wall time it started, ended)."""
    q = Qmp(str(vm.qmp))
    q.cmd("migrate-set-capabilities", capabilities=RETURN_PATH)
    vm.pause_share(hold=4)
    deadline = time.monotonic() + 30
    while True:
        try:
            q.cmd("migrate", uri=f"unix:{dest.uri}")
            break
        except RuntimeError as e:
            if "VirtFS" not in str(e) or time.monotonic() > deadline:
                raise LabError(f"QMP migrate refused: {e}") from None
            time.sleep(0.1)
    t0 = time.time()
    deadline = time.monotonic() + timeout
    while True:
        st = q.cmd("query-migrate")
        if on_active is not None and st.get("status") == "active":
            on_active()
            on_active = None
        if st.get("status") in ("completed", "failed", "cancelled"):
            return st.get("status"), st, t0, time.time()
        if time.monotonic() > deadline:
            q.cmd("migrate_cancel")
            return "timeout", st, t0, time.time()
        time.sleep(0.05)


# QEMU's return path: the destination tells the source whether it loaded the state
# (SHUT with an error when a device's load failed, the pvcm device's included), and the
# source fails the migration and runs the VM on, instead of completing and leaving it
# paused with nowhere to run.
RETURN_PATH = [{"capability": "return-path", "state": True}]


def start_destination(lab, vm, socket, dev, tag):
    """The destination QEMU (-incoming defer), the return path on, listening on a unix
    socket; the Destination, with .uri."""
    uri = lab.workdir / f"mig.{tag}.sock"
    uri.unlink(missing_ok=True)
    dest = lab.destination(vm, socket, dev, "defer", tag=tag)
    dest.uri = uri
    try:
        q = Qmp(str(dest.qmp))
        q.cmd("migrate-set-capabilities", capabilities=RETURN_PATH)
        q.cmd("migrate-incoming", uri=f"unix:{uri}")
    except (OSError, EOFError, RuntimeError) as e:
        raise LabError(f"destination QEMU: {e}") from None
    for _ in range(300):
        if uri.exists():
            return dest
        if dest.proc.poll() is not None:
            break
        time.sleep(0.1)
    raise LabError(f"destination QEMU did not listen on {uri}: "
                   f"{Path(str(dest.console) + '.qemu-stderr').read_text(errors='replace')[-800:]}")


def vm_of(st, name):
    for v in st.get("vms", []):
        if v.get("name") == name:
            return v
    return None


def failed_migration(lab, k, m, a_backend, v6, cut=False):
    """A migration that fails: the destination refuses it (B2 has the VM with another
    id-range, so its state load fails and QEMU's migration fails), or, with cut, its
    stream is cut (the destination QEMU killed while the RAM is being sent; B2 would
    have taken the VM). Either way the VM goes on at A with its connections."""
    what = "is cut (the destination killed mid-transfer)" if cut else "the destination refuses"
    tag, dev, port = ("cut", "pvcm-qp1d", 7713) if cut else ("refuse", "pvcm-qp1c", 7711)
    sock = lab.workdir / f"m-{tag}.sock"
    gid = M6 if v6 else f"::ffff:{M}"
    lab.host(f"bash {SCRIPTS / 'qp1-divert.sh'} dev {dev}", check=True)
    b2 = lab.backend("--port", f"packet:{dev}",
                     "--vm", f"socket={sock},gid={gid},name=m,{QPN_WINDOW},"
                             f"id-range={ID_KEYS if cut else OTHER_KEYS},incoming=yes",
                     name=f"backend-{tag}", env={"RUST_LOG": BACKEND_LOG})
    kip = K6 if v6 else K
    srv = k.spawn(f"rping -s -a {kip} -v -V -C 300 -p {port}")
    time.sleep(2)
    cli = m.spawn(f"rping -c -a {kip} -v -V -C 300 -p {port}", local=True)
    time.sleep(3)
    dest = start_destination(lab, m, sock, dev, tag)
    status, st, _, _ = migrate_once(m, dest, on_active=dest.proc.kill if cut else None)
    try:
        log = m.share_back(180)
    except LabError as e:
        log = str(e)
    if dest.proc.poll() is None:
        dest.proc.wait(30)
    lab.undivert(dest.tap, dev)
    lab.host(f"ip link del {dest.tap}")
    alive = m.proc.poll() is None
    qs = Qmp(str(m.qmp)).cmd("query-status")
    result(f"a migration that {what} fails; the VM runs on at the source",
           status == "failed" and alive and qs.get("status") == "running",
           f"migration {status} ({st.get('error-desc', '')[:160]}); source {qs.get('status')}; "
           f"share: {short(log, 120)}")
    try:
        rc_c = cli.wait(240)
        rc_s = srv.wait(60)
    except LabError as e:
        rc_c = rc_s = -1
        print(e)
    out = cli.text()
    result(f"rping m -> k across the migration that {what}: all 300 iterations, no error",
           rc_c == 0 and server_ok(rc_s, srv.text()) and pings(out) == 300
           and "mismatch" not in out,
           f"client rc {rc_c} ({pings(out)} iterations), server rc {rc_s}")
    attached = vm_attached(lab, a_backend, "m")
    result("the source backend holds the VM again (its state loaded back)", attached is True,
           f"attached {attached}")
    b2.stop()


def vm_attached(lab, backend, name):
    """Whether a backend's VM is attached (`vm list`), None if it has no such VM."""
    _, out = lab.host(f"{backend_path()} vm --control {backend.control} list", timeout=30)
    try:
        vms = json.loads(out[out.index("["):])
    except ValueError:
        return None
    for v in vms:
        if v.get("name") == name:
            return v.get("attached")
    return None


def run(workdir, v6, failed, hold):
    """One family's lab: the programs, the move, the checks and the figures. One
    function of about 280 lines: its steps run in the order the migration happens and
    each check reads the times, counters and jobs of the steps before it."""
    fam = "IPv6" if v6 else "IPv4"
    kip, mip = (K6, M6) if v6 else (K, M)
    gid = M6 if v6 else f"::ffff:{M}"
    with Lab(workdir, ipv6=v6) as lab:
        sa, sb = lab.workdir / "m-a.sock", lab.workdir / "m-b.sock"
        env = {"RUST_LOG": BACKEND_LOG}
        pa, pb = lab.workdir / "a.pcap", lab.workdir / "b.pcap"
        a = lab.backend("--port", f"packet:{DEV_A}", "--pcap", str(pa),
                        "--vm", f"socket={sa},gid={gid},name=m,{QPN_WINDOW},id-range={ID_KEYS}",
                        name="backend-a", env=env)
        lab.host(f"bash {SCRIPTS / 'qp1-divert.sh'} dev {DEV_B}", check=True)
        b = lab.backend("--port", f"packet:{DEV_B}", "--pcap", str(pb),
                        "--vm", f"socket={sb},gid={gid},name=m,{QPN_WINDOW},id-range={ID_KEYS},"
                                "incoming=yes",
                        name="backend-b", env=env)
        k = lab.kernel_guest("k", K, K6 if v6 else None, wait=False)
        m = lab.pvcm_vm("m", M, M6 if v6 else None, socket=str(sa), wait=False,
                        qmp=lab.workdir / "m.qmp")
        for g in (k, m):
            g.wait_ready()
        start_guestd(m, local=True)
        print(f"== {fam}: lab up", flush=True)
        # Before: the programs work, and rping's pace here sizes the long runs.
        t = time.monotonic()
        pair(f"{fam} before: rping -v -V -C 100 m -> k", k, m,
             f"rping -s -a {kip} -v -V -C 100", f"rping -c -a {kip} -v -V -C 100",
             lambda s: s.count("server ping data:") == 100, lambda c: c.count("ping data:") == 100)
        pace = 100 / max(time.monotonic() - t, 1)
        out = pair(f"{fam} before: rstream -S 4096 -C 200 -T v m -> k", k, m,
                   f"rstream -b {kip} -S 4096 -C 200 -T v -p 7712",
                   f"rstream -s {kip} -S 4096 -C 200 -T v -p 7712",
                   lambda s: rstream_ok(0, s), lambda c: rstream_ok(0, c))
        rs_pace = 200 / rstream_secs(out, 2.0)
        if failed:
            print(f"== {fam}: a refused migration", flush=True)
            failed_migration(lab, k, m, a, v6)
            print(f"== {fam}: a migration whose stream is cut", flush=True)
            failed_migration(lab, k, m, a, v6, cut=True)
        # rping to span the move: ~hold seconds at the pace measured.
        n = min(max(300, int(pace * hold)), 2000)
        print(f"== {fam}: rping -C {n} both ways, {HELD} held connections, cmtime "
              "loops; then the move", flush=True)
        k_srv = k.spawn(f"rping -s -a {kip} -v -V -C {n} -p 7701")
        m_srv = m.spawn(f"rping -s -a {mip} -v -V -C {n} -p 7702", local=True)
        # Bound to the address: an unbound listener is the IPv4 wildcard, which the
        # kernel CM does not match to IPv6 requests (afonly).
        k_held = k.spawn(f"cmtime -b {kip} -p 7703")
        k_loop_srv = k.spawn(f"cmtime -b {kip} -p 7704")
        m_loop_srv = m.spawn(f"cmtime -b {mip} -p 7705", local=True)
        # rstream: one connection each way, started just before the move (below) and
        # sized at the pace measured to last about hold seconds.
        rs_n = min(max(1000, int(rs_pace * hold)), 200000)
        rs = f"-S 4096 -C {rs_n} -T v"
        k_rs_srv = k.spawn(f"rstream -b {kip} {rs} -p 7709")
        m_rs_srv = m.spawn(f"rstream -b {mip} {rs} -p 7710", local=True)
        deadline = time.monotonic() + 60
        while (listeners(m) < 3 or listeners(k) < 4) and time.monotonic() < deadline:
            time.sleep(0.5)
        m_cli = m.spawn(f"rping -c -a {kip} -v -V -C {n} -p 7701", local=True)
        k_cli = k.spawn(f"rping -c -a {mip} -v -V -C {n} -p 7702")
        held_n = HELD
        m_held = m.spawn(f"pvcm-guest cmtime --dest {kip} --port 7703 --connections {HELD} "
                         f"--hold {hold + 20} --timeout {hold + 120}", local=True)
        loop = ("end=$(( $(cut -d. -f1 /proc/uptime) + {secs} )); i=0; bad=0; "
                "while [ $(cut -d. -f1 /proc/uptime) -lt $end ]; do i=$((i + 1)); "
                "if ! cmtime -s {ip} -p {port} -c 5 >/tmp/loop.$$.out 2>&1 || "
                "grep -q 'event:' /tmp/loop.$$.out || ! grep -q '^disconnect' /tmp/loop.$$.out; then "
                "bad=$((bad + 1)); echo \"run $i failed:\"; tail -n 3 /tmp/loop.$$.out; fi; done; "
                "echo loop runs=$i failed=$bad")
        watch = Lines([k_srv.output, k_cli.output], "ping data:").start()
        # Wait for the held connections (k's cm_ids on 7703) and rping's first lines.
        deadline = time.monotonic() + 120
        held = kheld = 0
        while time.monotonic() < deadline:
            held = guestd(m).get("agent", {}).get("connections", 0)
            if held >= held_n + 2 and pings(k_cli.text()) > 10:
                break
            time.sleep(1)
        _, res = k.run("rdma res show cm_id", 30)
        kheld = sum(1 for l in res.splitlines() if "7703" in l and "LISTEN" not in l)
        result(f"{fam}: before the move, {held_n} held connections up and rping running",
               held >= held_n + 2 and kheld >= held_n,
               f"pvcm-guestd's connections {held} (the held ones and rping's 2), k's cm_ids on "
               f"port 7703 but its listener {kheld}")
        g0 = guestd(m)
        kc0, ga0 = kernel_cm(k), agent_retries(g0)
        (lab.workdir / "guestd.before.json").write_text(json.dumps(g0, indent=1))
        rx0 = {"k": rxe_counters(k), "m": rxe_counters(m)}
        # The loops start now, so that they connect while the VM moves (a few seconds
        # from here) and go on after it.
        m_loop = m.spawn(loop.format(secs=hold, ip=kip, port=7704), local=True)
        k_loop = k.spawn(loop.format(secs=hold, ip=mip, port=7705))
        m_rs = m.spawn(f"rstream -s {kip} {rs} -p 7709", local=True)
        k_rs = k.spawn(f"rstream -s {mip} {rs} -p 7710")
        # Their connections are up (the listeners' accepted children) before the move.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (m_rs.done() or k_rs.done()):
            _, res = k.run("rdma res show cm_id", 30)
            if len(re.findall(r"[:\]](?:7709|7710)\b", res)) >= 3:
                break
            time.sleep(0.5)
        sa0, sb0 = a.stat_json(), b.stat_json()
        # The destination: its tap diverted to B's device before its QEMU starts.
        dest = start_destination(lab, m, str(sb), DEV_B, "dst")
        _, show = lab.host(f"bash {SCRIPTS / 'qp1-divert.sh'} show {dest.tap}", timeout=30)
        result(f"{fam}: the destination tap's divert (to {DEV_B}) and egress table are in place "
               "before the destination QEMU starts",
               f"to device {DEV_B}" in show and f"table netdev pvcm-{dest.tap}" in show,
               f"{show.count(f'to device {DEV_B}')} tc redirects to {DEV_B}, nftables table "
               f"{'present' if f'table netdev pvcm-{dest.tap}' in show else 'missing'}")
        cap = lab.workdir / "k-tap.pcap"
        lab.host_start(["tcpdump", "-i", k.tap, "-s", "96", "-U", "-w", str(cap), "udp port 4791"],
                       lab.workdir / "tcpdump.log")
        fdb_log = lab.workdir / "fdb.log"
        lab.host_start(["bridge", "-timestamp", "monitor", "fdb"], fdb_log)
        time.sleep(0.5)
        print(f"== {fam}: migrating m from backend A to backend B", flush=True)
        loops_before = (m_loop.done(), k_loop.done())
        rs_before = (m_rs.done(), k_rs.done())
        status, qm, t_start, t_end = migrate_once(m, dest)
        loops_after = k_loop.done()
        rs_after = k_rs.done()
        result(f"{fam}: the cmtime loops were running when the migration started and after "
               "it ended", loops_before == (False, False) and not loops_after,
               f"ended before it: m's {loops_before[0]}, k's {loops_before[1]}; k's ended by its "
               f"end: {loops_after}")
        (lab.workdir / "migrate.json").write_text(json.dumps(qm, indent=1))
        ok = status == "completed"
        result(f"{fam}: QMP migrate completed", ok,
               f"{status}: downtime {qm.get('downtime')} ms, total {qm.get('total-time')} ms, "
               f"{qm.get('error-desc', '')}")
        if not ok:
            return
        src_proc, src_tap = m.move_to(dest)
        back = m.share_back(180)
        print(f"      share: {short(back, 200)}", flush=True)
        # The source releases: its QEMU quits, its tap's divert goes, A forgets the VM.
        try:
            Qmp(str(lab.workdir / "m.qmp")).cmd("quit")
        except (EOFError, OSError, RuntimeError):
            pass
        src_proc.wait(30)
        lab.undivert(src_tap, DEV_A)
        lab.host(f"ip link del {src_tap}")
        st_a_right = a.stat_json()
        _, rm = lab.host(f"{backend_path()} vm --control {a.control} remove m", timeout=30)
        sa1 = a.stat_json()
        _, show = lab.host(f"nft list table netdev pvcm-{src_tap} 2>&1; "
                           f"ip link show {src_tap} 2>&1", timeout=30)
        va = vm_of(st_a_right, "m") or {}
        result(f"{fam}: the source released everything: A held no connection of m right "
               "after, forgets m (vm remove), the source tap's divert and table are gone",
               (st_a_right.get("host", {}).get("live") == 0 and vm_of(sa1, "m") is None
                and "No such file" in show and "does not exist" in show),
               f"A live right after {st_a_right.get('host', {}).get('live')}, attached "
               f"{va.get('attached')}; vm remove: {short(rm, 80)}; A's VMs now "
               f"{[v.get('name') for v in sa1.get('vms', [])]}; {short(show, 120)}")
        # What happened in between: A's save, B's load, the bridge's switch.
        t_save = log_time(a.log, "VM state saved")
        t_load = log_time(b.log, "VM state loaded")
        t_fdb = fdb_switch(fdb_log, m.mac, dest.tap)
        _, fdb = lab.host(f"bridge fdb show br br0 | grep -i {m.mac}", timeout=30)
        result(f"{fam}: the bridge sends m's frames to the destination tap",
               f"dev {dest.tap}" in fdb, short(fdb, 160))
        order = None not in (t_save, t_load) and t_save <= t_load
        result(f"{fam}: A saved the VM's state before B loaded it",
               order, f"save {t_save}, load {t_load}")
        # Afterwards: the programs finish.
        rcs = {}
        for nm, j, tmo in (("m rping client", m_cli, 600), ("k rping client", k_cli, 600),
                           ("m rping server", m_srv, 60), ("k rping server", k_srv, 60),
                           ("m cmtime loop", m_loop, 300), ("k cmtime loop", k_loop, 300),
                           ("m held", m_held, 300), ("m rstream client", m_rs, 600),
                           ("k rstream client", k_rs, 600), ("m rstream server", m_rs_srv, 60),
                           ("k rstream server", k_rs_srv, 60)):
            if j is None:
                continue
            try:
                rcs[nm] = j.wait(tmo)
            except LabError as e:
                rcs[nm] = f"timeout: {short(str(e), 200)}"
        watch.stop()
        (lab.workdir / "rping-lines.json").write_text(json.dumps(
            {"migration": [t_start, t_end], "save": t_save, "load": t_load,
             "files": {str(f): v for f, v in watch.seen.items()}}))
        outs = {"m_cli": m_cli.text(), "k_cli": k_cli.text(), "m_srv": m_srv.text(),
                "k_srv": k_srv.text()}
        for name_, o in outs.items():
            (lab.workdir / f"rping.{name_}.out").write_text(o)
        for d, cli, srv, cn, sn in (("m -> k", "m_cli", "k_srv", "m rping client", "k rping server"),
                                    ("k -> m", "k_cli", "m_srv", "k rping client", "m rping server")):
            c, s_ = outs[cli], outs[srv]
            ok = (rcs[cn] == 0 and server_ok(rcs[sn], s_) and pings(c) == n
                  and pings(s_) == n and "mismatch" not in c + s_)
            result(f"{fam}: rping -v -V -C {n} {d} through the migration: every iteration, "
                   "data verified, no reconnect", ok,
                   f"client rc {rcs[cn]} {pings(c)} iterations, server rc {rcs[sn]} "
                   f"{pings(s_)} iterations" + ("" if ok else f" | {short(c, 150)} | {short(s_, 150)}"))
        for f, label in ((k_srv.output, "m -> k (k's server)"), (k_cli.output, "k -> m (k's client)")):
            before, after = watch.around(f, t_start, t_end)
            result(f"{fam}: rping {label} ran before and after the move", before > 0 and after > 0,
                   f"{before} iterations printed before, {after} after")
        out_h = m_held.text() if m_held else ""
        summary = re.search(r"connections \d+ established \d+ failed \d+ disconnected \d+", out_h)
        if m_held:
            result(f"{fam}: {HELD} connections set up before the move, held through it, torn "
                   "down from the destination",
                   rcs["m held"] == 0 and summary is not None and summary.group(0) ==
                   f"connections {HELD} established {HELD} failed 0 disconnected {HELD}",
                   f"rc {rcs['m held']}: " + (summary.group(0) if summary else short(out_h, 300)))
        for nm, j in (("m cmtime loop", m_loop), ("k cmtime loop", k_loop)):
            o = j.text()
            mm = re.search(r"loop runs=(\d+) failed=(\d+)", o)
            result(f"{fam}: {nm.split()[0]}'s cmtime -c 5 loop through the move: every run "
                   "complete", rcs[nm] == 0 and mm is not None and mm.group(2) == "0"
                   and int(mm.group(1)) > 0, short(o, 200))
        for d, cn, sn in (("m -> k", "m rstream client", "k rstream server"),
                          ("k -> m", "k rstream client", "m rstream server")):
            c = dict((("m rstream client", m_rs), ("k rstream client", k_rs),
                      ("m rstream server", m_rs_srv), ("k rstream server", k_rs_srv)))
            co, so = c[cn].text(), c[sn].text()
            (lab.workdir / f"rstream.{cn.split()[0]}.out").write_text(co + "\n--- server\n" + so)
            ok = rstream_ok(rcs[cn], co) and rstream_ok(rcs[sn], so)
            result(f"{fam}: rstream {rs} {d}: one connection set up before the move, data "
                   "verified through and after it, closed cleanly", ok,
                   f"client rc {rcs[cn]}, server rc {rcs[sn]}: {short(co, 160)}"
                   + ("" if ok else f" | server: {short(so, 160)}"))
        result(f"{fam}: the rstream clients were running when the migration started and "
               "k's after it ended", rs_before == (False, False) and not rs_after,
               f"ended before it: m's {rs_before[0]}, k's {rs_before[1]}; k's ended by its "
               f"end: {rs_after}")
        for j in (k_held, k_loop_srv, m_loop_srv):
            j.kill("KILL")
        # k keeps only its listeners; nothing left in the service or at B.
        deadline = time.monotonic() + 120
        left = []
        while time.monotonic() < deadline:
            _, res = k.run("rdma res show cm_id", 30)
            left = [l for l in res.splitlines() if "cm-idn" in l and "LISTEN" not in l]
            if not left:
                break
            time.sleep(3)
        result(f"{fam}: k is left with its listeners only", not left,
               f"{len(left)} other cm_ids" + (f": {short(' '.join(left[:3]))}" if left else ""))
        # New connections after the move, both ways.
        pair(f"{fam} after: rping -v -V -C 50 m -> k", k, m,
             f"rping -s -a {kip} -v -V -C 50 -p 7707", f"rping -c -a {kip} -v -V -C 50 -p 7707",
             lambda s: s.count("server ping data:") == 50, lambda c: c.count("ping data:") == 50)
        pair(f"{fam} after: rping -v -V -C 50 k -> m", m, k,
             f"rping -s -a {mip} -v -V -C 50 -p 7708", f"rping -c -a {mip} -v -V -C 50 -p 7708",
             lambda s: s.count("server ping data:") == 50, lambda c: c.count("ping data:") == 50)
        pair(f"{fam} after: ucmatose -c 20 -C 10 m -> k", k, m,
             f"ucmatose -b {kip} -c 20 -C 10", f"ucmatose -s {kip} -c 20 -C 10",
             lambda s: "test complete" in s and "return status 0" in s,
             lambda c: "test complete" in c and "return status 0" in c)
        # Counters and figures.
        g1 = guestd(m)
        kc1, ga1 = kernel_cm(k), agent_retries(g1)
        (lab.workdir / "guestd.after.json").write_text(json.dumps(g1, indent=1))
        rx1 = {"k": rxe_counters(k), "m": rxe_counters(m)}
        rxd = {g: delta(rx1[g], rx0[g]) for g in rx1}
        sa2, sb2 = a.stat_json(), b.stat_json()
        (lab.workdir / "backend-a.stat.json").write_text(json.dumps(sa2, indent=1))
        (lab.workdir / "backend-b.stat.json").write_text(json.dumps(sb2, indent=1))
        da = delta(drop_reasons(sa2), drop_reasons(sa0))
        db = delta(drop_reasons(sb2), drop_reasons(sb0))
        fa, fb = pcap_frames(pa, mip), pcap_frames(pb, mip)
        # A handles m's frames until it saves; B from when it loads. A frame that reaches
        # A after the save, or B before the load, lands in the gap.
        cut_a = t_save if t_save is not None else t_end
        cut_b = t_load if t_load is not None else t_start
        last_a = max((t for t, _ in fa if t <= cut_a), default=None)
        first_b = min((t for t, _ in fb if t >= cut_b), default=None)
        late_a = sum(1 for t, d in fa if t > cut_a and d == "rx")
        early_b = sum(1 for t, d in fb if t < cut_b and d == "rx")
        pause = (first_b - last_a) if None not in (last_a, first_b) else None
        window = (t_fdb - t_save) if None not in (t_fdb, t_save) else None
        # The data stall: the longest pause of rping's frames (its QPs', k's tap) across
        # the migration, each way.
        gaps, where, stop = {}, {}, {}
        for src, dst, label in ((mip, kip, "m->k"), (kip, mip, "k->m")):
            frames = data_frames(cap, src, dst)
            if t_save is not None:
                g, _, _ = longest_gap(frames, t_save, t_save)
                stop[label] = round(g * 1000) if g is not None else None
            g, x, y = longest_gap(frames, t_start, t_end)
            gaps[label] = round(g * 1000) if g is not None else None
            where[label] = [round(x - t_start, 2), round(y - t_start, 2)] if g is not None else None
        fig = {
            "family": fam,
            "qemu_downtime_ms": qm.get("downtime"), "qemu_total_ms": qm.get("total-time"),
            "qemu_setup_ms": qm.get("setup-time"),
            "cm_pause_ms": round(pause * 1000) if pause is not None else None,
            "a_last_frame": last_a, "b_first_frame": first_b,
            "a_frames": len(fa), "b_frames": len(fb),
            "frames_to_a_after_save": late_a, "frames_to_b_before_load": early_b,
            "save_to_load_ms": round((t_load - t_save) * 1000) if None not in (t_save, t_load) else None,
            "save_to_bridge_switch_ms": round(window * 1000) if window is not None else None,
            "rping_stall_ms": gaps, "rping_stall_from_to_s": where,
            "rping_gap_across_the_save_ms": stop,
            "save_s": round(t_save - t_start, 2) if t_save else None,
            "rxe_counters": rxd,
            "kernel_cm_retries_dups": delta(kc1, kc0),
            "guest_agent_retries_dups": delta(ga1, ga0),
            "drops_at_a": da, "drops_at_b": db,
        }
        (lab.workdir / "figures.json").write_text(json.dumps(fig, indent=1))
        print(f"      figures ({fam}): QEMU downtime {fig['qemu_downtime_ms']} ms, total "
              f"{fig['qemu_total_ms']} ms; CM pause (A's last frame of m -> B's first) "
              f"{fig['cm_pause_ms']} ms; A save -> B load {fig['save_to_load_ms']} ms; A save -> "
              f"bridge on the destination tap {fig['save_to_bridge_switch_ms']} ms (frames for m "
              f"that reached A after its save {late_a}, B before its load {early_b}); rping stall "
              f"{gaps} ms (from, to s after migrate: {where}; A saved at {fig['save_s']} s; "
              f"the gap across the save {stop} ms); "
              f"rxe {rxd}; CM retries/duplicates: kernel CM {fig['kernel_cm_retries_dups']}, "
              f"pvcm-guestd {fig['guest_agent_retries_dups']}; drops at A {da}, at B {db}",
              flush=True)
        result(f"{fam}: figures measured (downtime, CM pause, rping stall)",
               None not in (qm.get("downtime"), pause, *gaps.values()),
               json.dumps({k_: fig[k_] for k_ in ("qemu_downtime_ms", "cm_pause_ms",
                                                   "rping_stall_ms")}))
        # Only what landed in the switch window may be dropped, and only at A: frames for
        # m that reached it after its save (its capture), which it no longer routes.
        result(f"{fam}: B dropped nothing; A dropped only frames for m that reached it after "
               "it saved (the window before the bridge's switch)",
               not db and sum(da.values()) <= late_a,
               f"A's drops {da}, frames for m at A after its save {late_a}; B's drops {db}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="keep logs here (default: a new dir under /tmp)")
    ap.add_argument("--only", default="4,6", help="4 (IPv4), 6 (IPv6), comma-separated")
    ap.add_argument("--failed", action="store_true", help="also a refused migration first")
    ap.add_argument("--hold", type=int, default=30,
                    help="seconds the long runs last around the move (default 30)")
    a = ap.parse_args()
    only = set(a.only.split(","))
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="pvcm-migrate."))
    t0 = time.monotonic()
    for fam, v6 in (("4", False), ("6", True)):
        if fam not in only:
            continue
        try:
            run(workdir / f"ipv{fam}", v6, a.failed, a.hold)
        except LabError as e:
            result(f"IPv{fam} migration lab", False, short(str(e), 1500))
    passed, failed = counts()
    print(f"logs: {workdir} ({time.monotonic() - t0:.0f} s)")
    print(f"migrate: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
