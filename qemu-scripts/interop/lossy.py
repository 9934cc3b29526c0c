"""Test 10 of qemu-scripts/interop.sh: DREQs under loss, read from the run's files.

Usage: lossy.py WORKDIR CONNECTIONS ROUNDS FIGURES

Reads, for each round R, kernel j's cmtime against kernel k (j.kk-lossR.out, .rc) and
against the pvcm VM (j.kp-lossR.out, .rc), and the pvcm server's summary
(srvlossR.out); the backend's `stat --json` before and after (lossbefore,
lossafter) and kernel j's infiniband_cm counters (j.counters-lossbefore/-lossafter).
Prints the test's result line (PASS or FAIL) and appends its figures to FIGURES.

It passes when every run established and tore down every connection and the pvcm
side's disconnect, summed over the rounds, took at most 1.5 times the kernel's.
"""

import json
import os
import re
import sys

RATIO = 1.5


def read(wd: str, name: str) -> str:
    path = os.path.join(wd, name)
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def step_ms(text: str, step: str) -> float | None:
    """The first figure of rdma-core cmtime's line for STEP (its total, ms)."""
    m = re.search(rf"^{step}\s*:\s*([\d.]+)", text, re.M)
    return float(m.group(1)) if m else None


def counters(wd: str, tag: str) -> dict[str, int]:
    c = {}
    for line in read(wd, f"j.counters-{tag}.out").splitlines():
        p = line.split()
        if len(p) == 2 and p[1].isdigit():
            c[p[0]] = int(p[1])
    return c


def stat(wd: str, tag: str) -> dict:
    try:
        with open(os.path.join(wd, f"{tag}.stat.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main() -> int:
    wd, conns, rounds, figures = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    bad = []
    sums = {"kernel": {"connect": 0.0, "disconnect": 0.0}, "pvcm": {"connect": 0.0, "disconnect": 0.0}}
    rows = []
    for r in range(1, rounds + 1):
        for side, tag in (("kernel", "kk"), ("pvcm", "kp")):
            out = read(wd, f"j.{tag}-loss{r}.out")
            rc = read(wd, f"j.{tag}-loss{r}.rc").strip()
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
        server = read(wd, f"srvloss{r}.out")
        # A connection whose RTU (and its REP retries' RTUs) were lost is disconnected by
        # the client before the server saw it established (rdma_cm reports DISCONNECTED
        # then without ESTABLISHED): every one accepted and torn down is what counts.
        m = re.search(r"accepted (\d+) established (\d+) disconnected (\d+) failed (\d+)", server)
        acc, _est, dis, failed = tuple(map(int, m.groups())) if m else (-1, -1, -1, -1)
        if (acc, dis, failed) != (conns, conns, 0):
            bad.append(f"round {r}: pvcm server {m.group(0) if m else 'printed no summary'}")
    k, p = sums["kernel"]["disconnect"], sums["pvcm"]["disconnect"]
    ratio = p / k if k else float("inf")
    if not bad and ratio > RATIO:
        bad.append(f"disconnect kernel -> pvcm VM {p:.0f} ms is {ratio:.2f}x kernel -> kernel "
                   f"{k:.0f} ms (at most {RATIO}x)")
    s0, s1 = stat(wd, "lossbefore").get("host", {}), stat(wd, "lossafter").get("host", {})
    on_behalf = s1.get("on_behalf", 0) - s0.get("on_behalf", 0)
    c0, c1 = counters(wd, "lossbefore"), counters(wd, "lossafter")
    retries = c1.get("cm_tx_retries/dreq", 0) - c0.get("cm_tx_retries/dreq", 0)
    nft = read(wd, "loss.nft")
    dropped = sum(int(n) for n in re.findall(r"packets (\d+)", nft))
    with open(figures, "a") as fo:
        fo.write(f"under 5% loss each way (test 10, {conns} connections, {rounds} rounds):\n")
        for row in rows:
            fo.write(f"  {row}\n")
        fo.write(f"  disconnect, summed: kernel -> kernel {k:.0f} ms, kernel -> pvcm VM {p:.0f} ms "
                 f"({ratio:.2f}x); connect {sums['kernel']['connect']:.0f} / "
                 f"{sums['pvcm']['connect']:.0f} ms\n")
        fo.write(f"  frames dropped by the bridge {dropped}; kernel j's DREQ retries {retries}; "
                 f"MADs pvcm-backend sent on the VM's behalf {on_behalf}\n")
    name = (f"10: 5% loss, kernel -> pvcm VM whose server exits at once: disconnect {ratio:.2f}x "
            f"kernel -> kernel ({p:.0f} / {k:.0f} ms over {rounds} rounds)")
    print(("FAIL  10: " + "; ".join(bad)) if bad else ("PASS  " + name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
