"""Parsers of what the suites' tools leave in a work directory: rdma-core's and pvcm's
cmtime, the kernel CM's infiniband_cm counters, `pvcm-backend stat --json`, JSON event
lines, a guest session's "@@ NAME" sections, and dumpcap's pcap files.

Each parser takes text (or bytes) and returns what it found, or None / an empty result
when the text does not hold it; WorkDir reads the files (a missing file reads as "").
"""

import json
import os
import re
import struct
from typing import NamedTuple

from .addr import ip_udp

ROCEV2_PORT = 4791
# pvcm-guest cmtime (client) and pvcm-lab attach cmtime: the run's summary line.
_CLIENT = re.compile(r"connections (\d+) established (\d+) failed (\d+) disconnected (\d+)")
# pvcm-guest cmtime --server: the server's summary line.
_SERVER = re.compile(r"accepted (\d+) established (\d+) disconnected (\d+) failed (\d+)")


class Summary(NamedTuple):
    """A cmtime summary line: its numbers in the order printed, and the line's text."""
    counts: tuple
    text: str


def _summary(pattern, text):
    m = pattern.search(text)
    return Summary(tuple(map(int, m.groups())), m.group(0)) if m else None


def client_summary(text):
    """pvcm's cmtime client summary, counts (connections, established, failed,
    disconnected); None when TEXT has none."""
    return _summary(_CLIENT, text)


def client_summaries(text):
    """The counts of every pvcm cmtime client summary in TEXT (one per round), in order."""
    return [tuple(map(int, m.groups())) for m in _CLIENT.finditer(text)]


def server_summary(text):
    """pvcm's cmtime --server summary, counts (accepted, established, disconnected,
    failed); None when TEXT has none."""
    return _summary(_SERVER, text)


def step_totals(text, step):
    """The total (ms, as printed) of STEP in every cmtime table of TEXT, in order:
    rdma-core's cmtime prints "connect    :  1234.56 ...", pvcm's "establish  12.3 ..."
    (a step's name at the start of a line, then a colon or blanks, then its total)."""
    return re.findall(rf"^{step}(?:\s*:\s*|\s+)([\d.]+)", text, re.M)


def step_total(text, step):
    """The first of step_totals() as text, or None."""
    t = step_totals(text, step)
    return t[0] if t else None


def step_ms(text, step):
    """The first of step_totals() as a float, or None."""
    t = step_total(text, step)
    return float(t) if t is not None else None


def has_step_line(text, step):
    """Did rdma-core's cmtime print its line for STEP ("connect :", "disconnect :")?"""
    return re.search(rf"^{step}\s*:", text, re.M) is not None


def step_lines(text, steps):
    """The lines of TEXT that start (after blanks) with one of STEPS, stripped: a cmtime
    table's rows, for the figures."""
    pat = re.compile(rf"\s*({'|'.join(steps)})")
    return [line.strip() for line in text.splitlines() if pat.match(line)]


def kernel_counters(text):
    """The kernel CM's counters as kcounters (interop/common.sh) prints them, a
    "group/message value" line each: {"group/message": value}. Other lines are skipped."""
    c = {}
    for line in text.splitlines():
        p = line.split()
        if len(p) == 2 and p[1].isdigit():
            c[p[0]] = int(p[1])
    return c


def counter_deltas(before, after, prefix):
    """{message: after - before} of the counters of group PREFIX (e.g. "cm_rx_msgs/")."""
    return {k[len(prefix):]: v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix)}


def kernel_retries(before, after):
    """["k +d", ...]: the kernel counters of CM retries and duplicates that grew."""
    out = []
    for k, v in after.items():
        d = v - before.get(k, 0)
        if d and (k.startswith("cm_tx_retries/") or k.startswith("cm_rx_duplicates/")):
            out.append(f"{k} +{d}")
    return out


def json_lines(text):
    """The JSON objects of TEXT, one a line (lines that do not start with "{" or do not
    parse are skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def sections(text):
    """A guest session's output split at its markers, "@@ NAME" then the command's
    output then "@@ rc N": ({NAME: output}, {NAME: "N"}), and the exit statuses in
    order."""
    parts = dict(re.findall(r"@@ (\w+)\n(.*?)@@ rc", text, re.S))
    rcs = dict(re.findall(r"@@ (\w+)\n.*?@@ rc (\d+)", text, re.S))
    return parts, rcs, re.findall(r"@@ rc (\d+)", text)


def exit_codes(text, key="rc"):
    """The "rc=N" (or KEY=N) statuses a command list echoed, in order."""
    return re.findall(rf"{key}=(\d+)", text)


def stat_drops(host, exclude=()):
    """The non-zero drop counters (drops and device_drops) of a `stat --json` "host"
    object, without the names in EXCLUDE."""
    return {k: v for g in ("drops", "device_drops") for k, v in host.get(g, {}).items()
            if v and k not in exclude}


def deltas(before, after):
    """{k: after[k] - before[k]} for the figures of AFTER that changed."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def vm_io(stat, name):
    """The io figures of VM NAME in a `stat --json` document ({} when it is not listed)."""
    return next((v["figures"]["io"] for v in stat.get("vms", []) if v.get("name") == name), {})


