"""pvcm-guest's commands through pvcm-guestd in a pvcm VM, against the Linux kernel CM.

    PYTHONPATH=qemu-scripts python3 -m netlab.cli_via_service [--workdir DIR] [--conns N]
        [--only LIST] [--pcap FILE]

The lab of netlab.apps, smaller: two TCG guests of the RDMA image on the lab's bridge,
  k  10.99.0.2   the Linux kernel CM (rdma_ucm loaded), the reference peer;
  a  10.99.0.11  a pvcm VM: the pvcm device on pvcm-backend, rxe on its NIC, the kernel
                 CM kept out, pvcm-guestd serving /dev/infiniband/rdma_cm and owning
                 the pvcm device;
pvcm-backend on the host side of the bridge with --port packet:pvcm-qp1 (the VM's QP1
frames diverted to it).

pvcm-guest runs in a with its default --via auto: pvcm-guestd's control socket answers,
so every command goes through the service's rdma_cm device. Checks (each PASS/FAIL):
  0 the kernel's rdma_ucm, rdma_cm, ib_cm are not loaded in a; pvcm-guest info goes
    through the service and reports the backend's QPN range for a; --via device is
    refused (it would reset the device under the service)
  1 pvcm-guest cmtime --dest k --connections N against the kernel's cmtime server:
    every connection established and torn down (its JSON report), its ids rdma_cm's
  2 pvcm-guest connect --dest k --data ... against the kernel's ucmatose -C 0, twice:
    disconnecting at once, and holding 3 s (ucmatose's server disconnects first); both
    finish
  3 pvcm-guest listen --count 10 against the kernel's cmtime -s a -c 10: requests,
    established, disconnected; the kernel's cmtime finishes
  4 pvcm-guest cmtime --server --connections N against the kernel's cmtime -s a -c N
  5 pvcm-guestd stat counts the commands (create_id, connect, listen, accept, ...) and
    no id is left; pvcm-backend dropped nothing (the simulated QPNs were admitted) and
    carried a's MADs

The last line reads "cli_via_service: N passed, N failed"; exit 0 when all passed.
"""

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from .addr import vm_gid
from .apps import A, K, guestd_stat, short, start_guestd
from .lab import Lab, LabError
from .results import counts, result

QPN_BASE, QPN_COUNT = 16, 0x20000  # rdma_rxe's QPNs, as netlab.apps gives its VMs

def json_lines(text):
    """The JSON objects among the lines of a --json run's output."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def events(objs, name):
    """The objects whose event is name."""
    return [o for o in objs if o.get("event") == name]


def until_ok(guest, cmd, timeout):
    """Runs a client until it succeeds (its server may not listen yet) or the time is
    up: the last (exit status, output)."""
    deadline = time.monotonic() + timeout
    while True:
        rc, out = guest.run(f"timeout {timeout} {cmd}", timeout + 30)
        if rc == 0 or time.monotonic() > deadline:
            return rc, out
        time.sleep(1)


def stop(job, timeout=30):
    """The job's exit status once it ended (killed after timeout seconds: -1)."""
    try:
        return job.wait(timeout)
    except LabError:
        job.kill("KILL")
        return -1


def info(a):
    """Section 0."""
    _, out = a.run("for m in rdma_ucm rdma_cm ib_cm; do [ -d /sys/module/$m ] "
                   "&& echo loaded $m; done; ls -l /dev/infiniband/rdma_cm")
    result("a: the kernel's rdma_ucm, rdma_cm, ib_cm are not loaded", "loaded" not in out,
           short(out, 200))
    rc, out = a.run("pvcm-guest --json info", 60)
    objs = json_lines(out)
    v = objs[0] if objs else {}
    result("a: pvcm-guest info goes through pvcm-guestd and reports the QPN range",
           rc == 0 and v.get("via") == "service" and v.get("qpn_base") == QPN_BASE
           and v.get("qpn_count") == QPN_COUNT and v.get("gid") == vm_gid(A),
           f"rc {rc}, via {v.get('via')}, gid {v.get('gid')}, qpns {v.get('qpn_base')} + "
           f"{v.get('qpn_count')}" + ("" if rc == 0 else f": {short(out)}"))
    rc, out = a.run("pvcm-guest info", 60)
    result("a: pvcm-guest info (text)", rc == 0 and "pvcm-guestd" in out and "qpns" in out,
           short(out, 160))
    rc, out = a.run("pvcm-guest --via device info; echo rc=$?; pvcm-guestd stat --json", 60)
    result("a: pvcm-guest --via device is refused while the service owns the device",
           "rc=1" in out and "owns the pvcm device" in out and '"device_resets":0' in out,
           short(out, 200))


