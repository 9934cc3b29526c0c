#!/usr/bin/env python3
"""The checks of qemu-scripts/e2e.sh, one subcommand each.

Each reads what a test left in its work directory (WORKDIR): the guests' output
(VM.out, one JSON object per line with --json) and the backends' counters
(HOST.stat.json, from `pvcm-backend stat --json`). A check prints its figures and one
"   check: WHAT" line per finding, and exits 1 when it found anything, 0 otherwise.

    python3 qemu-scripts/e2e/checks.py --help
    python3 qemu-scripts/e2e/checks.py burst /tmp/e2e t5h 1 4000

Helpers for the driver: `live FILE` (a stat JSON's live entries), `nonzero FILE` (its
non-zero figures), `bin-targets PACKAGE` (binary targets in `cargo metadata` on stdin),
`migration FILE` (QEMU's migration figures from qmp.py's reply).
"""

import argparse
import json
import re
import sys


def host(wd, h):
    """The `host` object of backend H's last `stat --json`."""
    with open(f"{wd}/{h}.stat.json") as f:
        return json.load(f)["host"]


def events(wd, vm):
    """The JSON objects VM printed (lines that parse; others are skipped)."""
    out = []
    with open(f"{wd}/{vm}.out", errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out


def drops(s):
    """A host's non-zero drop counters, mux and device together."""
    return {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}


def verdict(bad):
    for x in bad:
        print("   check:", x)
    return 1 if bad else 0


def flag(v):
    return v == "1"


# ------------------------------------------------------------------- the checks


def connect_disconnect(a):
    """Tests 1 and 4: both VMs saw the other's private data, established, disconnected;
    each host passed REQ/REP/RTU/DREQ/DREP once, with 0 retries and 0 drops."""
    wd, bad = a.workdir, []
    ea, eb = events(wd, a.a), events(wd, a.b)

    def has(evs, name, **kw):
        return any(e.get("event") == name and all(str(v) in str(e.get(k, "")) for k, v in kw.items())
                   for e in evs)

    if not has(eb, "connect_request", data="hello-from-A"):
        bad.append(f"{a.b}: no connect_request with A's private data")
    if not has(eb, "established"):
        bad.append(f"{a.b}: not established")
    if not has(eb, "disconnected"):
        bad.append(f"{a.b}: no disconnected")
    if not has(ea, "established", data="hello-from-B"):
        bad.append(f"{a.a}: not established with B's private data")
    if not has(ea, "disconnected"):
        bad.append(f"{a.a}: no disconnected")
    for h in (a.ha, a.hb):
        s = host(wd, h)
        cm = s["cm"]
        for t in ("req", "rep", "rtu", "dreq", "drep"):
            n = cm["cm_tx_msgs"][t] + cm["cm_rx_msgs"][t]
            if n != 1:
                bad.append(f"{h}: {t.upper()} sent+received {n}, want 1")
        r = sum(cm["cm_tx_retries"].values())
        if r:
            bad.append(f"{h}: {r} retries")
        d = sum(s["drops"].values()) + sum(s["device_drops"].values())
        if d:
            bad.append(f"{h}: {d} drops: " + ", ".join(
                f"{k}={v}" for g in ("drops", "device_drops") for k, v in s[g].items() if v))
    return verdict(bad)


def connect_destroy(a):
    """Test 2: A connected and destroyed at once; B saw the REQ and then a REJ(TIMEOUT),
    never an established connection; both hosts passed a REJ."""
    wd, bad = a.workdir, []
    ea, eb = events(wd, a.a), events(wd, a.b)
    if not any(e.get("event") == "connect_destroy" for e in ea):
        bad.append(f"{a.a}: no connect_destroy report")
    if not any(e.get("event") == "connect_request" for e in eb):
        bad.append(f"{a.b}: never saw the REQ")
    rej = [e for e in eb if e.get("event") == "rejected"]
    errs = [e["error"] for e in eb if "error" in e]
    if not rej:
        bad.append(f"{a.b}: its half-open connection was not reported rejected"
                   + (f" (pvcm-guest error: {errs})" if errs else ""))
    elif not any("imeout" in str(e.get("reason", "")) for e in rej):
        bad.append(f"{a.b}: rejected, but not with TIMEOUT: {rej}")
    if any(e.get("event") == "established" for e in eb):
        bad.append(f"{a.b}: established a connection A destroyed")
    sa, sb = host(wd, a.ha)["cm"], host(wd, a.hb)["cm"]
    if sa["cm_tx_msgs"]["rej"] + sa["cm_rx_msgs"]["rej"] < 1:
        bad.append(f"{a.ha}: no REJ passed")
    if sb["cm_tx_msgs"]["rej"] + sb["cm_rx_msgs"]["rej"] < 1:
        bad.append(f"{a.hb}: no REJ routed to B")
    return verdict(bad)


def seed000(a):
    """Test 3: on both hosts 2 x CONNS REQs, 0 retries, 0 drops, 0 live entries."""
    wd, bad = a.workdir, []
    for h in (a.h1, a.h2):
        s = host(wd, h)
        cm = s["cm"]
        r = sum(cm["cm_tx_retries"].values())
        req = cm["cm_tx_msgs"]["req"] + cm["cm_rx_msgs"]["req"]
        dreq = cm["cm_tx_msgs"]["dreq"] + cm["cm_rx_msgs"]["dreq"]
        print(f"   {h}: REQ {req} DREQ {dreq} retries {r} live {s['live']} quarantined {s['quarantined']}")
        d = drops(s)
        if r:
            bad.append(f"{h}: {r} retries")
        if d:
            bad.append(f"{h}: drops {d}")
        if s["live"]:
            bad.append(f"{h}: {s['live']} live (leaked) entries")
        if req != 2 * a.conns:
            bad.append(f"{h}: {req} REQs, want {2 * a.conns}")
    if not flag(a.drained):
        bad.append("live entries did not drain to 0 within 60 s")
    return verdict(bad)


def burst(a):
    """Tests 5 and 6: the host sent CONNS REQs and CONNS DREQs, 0 retries, 0 drops,
    0 live entries."""
    bad, h = [], a.h
    s = host(a.workdir, h)
    cm = s["cm"]
    r = sum(cm["cm_tx_retries"].values())
    d = drops(s)
    print(f"   {h}: REQ {cm['cm_tx_msgs']['req']} DREQ {cm['cm_tx_msgs']['dreq']} retries {r} drops {d} live {s['live']}")
    if r:
        bad.append(f"{h}: {r} retries")
    if d:
        bad.append(f"{h}: drops {d}")
    if s["live"]:
        bad.append(f"{h}: {s['live']} live entries")
    if cm["cm_tx_msgs"]["req"] != a.conns or cm["cm_tx_msgs"]["dreq"] != a.conns:
        bad.append(f"{h}: REQ {cm['cm_tx_msgs']['req']} DREQ {cm['cm_tx_msgs']['dreq']}, want {a.conns} each")
    if not flag(a.drained):
        bad.append("live entries did not drain to 0 within 60 s")
    return verdict(bad)


def late_app(a):
    """Tests 7 and 8: DREQ retries on the host: none when the agent answers the DREQ at
    once, at least one with --linux-drep (LINUX=1); no drops either way."""
    bad, h, linux = [], a.h, flag(a.linux)
    s = host(a.workdir, h)
    cm = s["cm"]
    r = cm["cm_tx_retries"]["dreq"]
    d = drops(s)
    print(f"   {h}: DREQ {cm['cm_tx_msgs']['dreq']} DREQ retries {r} DREP {cm['cm_tx_msgs']['drep']} drops {d}")
    if linux and r < 1:
        bad.append("with --linux-drep the late application should have caused a DREQ retry")
    if not linux and r:
        bad.append(f"{r} DREQ retries with the DREP answered at once")
    if d:
        bad.append(f"drops {d}")
    return verdict(bad)


def restart(a):
    """Test 9: the client's cmtime report shows every connection up and down; both hosts
    0 drops and 0 DREQ retries; the live entries drained."""
    wd, bad, c = a.workdir, [], a.c
    rep = None
    with open(f"{wd}/{c}.out", errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and '"disconnected"' in line:
                rep = json.loads(line)
    if rep is None:
        bad.append(f"{c}: no cmtime report")
    else:
        print(f"   {c}: established {rep['established']} disconnected {rep['disconnected']} failed {rep['failed']}")
        if rep["established"] != a.conns or rep["disconnected"] != a.conns:
            bad.append(f"{c}: {rep['established']} established, {rep['disconnected']} torn down of {a.conns}")
    for name in (a.h, a.hp):
        s = host(wd, name)
        cm = s["cm"]
        d = drops(s)
        r = cm["cm_tx_retries"]["dreq"]
        print(f"   {name}: DREQ {cm['cm_tx_msgs']['dreq']} DREP {cm['cm_rx_msgs']['drep'] + cm['cm_tx_msgs']['drep']} DREQ retries {r} drops {d} live {s['live']}")
        if d:
            bad.append(f"{name}: drops {d}")
        if r:
            bad.append(f"{name}: {r} DREQ retries")
    if not flag(a.drained):
        bad.append("live entries did not drain to 0 within 60 s")
    return verdict(bad)


def migrated_away(a):
    """Test 10, right after the migration: the source backend holds nothing."""
    src, dst = host(a.workdir, a.ha), host(a.workdir, a.hb)
    print(f"   right after: source backend live {src['live']} quarantined {src['quarantined']}; destination live {dst['live']}")
    return 1 if src["live"] or src["quarantined"] else 0


def migrate(a):
    """Test 10, at the end: the migrated VM's cmtime tore every connection down from the
    destination; the destination sent every DREQ and got every DREP, the source sent
    none and holds nothing; 0 drops anywhere."""
    wd, bad, conns = a.workdir, [], a.conns
    src, dst, peer = host(wd, a.ha), host(wd, a.hb), host(wd, a.hp)
    with open(f"{wd}/{a.c2}.out", errors="replace") as f:
        out = f.read()
    if not re.search(rf"connections {conns} established {conns} failed 0 disconnected {conns}", out):
        bad.append(f"the migrated VM's cmtime: {out[-400:]!r}")
    for name, h in (("source", src), ("destination", dst), ("peer", peer)):
        d = drops(h)
        r = sum(h["cm"]["cm_tx_retries"].values())
        print(f"   {name}: REQ {h['cm']['cm_tx_msgs']['req']} DREQ tx {h['cm']['cm_tx_msgs']['dreq']} rx {h['cm']['cm_rx_msgs']['dreq']} DREP rx {h['cm']['cm_rx_msgs']['drep']} retries {r} drops {d} live {h['live']}")
        if d:
            bad.append(f"{name}: drops {d}")
    if src["live"] or src["quarantined"]:
        bad.append("the source still holds entries")
    if dst["cm"]["cm_tx_msgs"]["dreq"] != conns:
        bad.append(f"destination sent {dst['cm']['cm_tx_msgs']['dreq']} DREQs, want {conns}")
    if dst["cm"]["cm_rx_msgs"]["drep"] < conns:
        bad.append(f"destination got {dst['cm']['cm_rx_msgs']['drep']} DREPs, want {conns}")
    if src["cm"]["cm_tx_msgs"]["dreq"]:
        bad.append("the source sent DREQs on the VM's behalf")
    if not flag(a.drained):
        bad.append("live entries did not drain within 60 s")
    return verdict(bad)


# ------------------------------------------------------------------- helpers


def live(a):
    with open(a.file) as f:
        print(json.load(f)["host"]["live"])
    return 0


def nonzero(a):
    def walk(v, path):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, path + [k])
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, path + [str(i)])
        elif v not in (0, False, None, ""):
            print(".".join(path), "=", v)

    with open(a.file) as f:
        walk(json.load(f), [])
    return 0


