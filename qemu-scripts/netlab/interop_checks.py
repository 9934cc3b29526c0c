"""The checks of qemu-scripts/interop.sh (interop/host.sh) and its benchmark
(interop/bench.sh): each reads what the run left in its work directory and prints
result lines (PASS or FAIL) or figures.

    python3 -m netlab.interop_checks active WORKDIR CONNS           tests 2, 3, 4
    python3 -m netlab.interop_checks passive WORKDIR CONNS          tests 5, 6, 7
    python3 -m netlab.interop_checks counters WORKDIR FIGURES       test 8; writes FIGURES
    python3 -m netlab.interop_checks ipv6 WORKDIR CONNS FIGURES     tests 9a, 9b, 9c
    python3 -m netlab.interop_checks loss WORKDIR CONNS ROUNDS FIGURES     test 10
    python3 -m netlab.interop_checks trials WORKDIR TRIALS FIGURES  the speed medians
    python3 -m netlab.interop_checks bench WORKDIR SIZES CLK_TCK ROUNDS    the benchmark

The files: the pvcm VMs' sessions (NAME.out, "@@ STEP" sections), the kernel guests'
command outputs (PEER.STEP.out, with .rc where the script saved the status), the kernel
CM's counters (PEER.counters-TAG.out), pvcm-backend's `stat --json` (TAG.stat.json).
"""

import argparse
import re
import statistics
import sys

from .toolout import (WorkDir, client_summaries, client_summary, deltas, has_step_line,
                      json_lines, kernel_retries, sections, server_summary, stat_drops,
                      step_ms, step_total, step_totals, vm_io)

# The pvcm VM addresses on br0 (interop/host.sh) and the kernel guests' IPv6 ones.
VM_IP6, K_IP6, J_IP6 = "fd99::21", "fd99::2", "fd99::3"
# Test 10 passes when pvcm's disconnect under loss takes at most this many times the
# kernel's.
LOSS_RATIO = 1.5


def verdicts(bad, names):
    """The result lines of the tests in NAMES ({test: what it showed}), each failed one
    with its reasons from BAD ({test: [why]})."""
    return [("FAIL  " if bad[t] else "PASS  ") + t + ": " + (names[t] if not bad[t] else "; ".join(bad[t]))
            for t in names]


def active(w, conns):
    """Tests 2-4, the pvcm VM as the active side (client.out): cmtime to the kernel, a
    connect to a closed port, connect-destroy."""
    parts, _, rcs = sections(w.read("client.out"))
    bad = {"2": [], "3": [], "4": []}
    s = client_summary(parts.get("cmtime", ""))
    if not s:
        bad["2"].append("no cmtime summary")
    elif s.counts != (conns, conns, 0, conns):
        n, est, failed, disc = s.counts
        bad["2"].append(f"connections {n} established {est} failed {failed} disconnected {disc}")
    if not rcs or rcs[0] != "0":
        bad["2"].append(f"cmtime exit {rcs[:1]}")
    closed = json_lines(parts.get("closed", ""))
    rej = [e for e in closed if e.get("event") == "rejected"]
    if not rej:
        bad["3"].append(f"no rejected event: {closed}")
    elif "InvalidServiceId" not in str(rej[0].get("reason")) and "8" not in str(rej[0].get("reason")):
        bad["3"].append(f"rejected, but reason {rej[0].get('reason')}")
    if len(rcs) < 2 or rcs[1] != "3":
        bad["3"].append(f"connect exit {rcs[1:2]} (want 3: rejected)")
    wd_ev = json_lines(parts.get("withdraw", ""))
    if not any(e.get("event") == "connect_destroy" for e in wd_ev):
        bad["4"].append("no connect_destroy report")
    res = w.read("k.res-after-withdraw.out")
    ids = [line for line in res.splitlines() if "cm-idn" in line]
    if len(ids) != 1 or "LISTEN" not in ids[0]:
        bad["4"].append("kernel cm_ids of port 7473 after connect-destroy: " + " | ".join(ids))
    if "CONNECT_REQUEST" not in res:
        bad["4"].append("the kernel listener never saw the REQ")
    return verdicts(bad, {
        "2": f"pvcm VM -> kernel cmtime, {conns} connections established and torn down",
        "3": "pvcm VM -> kernel closed port: rejected, invalid service ID",
        "4": "pvcm VM connect-destroy: the kernel keeps only its listener (rdma res show cm_id)"})


