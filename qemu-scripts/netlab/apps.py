"""Unmodified rdma-core programs in pvcm VMs (qemu-scripts/apps.sh runs it).

Three TCG guests of the RDMA image on the lab's bridge:
  k  10.99.0.2   the Linux kernel CM (rdma_ucm loaded), the reference peer;
  a  10.99.0.11  a pvcm VM: the pvcm device on pvcm-backend, rxe on its NIC (the
                 stand-in for a VF), the kernel CM kept out, pvcm-guestd serving
                 /dev/infiniband/rdma_cm;
  b  10.99.0.12  a second pvcm VM, the same.
pvcm-backend runs on the host side of the bridge with --port packet:pvcm-qp1: the VMs'
QP1 frames are diverted to it (qp1-divert.sh), it sends with the VMs' addresses.

Checks (each PASS/FAIL):
  0 the CM goes through pvcm: the VMs run what the pvcm-guest package installs
    (pvcm-guestd started as its unit starts it, its modprobe rule); rdma_ucm, rdma_cm,
    ib_cm absent; the node is pvcm-guestd's; its counters show the commands; the
    backend counts the MADs; pvcm-guestd serves on one thread per vCPU (or --threads)
  1 each program, from Debian's rdmacm-utils and perftest, unchanged, for the pairs
    a -> k, k -> a and a -> b (client -> server): rping -v (64, 1024 and 4000 bytes,
    200 iterations), ucmatose (100 connections with data), udaddy (UD, SIDR, data),
    rdma_client / rdma_server (the synchronous API), ib_send_bw -R, cmtime -c 1000
  2 seed 002's program (kcm connect-destroy) from a to a kernel listener: the kernel
    keeps only its listener (rdma res show cm_id)
  3 16 processes in a (12 cmtime -c 50, 4 ucmatose) against k at once, 8 killed with
    kill -9 mid-run: the survivors finish, k is left with its listeners only, the
    backend reaches 0 live entries after the quarantine, no drops; with pvcm-guestd on
    more than one thread, more than one of them served the processes' requests
  5 a misbehaving process (interop/ucflood.c) in a: 4 threads of garbage commands, bad
    response addresses, other files' ids and create/destroy pairs for 15 s, while
    rping -v and ucmatose run from a to k: they pass, the flood's calls all return with
    the errors they must, the service answers and holds no id afterwards
  8 signals to a program blocked in rdma_get_cm_event, with a pvcm VM's server (a,
    client k) and then the kernel guest's as the reference (k, client a): rping -s
    stopped and continued, then connected to; strace -f -p attached and detached, then
    connected to; a debugger's attach (interop/sigwait.c ptrace: PTRACE_ATTACH and
    detach) to a waiting sigwait listen, then connected to; SIGALRM every 200 ms into
    an SA_RESTART handler, then connected to (no EINTR); the same without SA_RESTART
    (the kernel: EINTR; pvcm: the call waits on, docs/apps.md); SIGTERM to a waiting
    rping -s: it exits, its listener goes, pvcm-guestd holds no id or file
  12 the VM's RDMA device changes under a waiting rping -s, in pvcm VM a (client k) and
    then in the kernel guest as the reference (k, client a): rdma link delete rxe0: in a
    the program gets DEVICE_REMOVAL ("cma detected device removal") and exits, the
    delete completes; in k the delete waits for the program (rxe cannot disassociate
    it), which gets no event until it is killed; rdma link add rxe0 again: a new
    rping -s is connected to, pvcm-guestd not restarted; ip addr del and add of the
    server's address: no ADDR_CHANGE (the kernel sends it at a bond's failover only),
    the waiting rping -s is connected to afterwards; a second address on the NIC:
    rping -s -a binds it in k, fails with EADDRNOTAVAIL in a (the backend does not
    serve it: it is none of the VM's GIDs), logged with the cause and counted
  9 pvcm-guestd stopped (SIGTERM) under running programs in a (rping -v to k, an rping
    server waiting): both end with an error within seconds (none hangs), k's kernel CM
    loses the connection at once (the backend ends it on the VM's behalf when the
    service's next start, or any driver's, asks for the port), and after the service
    starts again a new rping works
  4 counters: the backend's drops are 0; the VMs' MADs went through the backend
  7 root in VM b goes around pvcm (after 4, with its own accounting): it stops
    pvcm-guestd and loads the kernel CM itself (busybox modprobe: insmod of ib_cm, iw_cm,
    rdma_cm, rdma_ucm and their dependencies, past the package's rule); its rping -c to k and k's rping -c to
    its rping -s never reach the other CM (k's cm_rx_msgs/req, b's own), the tap's
    egress table counts the stopped frames and the backend counts them on VM b
    (vm_qp1_egress), while pvcm's own connections from b (pvcm-guest cmtime on the
    device) go on; then crafted frames (interop/rawqp1.c: IPv4 with options, IPv6 with
    an extension header, a VLAN tag, a later fragment, another VM's source address)
    are all stopped and counted
  11 address resolution, in pvcm VM a and in k (the kernel's rdma_resolve_ip(), the
    reference) alike: rping -c -a 10.99.0.99 (nobody has it: ADDR_ERROR -110 when
    rping's 2000 ms are up; both times printed), rping -c -a 203.0.113.1 (no route:
    rdma_resolve_addr fails, ENETUNREACH), rping -c through a route whose gateway
    nobody has (ADDR_ERROR -110); an rping killed while its resolution waits leaves no
    id in pvcm-guestd; rping -s and rping -c in one VM on its own address (a -> a, and
    k -> k) carry data; rping -c -a 127.0.0.1 (the route fails: No such device) and
    rping -s -a 127.0.0.1 (binds and listens) as in k; rping -v from a to k's second
    subnet 10.98.0.0/24, routed via the host side of the bridge (10.99.0.1,
    forwarding), carries data and a's resolved neighbour is the gateway
  10 multicast (rdma_join_multicast on RoCE v2): mckey from Debian's rdmacm-utils,
    receiver mckey -m GROUP -b LOCAL and sender mckey -s -m GROUP -b LOCAL, for pvcm VM
    a -> k and k -> a: both join (the IPv4-mapped group as DGID), the receiver's VM
    holds the group's IGMP membership (/proc/net/igmp) while it runs and not after,
    the receiver gets the sender's messages ("data transfers complete" on both), and
    pvcm-guestd holds no join afterwards; in the IPv6 lab (booted for it when 6 does not
    run), mckey with an IPv6 group fails to join in k ("Unknown error 524", the
    kernel's ENOTSUPP) and in a (EOPNOTSUPP, docs/apps.md)
  13 librdmacm 60's commands (interop/usrevent.c, with an rdma-core that has them:
    apps.sh --rdma-suite sid), in pvcm VM a and in the kernel guest k as the reference:
    rdma_write_cm_event(USER, status -7, an argument) while another thread waits in
    rdma_get_cm_event: that thread gets the event, status and argument; then
    rdma_resolve_addrinfo, answered by an INTERNAL event librdmacm writes: the next
    event is ADDRINFO_RESOLVED; RESOLVE_IB_SERVICE on an id bound to the guest's address:
    EOPNOTSUPP (a RoCE device has no SA). A kernel before 6.17 (Debian 12's) has neither
    command: EINVAL for both, which k's check expects then
  14 TOS (rdma_set_option RDMA_OPTION_ID_TOS): ucmatose -t 0x60 for a -> k and k -> a,
    with a capture of k's tap: every data frame between a and k, both directions (the
    client's QP and the server's, whose traffic class comes from the REQ's path), has
    IPv4 TOS 0x60, from pvcm's QPs as from the kernel's
  6 IPv6, in a second lab: kernel guest fd99::2 (and 10.99.0.2), pvcm VMs a6 (dual
    stack: two GIDs, 10.99.0.11 its primary and fd99::11) and b6 (fd99::12 its one GID,
    10.99.0.12 on its NIC too) and an IPv4 pvcm VM 10.99.0.13 on the same backend:
    rping -v and ucmatose over IPv6 pvcm -> kernel, kernel -> pvcm and pvcm -> pvcm
    (a6 over its second GID); a second address: rping -v a6 -> k over IPv4 and over
    IPv6 and k -> a6 over IPv6, a6's pvcm-guestd serving both addresses; two rping -s
    on one port, one on each address (-a 10.99.0.11 and -a fd99::11), both waiting at
    once and each connected to from k (IPv4, IPv6), a6's two listeners sharing one
    agent listener, next to the same in k (a6 its client); in b6 rping -s -a
    10.99.0.12 (its address the backend does not serve) fails with EADDRNOTAVAIL,
    logged and counted; rping over IPv4 from the IPv4 VM (IPv4 and IPv6
    VMs on one backend); the capture's QP1 frames are IPv6 and IPv4

--vcpus N gives every guest N vCPUs; --threads N starts pvcm-guestd with --threads N.
The last line reads "apps: N passed, N failed"; exit 0 when all passed.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from .addr import vm_gid
from .lab import SCRIPTS, Lab, LabError, mac_of
from .results import counts, result
from .toolout import rocev2_packets

K, A, B = "10.99.0.2", "10.99.0.11", "10.99.0.12"
QPN_WINDOW = "qpn-base=16,qpn-count=0x20000"  # rdma_rxe's QPNs


def short(text, n=400):
    """The last n characters of text, on one line, rping's data lines ("ping data: ...",
    one per iteration, which a buffered stdout prints after any error of stderr) left
    out and counted."""
    lines = text.splitlines()
    kept = [l for l in lines if "ping data:" not in l]
    data = len(lines) - len(kept)
    said = " ".join(" ".join(kept).split())[-n:]
    return f"[{data} data lines] {said}" if data else said


UNIT = "/lib/systemd/system/pvcm-guestd.service"
# pvcm-guestd's --threads in this run (None: its default, one thread per vCPU up to 8).
GUESTD_THREADS = {"n": None}


def pair_backend(lab):
    """pvcm-backend on the packet port for VMs a and b (their sockets in the lab's workdir,
    rxe's QPN window); returns the backend and the two sockets."""
    sa, sb = lab.workdir / "a.sock", lab.workdir / "b.sock"
    backend = lab.backend(
        "--port", "packet:pvcm-qp1",
        "--vm", f"socket={sa},gid={vm_gid(A)},name=a,{QPN_WINDOW}",
        "--vm", f"socket={sb},gid={vm_gid(B)},name=b,{QPN_WINDOW}",
        env={"RUST_LOG": os.environ.get("RUST_LOG", BACKEND_LOG)})
    return backend, sa, sb


def start_guestd(vm, local=False, threads=None):
    """pvcm-guestd in a pvcm VM, as the pvcm-guest package's systemd unit starts it (its
    EnvironmentFile and ExecStart; the image has no systemd); waits for the node. local:
    its job and log in the guest's own files (/run/guestd.log), none in the share;
    threads: its --threads (default: GUESTD_THREADS, else the service's default)."""
    out = vm.check(f"grep -E '^(ExecStart|EnvironmentFile)=' {UNIT}")
    start = re.search(r"^ExecStart=(.*)$", out, re.M)
    env = re.search(r"^EnvironmentFile=-?(.*)$", out, re.M)
    if not start:
        raise LabError(f"{vm.name}: no ExecStart in {UNIT}: {out}")
    cmd = start.group(1)
    threads = threads or GUESTD_THREADS["n"]
    if threads:
        cmd += f" --threads {threads}"
    if env:
        cmd = f"[ -f {env.group(1)} ] && . {env.group(1)}; exec {cmd}"
    else:
        cmd = f"exec {cmd}"
    log = "/run/guestd.log" if local else f"/host/guestd.{vm.name}.log"
    job = vm.spawn(f"{cmd} >{log} 2>&1", local=local)
    deadline = time.monotonic() + 90
    while True:
        rc, _ = vm.run("[ -c /dev/infiniband/rdma_cm ] && [ -S /run/pvcm-guestd.sock ]", 30)
        if rc == 0:
            return job
        if job.done() or time.monotonic() > deadline:
            text = vm.run(f"cat {log}", 30)[1]
            raise LabError(f"{vm.name}: pvcm-guestd did not come up: {text[-1500:]}")
        time.sleep(0.5)


def guestd_stat(vm):
    """pvcm-guestd stat --json of a VM, parsed ({} if it does not answer)."""
    rc, out = vm.run("pvcm-guestd stat --json", 30)
    try:
        return json.loads(out) if rc == 0 else {}
    except ValueError:
        return {}


def listeners(guest):
    """How many listening rdma_cm ids the guest's CM holds: pvcm-guestd's count in a pvcm
    VM (its rdma_cm ids, not its agent's listeners, which the listeners of one port
    share), the kernel's (rdma res show cm_id) in a kernel-CM guest."""
    if guest.cm == "pvcm":
        return guestd_stat(guest).get("listening", 0)
    _, out = guest.run("rdma res show cm_id", 30)
    return sum(1 for line in out.splitlines() if "state LISTEN" in line)


def wait_or_kill(job, timeout=30):
    """job's exit status once it ends, or -1 when it has not ended within timeout
    seconds (it is then killed)."""
    try:
        return job.wait(timeout)
    except LabError:
        job.kill("KILL")
        return -1


def wait_listening(guest, before, job, timeout=30):
    """Waits until the guest holds more listeners than before (the server listens)."""
    deadline = time.monotonic() + timeout
    while listeners(guest) <= before and not job.done() and time.monotonic() < deadline:
        time.sleep(0.2)


def pair(name, server, client, scmd, ccmd, ok_server, ok_client, timeout=120, keep_server=False,
         attempts=1):
    """Runs scmd on server and, once the server listens, ccmd on client; checks both
    outputs. With attempts > 1 a failed pair runs again from a fresh server, and the
    result says so (a program's own connection race, see ib_send_bw in docs/apps.md)."""
    failures = []
    for attempt in range(attempts):
        before = listeners(server)
        srv = server.spawn(scmd)
        wait_listening(server, before, srv)
        t0 = time.monotonic()
        rc, out = client.run(f"timeout {timeout} {ccmd}", timeout + 30)
        secs = time.monotonic() - t0
        if keep_server:
            srv.kill("KILL")
            src = 0
        else:
            try:
                src = srv.wait(30 if rc != 0 else timeout)
            except LabError:
                srv.kill("KILL")
                src = -1
        sout = srv.text()
        if rc == 0 and src == 0 and ok_client(out) and ok_server(sout):
            retried = f" (attempt {attempt + 1}; before: {'; '.join(failures)})" if failures else ""
            result(f"{name}: {client.name} -> {server.name}", True, f"{secs:.1f} s{retried}")
            return out
        failures.append(f"client rc {rc}: {short(out, 200)} | server rc {src}: {short(sout, 200)}")
    result(f"{name}: {client.name} -> {server.name}", False, " || ".join(failures))
    return out


def userland(info):
    """The image's rdma-core userland from its /etc/pvcm-image-info: "suite S, rdmacm-utils
    V, perftest V, libc6 V" ("" without the packages)."""
    suite = re.search(r"^rdma_suite=(\S+)", info, re.M)
    vers = dict(re.findall(r"^deb=([^_\s]+)_([^_\s]+)_", info, re.M))
    if "rdmacm-utils" not in vers:
        return ""
    return (f"suite {suite.group(1) if suite else 'bookworm'}, " +
            ", ".join(f"{p} {vers[p].replace('%3a', ':')}" for p in ("rdmacm-utils", "perftest", "libc6")
                      if p in vers))


def cmtime_kind(guest):
    """Which cmtime the guest has, from its usage text (asked once per guest): "mesh",
    rdma-core 59's and later's (-C controller, -b bind address, -L listener, a TCP
    rendezvous on the -p port, the listener on an RDMA port of its own); "oob", 52's to
    58's (-s server, -p the RDMA port and a TCP rendezvous on it, the server sized by its
    own -c, one client); "old", before 52 (a server for any number of clients)."""
    if not hasattr(guest, "cmtime_kind"):
        _, out = guest.run("cmtime -h 2>&1", 30)
        guest.cmtime_kind = ("mesh" if "controller_address" in out
                             else "oob" if "socket baseline" in out else "old")
    return guest.cmtime_kind


def cmtime_one_client(guest):
    """Whether a cmtime server of the guest serves one client only (and exits after)."""
    return cmtime_kind(guest) != "old"


def cmtime_cmds(server, client, conns, port=7471, qpn=None):
    """cmtime's server and client commands for conns connections from client to server,
    whichever cmtime the guests have (cmtime_kind); port is the RDMA port (old, oob) or
    the rendezvous port (mesh). qpn: the first QPN of the newer ones' pass without QPs
    (-q; else their default), which pairs running at once from one guest must not share:
    the peer's CM rejects a second connection from the same QPN as stale."""
    kind = cmtime_kind(client)
    q = f" -q {qpn}" if qpn is not None and kind != "old" else ""
    if kind == "mesh":
        return (f"cmtime -b {server.ip} -C {server.ip} -L -c {conns} -p {port}{q}",
                f"cmtime -b {client.ip} -C {server.ip} -c {conns} -p {port}{q}")
    if kind == "oob":
        return (f"cmtime -p {port} -c {conns}{q}",
                f"cmtime -s {server.ip} -p {port} -c {conns}{q}")
    return f"cmtime -p {port}", f"cmtime -s {server.ip} -p {port} -c {conns}"


def cmtime_steps(out):
    """cmtime's steps and their totals in ms, from either cmtime's table ("step : total
    ms ..." or "step avg/conn total(us) ..."; the newer one's first table)."""
    old = re.findall(r"^(\w[\w ]*\w)\s*:\s+([\d.]+)", out, re.M)
    if old:
        return old
    steps = []
    for name, total in re.findall(r"^([a-z][a-z ]*[a-z])\s+\d+\s+(\d+)\s+\d+", out, re.M):
        if any(name == n for n, _ in steps):
            break
        steps.append((name, f"{int(total) / 1000:.2f}"))
    return steps


def programs(k, a, b, pairs, conns):
    """Section 1: the programs for each (client, server) pair."""
    for client, server in pairs:
        for size in (64, 1024, 4000):
            pair(f"rping -v -S {size} -C 200", server, client,
                 f"rping -s -a {server.ip} -v -C 200 -S {size}",
                 f"rping -c -a {server.ip} -v -C 200 -S {size}",
                 lambda s: s.count("server ping data:") == 200,
                 lambda c: c.count("ping data:") == 200)
        pair("ucmatose -c 100 -C 10", server, client,
             "ucmatose -c 100 -C 10", f"ucmatose -s {server.ip} -c 100 -C 10",
             lambda s: "test complete" in s and "return status 0" in s,
             lambda c: "test complete" in c and "return status 0" in c)
        pair("udaddy -c 4 -C 10 (UD, SIDR)", server, client,
             "udaddy -c 4 -C 10", f"udaddy -s {server.ip} -c 4 -C 10",
             lambda s: "test complete" in s and "return status 0" in s,
             lambda c: "test complete" in c and "return status 0" in c)
        pair("rdma_client / rdma_server", server, client,
             "rdma_server -p 7473", f"rdma_client -s {server.ip} -p 7473",
             lambda s: "rdma_server: end 0" in s, lambda c: "rdma_client: end 0" in c)
        # perftest 4.5-0.17 connects its test connection as soon as its parameter
        # exchange ends, racing the server's second listen; its retry reuses destroyed
        # ids, so a lost race ends the run (docs/apps.md): the pair may run again.
        pair("ib_send_bw -R -n 1000", server, client,
             "ib_send_bw -R -n 1000", f"ib_send_bw -R -n 1000 {server.ip}",
             lambda s: re.search(r"^\s*65536\s+1000\s", s, re.M),
             lambda c: re.search(r"^\s*65536\s+1000\s", c, re.M), attempts=3)
        scmd, ccmd = cmtime_cmds(server, client, conns)
        out = pair(f"cmtime -c {conns}", server, client, scmd, ccmd,
                   lambda s: True, lambda c: any(n == "disconnect" for n, _ in cmtime_steps(c)),
                   timeout=300, keep_server=True)
        steps = cmtime_steps(out)
        if steps:
            print("      cmtime " + ", ".join(f"{s} {v} ms" for s, v in steps), flush=True)


def connect_destroy(k, a, share):
    """Section 2: seed 002's program in a pvcm VM against a kernel listener."""
    lst = k.spawn("/host/bin/kcm listen -p 7475")
    time.sleep(1)
    rc, out = a.run("/host/bin/kcm withdraw -s 10.99.0.2 -p 7475 -c 10", 120)
    time.sleep(3)
    _, res = k.run("rdma res show cm_id", 30)
    ids = [l for l in res.splitlines() if "cm-idn" in l and ":7475" in l]
    lst.kill("KILL")
    ok = rc == 0 and len(ids) == 1 and "LISTEN" in ids[0]
    result("kcm withdraw (connect, destroy at once) x 10 from pvcm VM a: the kernel keeps only "
           "its listener", ok, f"rc {rc}; kernel cm_ids on 7475: {len(ids)}" +
           ("" if ok else f" {short(out)} | {short(res)}"))


def misbehaving(k, a):
    """Section 5: a flood of bad commands beside well-behaved programs."""
    job = a.spawn("/host/bin/ucflood -t 4 -s 15")
    time.sleep(2)
    pair("rping -v -S 1024 -C 100 beside the flood", k, a,
         f"rping -s -a {k.ip} -v -C 100 -S 1024", f"rping -c -a {k.ip} -v -C 100 -S 1024",
         lambda s: s.count("server ping data:") == 100, lambda c: c.count("ping data:") == 100)
    pair("ucmatose -c 20 -C 10 beside the flood", k, a,
         "ucmatose -c 20 -C 10", f"ucmatose -s {k.ip} -c 20 -C 10",
         lambda s: "test complete" in s and "return status 0" in s,
         lambda c: "test complete" in c and "return status 0" in c)
    try:
        rc = job.wait(90)
    except LabError:
        job.kill("KILL")
        rc = -1
    out = job.text()
    result("ucflood (4 threads, 15 s) in VM a: every call returned with the error it must; "
           "the good ones succeeded", rc == 0 and "ucflood: ok" in out, short(out, 300))
    st = guestd_stat(a)
    result("pvcm-guestd answers after the flood and holds no id",
           bool(st) and st.get("ids") == 0 and st.get("files") == 0,
           f"ids {st.get('ids')}, files {st.get('files')}, bad requests "
           f"{st.get('bad_requests')}")


def kernel_has_write_cm_event(guest):
    """Whether the guest's kernel serves WRITE_CM_EVENT and RESOLVE_IB_SERVICE (Linux
    6.17 and later)."""
    _, out = guest.run("uname -r", 30)
    m = re.match(r"(\d+)\.(\d+)", out.strip())
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (6, 17)


def written_events(k, a):
    """Section 13: librdmacm 60's WRITE_CM_EVENT and RESOLVE_IB_SERVICE, in the pvcm VM and
    in the kernel guest (the reference)."""
    for g in (a, k):
        served = g.cm == "pvcm" or kernel_has_write_cm_event(g)
        tag = f"{'pvcm VM' if g.cm == 'pvcm' else 'kernel reference'} {g.name}"
        rc, out = g.run("timeout 60 /host/bin/usrevent write", 90)
        if "usrevent: absent" in out:
            print(f"      {tag}: this librdmacm has no rdma_write_cm_event: nothing to check",
                  flush=True)
            return
        if served:
            ok = rc == 0 and "write_cm_event: ok" in out and "resolve_addrinfo: ok" in out
            want = "the waiting thread gets the USER event; ADDRINFO_RESOLVED follows"
        else:
            ok = "write_cm_event: error 22 " in out
            want = "EINVAL: this kernel has no WRITE_CM_EVENT"
        result(f"{tag}: rdma_write_cm_event and rdma_resolve_addrinfo: {want}", ok, short(out, 300))
        _, out = g.run(f"timeout 60 /host/bin/usrevent ibservice {g.ip}", 90)
        errno_want = 95 if served else 22
        result(f"{tag}: RESOLVE_IB_SERVICE on an id bound to its address: errno {errno_want}",
               f"resolve_ib_service: errno {errno_want} " in out, short(out, 200))


def guest_state(guest, pid):
    """The State line of a process in a guest ("" if it is gone)."""
    _, out = guest.run(f"grep '^State:' /proc/{pid}/status 2>/dev/null", 30)
    return " ".join(out.split()[1:])


def rping_waiting(server):
    """rping -s -C 10 on the server guest, listening and blocked in rdma_get_cm_event;
    (job, pid)."""
    before = listeners(server)
    job = server.spawn(f"exec rping -s -a {server.ip} -v -C 10")
    wait_listening(server, before, job)
    time.sleep(1)
    return job, job.guest_pid()


def rping_to(server, client, job):
    """rping -c -C 10 from client to the waiting server job: (ok, what happened)."""
    rc, out = client.run(f"timeout 60 rping -c -a {server.ip} -v -C 10", 90)
    try:
        src = job.wait(60)
    except LabError:
        job.kill("KILL")
        src = -1
    ok = (rc == 0 and src == 0 and out.count("ping data:") == 10
          and job.text().count("server ping data:") == 10)
    return ok, f"client rc {rc}, server rc {src}" + ("" if ok else f": {short(out, 150)} | "
                                                      f"{short(job.text(), 150)}")


def sigwait_listen(server, port, flags=""):
    """interop/sigwait.c listening on the server guest, blocked in rdma_get_cm_event."""
    before = listeners(server)
    job = server.spawn(f"exec /host/bin/sigwait listen -p {port} {flags}")
    wait_listening(server, before, job)
    return job


def sigwait_connect(server, client, job, port):
    """sigwait connect from client to the listening job: (job's exit status, its output,
    the client's output)."""
    _, cout = client.run(f"timeout 60 /host/bin/sigwait connect -s {server.ip} -p {port}", 90)
    try:
        rc = job.wait(60)
    except LabError:
        job.kill("KILL")
        rc = -1
    return rc, job.text().strip(), cout.strip()


def signals(server, client):
    """Section 8 for one server guest: a pvcm VM, or the kernel guest as the reference.
    Each program waits in rdma_get_cm_event when the signal comes; the client connects
    afterwards."""
    kind = "pvcm VM" if server.cm == "pvcm" else "kernel reference"
    tag = f"{kind} {server.name}"
    st0 = guestd_stat(server) if server.cm == "pvcm" else {}

    job, pid = rping_waiting(server)
    _, out = server.run(f"kill -STOP {pid}; i=0; until grep -q '^State:.T' /proc/{pid}/status "
                        f"|| [ $i -ge 50 ]; do sleep 0.1; i=$((i + 1)); done; "
                        f"grep '^State:' /proc/{pid}/status; sleep 1; kill -CONT {pid}", 60)
    stopped = "T (stopped)" in out
    ok, what = rping_to(server, client, job)
    result(f"{tag}: rping -s stopped (SIGSTOP) while waiting, continued, then connected to "
           f"from {client.name}", stopped and ok, f"{short(out, 60)}; {what}")

    job, pid = rping_waiting(server)
    _, out = server.run(f"timeout -s INT 3 strace -f -p {pid} -e trace=write 2>&1 | "
                        "grep -E 'attached|detached|write' | head -n 6", 60)
    alive = not job.done()
    ok, what = rping_to(server, client, job)
    result(f"{tag}: strace -f -p attached to a waiting rping -s, detached, then connected to "
           f"from {client.name}", alive and "detached" in out and ok,
           f"strace: {short(out, 200)}; {what}")

    port = 7481
    job = sigwait_listen(server, port, "-i 600000")
    pid = job.guest_pid()
    _, out = server.run(f"/host/bin/sigwait ptrace {pid}; grep '^State:' /proc/{pid}/status", 30)
    rc, sout, cout = sigwait_connect(server, client, job, port)
    result(f"{tag}: a debugger's attach (PTRACE_ATTACH, detach) to a waiting program, then "
           f"connected to", "detached" in out and rc == 0 and "connect request" in sout,
           f"{short(out, 120)}; listener rc {rc}: {short(sout, 100)}; client: {short(cout, 80)}")

    port = 7482
    job = sigwait_listen(server, port, "-i 200")
    time.sleep(3)
    rc, sout, cout = sigwait_connect(server, client, job, port)
    m = re.search(r"connect request after (\d+) alarms", sout)
    result(f"{tag}: SIGALRM every 200 ms into an SA_RESTART handler while waiting: no EINTR, "
           f"the connection request arrives", rc == 0 and m is not None and int(m.group(1)) >= 5,
           f"listener rc {rc}: {short(sout, 120)}; client: {short(cout, 80)}")

    port = 7483
    job = sigwait_listen(server, port, "-i 200 -n")
    time.sleep(3)
    rc, sout, cout = sigwait_connect(server, client, job, port)
    if server.cm == "pvcm":
        # docs/apps.md: a CUSE server cannot tell SA_RESTART from /proc; the handler
        # runs and the call waits on.
        ok = rc == 0 and "connect request after" in sout
        want = "the handler runs, the call waits on (the documented difference)"
    else:
        ok = rc == 3 and "EINTR" in sout
        want = "EINTR"
    result(f"{tag}: SIGALRM into a handler without SA_RESTART while waiting: {want}", ok,
           f"listener rc {rc}: {short(sout, 120)}")

    before = listeners(server)
    job, pid = rping_waiting(server)
    t0 = time.monotonic()
    server.run(f"kill -TERM {pid}", 30)
    rc = wait_or_kill(job)
    secs = time.monotonic() - t0
    deadline = time.monotonic() + 20
    while listeners(server) > before and time.monotonic() < deadline:
        time.sleep(0.5)
    left = listeners(server)
    detail = f"exit status {rc} after {secs:.1f} s, listeners {left} (before {before})"
    ok = rc == 128 + 15 and left == before
    if server.cm == "pvcm":
        st = guestd_stat(server)
        ok = ok and st.get("ids") == 0 and st.get("files") == 0
        detail += (f"; service ids {st.get('ids')}, files {st.get('files')}, interrupted "
                   f"{st0.get('interrupted')} -> {st.get('interrupted')}, restarted "
                   f"{st.get('restarted')}")
    result(f"{tag}: SIGTERM (default action) to a waiting rping -s: it exits, its ids are "
           "freed", ok, detail)


def wait_for(pred, timeout):
    """Polls pred every 0.5 s until it is true or timeout seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.5)


def rxe_gid_present(guest):
    """Whether rxe0 is registered and its GID table holds the guest's address as RoCE v2
    (and, in a pvcm VM, pvcm-guestd serves it again)."""
    rc, _ = guest.run("rdma dev show rxe0 >/dev/null 2>&1", 30)
    if rc != 0:
        return False
    try:
        guest.gid_index()
    except LabError:
        return False
    if guest.cm != "pvcm":
        return True
    port = guestd_stat(guest).get("port", {})
    return bool(port.get("attached") and port.get("addr_present"))


def device_removal(server, tag):
    """rdma link delete rxe0 under a waiting rping -s on the server guest: a check."""
    st0 = guestd_stat(server) if server.cm == "pvcm" else {}
    job, _ = rping_waiting(server)
    t0 = time.monotonic()
    delete = server.spawn("exec rdma link delete rxe0")
    if server.cm == "pvcm":
        try:
            rc = job.wait(60)
        except LabError:
            job.kill("KILL")
            rc = -1
        secs = time.monotonic() - t0
        try:
            drc = delete.wait(60)
        except LabError:
            drc = -1
        out = job.text()
        st = guestd_stat(server)
        result(f"{tag}: rdma link delete rxe0 under a waiting rping -s: it gets DEVICE_REMOVAL "
               "and exits, the delete completes",
               "device removal" in out and rc not in (0, -1) and drc == 0,
               f"rping exit status {rc} after {secs:.1f} s: {short(out, 160)}; rdma link delete "
               f"status {drc}; service device_removals {st0.get('device_removals')} -> "
               f"{st.get('device_removals')}, DEVICE_REMOVAL events "
               f"{st.get('events', {}).get('DEVICE_REMOVAL')}")
        return
    # The kernel: rxe cannot disassociate a program's verbs context, so the delete waits
    # in the verbs client's removal for the program to close the device, before the
    # rdma_cm client's removal would send DEVICE_REMOVAL.
    time.sleep(20)
    waiting = not job.done() and not delete.done()
    said = job.text()
    job.kill("KILL")
    try:
        drc = delete.wait(60)
    except LabError:
        drc = -1
    secs = time.monotonic() - t0
    result(f"{tag}: rdma link delete rxe0 under a waiting rping -s: the delete waits for the "
           "program (rxe has no disassociate), which gets no event; killed, the delete completes",
           waiting and "device removal" not in said and drc == 0,
           f"after 20 s rping waiting and the delete pending: {waiting}; rping said "
           f"{short(said, 120)!r}; delete status {drc} after {secs:.1f} s")


def device_change(server, client, other_ip):
    """Section 12 for one server guest: a pvcm VM, or the kernel guest as the reference.
    rxe0 deleted under a waiting rping -s, added again, a new rping; the server's
    address deleted and added again under a waiting rping -s, which is then connected to;
    a second address (other_ip) on the server's NIC, bound by rping -s."""
    kind = "pvcm VM" if server.cm == "pvcm" else "kernel reference"
    tag = f"{kind} {server.name}"
    if server.cm == "pvcm":
        # A figure, not a check: what the looks at the device cost an idle service
        # (USER_HZ: 10 ms a tick).
        w0 = guestd_stat(server).get("port_watch", {})
        _, out = server.run("p=$(pidof pvcm-guestd); t() { awk '{print $14 + $15}' "
                            "/proc/$p/stat; }; a=$(t); sleep 10; b=$(t); "
                            "echo $(( (b - a) * 10 ))", 60)
        w1 = guestd_stat(server).get("port_watch", {})
        print(f"pvcm-guestd idle in {server.name}: {out.strip()} ms CPU in 10 s (TCG); looks "
              f"{w0.get('looks')} -> {w1.get('looks')}, GID table reads {w0.get('reads')} -> "
              f"{w1.get('reads')}", flush=True)
    device_removal(server, tag)

    server.run("rdma link add rxe0 type rxe netdev eth0", 60)
    back = wait_for(lambda: rxe_gid_present(server), 60)
    job, _ = rping_waiting(server)
    ok, what = rping_to(server, client, job)
    result(f"{tag}: rxe0 added again: a new rping -s is connected to from {client.name}"
           + (", the service not restarted" if server.cm == "pvcm" else ""),
           back and ok, f"GID back {bool(back)}; {what}")

    job, _ = rping_waiting(server)
    server.run(f"ip addr del {server.ip}/24 dev eth0; sleep 3; "
               f"ip addr add {server.ip}/24 dev eth0", 60)
    back = wait_for(lambda: rxe_gid_present(server), 60)
    time.sleep(2)
    alive = not job.done()
    ok, what = rping_to(server, client, job)
    said = job.text()
    events = ""
    if server.cm == "pvcm":
        events = f"; service ADDR_CHANGE events {guestd_stat(server).get('events', {}).get('ADDR_CHANGE')}"
    result(f"{tag}: ip addr del and add of {server.ip} under a waiting rping -s: no ADDR_CHANGE "
           f"(no bond failover), it waits on and is connected to from {client.name}",
           alive and back and ok and "unhandled event" not in said,
           f"alive {alive}, GID back {bool(back)}; {what}{events}")

    server.run(f"ip addr add {other_ip}/24 dev eth0", 30)
    wait_for(lambda: server.run(f"grep -qi ':{sysfs_tail(other_ip)}$' "
                                "/sys/class/infiniband/rxe0/ports/1/gids/* 2>/dev/null",
                                30)[0] == 0, 30)
    if server.cm == "pvcm":
        wait_for(lambda: other_ip in guestd_stat(server).get("port", {}).get("other_addrs", []),
                 30)
    job = server.spawn(f"exec timeout 5 rping -s -a {other_ip} -v -C 1")
    rc = wait_or_kill(job)
    said = job.text()
    server.run(f"ip addr del {other_ip}/24 dev eth0", 30)
    if server.cm == "pvcm":
        st = guestd_stat(server)
        log = server.run(f"grep -c 'the backend does not serve it for this VM' "
                         f"/host/guestd.{server.name}.log", 30)[1]
        result(f"{tag}: rping -s -a {other_ip} (a second address on the NIC, not one of the "
               "VM's GIDs): the bind fails with EADDRNOTAVAIL, the service logs the cause "
               "(the backend does not serve it for this VM) and counts it",
               rc not in (0, 124, 143, -1) and "rdma_bind_addr" in said
               and st.get("other_addr_binds", 0) >= 1 and log.strip() not in ("", "0"),
               f"rping status {rc}: {short(said, 120)}; other_addr_binds "
               f"{st.get('other_addr_binds')}; log lines {log.strip()}")
    else:
        result(f"{tag}: rping -s -a {other_ip} (a second address on the NIC): the kernel binds "
               "it and listens", rc in (124, 143) and "rdma_bind_addr" not in said,
               f"rping status {rc} (124 or 143: still listening at the timeout): "
               f"{short(said, 120)}")


def sysfs_tail(ip):
    """The last two groups of an IPv4 address's GID as sysfs writes them (0a63:010b)."""
    o = [int(x) for x in ip.split(".")]
    return f"{o[0]:02x}{o[1]:02x}:{o[2]:02x}{o[3]:02x}"


# How long section 3's survivors get (each is a cmtime -c 50 or ucmatose -C 50; under the
# kernel CM any connection that cannot be made or closed ends in its timeouts, ~75 s).
SURVIVOR_SECS = 300

# Section 3's wait for the survivors (the odd ones of $pids), bounded: one still running
# after SURVIVOR_SECS is printed ("stuck N pid P", each thread's wait channel and system
# call, its output's tail) and killed, so the wait after it ends.
SURVIVORS_BOUNDED = (
    "alive() { [ -r /proc/$1/stat ] && read -r _ _ st _ </proc/$1/stat && [ \"$st\" != Z ]; }\n"
    f"t=0; while [ $t -lt {SURVIVOR_SECS} ]; do run=0; n=0; for p in $pids; do n=$((n+1)); "
    "[ $((n % 2)) = 1 ] && alive $p && run=1; done; [ $run = 0 ] && break; sleep 1; t=$((t+1)); done\n"
    "n=0; for p in $pids; do n=$((n+1)); if [ $((n % 2)) = 1 ] && alive $p; then "
    "echo \"stuck $n pid $p after ${t}s:\"; for th in /proc/$p/task/*; do "
    "echo \"  thread ${th##*/} $(cat $th/wchan 2>/dev/null) syscall $(cat $th/syscall 2>/dev/null)\"; done; "
    "f=/tmp/k9.$n; [ $n -gt 12 ] && f=/tmp/k9.u$((n - 13)); tail -n 4 $f; kill -9 $p; fi; done\n")


def stuck_service(lab, a):
    """What pvcm-guestd in VM a holds when a survivor of section 3 is stuck: its
    counters of files, ids, blocked GET_EVENTs and lanes, and its log's tail."""
    st = guestd_stat(a)
    keys = ("files", "ids", "listening", "resolving", "blocked_get_event", "interrupted",
            "early_interrupts", "poll_wakeups", "lane_waits", "events_dropped", "backlog_full",
            "agent", "events", "command_errors", "released_ids")
    held = {k: st.get(k) for k in keys}
    log = lab.share / f"guestd.{a.name}.log"
    try:
        tail = " / ".join(log.read_text(errors="replace").splitlines()[-15:])
    except OSError as e:
        tail = f"(no log: {e})"
    return f"{json.dumps(held)}; log: {tail[-2500:]}"


def kill_nine(lab, k, a, backend):
    """Section 3: 16 processes, 8 killed."""
    st0 = guestd_stat(a)
    # The newer cmtimes pair a server with each client (their rendezvous waits for the
    # peers they were told of), on ports of their own (7500-7511; ucmatose's are
    # 7490-7493), each pair's simulated QPNs its own (in the VM's QPN window, 16 to
    # 0x2000F). The oldest (rdma-core 44) takes one listener for the 12, which is
    # interop/kcm.c's: its own server dies (a NULL node in its handler) on the REJECTED
    # event a killed client's REJ gives it, and its kernel then ends every connection
    # the survivors hold.
    if cmtime_one_client(k):
        servers = [cmtime_cmds(k, a, 50, 7500 + i, 0x10000 + 0x100 * i) for i in range(12)]
    else:
        _, client = cmtime_cmds(k, a, 50, 7480)
        servers = [("/host/bin/kcm listen -p 7480", client)] * 12
    srvs = [k.spawn(s) for s in sorted({s for s, _ in servers})]
    userv = [k.spawn(f"ucmatose -p {7490 + i} -c 10 -C 50") for i in range(4)]
    time.sleep(2)
    clients = "".join(f"{c} >/tmp/k9.{i + 1} 2>&1 & pids=\"$pids $!\"\n"
                      for i, (_, c) in enumerate(servers))
    script = (
        "pids=''\n" + clients +
        "for i in 0 1 2 3; do ucmatose -s 10.99.0.2 -p $((7490 + i)) -c 10 -C 50 "
        ">/tmp/k9.u$i 2>&1 & pids=\"$pids $!\"; done\n"
        "sleep 4\n"
        "n=0; for p in $pids; do n=$((n+1)); [ $((n % 2)) = 0 ] && kill -9 $p 2>/dev/null; done\n"
        + SURVIVORS_BOUNDED +
        "ok=0; bad=0; n=0\n"
        "for p in $pids; do n=$((n+1)); wait $p; rc=$?; "
        "if [ $((n % 2)) = 1 ]; then if [ $rc = 0 ]; then ok=$((ok+1)); "
        "else bad=$((bad+1)); echo survivor $n rc=$rc; "
        "[ $n -le 12 ] && tail -n 2 /tmp/k9.$n; fi; fi; done\n"
        "echo survivors ok=$ok bad=$bad\n")
    rc, out = a.run(script, SURVIVOR_SECS + 120)
    m = re.search(r"survivors ok=(\d+) bad=(\d+)", out)
    stuck = "stuck " in out
    why = short(out, 300)
    if stuck:
        why = f"{out.strip()[-3000:]} | pvcm-guestd: {stuck_service(lab, a)}"
    result("16 processes in VM a (12 cmtime, 4 ucmatose), 8 killed -9: the 8 survivors finish",
           m and m.group(1) == "8" and m.group(2) == "0" and not stuck, why)
    # The killed processes' connections end on their behalf: the kernel peer's ids go,
    # or are disconnected (state DISCONNECT: the peer's CM got the DREQ) and held by a
    # ucmatose server that a killed client left waiting for its data in poll_cqs(),
    # which it would be whoever served the client's CM.
    deadline = time.monotonic() + 120
    left = ended = []
    while time.monotonic() < deadline:
        _, res = k.run("rdma res show cm_id", 30)
        ids = [l for l in res.splitlines() if "cm-idn" in l and "LISTEN" not in l]
        ended = [l for l in ids if "state DISCONNECT" in l]
        left = [l for l in ids if "state DISCONNECT" not in l]
        if not left:
            break
        time.sleep(3)
    result("the kernel peer is left with its listeners and disconnected ids only", not left,
           f"{len(left)} other cm_ids, {len(ended)} disconnected"
           + ("" if not left else f": {short(' '.join(left[:3]))}"))
    for j in userv + srvs:
        j.kill("KILL")
    st = guestd_stat(a)
    result("pvcm-guestd destroyed the killed processes' ids on release",
           st.get("released_ids", 0) > 0 and st.get("ids", 1) == 0,
           f"released_ids {st.get('released_ids')}, ids now {st.get('ids')}, "
           f"interrupted {st.get('interrupted')}")
    deadline = time.monotonic() + 180
    live = None
    while time.monotonic() < deadline:
        st = backend.stat_json()
        live = live_entries(st)
        if live == 0:
            break
        time.sleep(3)
    result("the backend reaches 0 live entries after the quarantine", live == 0, f"live {live}")
    served_by_threads(a, st0)


def served_by_threads(a, st0):
    """Section 3's requests were spread over pvcm-guestd's threads (with more than one):
    the 16 processes were not served one after the other by one thread."""
    st = guestd_stat(a)
    before = st0.get("requests_by_thread") or []
    now = st.get("requests_by_thread") or []
    took = [n - (before[i] if i < len(before) else 0) for i, n in enumerate(now)]
    threads = st.get("threads", 0)
    if threads <= 1:
        print(f"(pvcm-guestd runs 1 thread in VM a: nothing to spread; requests {took})")
        return
    result(f"VM a: the 16 processes' requests were served by more than one of pvcm-guestd's "
           f"{threads} threads", sum(1 for n in took if n > 0) > 1,
           f"requests by thread {took}; queued behind their file's {st.get('lane_waits')}, "
           f"device thread woken {st.get('device_wakes')}")


def nonlisteners(k):
    """The kernel-CM guest's cm_ids that are not listeners (rdma res show cm_id)."""
    _, res = k.run("rdma res show cm_id", 30)
    return [l for l in res.splitlines() if "cm-idn" in l and "LISTEN" not in l]


def rping_running(k, a, port):
    """An rping -v from a to k on port, running; returns (k's server job, a's client
    job) once k's kernel CM shows the connection."""
    ksrv = k.spawn(f"rping -s -v -a 10.99.0.2 -p {port} -C 1000000")
    before = listeners(k)
    wait_listening(k, before - 1, ksrv)
    client = a.spawn(f"rping -c -v -a 10.99.0.2 -p {port} -C 1000000 -S 64")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not nonlisteners(k):
        time.sleep(1)
    time.sleep(2)
    return ksrv, client


def peer_clear_after(k, t0, timeout=60):
    """Seconds from t0 until k's kernel CM holds no connected cm_id (None: not within
    timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not nonlisteners(k):
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def keeper_count(vm):
    """How many pvcm-guestd keepers run in vm (`pvcm-guestd keep`, service/keeper.rs)."""
    _, out = vm.run("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <$f 2>/dev/null; echo; "
                    "done | grep -c '^pvcm-guestd keep '", 30)
    counts = re.findall(r"^(\d+)$", out, re.M)
    return int(counts[-1]) if counts else 0


def host_drop(backend, reason):
    """The backend's host-wide drops of one reason."""
    return backend.stat_json().get("host", {}).get("drops", {}).get(reason, 0)


def guestd_restart(k, a, guestd, backend):
    """Section 9: pvcm-guestd stopped under running programs, then started again. With
    SIGTERM the programs' files fail (never hang) and the service's own DREQs end their
    connections at the kernel peer at once; its main process killed with SIGKILL, its
    keeper fails the programs' files, and the backend ends their connections on the
    VM's behalf as soon as the service starts again. Programs started after a restart
    work. Returns the new pvcm-guestd job."""
    ksrv, client = rping_running(k, a, 7561)
    waiting = a.spawn("rping -s -v -a 10.99.0.11 -p 7562")
    up = nonlisteners(k)
    # Running: its connection is up at k and it has not ended (its output, a file, is
    # block-buffered, so "ping data" may not show yet).
    ran = not client.done()
    result("before the restart: rping a -> k is running, an rping server waits in a",
           bool(up) and ran and not waiting.done(), f"k's connected ids {len(up)}")
    t0 = time.monotonic()
    guestd.kill("TERM")
    guestd.wait(30)
    stopped = time.monotonic() - t0
    ends = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(ends) < 3:
        for name, job in (("client", client), ("waiting server", waiting)):
            if name not in ends and job.done():
                ends[name] = time.monotonic() - t0
        if "peer" not in ends and not nonlisteners(k):
            ends["peer"] = time.monotonic() - t0
        time.sleep(0.5)
    for j in (client, waiting):
        if not j.done():
            j.kill("KILL")
    figures = ", ".join(f"{n} {t:.1f} s" for n, t in ends.items())
    keepers = keeper_count(a)
    result("pvcm-guestd stopped (SIGTERM): a's programs end with an error, none hangs, "
           "and the service's keeper is gone with it",
           "client" in ends and "waiting server" in ends
           and client.wait(10) != 0 and waiting.wait(10) != 0 and keepers == 0,
           f"stopped in {stopped:.1f} s; keepers left {keepers}; ended after: {figures}; client: "
           f"{short(client.text().strip().splitlines()[-1] if client.text().strip() else '', 120)}")
    peer = ends.get("peer")
    result("SIGTERM: the kernel peer loses the VM's connection at once (the service's DREQ "
           "on its way out), not after its CM's timeouts", peer is not None and peer < 15,
           f"k's connected ids gone after {peer:.1f} s" if peer is not None else "still there after 60 s")
    ksrv.kill("KILL")
    guestd = start_guestd(a)
    # Killed outright (its main process only, as `kill -9` or the OOM killer would):
    # nothing is sent, but its keeper wakes the programs' pollers and answers their
    # files, so they end at once, whether they read the CM channel in a blocking call
    # (rping of rdma-core 44) or wait in poll() for POLLIN (59 and later); the next start
    # of the service ends what it held.
    ksrv, client = rping_running(k, a, 7564)
    keepers = keeper_count(a)
    guestd.kill("KILL", group=False)
    t_kill = time.monotonic()
    ended = keeper_gone = None
    while time.monotonic() - t_kill < 30 and (ended is None or keeper_gone is None):
        if ended is None and client.done():
            ended = time.monotonic() - t_kill
        if keeper_gone is None and keeper_count(a) == 0:
            keeper_gone = time.monotonic() - t_kill
        time.sleep(0.5)
    if ended is None:
        client.kill("KILL")
    result("SIGKILL of the service's main process: its keeper wakes the running rping "
           "client, which ends with an error, and then exits",
           keepers == 1 and ended is not None and ended < 10 and keeper_gone is not None,
           f"keepers while running {keepers}; client ended "
           + (f"{ended:.1f} s after the kill" if ended is not None else "never (killed)")
           + "; keeper gone " + (f"after {keeper_gone:.1f} s" if keeper_gone is not None
                                 else "never"))
    time.sleep(1)
    held = len(nonlisteners(k))
    absorbed = host_drop(backend, "absorbed")
    t0 = time.monotonic()
    guestd = start_guestd(a)
    peer = peer_clear_after(k, t0)
    EXPECTED_DROPS["absorbed"] = (EXPECTED_DROPS.get("absorbed", 0)
                                  + host_drop(backend, "absorbed") - absorbed)
    result("SIGKILL: the kernel peer keeps the connection until the service starts again, "
           "then the backend ends it on the VM's behalf at once",
           held > 0 and peer is not None and peer < 30,
           f"k's connected ids while the service was down: {held}; gone "
           + (f"{peer:.1f} s after the start began" if peer is not None else "never"))
    ksrv.kill("KILL")
    pair("rping -v -C 20 after the restart", k, a, "rping -s -v -a 10.99.0.2 -p 7563 -C 20",
         "rping -c -v -a 10.99.0.2 -p 7563 -C 20",
         lambda s: s.count("server ping data:") == 20, lambda c: c.count("ping data:") == 20)
    return guestd


def live_entries(st):
    """Live mux entries in a backend's stat JSON (the host's: every VM's)."""
    return st.get("host", {}).get("live")


# The backends' log level: info, and debug for the modules that log each MAD they drop
# (with its reason and source), so that a drop in a run explains itself.
BACKEND_LOG = "info,pvcm_backend::daemon=debug,pvcm_backend::device=debug"


# Drops a section caused on purpose, by reason, left out of the drop check: section 9
# kills pvcm-guestd outright, and the peer's DREP to the DREQ the backend then sends on
# the VM's behalf is `absorbed` (docs/operations.md: expected after a VM restarts).
EXPECTED_DROPS = {}


def drop_reasons(st):
    """The backend's drops by reason, host-wide, the mux's and the devices', but for
    `quarantined`: late answers to connections that had ended, which the peer sent
    before our REJ or DREQ reached it (a process killed mid-handshake), dropped as the
    kernel CM drops a message for a cm_id it destroyed; and less EXPECTED_DROPS."""
    h = st.get("host", {})
    out = {k: v for k, v in h.get("drops", {}).items() if v and k != "quarantined"}
    out.update({k: v for k, v in h.get("device_drops", {}).items() if v})
    for k, n in EXPECTED_DROPS.items():
        if k in out:
            out[k] -= n
    return {k: v for k, v in out.items() if v}


def drops(st):
    """How many MADs the backend dropped (the sum of drop_reasons)."""
    return sum(drop_reasons(st).values())


def drop_report(st, backend):
    """The drops by reason and the backend's last log lines about dropped MADs."""
    text = f"drops {drops(st)} {drop_reasons(st)}"
    if EXPECTED_DROPS:
        text += f" (left out, caused on purpose: {EXPECTED_DROPS})"
    if drops(st):
        try:
            log = backend.log.read_text(errors="replace").splitlines()
        except OSError:
            log = []
        lines = [l for l in log if "dropped" in l][-5:]
        if lines:
            text += "; backend log: " + " | ".join(lines)
    return text


def quarantined(st):
    """Late MADs for ended connections, dropped (see drops)."""
    return st.get("host", {}).get("drops", {}).get("quarantined", 0)


def wire_mads(st, name):
    """Frames VM name sent and received on the wire."""
    for v in st.get("vms", []):
        if v.get("name") == name:
            io = v.get("figures", {}).get("io", {})
            return io.get("wire_tx_frames", 0), io.get("wire_rx_frames", 0)
    return 0, 0


def divert_counters(lab, tap):
    """The packets counted by the named counters of a tap's egress table
    (qp1-divert.sh show): {name: packets}."""
    _, out = lab.host(f"bash {SCRIPTS / 'qp1-divert.sh'} show {tap}", timeout=30)
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"counter (\w+) \{\s*packets (\d+)", out)}


