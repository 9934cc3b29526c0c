"""The network lab's smoke test (qemu-scripts/netlab-smoke.sh runs it).

0. qp1-divert.sh in a namespace of its own (divert_test).
1. Two kernel-CM guests: rping -v at a few sizes and ucmatose with data: the RDMA
   image's userland works.
2. A pvcm VM with its own RDMA NIC (10.99.0.11) whose pvcm device is attached to a
   pvcm-backend on a spare host address (10.99.0.250): rxe0's RoCE v2 GID is
   ::ffff:10.99.0.11; ib_cm, rdma_cm and rdma_ucm are absent and modprobe rdma_ucm
   fails; /dev/cuse exists; pvcm-guest info works; ibv_rc_pingpong (verbs over a real
   RC QP, out-of-band exchange over TCP, no CM) passes between it and a kernel guest
   in both roles with the QP1 divert on its tap; a CM REQ to its address lands on
   pvcm-qp1 and the VM never answers it.

Prints PASS/FAIL lines and "netlab-smoke: N passed, N failed"; exit 0 when all passed.
"""

import argparse
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import divert_test
from .addr import sysfs_gid, vm_gid
from .lab import DIVERT_DEV, Lab, LabError
from .results import counts, result

K1, K2, VM, SPARE = "10.99.0.2", "10.99.0.3", "10.99.0.11", "10.99.0.250"


def retry_connect(guest, cmd, timeout=60):
    """Run a client command until it stops failing fast (its server may not listen
    yet); the last (rc, output)."""
    deadline = time.monotonic() + timeout
    while True:
        rc, out = guest.run(cmd, timeout)
        if rc == 0 or time.monotonic() > deadline:
            return rc, out
        time.sleep(1)


def kernel_pair(lab, k1, k2):
    """rping at a few sizes and ucmatose with data between two kernel guests."""
    for size in (64, 1024, 4000):
        srv = k1.spawn(f"rping -s -a {K1} -v -C 5 -S {size}")
        rc, out = retry_connect(k2, f"timeout 60 rping -c -a {K1} -v -C 5 -S {size}")
        srv_rc = srv.wait(60)
        pings = len(re.findall(r"^ping data:", out, re.M))
        spings = len(re.findall(r"server ping data:", srv.text()))
        result(f"kernel <-> kernel rping -S {size}", rc == 0 and srv_rc == 0 and pings == 5 and spings == 5,
               f"client rc {rc} {pings} pings, server rc {srv_rc} {spings} pings")
    srv = k1.spawn("ucmatose -c 2 -C 4 -S 1024")
    rc, out = retry_connect(k2, f"timeout 60 ucmatose -s {K1} -c 2 -C 4 -S 1024")
    srv_rc = srv.wait(60)
    ok = rc == 0 and srv_rc == 0 and "data transfers complete" in out \
        and "data transfers complete" in srv.text()
    result("kernel <-> kernel ucmatose, 2 connections x 4 messages of 1024 bytes", ok,
           f"client rc {rc}, server rc {srv_rc}" + ("" if ok else f": {out[-300:]}"))


class Sniffer(threading.Thread):
    """Counts RoCEv2 frames to QP1 on an interface of the lab's namespace, by packet
    socket: {(src, dst): count} of IPv4 UDP 4791 frames with BTH destination QP 1."""

    def __init__(self, lab, ifname):
        super().__init__(daemon=True)
        self.lab, self.ifname = lab, ifname
        self.counts = {}
        self.stop = threading.Event()
        self.ready = threading.Event()

    def run(self):
        # The socket is opened inside the namespace (setns on this thread).
        import ctypes
        import os
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.lab.ns}", os.O_RDONLY)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            os.close(fd)
            self.ready.set()
            return
        os.close(fd)
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        s.bind((self.ifname, 0))
        s.settimeout(0.2)
        self.ready.set()
        while not self.stop.is_set():
            try:
                data, addr = s.recvfrom(4096)
            except socket.timeout:
                continue
            if len(data) < 14 + 20 + 8 + 12 or data[12:14] != b"\x08\x00":
                continue
            ihl = (data[14] & 15) * 4
            if data[14 + 9] != 17:
                continue
            udp = 14 + ihl
            dport = struct.unpack("!H", data[udp + 2:udp + 4])[0]
            qp = int.from_bytes(data[udp + 8 + 5:udp + 8 + 8], "big")
            if dport != 4791 or qp != 1:
                continue
            key = (socket.inet_ntoa(data[26:30]), socket.inet_ntoa(data[30:34]), addr[2])
            self.counts[key] = self.counts.get(key, 0) + 1
        s.close()