def passive(w, conns):
    """Tests 5-7, the pvcm VM as the passive side (server.out): the kernel's cmtime, a
    closed port, the kernel's connect-and-destroy."""
    parts, _, _ = sections(w.read("server.out"))
    bad = {"5": [], "6": [], "7": []}
    kp = w.read("j.kp.out")
    if w.rc("j.kp.rc") != "0":
        bad["5"].append(f"kernel cmtime exit {w.rc('j.kp.rc')}: {kp[-300:]}")
    for step in ("connect", "disconnect"):
        if not has_step_line(kp, step):
            bad["5"].append(f"kernel cmtime printed no {step} line")
    s = server_summary(parts.get("server", ""))
    if not s or s.counts != (conns, conns, conns, 0):
        bad["5"].append(f"pvcm server summary: {s.text if s else 'none'}")
    closed = w.read("j.closed.out")
    if "REJECTED" not in closed:
        bad["6"].append(f"ucmatose to a closed port was not rejected: {closed[-300:]}")
    wd_out = w.read("j.withdraw.out")
    if w.rc("j.withdraw.rc") != "0":
        bad["7"].append(f"kcm-withdraw failed: {wd_out[-300:]}")
    ev = json_lines(parts.get("listen", ""))
    # Withdrawn before pvcm answered, or (when the REP crossed the destroy on a loaded
    # machine) rejected by the kernel's REJ(TIMEOUT) or REJ(CONSUMER_DEFINED) after it.
    reqs = {e.get("id") for e in ev if e.get("event") == "connect_request"}
    gone = {e.get("id") for e in ev if e.get("event") == "withdrawn"
            or (e.get("event") == "rejected" and e.get("reason") in ("Timeout", "ConsumerDefined"))}
    if any(e.get("event") == "established" for e in ev):
        bad["7"].append("a withdrawn request was established")
    if len(reqs) != 10 or gone != reqs:
        bad["7"].append(f"{len(reqs)} requests, {len(gone & reqs)} reported withdrawn: "
                        f"{[e.get('event') for e in ev]}")
    return verdicts(bad, {
        "5": f"kernel cmtime -> pvcm VM, {conns} connections established and torn down",
        "6": "kernel -> pvcm VM closed port: rejected by pvcm",
        "7": "kernel connect-and-destroy -> pvcm listener: 10 requests withdrawn"})


def _msg_delta(after, before, group, m):
    return after.get(f"{group}/{m}", 0) - before.get(f"{group}/{m}", 0)


