#!/usr/bin/env python3
"""Checks tshark's decode of an interop capture: every RoCEv2 frame, over IPv4 or IPv6,
decodes as a CM MAD without a malformed-packet mark. Prints the CM messages per sender
and the full decode of the first REQ that pvcm sent (from 10.99.0.1, or fd99::21 over
IPv6) and of the first the kernel sent, per family. With --mtu N (the bridge's MTU),
every REQ must carry the path MTU a RoCE device on that link uses (Linux's
iboe_get_mtu(): N less 96 bytes of headers, rounded down to an IB MTU, at most 4096).
Exit 1 if a frame does not decode or a REQ carries another path MTU."""
import argparse
import collections
import subprocess
import sys

PVCM = ("10.99.0.1", "fd99::21")


def tshark(*args):
    return subprocess.run(["tshark", "-n", *args], capture_output=True, text=True, check=True).stdout


# IBTA path MTU codes (enum ib_mtu).
MTU_CODES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def iboe_mtu_code(netdev_mtu):
    """Linux's iboe_get_mtu(): the largest IB MTU that fits the device MTU less RoCE's
    96 bytes of headers."""
    fits = [c for c, b in MTU_CODES.items() if b <= netdev_mtu - 96]
    return max(fits) if fits else None


def main(pcap, mtu):
    rows = tshark("-r", pcap, "-Y", "udp.dstport == 4791", "-T", "fields", "-E", "separator=\t",
                  "-e", "frame.number", "-e", "ip.src", "-e", "ip.dst", "-e", "ipv6.src",
                  "-e", "ipv6.dst", "-e", "_ws.col.Info", "-e", "_ws.malformed",
                  "-e", "infiniband.cm.req.pppmtu")
    want = iboe_mtu_code(mtu) if mtu else None
    per = collections.defaultdict(collections.Counter)
    req_mtu = collections.defaultdict(collections.Counter)
    bad, first = [], {}
    n = 0
    for line in rows.splitlines():
        f = (line.split("\t") + [""] * 8)[:8]
        n += 1
        num, src4, dst4, src6, dst6, info, malformed, pppmtu = f
        src, dst = src4 or src6, dst4 or dst6
        if malformed or "CM:" not in info:
            bad.append(f"frame {num} {src} -> {dst}: {info} {malformed}")
            continue
        msg = info.split("CM:", 1)[1].strip().split()[0]
        who = "pvcm" if src in PVCM else "kernel"
        per[f"{who} ({src} -> {dst})"][msg] += 1
        if msg == "ConnectRequest":
            first.setdefault(f"{who} over IPv{6 if src6 else 4}", num)
            try:
                code = int(pppmtu, 0)
            except ValueError:
                code = None
            req_mtu[who][MTU_CODES.get(code, f"code {pppmtu!r}")] += 1
            if want is not None and code != want:
                bad.append(f"frame {num} {src} -> {dst}: REQ path MTU {pppmtu!r}, want {want} "
                           f"({MTU_CODES[want]} bytes on a {mtu}-byte link)")
    print(f"{n} RoCEv2 frames, {n - len(bad)} decode as CM MADs")
    for k in sorted(per):
        print(f"  {k}: " + ", ".join(f"{m} {c}" for m, c in sorted(per[k].items())))
    for who in sorted(req_mtu):
        print(f"  REQ path MTU, {who}: " +
              ", ".join(f"{b} bytes x {c}" for b, c in sorted(req_mtu[who].items(), key=str)))
    for who, num in sorted(first.items()):
        print(f"--- first ConnectRequest from {who} (frame {num}), tshark -V:")
        full = tshark("-r", pcap, "-V", "-Y", f"frame.number == {num}")
        keep = False
        for l in full.splitlines():
            if l.startswith("InfiniBand") or l.startswith("User Datagram") or l.startswith("Internet Protocol"):
                keep = True
            if keep:
                print("  " + l)
    for b in bad[:20]:
        print("  BAD:", b)
    return 1 if bad or n == 0 else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mtu", type=int, default=0, help="the link's MTU (0: no path MTU check)")
    ap.add_argument("pcap")
    a = ap.parse_args()
    sys.exit(main(a.pcap, a.mtu))
