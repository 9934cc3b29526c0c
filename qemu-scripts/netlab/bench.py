"""The distribution's cmtime between two pvcm VMs next to two kernel-CM guests, in one
lab run, every step cmtime prints; and pvcm-guestd's idle cost. Prints figures,
asserts none (qemu-scripts/apps.sh --bench; docs/apps.md, "Benchmark").

The lab: kernel-CM guests k (10.99.0.2) and k2 (10.99.0.3); pvcm VMs a (10.99.0.11) and
b (10.99.0.12) on one pvcm-backend (--port packet:pvcm-qp1), each running pvcm-guestd
as the pvcm-guest package's unit starts it. All four are TCG guests with one vCPU on
this machine's cores.

Each round runs `cmtime -c N` k2 -> k (kernel <-> kernel), then a -> b (pvcm <-> pvcm),
alternating which goes first, so drift on a shared machine hits both alike. The table
gives each step's mean over the rounds and the ratio kernel / pvcm (above 1: pvcm is
faster). Retries are counted where each CM counts them: the kernel's
/sys/class/infiniband_cm/rxe0/1/cm_tx_retries, the backend's cm_tx_retries for the
pvcm VMs (the retries their CM agents sent). Drops are the backend's.

Per command: ucbench (qemu-scripts/interop/ucbench.c) in k and in a times rdma_cm
commands as a process sees them: create_id + destroy_id through librdmacm, and a bare
command the server answers at once with EINVAL (the round trip and nothing else: the
kernel's ioctl-like write in k, a CUSE round trip to pvcm-guestd in a).

Many processes (--procs P): P processes of `cmtime -c N` at once from one guest to one
cmtime server in its peer, one run each: k2 -> k (kernel), then a -> b (pvcm) with
pvcm-guestd restarted in both VMs on each thread count of --threads (e.g. 1,4: one
thread, then four). Printed: the batch's wall time (the first start to the last end,
in the client guest), each step's mean over the processes, and the ratios kernel /
pvcm and pvcm on one thread / on N. --vcpus gives every guest that many vCPUs (the
service's default thread count is one per vCPU, at least 4). The per-command and idle-cost parts
are skipped in this mode.

Idle cost: with the lab idle, QEMU's host CPU time for VM a over alternating windows
with pvcm-guestd running and stopped (SIGSTOP); the difference is the service's cost
in host-core terms under TCG (which inflates guest work). Also pvcm-guestd's own CPU
time inside the guest (/proc/PID/stat) over the running windows.
"""

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from .apps import (A, B, K, drops, guestd_stat, listeners, pair_backend, quarantined, start_guestd,
                   wait_listening)
from .lab import Lab, LabError

K2 = "10.99.0.3"
STEPS = ("create id", "resolve addr", "resolve route", "create qp", "connect", "disconnect",
         "destroy")


def listening(server, cmd):
    """cmd started on server, once it listens (a fixed wait is too short for a service
    just restarted on a busy machine)."""
    before = listeners(server)
    srv = server.spawn(cmd)
    wait_listening(server, before, srv)
    return srv


def cmtime(server, client, conns):
    """One cmtime -c conns, client -> server; {step: ms} (LabError when it fails)."""
    srv = listening(server, "cmtime")
    rc, out = client.run(f"timeout 600 cmtime -s {server.ip} -c {conns}", 660)
    srv.kill("KILL")
    steps = {s: float(v) for s, v in re.findall(r"^(\w[\w ]*\w)\s*:\s+([\d.]+)", out, re.M)}
    if rc != 0 or "disconnect" not in steps:
        raise LabError(f"cmtime {client.name} -> {server.name} failed (rc {rc}): {out[-800:]}")
    return steps


def cmtime_procs(server, client, procs, conns, port):
    """procs processes of cmtime -c conns at once, client -> server (one cmtime server
    on port): (wall ms of the batch, {step: mean ms over the processes}); LabError when
    one fails."""
    srv = listening(server, f"cmtime -p {port}")
    script = (
        "t0=$(cut -d' ' -f1 /proc/uptime); pids=''\n"
        f"for i in $(seq {procs}); do timeout 900 cmtime -s {server.ip} -p {port} "
        f"-c {conns} >/tmp/cmt.$i 2>&1 & pids=\"$pids $!\"; done\n"
        "bad=0; for p in $pids; do wait $p || bad=$((bad+1)); done\n"
        "t1=$(cut -d' ' -f1 /proc/uptime); echo wall=$t0-$t1 bad=$bad\n"
        f"for i in $(seq {procs}); do cat /tmp/cmt.$i; done\n")
    rc, out = client.run(script, 1000)
    srv.kill("KILL")
    # The guest's shell is busybox's: no date +%N; /proc/uptime has centiseconds.
    m = re.search(r"wall=([\d.]+)-([\d.]+) bad=(\d+)", out)
    if rc != 0 or not m or m.group(3) != "0":
        raise LabError(f"{procs} x cmtime {client.name} -> {server.name} failed (rc {rc}): "
                       f"{out[-800:]}")
    sums, n = {}, {}
    for step, v in re.findall(r"^(\w[\w ]*\w)\s*:\s+([\d.]+)", out, re.M):
        sums[step] = sums.get(step, 0.0) + float(v)
        n[step] = n.get(step, 0) + 1
    wall = round(1000 * (float(m.group(2)) - float(m.group(1))))
    return wall, {s: sums[s] / n[s] for s in sums}


