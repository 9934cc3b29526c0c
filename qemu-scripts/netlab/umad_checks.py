"""The checks of qemu-scripts/umad.sh: read what umad/host.sh left in its work directory
and print a result line per test (PASS or FAIL, in the order of the tests' names),
appending the figures to FIGURES.

    python3 -m netlab.umad_checks WORKDIR CONNS FIGURES CONNS6

CONNS: the connections of tests 1 and 2; CONNS6: of tests 6a and 6b. The files are the
guests' outputs (PEER.STEP.out, from kexec), the pvcm servers' logs and exit statuses
(t2srv.*, t3a.*, t3b.*, t3la.log, t3lb.log, t6srv.*), the kernel CM's counters
(b.counters-TAG.out), pvcm-backend's `stat --json` (final, v6before, v6after), its log
(backend.log) and the capture of br0 during test 6 (v6.pcap).
"""

import json
import re
import sys

from .toolout import (WorkDir, client_summary, counter_deltas, exit_codes, kernel_retries,
                      rocev2_frames, server_summary, stat_drops, step_lines, vm_io)

# Guest b's kernel CM and pvcm VM a6 over IPv6 (test 6).
A6, B6 = "fd99::11", "fd99::3"
CM_MAD_CLASS = 7
# rdma_rxe's RXE_LOCAL_CA_ACK_DELAY, which ibv_devinfo reports for rxe0.
RXE_ACK_DELAY = "15"


def refused_with_ib_cm(w, fig):
    """0: pvcm-backend --port umad refused where ib_cm holds the CM class."""
    o = w.read("b.t0.out")
    bad = []
    if "rc=1" not in o:
        bad.append(f"exit status: {o[-200:]!r}")
    if "ib_cm" not in o or "modprobe -r" not in o:
        bad.append(f"the error does not name ib_cm and how to unload it: {o[-400:]!r}")
    m = re.search(r"pvcm-backend: (.*)", o)
    if m:
        fig.append(f"test 0 error: {m.group(1)[:300]}")
    return bad


def setup_bad(w):
    """[why] when guest a's setup (aprep.sh) failed, else []."""
    return [] if w.rc("a.setup.rc") == "0" else ["setup failed: " + w.read("a.setup.out")[-300:]]


def vm_to_kernel(w, out_name, conns):
    """pvcm-lab attach cmtime (a VM behind the umad port) -> the kernel: every
    connection up and down, exit 0."""
    o = w.read(out_name)
    bad = setup_bad(w)
    s = client_summary(o)
    if not s:
        bad.append("no cmtime summary: " + o[-300:])
    elif s.counts != (conns, conns, 0, conns):
        bad.append(s.text)
    if "rc=0" not in o:
        bad.append("pvcm cmtime exit " + str(exit_codes(o)))
    return bad, o


def routed_by_gid(w):
    """3a: the kernel's 3 connections to VM a and 5 to VM b, on one TCP port."""
    bad = []
    o = w.read("b.t3.out")
    if o.count("rc=0") != 2:
        bad.append("kernel cmtime: " + o[-300:])
    for vm, n in (("a", 3), ("b", 5)):
        fin = [e for e in w.json_lines(f"t3{vm}.log") if "accepted" in e]
        if w.rc(f"t3{vm}.rc") != "0" or not fin:
            bad.append(f"VM {vm}: server exit {w.rc(f't3{vm}.rc')!r} {w.read(f't3{vm}.log')[-200:]}")
        elif (fin[-1]["accepted"], fin[-1]["established"], fin[-1]["disconnected"]) != (n, n, n):
            bad.append(f"VM {vm}: {fin[-1]} (want {n} each)")
    return bad


def withdrawals_routed(w):
    """3b: the kernel's connect-and-destroy, 5 to VM a and 7 to VM b: each REJ(TIMEOUT)
    reached the VM it was for."""
    bad = []
    o = w.read("b.t3w.out")
    if o.count("rc=0") != 2:
        bad.append("kcm withdraw: " + o[-300:])
    for vm, n in (("a", 5), ("b", 7)):
        ev = w.json_lines(f"t3l{vm}.log")
        reqs = {e["id"] for e in ev if e.get("event") == "connect_request"}
        gone = {e["id"] for e in ev if e.get("event") in ("withdrawn", "rejected")}
        est = {e["id"] for e in ev if e.get("event") == "established"}
        if len(reqs) != n or gone != reqs or est:
            bad.append(f"VM {vm}: {len(reqs)} requests (want {n}), {len(gone & reqs)} withdrawn, "
                       f"{len(est)} established")
    return bad