def vm_drops(st, name):
    """A VM's drops by reason in a backend stat (mux and device)."""
    for v in st.get("vms", []):
        if v.get("name") == name:
            f = v.get("figures", {})
            return {**f.get("drops", {}), **f.get("device_drops", {})}
    return {}


def delta(after, before):
    """What grew between two {name: count} readings."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def kernel_reqs(guest):
    """REQs a guest's kernel CM has received (its infiniband_cm counter; -1 if none)."""
    _, out = guest.run("cat /sys/class/infiniband/rxe0/ports/1/cm_rx_msgs/req "
                       "/sys/class/infiniband_cm/rxe0/1/cm_rx_msgs/req 2>/dev/null | head -n 1", 30)
    out = out.strip()
    return int(out) if out.isdigit() else -1


def hostile_root(lab, k, b, backend):
    """Section 7: root in VM b runs its own kernel CM and crafts QP1 frames."""
    tap = b.tap
    c0, st0, k0 = divert_counters(lab, tap), backend.stat_json(), kernel_reqs(k)
    # busybox's own modprobe: insmod in dependency order (configfs, ...), past the
    # image's modprobe that honours the package's install rule.
    rc, out = b.run("killall pvcm-guestd; i=0; while [ -e /dev/infiniband/rdma_cm ] && "
                    "[ $i -lt 50 ]; do sleep 0.2; i=$((i + 1)); done; "
                    "for m in ib_cm iw_cm rdma_cm rdma_ucm; do /bin/busybox modprobe $m || exit 1; done; "
                    "i=0; until [ -c /dev/infiniband/rdma_cm ] || [ $i -ge 50 ]; do sleep 0.2; "
                    "i=$((i + 1)); done; ls -l /dev/infiniband/rdma_cm", 60)
    result("VM b: root stops pvcm-guestd and loads the kernel CM past the modprobe rule",
           rc == 0, short(out, 200))
    if rc != 0:
        return
    # pvcm's own connections from b meanwhile: the CLI drives the device itself.
    # A listener on port 7477 that accepts them: the oldest cmtime's server, or (the newer
    # ones wait for their own client first) interop/kcm.c's.
    kc = k.spawn("/host/bin/kcm listen -p 7477" if cmtime_one_client(k) else "cmtime -p 7477")
    time.sleep(1)
    own = b.spawn(f"pvcm-guest cmtime --dest {k.ip} --port 7477 --connections 50 --timeout 90")
    srv = k.spawn(f"rping -s -a {k.ip} -C 1 -v")
    time.sleep(1)
    rc_c, out_c = b.run(f"timeout 25 rping -c -a {k.ip} -C 1 -v", 40)
    srv.kill("KILL")
    bsrv = b.spawn(f"rping -s -a {b.ip} -C 1 -v")
    time.sleep(1)
    rc_k, out_k = k.run(f"timeout 25 rping -c -a {b.ip} -C 1 -v", 40)
    bsrv.kill("KILL")
    b_reqs = kernel_reqs(b)
    try:
        rc_own = own.wait(120)
    except LabError:
        own.kill("KILL")
        rc_own = -1
    kc.kill("KILL")
    k1 = kernel_reqs(k)
    time.sleep(1)
    c1, st1 = divert_counters(lab, tap), backend.stat_json()
    stopped, counted = delta(c1, c0), delta(vm_drops(st1, "b"), vm_drops(st0, "b"))
    # Every REQ k's CM took came through the backend (pvcm's own, counted in the host's
    # totals, which a device reset does not take back): none from b's kernel CM.
    sent = lambda st: st.get("host", {}).get("cm", {}).get("cm_tx_msgs", {}).get("req", 0)
    pvcm_reqs = sent(st1) - sent(st0)
    result("VM b's own kernel CM reaches no CM: its rping -c and k's rping -c to it fail, "
           "every REQ k's kernel CM took was one pvcm-backend sent, b's took none",
           rc_c != 0 and rc_k != 0 and k1 - k0 == pvcm_reqs and b_reqs == 0,
           f"rping -c rc {rc_c}, k's rping -c rc {rc_k}, k's REQs +{k1 - k0}, pvcm-backend's "
           f"REQs +{pvcm_reqs}, b's kernel CM REQs {b_reqs}"
           + ("" if rc_c and rc_k else f" | {short(out_c, 150)} | {short(out_k, 150)}"))
    result("the tap's egress table stopped b's QP1 frames and the backend counted them on VM b",
           stopped.get("qp1", 0) > 0 and counted.get("vm_qp1_egress", 0) > 0,
           f"table {stopped}, backend VM b {counted}")
    out_own = own.text()
    result("pvcm's own connections from VM b meanwhile (pvcm-guest cmtime, 50)",
           rc_own == 0 and re.search(r"connections 50 established 50 failed 0 disconnected 50",
                                     out_own) is not None, short(out_own, 200))
    # Crafted frames, one of each shape.
    _, ll = b.run("ip -6 addr show dev eth0 scope link | sed -n 's/.*inet6 \\([^/]*\\).*/\\1/p'", 30)
    ll = ll.strip().splitlines()[0] if ll.strip() else "fe80::1"
    c0, st0, k0 = divert_counters(lab, tap), backend.stat_json(), kernel_reqs(k)
    rc, out = b.run(f"/host/bin/rawqp1 eth0 {mac_of(k.ip)} {b.ip} {k.ip} 10.99.0.11 {ll} "
                    "fe80::2 v4opt v6ext vlan frag spoof", 30)
    time.sleep(1)
    c1, st1 = divert_counters(lab, tap), backend.stat_json()
    stopped, counted = delta(c1, c0), delta(vm_drops(st1, "b"), vm_drops(st0, "b"))
    host = delta(st1.get("host", {}).get("device_drops", {}),
                 st0.get("host", {}).get("device_drops", {}))
    qp1 = stopped.get("qp1", 0) + stopped.get("unclassified", 0)
    ok = (rc == 0 and qp1 == 4 and stopped.get("spoofed", 0) == 1
          and sum(counted.values()) + host.get("wire_egress_unknown_source", 0) == qp1)
    result("crafted QP1 frames from VM b (IPv4 with options, IPv6 with an extension header, "
           "a VLAN tag, a later fragment) stopped, another VM's source address dropped, "
           "all counted", ok,
           f"table {stopped}, backend VM b {counted}, host {host}" + ("" if ok else f" | {short(out, 200)}"))