def restart_guestd(vm, threads):
    """pvcm-guestd in vm stopped (SIGTERM) and started again with --threads threads."""
    vm.run("kill $(pidof pvcm-guestd) 2>/dev/null; for i in $(seq 100); do "
           "pidof pvcm-guestd >/dev/null || break; sleep 0.1; done", 60)
    start_guestd(vm, threads=threads)


def many_processes(k, k2, va, vb, a):
    """--procs: the batch on the kernel pair, then on the pvcm pair per thread count."""
    runs = []
    wall, steps = cmtime_procs(k, k2, a.procs, a.conns, 7470)
    runs.append(("kernel", wall, steps))
    print(f"kernel       wall {wall} ms; " +
          ", ".join(f"{s} {steps.get(s, 0):.0f}" for s in STEPS) + " (ms, mean)", flush=True)
    for t in [int(x) for x in a.threads.split(",") if x]:
        for vm in (va, vb):
            restart_guestd(vm, t)
        wall, steps = cmtime_procs(vb, va, a.procs, a.conns, 7471 + t)
        st = guestd_stat(va)
        runs.append((f"pvcm {t} thr", wall, steps))
        print(f"pvcm {t:2} thr  wall {wall} ms; " +
              ", ".join(f"{s} {steps.get(s, 0):.0f}" for s in STEPS) +
              f" (ms, mean); service threads {st.get('threads')}, requests by thread "
              f"{st.get('requests_by_thread')}, queued behind their file "
              f"{st.get('lane_waits')}", flush=True)
    names = [r[0] for r in runs]
    print(f"\n{a.procs} processes x cmtime -c {a.conns}, {a.vcpus} vCPU(s) per guest")
    print(f"{'':14} " + " ".join(f"{nm:>13}" for nm in names))
    print(f"{'wall':14} " + " ".join(f"{w:13d}" for _, w, _ in runs))
    for s in STEPS:
        print(f"{s:14} " + " ".join(f"{st.get(s, 0):13.0f}" for _, _, st in runs))
    for nm, w, _ in runs[1:]:
        print(f"wall kernel / {nm}: {runs[0][1] / w:.2f}x" if w else f"{nm}: -")
    if len(runs) > 2:
        first = runs[1]
        for nm, w, _ in runs[2:]:
            print(f"wall {first[0]} / {nm}: {first[1] / w:.2f}x" if w else f"{nm}: -")


def ucbench(guest, count):
    """ucbench -n count in the guest: {"create+destroy": us, "bare command": us}."""
    rc, out = guest.run(f"/host/bin/ucbench -n {count}", 300)
    if rc != 0:
        raise LabError(f"ucbench in {guest.name} failed (rc {rc}): {out[-400:]}")
    return {k: float(v) for k, v in re.findall(r"^([\w+ ]+): ([\d.]+) us per command", out, re.M)}


def kernel_retries(guest):
    """The kernel CM's cm_tx_retries on rxe0 port 1, summed over the message types."""
    _, out = guest.run("cat /sys/class/infiniband_cm/rxe0/1/cm_tx_retries/* 2>/dev/null", 30)
    return sum(int(x) for x in out.split() if x.isdigit())


def pvcm_retries(st):
    """The pvcm VMs' retries (the backend's cm_tx_retries), summed."""
    return sum(sum(v.get("figures", {}).get("cm", {}).get("cm_tx_retries", {}).values())
               for v in st.get("vms", []))