def bin_targets(a):
    for p in json.load(sys.stdin)["packages"]:
        if p["name"] == a.package:
            print(" ".join(t["name"] for t in p["targets"] if "bin" in t["kind"]))
    return 0


def migration(a):
    with open(a.file) as f:
        m = json.load(f)
    print("   migration completed: total %s ms, downtime %s ms, setup %s ms"
          % (m.get("total-time"), m.get("downtime"), m.get("setup-time")))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Each subcommand has --help.")
    sub = p.add_subparsers(dest="cmd", required=True)

    arg_help = {
        "conns": "connections the test made",
        "drained": "1 if the backends' live entries drained to 0, else 0",
        "linux": "1 if the listener ran with --linux-drep, else 0",
    }

    def cmd(name, fn, *args):
        doc = " ".join(fn.__doc__.split())
        s = sub.add_parser(name, help=doc.split(": ")[0], description=doc)
        s.add_argument("workdir", help="the test's work directory")
        for arg in args:
            if arg == "conns":
                s.add_argument(arg, type=int, help=arg_help[arg])
            elif arg in ("drained", "linux"):
                s.add_argument(arg, choices=("0", "1"), help=arg_help[arg])
            elif arg.startswith("h"):
                s.add_argument(arg, help="a backend's name (its NAME.stat.json)")
            else:
                s.add_argument(arg, help="a VM's name (its NAME.out)")
        s.set_defaults(fn=fn)

    cmd("connect-disconnect", connect_disconnect, "a", "b", "ha", "hb")
    cmd("connect-destroy", connect_destroy, "a", "b", "ha", "hb")
    cmd("seed000", seed000, "h1", "h2", "drained", "conns")
    cmd("burst", burst, "h", "drained", "conns")
    cmd("late-app", late_app, "h", "linux")
    cmd("restart", restart, "h", "hp", "c", "drained", "conns")
    cmd("migrated-away", migrated_away, "ha", "hb")
    cmd("migrate", migrate, "ha", "hb", "hp", "c2", "drained", "conns")
    for name, fn, arg, text in (
        ("live", live, "file", "print a stat JSON file's live entries"),
        ("nonzero", nonzero, "file", "print a stat JSON file's non-zero figures"),
        ("bin-targets", bin_targets, "package", "binary targets of PACKAGE in `cargo metadata` on stdin"),
        ("migration", migration, "file", "QEMU's migration figures from qmp.py's reply"),
    ):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument(arg)
        s.set_defaults(fn=fn)
    a = p.parse_args()
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