def counters(w):
    """Test 8, over tests 1-7: the kernels' counters, pvcm-backend's drops and retries,
    every MAD pvcm sent taken by a kernel. Returns (lines, figure lines)."""
    lines, bad = [], []
    c = {(p, t): w.counters(f"{p}.counters-{t}.out") for p in ("k", "j") for t in ("before", "after")}
    for peer in ("k", "j"):
        if not c[(peer, "after")]:
            bad.append(f"{peer}: no infiniband_cm counters")
        bad += [f"kernel {peer}: {x}" for x in kernel_retries(c[(peer, "before")], c[(peer, "after")])]
    s = w.host_stat("final.stat.json")
    if s is None:
        return [f"FAIL  8: {'; '.join(bad + ['no pvcm-backend stat (final.stat.json)'])}"], []
    drops = stat_drops(s)
    # Test 7 races on purpose: the kernel withdraws each request at once, so a pvcm REP can
    # cross the kernel's REJ; the mux has retired the entry and refuses that REP with a
    # SEND_ERROR (unknown_connection). Those (at most one per withdrawn request) are the
    # only drops allowed, and they are printed.
    crossed = drops.pop("unknown_connection", 0)
    if crossed > 10:
        drops["unknown_connection"] = crossed
    elif crossed:
        lines.append(f"note  8: {crossed} pvcm REP(s) crossed the kernel's withdrawal in test 7 "
                     "(refused by the mux, unknown_connection)")
    # Test 4 races the same way from the other side: the kernel's REP can cross pvcm's
    # REJ(TIMEOUT) and find the connection already closed (`quarantined`).
    late = drops.pop("quarantined", 0)
    if late > 1:
        drops["quarantined"] = late
    elif late:
        lines.append("note  8: the kernel's REP crossed pvcm's REJ(TIMEOUT) in test 4 (a late MAD of a "
                     "closed connection, quarantined)")
    if drops:
        bad.append(f"pvcm-backend drops: {drops}")
    r = sum(s["cm"]["cm_tx_retries"].values())
    if r:
        bad.append(f"pvcm-backend: {r} retries passed")
    # Every MAD pvcm sent was taken by the kernel CM (rxe drops a bad ICRC silently).
    # What the kernels sent each other (test 1) counts on both sides: subtract it.
    ka, kb, ja, jb = c[("k", "after")], c[("k", "before")], c[("j", "after")], c[("j", "before")]
    # A kernel MAD the mux refused in those races is missing from pvcm's rx count, so the
    # difference may be as large as the races it allowed.
    slack = crossed + late
    for m, sent in s["cm"]["cm_tx_msgs"].items():
        krx = _msg_delta(ka, kb, "cm_rx_msgs", m) + _msg_delta(ja, jb, "cm_rx_msgs", m)
        ktx_to_k = (_msg_delta(ka, kb, "cm_tx_msgs", m) + _msg_delta(ja, jb, "cm_tx_msgs", m)
                    - s["cm"]["cm_rx_msgs"][m])
        got = krx - ktx_to_k
        if abs(sent - got) > slack:
            bad.append(f"{m}: pvcm sent {sent}, the kernel CMs took {got}")
    lines.append(("FAIL  8: " + "; ".join(bad)) if bad else
                 "PASS  8: kernel counters show no duplicates or retries; pvcm-backend 0 drops; every pvcm "
                 "MAD taken by the kernel")
    return lines, speed_table(w, s)


def _fmt_ms(v):
    return v if v is not None else "-"


def speed_table(w, s):
    """Figures: the connect/disconnect totals of tests 1, 2 and 5 from this one run."""
    kk = {step: step_ms(w.read("j.kk.out"), step) for step in ("connect", "disconnect")}
    client = w.read("client.out")
    pk = {"connect": step_ms(client, "establish"), "disconnect": step_ms(client, "disconnect")}
    kp = {step: step_ms(w.read("j.kp.out"), step) for step in ("connect", "disconnect")}
    fig = ["direction             connect ms   disconnect ms"]
    for name, f in (("kernel -> kernel", kk), ("pvcm VM -> kernel", pk), ("kernel -> pvcm VM", kp)):
        fig.append(f"{name:<20} {_fmt_ms(f['connect']):>11} {_fmt_ms(f['disconnect']):>15}")
    if kk["connect"] and pk["connect"]:
        fig.append(f"pvcm VM -> kernel / kernel -> kernel: connect {pk['connect'] / kk['connect']:.2f}x, "
                   f"disconnect {pk['disconnect'] / kk['disconnect']:.2f}x (time ratio; < 1 is faster)")
    fig.append(f"pvcm-backend: cm_tx_msgs {s['cm']['cm_tx_msgs']}")
    return fig