def refused_at_attach(w, fig):
    """5: VM c, whose GID is not in rxe0's table, refused at attach."""
    o, log = w.read("a.t5.out"), w.read("backend.log")
    bad = []
    if "rc=0" in o:
        bad.append("VM c connected")
    if "attach refused" not in log or "not a RoCE v2 entry" not in log:
        bad.append("no attach refusal in the backend log")
    m = re.search(r"attach refused.*", log)
    if m:
        fig.append(f"test 5 log: {m.group(0)[:300]}")
    return bad


def ack_delay_from_device(log):
    """The local CA ACK delay the backend logged it read with ibv_devinfo, or None."""
    m = re.search(r"ca_ack_delay=(\d+).*local CA ACK delay \(ibv_devinfo\)|"
                  r"local CA ACK delay \(ibv_devinfo\).*ca_ack_delay=(\d+)", log)
    return (m.group(1) or m.group(2)) if m else None


def ack_delay(w):
    """5b: the ACK delay VMs report is the device's."""
    got = ack_delay_from_device(w.read("backend.log"))
    if got != RXE_ACK_DELAY:
        return [f"the backend did not read rxe0's local CA ACK delay (15) from the device: {got!r}"]
    return []


def teardown_counters(w, fig):
    """4: tests 1 and 2's teardowns, both sides' counters: no retries, duplicates or
    drops, every MAD pvcm sent taken by the kernel CM."""
    bad = []
    b0, b1 = w.counters("b.counters-before.out"), w.counters("b.counters-after.out")
    if not b1:
        bad.append("no kernel counters")
    bad += [f"kernel b: {x}" for x in kernel_retries(b0, b1)]
    s = w.host_stat("final.stat.json")
    if s is None:
        bad.append("no backend stat")
        return bad
    r = sum(s["cm"]["cm_tx_retries"].values())
    if r:
        bad.append(f"pvcm-backend: {r} retries")
    drops = stat_drops(s, exclude=("not_attached",))  # not_attached: VM c (test 5)
    crossed = drops.pop("unknown_connection", 0)
    if crossed > 12:
        drops["unknown_connection"] = crossed
    if drops:
        bad.append(f"pvcm-backend drops: {drops}")
    fig.append("pvcm-backend (umad) cm_tx_msgs: " + json.dumps(s["cm"]["cm_tx_msgs"]))
    fig.append("pvcm-backend (umad) io: " + json.dumps(s["io"]))
    krx = counter_deltas(b0, b1, "cm_rx_msgs/")
    fig.append("kernel b cm_rx_msgs delta: " + json.dumps({k: v for k, v in krx.items() if v}))
    # Every MAD pvcm sent reached the kernel CM (guest b is the only other CM here).
    for m, sent in s["cm"]["cm_tx_msgs"].items():
        if sent != krx.get(m, 0):
            bad.append(f"{m}: pvcm sent {sent}, the kernel CM took {krx.get(m, 0)}")
    return bad


def kernel_to_vm_v6(w, conns6):
    """6b: the kernel -> pvcm VM a6 over IPv6."""
    o, srv = w.read("b.t6b.out"), w.read("t6srv.log")
    bad = []
    if "rc=0" not in o:
        bad.append("kernel cmtime: " + o[-300:])
    s = server_summary(srv)
    if w.rc("t6srv.rc") != "0":
        bad.append(f"pvcm cmtime server exit {w.rc('t6srv.rc')!r}: {srv[-300:]}")
    elif not s or s.counts != (conns6, conns6, conns6, 0):
        bad.append(f"pvcm server summary: {s.text if s else srv[-300:]}")
    return bad, o