def cpu_ticks(pid):
    """utime + stime of a host process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def guest_ticks(vm, pid):
    """utime + stime of a process in the guest, in its clock ticks (USER_HZ 100)."""
    _, out = vm.run(f"cut -d')' -f2 /proc/{pid}/stat", 30)
    f = out.split()
    return int(f[11]) + int(f[12])


def idle_cost(vm, window, windows):
    """pvcm-guestd's idle cost in VM vm over `windows` windows of each state: (host-core
    % running - stopped, QEMU's % while running, the service's guest CPU % while running,
    the spread of QEMU's % over all windows: the noise the difference sits in)."""
    _, pid = vm.run("pidof pvcm-guestd", 30)
    pid = pid.split()[0]
    hz = 100  # the host's and the guest's USER_HZ
    running, stopped, guest = [], [], []
    for i in range(2 * windows):
        on = i % 2 == 0
        vm.run(f"kill -{'CONT' if on else 'STOP'} {pid}", 30)
        time.sleep(1)
        h0, g0 = cpu_ticks(vm.pid), guest_ticks(vm, pid)
        time.sleep(window)
        h1, g1 = cpu_ticks(vm.pid), guest_ticks(vm, pid)
        (running if on else stopped).append(100.0 * (h1 - h0) / hz / window)
        if on:
            guest.append(100.0 * (g1 - g0) / hz / window)
    vm.run(f"kill -CONT {pid}", 30)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    spread = max(running + stopped) - min(running + stopped)
    return mean(running) - mean(stopped), mean(running), mean(guest), spread


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="keep logs here (default: a new dir under /tmp)")
    ap.add_argument("--conns", type=int, default=1000, help="cmtime connections (default 1000)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both pairs (default 2)")
    ap.add_argument("--idle", type=int, default=20,
                    help="seconds per idle-cost window (default 20; 0 skips it)")
    ap.add_argument("--ucbench", help="the ucbench binary (interop/ucbench.c built against "
                    "librdmacm); without it the per-command figures are skipped")
    ap.add_argument("--idle-windows", type=int, default=4,
                    help="idle-cost windows of each state (default 4)")
    ap.add_argument("--procs", type=int, default=0,
                    help="processes of cmtime at once (default 0: one cmtime per round)")
    ap.add_argument("--vcpus", type=int, default=1, help="each guest's vCPUs (default 1)")
    ap.add_argument("--threads", default="",
                    help="(--procs) pvcm-guestd thread counts to run the pvcm pair with, "
                    "e.g. 1,4 (default: the service's own default only)")
    a = ap.parse_args()
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="pvcm-bench."))
    t0 = time.monotonic()
    try:
        with Lab(workdir, vcpus=a.vcpus) as lab:
            backend, sa, sb = pair_backend(lab)
            k = lab.kernel_guest("k", K, wait=False)
            k2 = lab.kernel_guest("k2", K2, wait=False)
            va = lab.pvcm_vm("a", A, socket=str(sa), wait=False)
            vb = lab.pvcm_vm("b", B, socket=str(sb), wait=False)
            for g in (k, k2, va, vb):
                g.wait_ready()
            for vm in (va, vb):
                start_guestd(vm)
            if a.procs:
                print(f"== lab up in {time.monotonic() - t0:.0f} s; {a.procs} x cmtime -c "
                      f"{a.conns}, {a.vcpus} vCPU(s) per guest", flush=True)
                if not a.threads:
                    a.threads = str(guestd_stat(va).get("threads", 1))
                many_processes(k, k2, va, vb, a)
                print(f"logs: {workdir} ({time.monotonic() - t0:.0f} s)")
                return 0
            print(f"== lab up in {time.monotonic() - t0:.0f} s; cmtime -c {a.conns}, "
                  f"{a.rounds} rounds", flush=True)
            kern, pv = [], []
            kr0 = kernel_retries(k) + kernel_retries(k2)
            st0 = backend.stat_json()
            pr0, d0, q0 = pvcm_retries(st0), drops(st0), quarantined(st0)
            for r in range(a.rounds):
                order = [("kernel", k, k2), ("pvcm", vb, va)]
                if r % 2:
                    order.reverse()
                for kind, server, client in order:
                    steps = cmtime(server, client, a.conns)
                    (kern if kind == "kernel" else pv).append(steps)
                    print(f"round {r + 1} {kind:6} " +
                          ", ".join(f"{s} {steps.get(s, 0):.0f}" for s in STEPS) + " (ms)",
                          flush=True)
            kr = kernel_retries(k) + kernel_retries(k2) - kr0
            st = backend.stat_json()
            pr, d, q = pvcm_retries(st) - pr0, drops(st) - d0, quarantined(st) - q0
            print(f"\n{'step':14} {'kernel ms':>10} {'pvcm ms':>10} {'kernel/pvcm':>12}")
            for s in STEPS:
                km = sum(x.get(s, 0) for x in kern) / len(kern)
                pm = sum(x.get(s, 0) for x in pv) / len(pv)
                ratio = f"{km / pm:.2f}x" if pm else "-"
                print(f"{s:14} {km:10.0f} {pm:10.0f} {ratio:>12}")
            print(f"retries: kernel {kr}, pvcm {pr}; backend drops {d} "
                  f"(late answers to ended connections {q})")
            if a.ucbench:
                (lab.share / "bin").mkdir(exist_ok=True)
                dst = lab.share / "bin" / "ucbench"
                dst.write_bytes(Path(a.ucbench).read_bytes())
                dst.chmod(0o755)
                kc, pc = ucbench(k, 2000), ucbench(va, 2000)
                for name in ("create+destroy", "bare command"):
                    km, pm = kc.get(name, 0), pc.get(name, 0)
                    print(f"per command, {name}: kernel {km:.1f} us, pvcm-guestd {pm:.1f} us "
                          f"(kernel/pvcm {km / pm if pm else 0:.2f}x)")
            if a.idle > 0:
                n = a.idle_windows
                diff, run, guest, spread = idle_cost(va, a.idle, n)
                print(f"pvcm-guestd idle (VM a, {n} x {a.idle} s running, {n} x {a.idle} s "
                      f"stopped): QEMU {diff:+.2f}% of a host core with it running "
                      f"({run:.2f}% in all; windows spread {spread:.2f}%); the service's own "
                      f"guest CPU {guest:.3f}% of the vCPU")
    except LabError as e:
        print(f"bench: {e}")
        return 1
    print(f"logs: {workdir} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