def ipv6(w, conns):
    """Tests 9a-9c, IPv6 on the soft port (v6.out: the VM's cmtime, then its server).
    Returns (lines, figure lines)."""
    parts, rcs, _ = sections(w.read("v6.out"))
    bad = {"9a": [], "9b": [], "9c": []}
    s = client_summary(parts.get("cmtime", ""))
    if not s or s.counts != (conns, conns, 0, conns):
        bad["9a"].append(f"pvcm cmtime: {s.text if s else 'no summary: ' + parts.get('cmtime', w.read('v6.out'))[-300:]}")
    if rcs.get("cmtime") != "0":
        bad["9a"].append(f"pvcm cmtime exit {rcs.get('cmtime')}")
    kp = w.read("j.kp6.out")
    if w.rc("j.kp6.rc") != "0":
        bad["9b"].append(f"kernel cmtime exit {w.rc('j.kp6.rc') or 'none'}: {kp[-300:]}")
    for step in ("connect", "disconnect"):
        if not has_step_line(kp, step):
            bad["9b"].append(f"kernel cmtime printed no {step} line")
    s = server_summary(parts.get("server", ""))
    if not s or s.counts != (conns, conns, conns, 0) or rcs.get("server") != "0":
        bad["9b"].append(f"pvcm server: {s.text if s else 'none'}, exit {rcs.get('server')}")
    fig = []
    bad["9c"] = ipv6_accounting(w, fig)
    pc, pd = (step_total(parts.get("cmtime", ""), st) or "-" for st in ("establish", "disconnect"))
    kc, kd = (step_total(kp, st) or "-" for st in ("connect", "disconnect"))
    fig.append(f"{'pvcm VM -> kernel v6':<20} {pc:>11} {pd:>15}")
    fig.append(f"{'kernel -> pvcm VM v6':<20} {kc:>11} {kd:>15}")
    return verdicts(bad, {
        "9a": f"IPv6, soft port: pvcm VM {VM_IP6} -> kernel {K_IP6}, {conns} connections established and torn down",
        "9b": f"IPv6, soft port: kernel {J_IP6} -> pvcm VM {VM_IP6}, {conns} connections established and torn down",
        "9c": "IPv6 (9a, 9b): kernel counters show no duplicates or retries; pvcm-backend 0 drops, 0 retries; "
              "every pvcm MAD taken by a kernel; all through the IPv6 VM"}), fig


def ipv6_accounting(w, fig):
    """9c, over test 9 only: both kernels' counters, the host's neighbor discards,
    pvcm-backend's drops and retries, every pvcm MAD taken by a kernel, every frame
    through the IPv6 VM."""
    bad = []
    peers = ("k", "j")
    kb = {p: w.counters(f"{p}.counters-v6before.out") for p in peers}
    ka = {p: w.counters(f"{p}.counters-v6after.out") for p in peers}
    for p in peers:
        if not ka[p]:
            bad.append(f"{p}: no infiniband_cm counters")
        bad += [f"kernel {p}: {x}" for x in kernel_retries(kb[p], ka[p])]
    unres = [w.rc(f"unresolved.{t}") for t in ("v6before", "v6after")]
    if all(u.isdigit() for u in unres) and int(unres[1]) > int(unres[0]):
        bad.append(f"the host dropped {int(unres[1]) - int(unres[0])} frames while resolving "
                   "a neighbor (unresolved_discards)")
    s0, s1 = w.json("v6before.stat.json"), w.json("v6after.stat.json")
    if not s0 or not s1:
        bad.append("no pvcm-backend stat around test 9")
        return bad
    h0, h1 = s0["host"], s1["host"]
    drops = {**deltas(h0.get("drops", {}), h1.get("drops", {})),
             **deltas(h0.get("device_drops", {}), h1.get("device_drops", {}))}
    if drops:
        bad.append(f"pvcm-backend drops: {drops}")
    r = sum(deltas(h0["cm"]["cm_tx_retries"], h1["cm"]["cm_tx_retries"]).values())
    if r:
        bad.append(f"pvcm-backend: {r} retries")
    ptx = deltas(h0["cm"]["cm_tx_msgs"], h1["cm"]["cm_tx_msgs"])
    for m, sent in ptx.items():
        got = sum(_msg_delta(ka[p], kb[p], "cm_rx_msgs", m) for p in peers)
        if got != sent:
            bad.append(f"{m}: pvcm sent {sent}, the kernel CMs took {got}")
    # Every frame of test 9 went through the IPv6 VM; the IPv4 VM carried none.
    moved = {n: {k: vm_io(s1, n).get(k, 0) - vm_io(s0, n).get(k, 0) for k in ("wire_tx_frames", "wire_rx_frames")}
             for n in ("vm", "vm6")}
    if any(moved["vm"].values()):
        bad.append(f"the IPv4 VM carried frames: {moved['vm']}")
    if moved["vm6"]["wire_tx_frames"] != sum(ptx.values()) or not moved["vm6"]["wire_rx_frames"]:
        bad.append(f"the IPv6 VM's frames {moved['vm6']}, pvcm sent {sum(ptx.values())} MADs")
    fig.append(f"IPv6 (test 9): pvcm-backend cm_tx_msgs {ptx}; VM vm6 wire frames {moved['vm6']}")
    return bad