def igmp_member(guest, group):
    """Whether the guest's eth0 is an IGMP member of group (/proc/net/igmp)."""
    hexed = "".join(f"{int(o):02X}" for o in reversed(group.split(".")))
    _, out = guest.run("cat /proc/net/igmp", 30)
    dev = None
    for line in out.splitlines():
        m = re.match(r"^\d+\s+(\S+)\s*:", line)
        if m:
            dev = m.group(1)
        elif dev == "eth0" and line.split() and line.split()[0] == hexed:
            return True
    return False


def multicast(k, a, group="239.1.2.3"):
    """Section 10: mckey across a pvcm VM and the kernel guest, both directions."""
    for sender, receiver in ((a, k), (k, a)):
        name = f"mckey -m {group}: {sender.name} -> {receiver.name}"
        recv = receiver.spawn(f"timeout 90 mckey -m {group} -b {receiver.ip}")
        deadline = time.monotonic() + 60
        joined = False
        while not recv.done() and time.monotonic() < deadline:
            joined = igmp_member(receiver, group)
            if joined:
                break
            time.sleep(0.5)
        result(f"{name}: the receiver's VM is an IGMP member of {group} while it runs", joined,
               "" if joined else short(recv.text(), 300))
        rc, out = sender.run(f"timeout 60 mckey -s -m {group} -b {sender.ip}", 90)
        try:
            rrc = recv.wait(60)
        except LabError:
            recv.kill("KILL")
            rrc = -1
        rout = recv.text()
        dgid = f"joined dgid: ::ffff:{group}"
        ok = (rc == 0 and rrc == 0 and dgid in out and dgid in rout
              and "initiating data transfers" in out and "data transfers complete" in out
              and "receiving data transfers" in rout and "data transfers complete" in rout)
        result(name, ok, f"sender rc {rc}: {short(out, 300)} | receiver rc {rrc}: {short(rout, 300)}")
        left = not igmp_member(receiver, group)
        result(f"{name}: the membership ends with the receiver", left, "")
    st = guestd_stat(a)
    result("pvcm-guestd: joins served, none held afterwards",
           st.get("mcast_joined", 0) >= 2 and st.get("mcast_joins") == 0 and not st.get("igmp_groups"),
           f"joined {st.get('mcast_joined')}, left {st.get('mcast_left')}, held {st.get('mcast_joins')}, "
           f"igmp {st.get('igmp_groups')}, commands {st.get('commands', {}).get('join_ip_mcast')}"
           f"/{st.get('commands', {}).get('join_mcast')} join, {st.get('commands', {}).get('leave_mcast')} leave")