def capture_bad(fr, a6tx, a6rx, fig):
    """6c's capture check: every RoCEv2 frame on br0 an IPv6 CM MAD between VM a6 and
    kernel b, as many each way as the umad port counted for a6."""
    bad = []
    per = {}
    for key in fr:
        per[key] = per.get(key, 0) + 1
    out6 = per.pop((6, A6, B6, CM_MAD_CLASS), 0)
    in6 = per.pop((6, B6, A6, CM_MAD_CLASS), 0)
    if per:
        bad.append(f"other RoCEv2 frames on br0: {per}")
    if not out6 or out6 != a6tx:
        bad.append(f"{out6} IPv6 CM frames {A6} -> {B6} on br0, the umad port sent {a6tx} for VM a6")
    if not in6 or in6 != a6rx:
        bad.append(f"{in6} IPv6 CM frames {B6} -> {A6} on br0, the umad port received {a6rx} for VM a6")
    fig.append(f"IPv6: br0 capture: {out6} CM MADs {A6} -> {B6}, {in6} {B6} -> {A6}, "
               f"{len(fr) - out6 - in6} other RoCEv2 frames")
    return bad


def ipv6_accounting(w, fig):
    """6c: over test 6 only: counters, drops, and what went over br0."""
    bad = []
    kb, ka = w.counters("b.counters-v6before.out"), w.counters("b.counters-v6after.out")
    if not ka:
        bad.append("no kernel counters")
    bad += [f"kernel b: {x}" for x in kernel_retries(kb, ka)]
    s0, s1 = w.json("v6before.stat.json"), w.json("v6after.stat.json")
    if not s0 or not s1 or "host" not in s0 or "host" not in s1:
        bad.append("no backend stat around test 6")
        return bad
    h0, h1 = s0["host"], s1["host"]
    r = sum(v - h0["cm"]["cm_tx_retries"].get(k, 0) for k, v in h1["cm"]["cm_tx_retries"].items())
    if r:
        bad.append(f"pvcm-backend: {r} retries")
    drops = {k: v - h0.get(g, {}).get(k, 0) for g in ("drops", "device_drops")
             for k, v in h1.get(g, {}).items() if v - h0.get(g, {}).get(k, 0)}
    if drops:
        bad.append(f"pvcm-backend drops: {drops}")
    ptx = {m: v - h0["cm"]["cm_tx_msgs"].get(m, 0) for m, v in h1["cm"]["cm_tx_msgs"].items()}
    krx = {m: ka.get(f"cm_rx_msgs/{m}", 0) - kb.get(f"cm_rx_msgs/{m}", 0) for m in ptx}
    ktx = {m: ka.get(f"cm_tx_msgs/{m}", 0) - kb.get(f"cm_tx_msgs/{m}", 0) for m in ptx}
    for m, sent in ptx.items():
        if sent != krx[m]:
            bad.append(f"{m}: pvcm sent {sent}, the kernel CM took {krx[m]}")
    fig.append("IPv6: pvcm-backend cm_tx_msgs: " + json.dumps({m: v for m, v in ptx.items() if v}))
    fig.append("IPv6: kernel b cm_tx_msgs:     " + json.dumps({m: v for m, v in ktx.items() if v}))
    # The capture of br0: every RoCEv2 frame of test 6 is IPv6, between the VM and b,
    # a CM MAD to QP1, one for every frame the umad port counted for VM a6 each way.
    a6tx = vm_io(s1, "a6").get("wire_tx_frames", 0) - vm_io(s0, "a6").get("wire_tx_frames", 0)
    a6rx = vm_io(s1, "a6").get("wire_rx_frames", 0) - vm_io(s0, "a6").get("wire_rx_frames", 0)
    if a6tx != sum(ptx.values()):
        bad.append(f"VM a6 sent {a6tx} frames, pvcm-backend counted {sum(ptx.values())} MADs")
    data = w.read_bytes("v6.pcap")
    fr = rocev2_frames(data) if data is not None else None
    if fr is None:
        bad.append("no capture of br0 (dumpcap: " + w.read("dumpcap.log")[-200:] + ")")
    else:
        bad += capture_bad(fr, a6tx, a6rx, fig)
    return bad


