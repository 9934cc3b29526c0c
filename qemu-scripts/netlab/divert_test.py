"""A test of qemu-scripts/qp1-divert.sh in a network namespace of its own: a veth pair
stands in for a VM's tap (frames sent on "tapx" leave it towards the VM end "far"),
and packet sockets on far and on the divert device show where each frame lands.

    python3 -m netlab.divert_test      # as root; prints PASS/FAIL lines

Returns the list of (name, ok, detail) from run(); exits non-zero on a failure when
run as a program.
"""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .lab import SCRIPTS

TAP, FAR, DEV = "tapx", "far", "pvcm-qp1"
VM_MAC, PEER_MAC = bytes.fromhex("525400990011"), bytes.fromhex("525400990002")


def roce4(qp, ihl=5):
    """An Ethernet frame: IPv4 (ihl words of header) / UDP 4791 / BTH to qp / 48 bytes."""
    bth = bytes([0x64, 0, 0xFF, 0xFF, 0]) + qp.to_bytes(3, "big") + b"\0\0\0\1"
    payload = bth + b"\0" * 8 + b"x" * 40
    udp = struct.pack("!HHHH", 49152, 4791, 8 + len(payload), 0)
    opts = b"\x01" * (4 * (ihl - 5))
    ip = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 4 * ihl + len(udp) + len(payload), 0,
                     0x4000, 64, 17, 0, bytes([10, 99, 0, 2]), bytes([10, 99, 0, 11]))
    return VM_MAC + PEER_MAC + b"\x08\x00" + ip + opts + udp + payload


def roce6(qp):
    """An Ethernet frame: IPv6 / UDP 4791 / BTH to qp."""
    bth = bytes([0x64, 0, 0xFF, 0xFF, 0]) + qp.to_bytes(3, "big") + b"\0\0\0\1"
    payload = bth + b"\0" * 8 + b"x" * 40
    udp = struct.pack("!HHHH", 49152, 4791, 8 + len(payload), 0)
    src = bytes.fromhex("fd990000000000000000000000000002")
    dst = bytes.fromhex("fd990000000000000000000000000011")
    ip6 = struct.pack("!IHBB", 6 << 28, len(udp) + len(payload), 17, 64) + src + dst
    return VM_MAC + PEER_MAC + b"\x86\xdd" + ip6 + udp + payload


def arp():
    """A broadcast ARP request for 10.99.0.11."""
    body = struct.pack("!HHBBH", 1, 0x0800, 6, 4, 1) + PEER_MAC + bytes([10, 99, 0, 2]) \
        + b"\0" * 6 + bytes([10, 99, 0, 11])
    return b"\xff" * 6 + PEER_MAC + b"\x08\x06" + body


def _inside():
    """Runs in the namespace: send each frame on tapx, see where it lands."""
    rx = {}
    for d in (FAR, DEV):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        s.bind((d, 0))
        s.settimeout(0.3)
        rx[d] = s
    tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    tx.bind((TAP, 0))

    def send(frame):
        for s in rx.values():  # drain
            s.setblocking(False)
            try:
                while True:
                    s.recv(4096)
            except BlockingIOError:
                pass
            s.settimeout(0.3)
        tx.send(frame)
        seen = {}
        for d, s in rx.items():
            seen[d] = []
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                try:
                    data, addr = s.recvfrom(4096)
                except socket.timeout:
                    break
                if data == frame[:len(data)] and addr[2] != socket.PACKET_OUTGOING:
                    seen[d].append(addr[2])
        return seen

    def check(name, frame, want):
        seen = send(frame)
        where = {d for d, v in seen.items() if v}
        ok = where == want
        kinds = {d: v for d, v in seen.items() if v}
        print(f"{'PASS' if ok else 'FAIL'}  {name}: landed on {sorted(where) or 'nothing'}"
              f" (packet types {kinds}), want {sorted(want)}", flush=True)
        return ok

    if sys.argv[-1] == "--after-del":
        sys.exit(0 if check("after del: IPv4 RoCEv2 to QP1 -> the VM", roce4(1), {FAR}) else 1)
    results = [
        check("IPv4 RoCEv2 to QP1 -> divert device only", roce4(1), {DEV}),
        check("IPv4 RoCEv2 to QP 0x11 -> the VM", roce4(0x11), {FAR}),
        check("ARP -> the VM", arp(), {FAR}),
        check("IPv6 RoCEv2 to QP1 -> divert device only", roce6(1), {DEV}),
        check("IPv6 RoCEv2 to QP 0x11 -> the VM", roce6(0x11), {FAR}),
        check("IPv4 with options to QP1 (not matched) -> the VM", roce4(1, ihl=6), {FAR}),
    ]
    sys.exit(0 if all(results) else 1)


def ifup_ifdown(nsx, div):
    """QEMU's script=/downscript= route: ifup TAP installs the divert that TAP's
    configuration file names (the filters and the table), ifdown removes it."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / f"{TAP}.conf").write_text(
            f"# the VM on {TAP}\ndev={DEV}\nmac=52:54:00:99:00:11\n"
            'addresses="10.99.0.11 fe80::/64"\n')
        env = dict(os.environ, PVCM_DIVERT_CONF_DIR=d)
        def on():
            t = nsx("nft", "list", "table", "netdev", f"pvcm-{TAP}", capture_output=True)
            f = nsx("tc", "filter", "show", "dev", TAP, "egress", capture_output=True, text=True)
            return t.returncode == 0 and "mirred" in f.stdout
        up = nsx(*div, "ifup", TAP, env=env).returncode == 0 and on()
        down = nsx(*div, "ifdown", TAP, env=env).returncode == 0 and not on()
        (Path(d) / "bad.conf").write_text("dev=x\nwhat=1\n")
        bad = nsx(*div, "ifup", "bad", env=env, capture_output=True, text=True)
    ok = [up, down, bad.returncode == 1 and "unknown key" in bad.stderr]
    for name, good in zip(("ifup TAP (QEMU's script=): the divert TAP.conf names is on",
                           "ifdown TAP (QEMU's downscript=): the divert is gone",
                           "ifup with a configuration file it cannot read: refused, no change"), ok):
        print(("PASS  " if good else "FAIL  ") + name, flush=True)
    return all(ok)


def run():
    """Build the namespace, run the checks, tear down; True when all passed."""
    ns = f"pvcmdiv{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        def nsx(*cmd, **kw):
            return subprocess.run(["ip", "netns", "exec", ns, *cmd], **kw)
        nsx("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1", check=True)
        nsx("ip", "link", "add", TAP, "type", "veth", "peer", "name", FAR, check=True)
        for d in ("lo", TAP, FAR):
            nsx("ip", "link", "set", d, "up", check=True)
        div = ["bash", str(SCRIPTS / "qp1-divert.sh")]
        nsx(*div, "add", TAP, DEV, "52:54:00:99:00:11", "10.99.0.11", "fd99::11", check=True)
        here = str(SCRIPTS)
        env = dict(os.environ, PYTHONPATH=here)
        ok = nsx(sys.executable, "-m", "netlab.divert_test", "--inside", env=env).returncode == 0
        nsx(*div, "show", TAP, stdout=subprocess.DEVNULL)
        nsx(*div, "del", TAP, DEV, check=True)
        ok = nsx(sys.executable, "-m", "netlab.divert_test", "--inside", "--after-del",
                 env=env).returncode == 0 and ok
        return ifup_ifdown(nsx, div) and ok
    finally:
        subprocess.run(["ip", "netns", "del", ns])


if __name__ == "__main__":
    if "--inside" in sys.argv:
        _inside()
    sys.exit(0 if run() else 1)