def ipv6_multicast(k, a, group="ff0e::db8:1"):
    """Section 10 in the IPv6 lab: an IPv6 group on a RoCE v2 port fails to join in the
    kernel (its internal ENOTSUPP, "Unknown error 524") and in pvcm-guestd (EOPNOTSUPP:
    a CUSE reply cannot carry 524), before any data or membership."""
    want = {k.name: "Unknown error 524", a.name: "Operation not supported"}
    for g in (k, a):
        rc, out = g.run(f"timeout 60 mckey -m {group} -b {g.ip6}", 90)
        ok = rc != 0 and f"failure joining: {want[g.name]}" in out
        result(f"IPv6 mckey -m {group} in {g.name}: the join fails as the kernel's", ok,
               f"rc {rc}: {short(out, 300)}")
    st = guestd_stat(a)
    result("IPv6 lab: pvcm-guestd holds no join", st.get("mcast_joins") == 0
           and not st.get("igmp_groups"), f"joins {st.get('mcast_joins')}, igmp {st.get('igmp_groups')}")


NOBODY = "10.99.0.99"      # on the lab's subnet, no guest has it
GW_NET, GW_K = "10.98.0.0/24", "10.98.0.2"   # k's second subnet, reached via the host
SILENT_NET, SILENT_GW = "10.97.0.0/24", "10.99.0.97"  # routed via a gateway nobody has