def vm_added_at_runtime(w):
    """7: vm add, 100 connections through the new VM, vm remove."""
    add, run, rm = w.read("a.t7add.out"), w.read("a.t7.out"), w.read("a.t7rm.out")
    bad = []
    if "add_rc=0" not in add or '"name":"d"' not in add.replace(" ", ""):
        bad.append(f"vm add failed or d not listed: {add[-300:]!r}")
    if "rc=0" not in run or "established 100" not in run or "failed 0" not in run:
        bad.append(f"the runtime VM's cmtime: {run[-300:]!r}")
    if "remove_rc=0" not in rm or '"name":"d"' in rm.replace(" ", ""):
        bad.append(f"vm remove failed or d still listed: {rm[-300:]!r}")
    return bad


def check(wd, conns, conns6):
    """The results, [(test, [why it failed], what it showed)], and the figure lines."""
    w = WorkDir(wd)
    res, fig = [], []

    res.append(("0", refused_with_ib_cm(w, fig),
                "umad port refused at startup where ib_cm is loaded, saying so and what to do"))
    bad, o = vm_to_kernel(w, "a.t1.out", conns)
    res.append(("1", bad, f"pvcm VM behind umad -> kernel CM: {conns} connections established and torn down"))
    fig += [f"pvcm VM -> kernel   {line}" for line in step_lines(o, ("establish", "disconnect"))]

    o, srv = w.read("b.t2.out"), w.read("t2srv.log")
    bad = []
    if "rc=0" not in o:
        bad.append("kernel cmtime: " + o[-300:])
    if w.rc("t2srv.rc") != "0":
        bad.append(f"pvcm cmtime server exit {w.rc('t2srv.rc')!r}: {srv[-300:]}")
    res.append(("2", bad, f"kernel CM -> pvcm VM behind umad: {conns} connections established and torn down"))
    fig += [f"kernel -> pvcm VM   {line}" for line in step_lines(o, (r"connect\s*:", r"disconnect\s*:"))]

    res.append(("3a", routed_by_gid(w),
                "two VMs on one umad port and one TCP port: each got exactly its own connections (3, 5)"))
    res.append(("3b", withdrawals_routed(w),
                "kernel connect-and-destroy to two VMs (5, 7): every REJ(TIMEOUT) reached the VM it was for"))
    res.append(("5", refused_at_attach(w, fig), "a VM whose GID is not in the port's GID table is refused at attach"))
    res.append(("5b", ack_delay(w),
                "the backend took the ACK delay VMs report from the device (ibv_devinfo: rxe0's 15)"))
    res.append(("4", teardown_counters(w, fig),
                f"teardown of {conns} connections at once (tests 1, 2), both directions: 0 retries and 0 "
                "duplicates on both sides, no drops, every pvcm MAD taken by the kernel CM"))

    bad, o = vm_to_kernel(w, "a.t6a.out", conns6)
    res.append(("6a", bad, f"IPv6: pvcm VM {A6} behind umad -> kernel CM {B6}: {conns6} connections "
                "established and torn down"))
    fig += [f"IPv6 pvcm VM -> kernel   {line}" for line in step_lines(o, ("establish", "disconnect"))]
    bad, o = kernel_to_vm_v6(w, conns6)
    res.append(("6b", bad, f"IPv6: kernel CM {B6} -> pvcm VM {A6} behind umad: {conns6} connections "
                "established and torn down"))
    fig += [f"IPv6 kernel -> pvcm VM   {line}" for line in step_lines(o, (r"connect\s*:", r"disconnect\s*:"))]
    res.append(("6c", ipv6_accounting(w, fig),
                "IPv6 (tests 6a, 6b): 0 retries and 0 duplicates on both sides, no drops, every pvcm MAD "
                "taken by the kernel CM, every frame on br0 an IPv6 RoCEv2 CM MAD between the VM and the kernel"))
    res.append(("7", vm_added_at_runtime(w),
                "a VM added at runtime to the umad port (vm add) set up and tore down 100 connections with "
                "the kernel CM, then left (vm remove)"))
    return res, fig


def result_lines(res):
    """The summary lines, in the order of the tests' names."""
    return [("FAIL  " if b else "PASS  ") + t + ": " + ("; ".join(b) if b else text)
            for t, b, text in sorted(res, key=lambda x: x[0])]


def main(argv):
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    wd, conns, figures, conns6 = argv[0], int(argv[1]), argv[2], int(argv[3])
    res, fig = check(wd, conns, conns6)
    with open(figures, "a") as f:
        f.writelines(line + "\n" for line in fig)
    print("\n".join(result_lines(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