def loss(w, conns, rounds):
    """Test 10, DREQs under loss: for each round R, kernel j's cmtime against kernel k
    (j.kk-lossR.*) and against the pvcm VM (j.kp-lossR.*), the pvcm server's summary
    (srvlossR.out); pvcm-backend's stat and kernel j's counters around the test
    (lossbefore, lossafter); the bridge's drop rules (loss.nft). Passes when every run
    set up and tore down every connection and pvcm's disconnect, summed over the rounds,
    took at most LOSS_RATIO times the kernel's. Returns (line, figure lines)."""
    bad = []
    sums = {"kernel": {"connect": 0.0, "disconnect": 0.0}, "pvcm": {"connect": 0.0, "disconnect": 0.0}}
    rows = []
    for r in range(1, rounds + 1):
        for side, tag in (("kernel", "kk"), ("pvcm", "kp")):
            out = w.read(f"j.{tag}-loss{r}.out")
            rc = w.rc(f"j.{tag}-loss{r}.rc")
            if rc != "0":
                bad.append(f"round {r} {side}: kernel cmtime exit {rc or 'none'}: {out[-200:]!r}")
                continue
            row = []
            for step in ("connect", "disconnect"):
                v = step_ms(out, step)
                if v is None:
                    bad.append(f"round {r} {side}: cmtime printed no {step} line")
                    continue
                sums[side][step] += v
                row.append(f"{v:.0f}")
            rows.append(f"round {r} kernel -> {'kernel' if side == 'kernel' else 'pvcm VM'}: "
                        f"connect {'/'.join(row[:1]) or '-'} ms, disconnect {'/'.join(row[1:]) or '-'} ms")
        # A connection whose RTU (and its REP retries' RTUs) were lost is disconnected by
        # the client before the server saw it established (rdma_cm reports DISCONNECTED
        # then without ESTABLISHED): every one accepted and torn down is what counts.
        s = server_summary(w.read(f"srvloss{r}.out"))
        acc, _est, dis, failed = s.counts if s else (-1, -1, -1, -1)
        if (acc, dis, failed) != (conns, conns, 0):
            bad.append(f"round {r}: pvcm server {s.text if s else 'printed no summary'}")
    k, p = sums["kernel"]["disconnect"], sums["pvcm"]["disconnect"]
    ratio = p / k if k else float("inf")
    if not bad and ratio > LOSS_RATIO:
        bad.append(f"disconnect kernel -> pvcm VM {p:.0f} ms is {ratio:.2f}x kernel -> kernel "
                   f"{k:.0f} ms (at most {LOSS_RATIO}x)")
    s0, s1 = w.host_stat("lossbefore.stat.json") or {}, w.host_stat("lossafter.stat.json") or {}
    on_behalf = s1.get("on_behalf", 0) - s0.get("on_behalf", 0)
    c0, c1 = w.counters("j.counters-lossbefore.out"), w.counters("j.counters-lossafter.out")
    retries = c1.get("cm_tx_retries/dreq", 0) - c0.get("cm_tx_retries/dreq", 0)
    dropped = nft_dropped(w.read("loss.nft"))
    fig = [f"under 5% loss each way (test 10, {conns} connections, {rounds} rounds):"]
    fig += [f"  {row}" for row in rows]
    fig.append(f"  disconnect, summed: kernel -> kernel {k:.0f} ms, kernel -> pvcm VM {p:.0f} ms "
               f"({ratio:.2f}x); connect {sums['kernel']['connect']:.0f} / "
               f"{sums['pvcm']['connect']:.0f} ms")
    fig.append(f"  frames dropped by the bridge {dropped}; kernel j's DREQ retries {retries}; "
               f"MADs pvcm-backend sent on the VM's behalf {on_behalf}")
    name = (f"10: 5% loss, kernel -> pvcm VM whose server exits at once: disconnect {ratio:.2f}x "
            f"kernel -> kernel ({p:.0f} / {k:.0f} ms over {rounds} rounds)")
    return ("FAIL  10: " + "; ".join(bad)) if bad else ("PASS  " + name), fig


def nft_dropped(listing):
    """The packets `nft list table` counted, summed over its counters."""
    return sum(int(n) for n in re.findall(r"packets (\d+)", listing))


def cmtime_ms(text, steps):
    """{key: ms} of the cmtime totals of STEPS ({key: step name}) found in TEXT."""
    out = {}
    for key, step in steps.items():
        v = step_ms(text, step)
        if v is not None:
            out[key] = v
    return out