def outcome(out):
    """What an rping run came to, in words both CMs print alike: the error event and its
    status, the failed call and its errno text, or the data it carried."""
    m = re.search(r"cma event (RDMA_CM_EVENT_\w+), error (-?\d+)", out)
    if m:
        return f"{m.group(1)} {m.group(2)}"
    m = re.search(r"^(rdma_\w+): (.+)$", out, re.M)
    if m:
        return f"{m.group(1)} fails: {m.group(2).strip()}"
    if "ping data:" in out:
        return "connected, data"
    return "other: " + short(out, 120)


def timed(guest, cmd, timeout=30):
    """cmd in the guest, timed there (/proc/uptime around it, 10 ms steps): (outcome, ms,
    output)."""
    up = "u=$(cut -d' ' -f1 /proc/uptime); u=${u%.*}${u#*.}"
    _, out = guest.run(f"{up}; s=$u; timeout {timeout} {cmd} 2>&1; r=$?; {up}; "
                       f"echo \"rc=$r ms=$(( (u - s) * 10 ))\"", timeout + 30)
    m = re.search(r"rc=(\d+) ms=(\d+)\s*$", out)
    if not m:
        return outcome(out), -1, out
    text = out[:m.start()]
    return outcome(text) + ("" if m.group(1) != "124" else " (still running when stopped)"), \
        int(m.group(2)), out


