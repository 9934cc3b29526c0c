"""python3 -m netlab run: boot lab guests, run a host command in the lab's namespace
while they run, tear everything down. (python3 -m netlab addr ...: the lab's
addresses' GIDs, see addr.py.)

    python3 -m netlab run --workdir DIR [--pcap FILE] [--timeout SECS] [--ipv6] [--mtu N]
        --guest NAME=IP[,IP6][:CM] ... -- COMMAND [ARG...]

Each --guest boots a guest of the RDMA image (rxe on its NIC, agent NAME, the share
workdir/share at /host; IP6, when given, is its IPv6 address on eth0 (a /64 unless it
names a prefix length) and turns --ipv6 on; CM is kernel, the default, or pvcm); all
boot at once and
COMMAND starts when every agent is ready. COMMAND runs in the namespace (br0 has
10.99.0.1/24) in a session of its own, with NETLAB_NS, NETLAB_WORKDIR and NETLAB_SHARE
set; its output goes to workdir/host.out (--host-log moves it). Exit status: COMMAND's;
124 when --timeout passed (COMMAND's process group is killed); 125 when a guest did not
boot.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

from . import addr
from .addr import ipv4, ipv6_interface
from .lab import Lab, LabError


def guest_spec(spec):
    """NAME=IP[,IP6][:kernel|pvcm] -> (name, ip, ip6 or None, cm). The CM is the part
    after the last colon when that part is a CM's name (IPv6 addresses have colons of
    their own). ValueError saying what is wrong."""
    name, eq, rest = spec.partition("=")
    head, _, tail = rest.rpartition(":")
    cm = "kernel"
    if tail in ("kernel", "pvcm"):
        rest, cm = head, tail
    ip, _, ip6 = rest.partition(",")
    if not eq or not name or not ip:
        raise ValueError("want NAME=IP[,IP6][:kernel|pvcm]")
    ipv4(ip)
    if ip6:
        ipv6_interface(ip6)
    return name, ip, ip6 or None, cm


def run(argv):
    ap = argparse.ArgumentParser(prog="python3 -m netlab run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--pcap")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--ipv6", action="store_true")
    ap.add_argument("--mtu", type=int, default=1500)
    ap.add_argument("--guest", action="append", default=[], metavar="NAME=IP[,IP6][:CM]")
    ap.add_argument("--host-log")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no COMMAND (after --)")
    specs = []
    for g in a.guest:
        try:
            specs.append(guest_spec(g))
        except ValueError as e:
            ap.error(f"--guest {g}: {e}")
    ipv6 = a.ipv6 or any(ip6 for _, _, ip6, _ in specs)
    with Lab(a.workdir, ipv6=ipv6, mtu=a.mtu, pcap=a.pcap) as lab:
        t0 = time.monotonic()
        try:
            guests = [lab.guest(n, ip, ip6, cm=cm, wait=False) for n, ip, ip6, cm in specs]
            for g in guests:
                g.wait_ready()
        except LabError as e:
            print(f"netlab: {e}", file=sys.stderr)
            return 125
        print(f"netlab: {len(guests)} guest(s) ready in {time.monotonic() - t0:.1f} s "
              f"(namespace {lab.ns})", file=sys.stderr)
        env = dict(os.environ, NETLAB_NS=lab.ns, NETLAB_WORKDIR=str(lab.workdir),
                   NETLAB_SHARE=str(lab.share))
        log = a.host_log or str(lab.workdir / "host.out")
        p = lab.host_start(cmd, log, env)
        try:
            return p.wait(a.timeout)
        except subprocess.TimeoutExpired:
            print(f"netlab: {' '.join(cmd)} still running after {a.timeout:.0f} s; killed",
                  file=sys.stderr)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            return 124


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    if sys.argv[1] == "addr":
        return addr.main(sys.argv[2:])
    if sys.argv[1] != "run":
        print(f"netlab: unknown action {sys.argv[1]!r} (run, addr)", file=sys.stderr)
        return 2
    return run(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