def pcap_records(data):
    """A pcap capture (classic format, either byte order, micro- or nanosecond
    timestamps): (link type, [(time, frame bytes)]); None when DATA is not one."""
    if len(data) < 24:
        return None
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        end = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        end = ">"
    else:
        return None
    scale = 1e9 if magic in (b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d") else 1e6
    link = struct.unpack(end + "I", data[20:24])[0]
    out, off = [], 24
    while off + 16 <= len(data):
        sec, frac, incl = struct.unpack(end + "III", data[off:off + 12])
        out.append((sec + frac / scale, data[off + 16:off + 16 + incl]))
        off += 16 + incl
    return link, out


def pcap_frames(data):
    """The frames of a pcap capture, as bytes; None when DATA is not one."""
    rec = pcap_records(data)
    return None if rec is None else [f for _, f in rec[1]]


def ip_tclass(frame):
    """An Ethernet frame's IPv4 TOS byte or IPv6 traffic class (no VLAN tag)."""
    if len(frame) < 16:
        return None
    if frame[12:14] == b"\x08\x00":
        return frame[15]
    if frame[12:14] == b"\x86\xdd":
        return ((frame[14] & 0x0F) << 4) | (frame[15] >> 4)
    return None


def rocev2_packets(data):
    """The RoCEv2 frames of an Ethernet pcap capture: (time, src, dst, traffic class,
    destination QP) each, src and dst as text; None when DATA is not a pcap capture."""
    rec = pcap_records(data)
    if rec is None:
        return None
    out = []
    for t, f in rec[1]:
        ip = ip_udp(f)
        if ip is None:
            continue
        _, src, dst, udp = ip
        if len(f) < udp + 20 or struct.unpack(">H", f[udp + 2:udp + 4])[0] != ROCEV2_PORT:
            continue
        dqp = struct.unpack(">I", f[udp + 12:udp + 16])[0] & 0xFFFFFF
        out.append((t, str(src), str(dst), ip_tclass(f), dqp))
    return out


def rocev2_frames(data):
    """The RoCEv2 frames (UDP port 4791, IPv4 or IPv6) of a pcap capture: (family, src,
    dst, MAD class) each, the class (a CM MAD's is 7) when the frame is a UD SEND to QP1,
    else None; src and dst as text. None when DATA is not a pcap capture."""
    frames = pcap_frames(data)
    if frames is None:
        return None
    out = []
    for f in frames:
        ip = ip_udp(f)
        if ip is None:
            continue
        fam, src, dst, udp = ip
        if len(f) < udp + 8 or struct.unpack(">H", f[udp + 2:udp + 4])[0] != ROCEV2_PORT:
            continue
        bth = udp + 8
        # BTH (12 bytes): UD SEND only (0x64) to QP1; then DETH (8), then the MAD.
        mad = bth + 20
        qp1 = len(f) > mad + 1 and f[bth] == 0x64 and f[bth + 5:bth + 8] == b"\x00\x00\x01"
        out.append((fam, str(src), str(dst), f[mad + 1] if qp1 else None))
    return out


class WorkDir:
    """A suite's work directory: the files its steps left there."""

    def __init__(self, path):
        self.path = path

    def file(self, name):
        return os.path.join(self.path, name)

    def read(self, name):
        """The text of NAME ("" when it cannot be read)."""
        try:
            with open(self.file(name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def read_bytes(self, name):
        """The bytes of NAME (None when it cannot be read)."""
        try:
            with open(self.file(name), "rb") as f:
                return f.read()
        except OSError:
            return None

    def rc(self, name):
        """The exit status a step wrote to NAME, stripped ("" when none)."""
        return self.read(name).strip()

    def json(self, name):
        """NAME as a JSON document; None when it is missing or does not parse."""
        try:
            with open(self.file(name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def json_lines(self, name):
        return json_lines(self.read(name))

    def counters(self, name):
        """The kernel CM counters in NAME (kcounters' output)."""
        return kernel_counters(self.read(name))

    def host_stat(self, name):
        """The "host" object of a `pvcm-backend stat --json` file; None when missing."""
        s = self.json(name)
        return s.get("host") if isinstance(s, dict) else None