def same_as_kernel(what, k, a, cmd, limit_ms=None, timeout=30):
    """cmd in k (the kernel's rdma_cm, the reference) and in a (pvcm-guestd): the same
    outcome, both times printed; with limit_ms, a's within it."""
    ko, kms, _ = timed(k, cmd, timeout)
    ao, ams, aout = timed(a, cmd, timeout)
    ok = ao == ko and (limit_ms is None or 0 <= ams <= limit_ms)
    result(f"{what}: pvcm VM a as the kernel guest k ({cmd})", ok,
           f"k: {ko} in {kms} ms; a: {ao} in {ams} ms" + ("" if ok else f" | {short(aout, 200)}"))


def resolution(lab, k, a):
    """Section 11: address resolution as the kernel's rdma_resolve_ip() does it."""
    # An address of the VM's subnet nobody has: ARP goes unanswered, ADDR_ERROR when
    # rping's 2000 ms are up (TCG guests: 2 s more for the programs' start).
    same_as_kernel(f"no neighbour ({NOBODY})", k, a, f"rping -c -a {NOBODY} -C 1", 4000)
    same_as_kernel("no route (203.0.113.1)", k, a, "rping -c -a 203.0.113.1 -C 1")
    # A program that ends while its resolution waits: the service drops it, holds
    # nothing, and the next resolution is served.
    job = a.spawn(f"exec rping -c -a {NOBODY} -C 1")
    waiting = 0
    deadline = time.monotonic() + 10
    while not waiting and not job.done() and time.monotonic() < deadline:
        waiting = guestd_stat(a).get("resolving", 0)
    job.kill("KILL")
    try:
        job.wait(30)
    except LabError:
        pass
    st = guestd_stat(a)
    result("an rping killed while its resolution waits (pvcm-guestd: resolving 1): its id "
           "goes, nothing waits", waiting == 1 and st.get("ids") == 0
           and st.get("files") == 0 and st.get("resolving") == 0,
           f"resolving {waiting} before, {st.get('resolving')} after; ids {st.get('ids')}, "
           f"files {st.get('files')}")
    # Client and server in one VM, on its own address (the REQ leaves the VM and comes
    # back to it through the backend); the kernel guest is the reference.
    for g in (k, a):
        pair(f"rping -v -C 10 in one VM on its own address ({g.ip})", g, g,
             f"rping -s -a {g.ip} -v -C 10", f"rping -c -a {g.ip} -v -C 10",
             lambda s: s.count("server ping data:") == 10, lambda c: c.count("ping data:") == 10)
    same_as_kernel("loopback client", k, a, "rping -c -a 127.0.0.1 -C 1")
    same_as_kernel("loopback server", k, a, "rping -s -a 127.0.0.1 -C 1", timeout=5)
    # A route through a gateway: k has a second subnet, which a reaches through the host
    # side of the bridge (forwarding there); the neighbour a resolves is the gateway's.
    lab.add_address("10.98.0.1/24")
    lab.host("sysctl -qw net.ipv4.ip_forward=1", check=True)
    k.check(f"ip addr add {GW_K}/24 dev eth0")
    for g in (k, a):
        g.check(f"ip route add {SILENT_NET} via {SILENT_GW}")
    a.check(f"ip route add {GW_NET} via 10.99.0.1")
    a.run("ip neigh flush dev eth0", 30)
    pair(f"rping -v -C 10 through a gateway (a: {GW_NET} via 10.99.0.1)", k, a,
         f"rping -s -a {GW_K} -v -C 10", f"rping -c -a {GW_K} -v -C 10",
         lambda s: s.count("server ping data:") == 10, lambda c: c.count("ping data:") == 10)
    _, neigh = a.run("ip neigh show dev eth0", 30)
    gw = re.search(r"^10\.99\.0\.1 lladdr \S+", neigh, re.M) is not None
    result("through a gateway: the gateway 10.99.0.1 is a's resolved neighbour", gw,
           short(neigh, 200))
    same_as_kernel(f"a gateway nobody has ({SILENT_NET} via {SILENT_GW})", k, a,
                   "rping -c -a 10.97.0.1 -C 1", 4000)