def cmtime_client(k, a, conns):
    """Section 1."""
    srv = k.spawn("exec cmtime -p 7471")
    time.sleep(1)
    t0 = time.monotonic()
    rc, out = until_ok(a, f"pvcm-guest --json cmtime --dest {K} --port 7471 "
                          f"--connections {conns} --timeout 120", 400)
    secs = time.monotonic() - t0
    srv.kill("KILL")
    objs = json_lines(out)
    rep = next((o for o in objs if "connections" in o and "steps" in o), {})
    good = (rc == 0 and rep.get("established") == conns and rep.get("disconnected") == conns
            and rep.get("failed") == 0)
    steps = rep.get("steps", {})
    detail = (f"{secs:.1f} s; " + ", ".join(f"{s} {v.get('total_ms')} ms"
                                             for s, v in steps.items())
              + f"; {next((o for o in objs if o.get('event') == 'service'), {})}")
    result(f"pvcm-guest cmtime --connections {conns}: a -> k (kernel cmtime)", good,
           detail if good else f"rc {rc}: {short(out, 600)}")
    # For comparison: rdma-core's cmtime in the same VM through the same service (with
    # QPs on rxe), against the same server.
    srv = k.spawn("exec cmtime -p 7471")
    time.sleep(1)
    t0 = time.monotonic()
    rc, out = until_ok(a, f"cmtime -s {K} -p 7471 -c {conns}", 400)
    secs = time.monotonic() - t0
    srv.kill("KILL")
    steps = re.findall(r"^(\w[\w ]*\w)\s*:\s+([\d.]+)", out, re.M)
    print(f"      for comparison, rdma-core cmtime -c {conns} a -> k: rc {rc}, {secs:.1f} s; "
          + ", ".join(f"{s} {v} ms" for s, v in steps), flush=True)


def connect(k, a):
    """Section 2."""
    for hold, by in ((0, ("us", "peer")), (3, ("peer",))):
        srv = k.spawn("exec ucmatose -p 7480 -c 1 -C 0")
        time.sleep(1)
        rc, out = until_ok(a, f"pvcm-guest --json connect --dest {K} --port 7480 "
                              f"--data hello-from-pvcm --timeout 20 --hold {hold}", 60)
        src = stop(srv, 60)
        sout = srv.text()
        objs = json_lines(out)
        est = events(objs, "established")
        dis = events(objs, "disconnected")
        good = (rc == 0 and src == 0 and len(est) == 1 and len(dis) == 1
                and dis[0].get("by") in by
                and str(est[0].get("id", "")).startswith("rdma_cm#")
                and "test complete" in sout and "return status 0" in sout)
        result(f"pvcm-guest connect --hold {hold}: a -> k (kernel ucmatose -C 0)", good,
               f"{est[0].get('ms')} ms, remote qpn {est[0].get('remote_qpn')}, "
               f"disconnected by {dis[0].get('by')}" if good else
               f"client rc {rc}: {short(out)} | server rc {src}: {short(sout)}")


def listen(k, a, n=10):
    """Section 3. The kernel's cmtime as the client: it disconnects every connection
    itself, as `listen` waits for its peers to (ucmatose's client waits for its server
    to disconnect instead, so it cannot end with `listen`)."""
    srv = a.spawn(f"exec pvcm-guest --json listen --port 7481 --count {n} --data hi-from-pvcm")
    deadline = time.monotonic() + 30
    while not events(json_lines(srv.text()), "listening") and time.monotonic() < deadline:
        time.sleep(0.5)
    rc, out = until_ok(k, f"cmtime -s {A} -p 7481 -c {n}", 120)
    src = stop(srv, 60)
    objs = json_lines(srv.text())
    req = events(objs, "connect_request")
    good = (rc == 0 and src == 0 and len(req) == n
            and all(r.get("remote_gid") == vm_gid(K) for r in req)
            and len(events(objs, "established")) == n
            and len(events(objs, "disconnected")) == n
            and re.search(r"^disconnect\s*:", out, re.M))
    result(f"pvcm-guest listen --count {n}: k (kernel cmtime -c {n}) -> a", good,
           f"requests from {req[0].get('remote_gid')}, QPNs "
           f"{sorted(r.get('remote_qpn') for r in req)[:3]}..." if good
           else f"listener rc {src}: {short(srv.text())} | client rc {rc}: {short(out)}")