KERNEL_STEPS = {"connect": "connect", "disconnect": "disconnect"}
PVCM_STEPS = {"connect": "establish", "disconnect": "disconnect"}


def middle(v):
    """The middle of the sorted values (for an even count, the upper of the two); None
    when there are none."""
    v = sorted(v)
    return v[len(v) // 2] if v else None


def trials(w, n):
    """The speed figures of tests 1 and 2 and their N more alternating trials: the
    medians of kernel -> kernel and pvcm VM -> kernel and their ratio."""
    kk = [cmtime_ms(w.read("j.kk.out"), KERNEL_STEPS)]
    kk += [cmtime_ms(w.read(f"j.kk{t}.out"), KERNEL_STEPS) for t in range(1, n + 1)]
    pk = []
    for name in ["client.out"] + [f"pk{t}.out" for t in range(1, n + 1)]:
        text = w.read(name)
        s = client_summary(text)
        complete = s and s.counts[2] == 0 and s.counts[1] == s.counts[0] == s.counts[3]
        pk.append(cmtime_ms(text, PVCM_STEPS) if complete else {})
    fig = []
    for step in ("connect", "disconnect"):
        a = [x[step] for x in kk if step in x]
        b = [x[step] for x in pk if step in x]
        if len(a) == len(b) == n + 1:
            ratios = " ".join(f"{y / x:.2f}" for x, y in zip(a, b))
            fig.append(f"{step}: kernel -> kernel median {middle(a):.1f} ms, pvcm VM -> kernel median "
                       f"{middle(b):.1f} ms ({n + 1} runs each, alternating): "
                       f"{middle(b) / middle(a):.2f}x (per pair: {ratios})")
        else:
            fig.append(f"{step}: trials incomplete (kernel {len(a)}, pvcm {len(b)} of {n + 1})")
    return fig


def cpu_ticks(text):
    """The lines of TEXT that are a number alone (a process's CPU ticks, sampled)."""
    return [int(x) for x in re.findall(r"^(\d+)\s*$", text, re.M)]


def bench(w, sizes, tck, rounds):
    """The benchmark's table (bench.sh): per size, kernel CM <-> kernel CM next to pvcm
    VM <-> pvcm VM, medians of the rounds, CPU per connection, the speed-up; the idle
    cost of a VM running pvcm-guest listen. Returns (lines, [why it failed])."""
    bad, out = [], []
    out.append(f"{rounds} round(s) per size and side, back to back in VMs that stay up; the "
               "figures are medians of the rounds, round 1 is the cold start")
    out.append(f"{'N':>6} {'side':<22} {'connect ms':>11} {'disconnect ms':>14} {'CPU ms/conn':>12}  "
               "rounds (connect / disconnect ms)")

    def f(v, p=1):
        return f"{v:.{p}f}" if v is not None else "-"

    def each(c, d):
        return " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(c, d))

    def med(v):
        return statistics.median(v) if v else None

    for n in sizes:
        kk = w.read(f"j.kk-{n}.out")
        jb = cpu_ticks(kk)
        kb = cpu_ticks(w.read(f"k.busy0-{n}.out")) + cpu_ticks(w.read(f"k.busy1-{n}.out"))
        kcpu = None
        if len(jb) >= 2 and len(kb) >= 2:
            # jiffies are 10 ms
            kcpu = ((jb[-1] - jb[0]) + (kb[1] - kb[0])) * 10.0 / (n * rounds)
        kcs, kds = [float(x) for x in step_totals(kk, "connect")], [float(x) for x in step_totals(kk, "disconnect")]
        cli, srv = w.read(f"cli{n}.out"), w.read(f"srv{n}.out")
        pcs = [float(x) for x in step_totals(cli, "establish")]
        pds = [float(x) for x in step_totals(cli, "disconnect")]
        cb, sb = cpu_ticks(cli), cpu_ticks(srv)
        ticks = w.read(f"backend-ticks-{n}").split()
        pcpu = None
        if len(cb) >= 2 and len(sb) >= 2 and len(ticks) == 2 and all(t.isdigit() for t in ticks):
            backend_ms = (int(ticks[1]) - int(ticks[0])) * 1000.0 / tck
            pcpu = ((cb[-1] - cb[0]) + (sb[-1] - sb[0])) * 10.0 / (n * rounds) + backend_ms / (n * rounds)
        ok = [c for c in client_summaries(cli) if c == (n, n, 0, n)]
        if len(ok) != rounds:
            bad.append(f"pvcm {n}: {len(ok)} of {rounds} rounds established and tore down every connection")
        if len(kcs) != rounds:
            bad.append(f"kernel {n}: {len(kcs)} of {rounds} rounds reported (cmtime output in j.kk-{n}.out)")
        s = w.host_stat(f"after-{n}.stat.json")
        if s:
            d = stat_drops(s)
            r = sum(s["cm"]["cm_tx_retries"].values())
            if d or r:
                bad.append(f"pvcm {n}: drops {d} retries {r}")
        kc, kd, pc, pd = med(kcs), med(kds), med(pcs), med(pds)
        out.append(f"{n:>6} {'kernel CM <-> kernel CM':<22} {f(kc):>11} {f(kd):>14} {f(kcpu, 2):>12}  {each(kcs, kds)}")
        out.append(f"{n:>6} {'pvcm VM <-> pvcm VM':<22} {f(pc):>11} {f(pd):>14} {f(pcpu, 2):>12}  {each(pcs, pds)}")
        if kc and pc and kd and pd:
            cold = (f"round 1 (cold): {kcs[0] / pcs[0]:.1f}x / {kds[0] / pds[0]:.1f}x"
                    if kcs and pcs and kds and pds and pcs[0] and pds[0] else "")
            out.append(f"{n:>6} {'pvcm speed-up':<22} {kc / pc:>10.1f}x {kd / pd:>13.1f}x "
                       f"{(f'{kcpu / pcpu:.1f}x less' if kcpu and pcpu else '-'):>12}  {cold}")

    def idle(name):
        v = w.read(f"idle-{name}").split()
        if len(v) != 4:
            return None, None
        a, b, b0, b1 = map(int, v)
        secs = 20.0
        return (b - a) / tck / secs * 100, (b1 - b0) / tck / secs * 100

    ip, bp = idle("idlepvcm")
    ib, _ = idle("idlebase")
    if ip is not None and ib is not None:
        out.append(f"idle: QEMU VM with pvcm-guest listen {ip:.1f}% of a host core, without it {ib:.1f}%: "
                   f"the driver's poll costs {ip - ib:.1f}%; pvcm-backend {bp:.2f}%")
    out += ["bench: " + b for b in bad]
    out.append("bench goal: pvcm at least 20x faster than the kernel CM in both steps at every size")
    return out, bad


def _append(path, lines):
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)