def pvcm_vm_checks(lab, k1):
    """The pvcm VM: its GID, no kernel CM, cuse, the device, verbs both ways, QP1."""
    lab.add_address(f"{SPARE}/24")
    sock = lab.workdir / "p.sock"
    backend = lab.backend("--vm", f"socket={sock},gid={vm_gid(SPARE)},name=p")
    p = lab.pvcm_vm("p", VM, socket=str(sock))

    idx = None
    try:
        idx = p.gid_index()
        result("pvcm VM: rxe0 has the RoCE v2 GID ::ffff:10.99.0.11", True,
               f"index {idx}, {sysfs_gid(VM)}")
    except LabError as e:
        result("pvcm VM: rxe0 has the RoCE v2 GID ::ffff:10.99.0.11", False, str(e))

    rc, out = p.run("for m in ib_cm rdma_cm rdma_ucm; do [ -d /sys/module/$m ] && echo loaded $m; done; "
                    "modprobe rdma_ucm; echo modprobe=$?; "
                    "for m in ib_cm rdma_cm rdma_ucm; do [ -d /sys/module/$m ] && echo loaded $m; done; "
                    "[ -c /dev/cuse ] && echo cuse=yes; lsmod | grep -c '^cuse '")
    ok = "loaded" not in out and re.search(r"modprobe=[1-9]", out) and "cuse=yes" in out
    result("pvcm VM: ib_cm, rdma_cm, rdma_ucm absent, modprobe rdma_ucm fails, /dev/cuse exists",
           bool(ok), " ".join(out.split()))
    console = p.console.read_text(errors="replace")
    result("pvcm VM: the init's marker says the kernel CM is absent",
           "pvcm-init: kernel CM absent" in console)

    rc, out = p.run("pvcm-guest info", 60)
    result("pvcm VM: pvcm-guest info", rc == 0, " ".join(out.split())[:300])

    # Verbs over a real RC QP, both roles; rxe's GID index of the IPv4 address.
    kidx = k1.gid_index()
    for server, client, sidx, cidx, name in ((p, k1, idx, kidx, "pvcm VM serves, kernel guest connects"),
                                              (k1, p, kidx, idx, "kernel guest serves, pvcm VM connects")):
        if sidx is None:
            result(f"ibv_rc_pingpong: {name}", False, "no GID index")
            continue
        srv = server.spawn(f"ibv_rc_pingpong -d rxe0 -g {sidx} -n 200 -s 4096")
        rc, out = retry_connect(client, f"timeout 60 ibv_rc_pingpong -d rxe0 -g {cidx} -n 200 -s 4096 {server.ip}")
        srv_rc = srv.wait(60)
        ok = rc == 0 and srv_rc == 0 and "200 iters" in out and "200 iters" in srv.text()
        result(f"ibv_rc_pingpong (200 x 4096 bytes, RC): {name}", ok,
               " ".join((out.strip().splitlines() or ["-"])[-1:]) if ok else f"client rc {rc} {out[-300:]} server rc {srv_rc} {srv.text()[-300:]}")

    # A CM REQ to the VM's address: diverted to pvcm-qp1, never answered by the VM.
    div = Sniffer(lab, DIVERT_DEV)
    tap = Sniffer(lab, p.tap)
    for s in (div, tap):
        s.start()
        s.ready.wait(5)
    retries_cmd = "cat /sys/class/infiniband/rxe0/ports/1/cm_tx_retries/* | awk '{ n += $1 } END { print n + 0 }'"
    before = k1.check(retries_cmd)
    rc, out = k1.run(f"timeout 12 ucmatose -s {VM} -C 1 -c 1", 60)
    after = k1.check(retries_cmd)
    time.sleep(1)
    for s in (div, tap):
        s.stop.set()
        s.join(5)
    reqs = sum(n for (src, dst, _), n in div.counts.items() if src == K1 and dst == VM)
    answers = sum(n for (src, dst, _), n in tap.counts.items() if src == VM)
    leaked = sum(n for (src, dst, kind), n in tap.counts.items() if dst == VM)
    retries = int(after.strip() or 0) - int(before.strip() or 0)
    result("CM REQ to the pvcm VM lands on pvcm-qp1", reqs >= 1,
           f"{reqs} QP1 frame(s) {K1} -> {VM} on {DIVERT_DEV}")
    result("the pvcm VM never sees or answers it", leaked == 0 and answers == 0 and rc != 0,
           f"QP1 frames to the VM on its tap {leaked}, from the VM {answers}; ucmatose rc {rc}, "
           f"kernel REQ retries +{retries}")
    st = backend.stat_json()
    result("pvcm-backend answers stat", "host" in st)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="keep logs here (default: a new dir under /tmp)")
    ap.add_argument("--pcap", help="capture br0 into this file")
    a = ap.parse_args()
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="pvcm-netlab-smoke."))
    t0 = time.monotonic()
    print("== 0. qp1-divert.sh in a namespace (veth pair for the tap)", flush=True)
    result("qp1-divert.sh: QP1 frames on the divert device, everything else to the VM",
           divert_test.run())
    try:
        with Lab(workdir, pcap=a.pcap) as lab:
            print("== 1. two kernel-CM guests", flush=True)
            k1 = lab.kernel_guest("k1", K1)
            k2 = lab.kernel_guest("k2", K2)
            kernel_pair(lab, k1, k2)
            lab.guests["k2"].proc.terminate()  # two busy TCG guests at most
            print("== 2. a pvcm VM with its own RDMA NIC", flush=True)
            pvcm_vm_checks(lab, k1)
    except LabError as e:
        result("lab", False, str(e))
    passed, failed = counts()
    print(f"logs: {workdir} ({time.monotonic() - t0:.0f} s)")
    print(f"netlab-smoke: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