def cmtime_server(k, a, conns):
    """Section 4."""
    srv = a.spawn(f"exec pvcm-guest --json cmtime --server --port 7482 --connections {conns} "
                  "--timeout 400")
    deadline = time.monotonic() + 30
    while not events(json_lines(srv.text()), "listening") and time.monotonic() < deadline:
        time.sleep(0.5)
    t0 = time.monotonic()
    rc, out = until_ok(k, f"cmtime -s {A} -p 7482 -c {conns}", 400)
    secs = time.monotonic() - t0
    src = stop(srv, 120)
    objs = json_lines(srv.text())
    rep = next((o for o in objs if "accepted" in o), {})
    good = (rc == 0 and src == 0 and re.search(r"^disconnect\s*:", out, re.M)
            and rep.get("disconnected") == conns and rep.get("failed") == 0)
    steps = ", ".join(f"{s} {v} ms" for s, v in re.findall(r"^(\w[\w ]*\w)\s*:\s+([\d.]+)",
                                                             out, re.M))
    result(f"pvcm-guest cmtime --server --connections {conns}: k (kernel cmtime) -> a", good,
           f"{secs:.1f} s; server {rep}; kernel cmtime {steps}" if good
           else f"server rc {src}: {short(srv.text())} | client rc {rc}: {short(out)}")


def counters(a, backend):
    """Section 5."""
    st = guestd_stat(a)
    cmds = st.get("commands", {})
    want = ("create_id", "resolve_ip", "resolve_route", "connect", "bind_ip", "listen",
            "accept", "disconnect", "get_event", "destroy_id")
    result("pvcm-guestd served pvcm-guest's commands; no id left",
           all(cmds.get(c, 0) > 0 for c in want) and st.get("ids") == 0
           and st.get("pvcm", {}).get("qpn_base") == QPN_BASE,
           ", ".join(f"{c} {n}" for c, n in sorted(cmds.items()))
           + f"; ids {st.get('ids')}; errors {st.get('command_errors')}")
    bst = backend.stat_json()
    h = bst.get("host", {})
    mux = {k: v for k, v in h.get("drops", {}).items() if k != "quarantined" and v}
    dev = {k: v for k, v in h.get("device_drops", {}).items() if v}
    io = next((v.get("figures", {}).get("io", {}) for v in bst.get("vms", [])
               if v.get("name") == "a"), {})
    result("pvcm-backend: 0 drops (the simulated QPNs were admitted), a's MADs carried",
           not mux and not dev and io.get("wire_tx_frames", 0) > 0
           and io.get("wire_rx_frames", 0) > 0,
           f"drops {mux} {dev}; a wire tx {io.get('wire_tx_frames')} rx "
           f"{io.get('wire_rx_frames')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="keep logs here (default: a new dir under /tmp)")
    ap.add_argument("--conns", type=int, default=1000, help="cmtime connections (default 1000)")
    ap.add_argument("--only", default="0,1,2,3,4,5", help="sections to run (default all)")
    ap.add_argument("--pcap", help="capture br0 into this file (needs dumpcap)")
    a = ap.parse_args()
    only = set(a.only.split(","))
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="pvcm-cli-via-service."))
    t0 = time.monotonic()
    try:
        with Lab(workdir, pcap=a.pcap) as lab:
            sock = lab.workdir / "a.sock"
            backend = lab.backend(
                "--port", "packet:pvcm-qp1",
                "--vm", f"socket={sock},gid={vm_gid(A)},name=a,"
                        f"qpn-base={QPN_BASE},qpn-count={QPN_COUNT:#x}")
            k = lab.kernel_guest("k", K, wait=False)
            va = lab.pvcm_vm("a", A, socket=str(sock), wait=False)
            for g in (k, va):
                g.wait_ready()
            start_guestd(va)
            print(f"== lab up in {time.monotonic() - t0:.0f} s", flush=True)
            if "0" in only:
                info(va)
            if "1" in only:
                cmtime_client(k, va, a.conns)
            if "2" in only:
                connect(k, va)
            if "3" in only:
                listen(k, va)
            if "4" in only:
                cmtime_server(k, va, a.conns)
            if "5" in only:
                counters(va, backend)
    except LabError as e:
        result("lab", False, str(e))
    passed, failed = counts()
    print(f"logs: {workdir} ({time.monotonic() - t0:.0f} s)")
    print(f"cli_via_service: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