def type_of_service(lab, k, a, tos=0x60):
    """Section 14: ucmatose -t TOS both ways; the traffic class of the data frames (not
    QP1) between a and k in a capture of k's tap, each way, per pair."""
    cap = lab.workdir / "tos.pcap"
    dump = lab.host_start(["tcpdump", "-i", k.tap, "-s", "96", "-U", "-w", str(cap),
                           "udp port 4791"], lab.workdir / "tcpdump.tos.log")
    time.sleep(1)
    spans = []
    for server, client in ((k, a), (a, k)):
        t0 = time.time()
        pair(f"ucmatose -t {tos:#x} -c 2 -C 20", server, client,
             f"ucmatose -b {server.ip} -c 2 -C 20", f"ucmatose -s {server.ip} -t {tos:#x} -c 2 -C 20",
             lambda s_: "test complete" in s_ and "return status 0" in s_,
             lambda c: "test complete" in c and "return status 0" in c)
        spans.append((server, client, t0, time.time()))
    time.sleep(1)
    dump.terminate()
    dump.wait(30)
    try:
        pkts = rocev2_packets(cap.read_bytes()) or []
    except OSError:
        pkts = []
    for server, client, t0, t1 in spans:
        for src, dst, role in ((client, server, "the client's QP"), (server, client, "the server's QP")):
            seen = {}
            for t, s_, d, tc, dqp in pkts:
                if t0 <= t <= t1 and s_ == src.ip and d == dst.ip and dqp != 1:
                    seen[tc] = seen.get(tc, 0) + 1
            who = "pvcm" if src.cm == "pvcm" else "kernel"
            result(f"ucmatose -t {tos:#x} {client.name} -> {server.name}: data frames "
                   f"{src.name} -> {dst.name} ({role}, {who}) carry TOS {tos:#x}",
                   bool(seen) and set(seen) == {tos},
                   "frames by TOS: " + (", ".join(f"{tc:#x}: {n}" for tc, n in sorted(seen.items()))
                                        or "none"))


def one_port_two_addresses(server, client, ip4, ip6, port=7581):
    """rping -s -a ip4 -p port and rping -s -a ip6 -p port at once on server (two
    listeners of one port on two of its addresses), then rping -c from client to each
    (IPv4, then IPv6, the first server gone by then): each server gets its own
    connection. In a pvcm VM the two share one agent listener while both listen."""
    jobs = []
    shared = None
    held = (0, 0)
    if server.cm == "pvcm":
        st = guestd_stat(server)
        held = (st.get("listening", 0), st.get("agent", {}).get("listeners", 0))
    for ip in (ip4, ip6):
        before = listeners(server)
        job = server.spawn(f"exec rping -s -a {ip} -p {port} -v -C 10")
        wait_listening(server, before, job)
        jobs.append(job)
    if server.cm == "pvcm":
        st = guestd_stat(server)
        shared = (st.get("listening", 0) - held[0],
                  st.get("agent", {}).get("listeners", 0) - held[1])
    outs = []
    for ip, job in zip((ip4, ip6), jobs):
        if job.done():
            outs.append((None, "", -2, job.text()))
            continue
        rc, out = client.run(f"timeout 60 rping -c -a {ip} -p {port} -v -C 10", 90)
        try:
            src = job.wait(30 if rc != 0 else 60)
        except LabError:
            job.kill("KILL")
            src = -1
        outs.append((rc, out, src, job.text()))
    for job in jobs:
        if not job.done():
            job.kill("KILL")
    ok = all(rc == 0 and src == 0 and out.count("ping data:") == 10
             and sout.count("server ping data:") == 10 for rc, out, src, sout in outs)
    if shared is not None:
        ok = ok and shared == (2, 1)
    what = " | ".join(f"[{ip}] client rc {rc}: {short(out, 80)}; server rc {src}: {short(sout, 80)}"
                      for ip, (rc, out, src, sout) in zip((ip4, ip6), outs))
    if shared is not None:
        what += f"; new listening ids {shared[0]}, new agent listeners {shared[1]}"
    result(f"{server.name} ({server.cm} CM): rping -s -a {ip4} -p {port} and rping -s -a [{ip6}] "
           f"-p {port} at once, each connected to from {client.name} (IPv4, IPv6)", ok, what)


def second_address(k, a, b, k4, k6, a6, b4):
    """Section 6's second address: a is dual stack with two GIDs (its IPv4 address the
    primary, a6 the second); b has b4 on its NIC but not among its GIDs."""
    def served():
        return [s.get("addr") for s in guestd_stat(a).get("port", {}).get("served", [])]
    wait_for(lambda: served() == [a.ip, a6], 60)
    served = served()
    result(f"{a.name}: pvcm-guestd serves both of the VM's GIDs ({a.ip}, {a6})",
           served == [a.ip, a6], f"served {served}")
    for client, server, sip, how in ((a, k, k4, "IPv4, the primary GID"),
                                     (a, k, k6, "IPv6, the second GID"),
                                     (k, a, a6, "IPv6, to the second GID")):
        pair(f"a second address: rping -v -C 10 {client.name} -> {server.name} [{sip}] ({how})",
             server, client, f"rping -s -a {sip} -v -C 10", f"rping -c -a {sip} -v -C 10",
             lambda s_: s_.count("server ping data:") == 10,
             lambda c_: c_.count("ping data:") == 10)
    # Two listeners on one port, on the two addresses: the kernel's first, the reference.
    one_port_two_addresses(k, a, k4, k6)
    one_port_two_addresses(a, k, a.ip, a6)
    before = guestd_stat(b).get("other_addr_binds", 0)
    job = b.spawn(f"exec timeout 5 rping -s -a {b4} -v -C 1")
    rc = wait_or_kill(job)
    said = job.text()
    st = guestd_stat(b)
    log = b.run(f"grep -c 'the backend does not serve it for this VM' /host/guestd.{b.name}.log",
                30)[1]
    result(f"{b.name}: rping -s -a {b4} (an address of the VM none of its GIDs): the bind "
           "fails with EADDRNOTAVAIL, logged with the cause and counted",
           rc not in (0, 124, 143, -1) and "rdma_bind_addr" in said
           and st.get("other_addr_binds", 0) > before and log.strip() not in ("", "0"),
           f"rping status {rc}: {short(said, 120)}; other_addr_binds {before} -> "
           f"{st.get('other_addr_binds')}; log lines {log.strip()}")