def main(argv):
    ap = argparse.ArgumentParser(prog="python3 -m netlab.interop_checks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="check", required=True)
    for name, args in (("active", ("conns",)), ("passive", ("conns",)), ("counters", ("figures",)),
                       ("ipv6", ("conns", "figures")), ("loss", ("conns", "rounds", "figures")),
                       ("trials", ("trials", "figures")), ("bench", ("sizes", "clk_tck", "rounds"))):
        p = sub.add_parser(name)
        p.add_argument("workdir")
        for a in args:
            p.add_argument(a, type=int if a in ("conns", "rounds", "trials", "clk_tck") else str)
    a = ap.parse_args(argv)
    w = WorkDir(a.workdir)
    if a.check == "active":
        print("\n".join(active(w, a.conns)))
    elif a.check == "passive":
        print("\n".join(passive(w, a.conns)))
    elif a.check == "counters":
        lines, fig = counters(w)
        print("\n".join(lines))
        with open(a.figures, "w") as f:
            f.writelines(line + "\n" for line in fig)
    elif a.check == "ipv6":
        lines, fig = ipv6(w, a.conns)
        _append(a.figures, fig)
        print("\n".join(lines))
    elif a.check == "loss":
        line, fig = loss(w, a.conns, a.rounds)
        _append(a.figures, fig)
        print(line)
    elif a.check == "trials":
        _append(a.figures, trials(w, a.trials))
    elif a.check == "bench":
        lines, bad = bench(w, [int(x) for x in a.sizes.split(",")], a.clk_tck, a.rounds)
        print("\n".join(lines))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
