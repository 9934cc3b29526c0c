#!/usr/bin/env python3
"""Checks tshark's decode of an interop capture: every RoCEv2 frame, over IPv4 or IPv6,
decodes as a CM MAD without a malformed-packet mark. Prints the CM messages per sender
and the full decode of the first REQ that pvcm sent (from 10.99.0.1, or fd99::21 over
IPv6) and of the first the kernel sent, per family. Exit 1 if a frame does not
decode."""
import collections
import subprocess
import sys

PVCM = ("10.99.0.1", "fd99::21")


def tshark(*args):
    return subprocess.run(["tshark", "-n", *args], capture_output=True, text=True, check=True).stdout


def main(pcap):
    rows = tshark("-r", pcap, "-Y", "udp.dstport == 4791", "-T", "fields", "-E", "separator=\t",
                  "-e", "frame.number", "-e", "ip.src", "-e", "ip.dst", "-e", "ipv6.src",
                  "-e", "ipv6.dst", "-e", "_ws.col.Info", "-e", "_ws.malformed")
    per = collections.defaultdict(collections.Counter)
    bad, first = [], {}
    n = 0
    for line in rows.splitlines():
        f = (line.split("\t") + [""] * 7)[:7]
        n += 1
        num, src4, dst4, src6, dst6, info, malformed = f
        src, dst = src4 or src6, dst4 or dst6
        if malformed or "CM:" not in info:
            bad.append(f"frame {num} {src} -> {dst}: {info} {malformed}")
            continue
        msg = info.split("CM:", 1)[1].strip().split()[0]
        who = "pvcm" if src in PVCM else "kernel"
        per[f"{who} ({src} -> {dst})"][msg] += 1
        if msg == "ConnectRequest":
            first.setdefault(f"{who} over IPv{6 if src6 else 4}", num)
    print(f"{n} RoCEv2 frames, {n - len(bad)} decode as CM MADs")
    for k in sorted(per):
        print(f"  {k}: " + ", ".join(f"{m} {c}" for m, c in sorted(per[k].items())))
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
        print("  NOT DECODED:", b)
    return 1 if bad or n == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