def ipv6_lab(workdir, pcap, full=True, mcast=False):
    """Section 6: IPv6 GIDs, and IPv4 and IPv6 VMs on one backend; with mcast, section
    10's IPv6 check (alone when not full)."""
    K6, A6, B6, C4 = "fd99::2", "fd99::11", "fd99::12", "10.99.0.13"
    with Lab(workdir, ipv6=True, pcap=pcap) as lab:
        sa, sb, sc = (lab.workdir / f"{n}6.sock" for n in "abc")
        backend = lab.backend(
            "--port", "packet:pvcm-qp1",
            # a6 is dual stack: its IPv4 address is its primary GID, its IPv6 one the
            # second (a VM with several addresses, docs/daemon.md).
            "--vm", f"socket={sa},gid={vm_gid(A)},gid={vm_gid(A6)},name=a6,{QPN_WINDOW}",
            "--vm", f"socket={sb},gid={vm_gid(B6)},name=b6,{QPN_WINDOW}",
            "--vm", f"socket={sc},gid={vm_gid(C4)},name=c4,{QPN_WINDOW}", name="backend6",
            env={"RUST_LOG": os.environ.get("RUST_LOG", BACKEND_LOG)})
        k = lab.kernel_guest("k6", K, K6, wait=False)
        a = lab.pvcm_vm("a6", A, A6, socket=str(sa), wait=False)
        b = lab.pvcm_vm("b6", B, B6, socket=str(sb), wait=False)
        c = lab.pvcm_vm("c4", C4, socket=str(sc), wait=False)
        for g in (k, a, b, c):
            g.wait_ready()
        for vm in (a, b, c):
            start_guestd(vm)
        if mcast:
            ipv6_multicast(k, a)
        if not full:
            return
        for client, server, sip in ((a, k, K6), (k, a, A6), (a, b, B6)):
            pair(f"IPv6 rping -v -S 1024 -C 100 [{sip}]", server, client,
                 f"rping -s -a {sip} -v -C 100 -S 1024", f"rping -c -a {sip} -v -C 100 -S 1024",
                 lambda s_: s_.count("server ping data:") == 100,
                 lambda c_: c_.count("ping data:") == 100)
            pair(f"IPv6 ucmatose -c 20 -C 10 [{sip}]", server, client,
                 f"ucmatose -b {sip} -c 20 -C 10", f"ucmatose -s {sip} -c 20 -C 10",
                 lambda s_: "test complete" in s_ and "return status 0" in s_,
                 lambda c_: "test complete" in c_ and "return status 0" in c_)
        second_address(k, a, b, K, K6, A6, B)
        pair("IPv4 VM on the same backend: rping -v -C 100 [10.99.0.2]", k, c,
             f"rping -s -a {K} -v -C 100", f"rping -c -a {K} -v -C 100",
             lambda s_: s_.count("server ping data:") == 100,
             lambda c_: c_.count("ping data:") == 100)
        st = backend.stat_json()
        (lab.workdir / "backend6.stat.json").write_text(json.dumps(st, indent=1))
        mads = {n: wire_mads(st, n) for n in ("a6", "b6", "c4")}
        result("IPv6 and IPv4 VMs of one backend carried MADs",
               all(t > 0 and r > 0 for t, r in mads.values()), str(mads))
        result("IPv6 lab: pvcm-backend 0 drops", drops(st) == 0, drop_report(st, backend))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="keep logs here (default: a new dir under /tmp)")
    ap.add_argument("--pcap", help="capture br0 into this file")
    ap.add_argument("--conns", type=int, default=1000, help="cmtime connections (default 1000)")
    ap.add_argument("--only", default="0,1,2,3,5,8,12,9,11,13,10,14,4,7,6",
                    help="sections to run (default all)")
    ap.add_argument("--kcm", help="the kcm binary (interop/kcm.c built against librdmacm)")
    ap.add_argument("--ucflood", help="the ucflood binary (interop/ucflood.c)")
    ap.add_argument("--rawqp1", help="the rawqp1 binary (interop/rawqp1.c)")
    ap.add_argument("--sigwait", help="the sigwait binary (interop/sigwait.c)")
    ap.add_argument("--usrevent", help="the usrevent binary (interop/usrevent.c)")
    ap.add_argument("--vcpus", type=int, default=1, help="each guest's vCPUs (default 1)")
    ap.add_argument("--threads", type=int, help="pvcm-guestd's --threads (default: its own, "
                    "one per vCPU, at least 4, at most 8)")
    a = ap.parse_args()
    GUESTD_THREADS["n"] = a.threads
    only = set(a.only.split(","))
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="pvcm-apps."))
    t0 = time.monotonic()
    try:
        with Lab(workdir, pcap=a.pcap, vcpus=a.vcpus) as lab:
            for name, path in (("kcm", a.kcm), ("ucflood", a.ucflood), ("rawqp1", a.rawqp1),
                               ("sigwait", a.sigwait), ("usrevent", a.usrevent)):
                if path:
                    (lab.share / "bin").mkdir(exist_ok=True)
                    (lab.share / "bin" / name).write_bytes(Path(path).read_bytes())
                    (lab.share / "bin" / name).chmod(0o755)
            backend, sa, sb = pair_backend(lab)
            k = lab.kernel_guest("k", K, wait=False)
            va = lab.pvcm_vm("a", A, socket=str(sa), wait=False)
            vb = lab.pvcm_vm("b", B, socket=str(sb), wait=False)
            for g in (k, va, vb):
                g.wait_ready()
            guestd = {vm.name: start_guestd(vm) for vm in (va, vb)}
            print(f"== lab up in {time.monotonic() - t0:.0f} s", flush=True)

            if "0" in only:
                print("== 0. the CM goes through pvcm", flush=True)
                for g in (k, va, vb):
                    _, info = g.run("cat /etc/pvcm-image-info", 30)
                    ver = userland(info)
                    result(f"{g.name}: the image's rdma-core userland", bool(ver), ver or short(info))
                for vm in (va, vb):
                    _, out = vm.run("for m in rdma_ucm rdma_cm ib_cm; do [ -d /sys/module/$m ] "
                                    "&& echo loaded $m; done; modprobe rdma_ucm; echo modprobe=$?; "
                                    "ls -l /dev/infiniband/rdma_cm; "
                                    "grep -c 'install rdma_ucm /bin/false' /lib/modprobe.d/pvcm-guest.conf")
                    result(f"VM {vm.name}: rdma_ucm, rdma_cm, ib_cm not loaded and kept out by the "
                           "package's modprobe rule", "loaded" not in out and "modprobe=0" not in out
                           and out.strip().endswith("1"), short(out, 200))
                    _, cpus = vm.run("nproc", 30)
                    cpus = int(cpus.strip() or 0)
                    want = a.threads or min(max(cpus, 4), 8)
                    threads = guestd_stat(vm).get("threads")
                    result(f"VM {vm.name}: pvcm-guestd serves on {want} thread(s) "
                           f"({'--threads' if a.threads else 'one per vCPU, 4 to 8'})",
                           threads == want,
                           f"{cpus} vCPUs, threads {threads}")

            if "1" in only:
                print("== 1. the programs", flush=True)
                programs(k, va, vb, [(va, k), (k, va), (va, vb)], a.conns)

            if "2" in only and a.kcm:
                print("== 2. connect and destroy at once (seed 002)", flush=True)
                connect_destroy(k, va, lab.share)

            if "3" in only:
                print("== 3. 16 processes, 8 killed", flush=True)
                kill_nine(lab, k, va, backend)

            if "5" in only and a.ucflood:
                print("== 5. a misbehaving process", flush=True)
                misbehaving(k, va)

            if "8" in only and a.sigwait:
                print("== 8. signals to a program waiting for an event", flush=True)
                signals(va, k)
                signals(k, va)

            if "12" in only:
                print("== 12. the VM's RDMA device changes under running programs", flush=True)
                device_change(va, k, "10.99.1.11")
                device_change(k, va, "10.99.1.2")

            if "9" in only:
                print("== 9. pvcm-guestd restarted under running programs", flush=True)
                guestd["a"] = guestd_restart(k, va, guestd["a"], backend)

            if "11" in only:
                print("== 11. address resolution", flush=True)
                resolution(lab, k, va)

            if "13" in only and a.usrevent:
                print("== 13. librdmacm 60's commands: WRITE_CM_EVENT, RESOLVE_IB_SERVICE", flush=True)
                written_events(k, va)

            if "0" in only or "4" in only:
                print("== 4. counters", flush=True)
                traffic = bool(only & {"1", "2", "3", "5"})
                if not traffic:
                    print("(sections 1-3 and 5 did not run: only the drop counters are checked)")
                # VM b carries traffic in section 1 only.
                used = (va, vb) if "1" in only else (va,)
                for vm in used if traffic else ():
                    st = guestd_stat(vm)
                    cmds = st.get("commands", {})
                    result(f"VM {vm.name}: pvcm-guestd served the commands",
                           cmds.get("create_id", 0) > 0 and cmds.get("connect", 0) + cmds.get("listen", 0) > 0,
                           ", ".join(f"{c} {n}" for c, n in sorted(cmds.items())))
                st = backend.stat_json()
                (lab.workdir / "backend.stat.json").write_text(json.dumps(st, indent=1))
                mads = {vm.name: wire_mads(st, vm.name) for vm in used}
                if traffic:
                    result("pvcm-backend carried the VMs' MADs (wire frames sent, received)",
                           all(t > 0 and r > 0 for t, r in mads.values()), str(mads))
                result("pvcm-backend: 0 drops", drops(st) == 0,
                       f"{drop_report(st, backend)}; late answers to ended connections "
                       f"{quarantined(st)}")

            if "10" in only:
                print("== 10. multicast: mckey", flush=True)
                multicast(k, va)

            if "14" in only:
                print("== 14. TOS: ucmatose -t", flush=True)
                type_of_service(lab, k, va)

            if "7" in only and a.rawqp1:
                print("== 7. root in VM b goes around pvcm", flush=True)
                hostile_root(lab, k, vb, backend)
    except LabError as e:
        result("lab", False, str(e))
    if "6" in only or "10" in only:
        print("== 6. IPv6 GIDs; IPv4 and IPv6 VMs on one backend" if "6" in only
              else "== 10. multicast in the IPv6 lab", flush=True)
        try:
            ipv6_lab(workdir / "ipv6", a.pcap and str(a.pcap) + ".ipv6", full="6" in only,
                     mcast="10" in only)
        except LabError as e:
            result("IPv6 lab", False, str(e))
    passed, failed = counts()
    print(f"logs: {workdir} ({time.monotonic() - t0:.0f} s)")
    print(f"apps: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
