#!/usr/bin/env bash
# The host side of `qemu-scripts/interop.sh --bench`: connection-rate figures, all from
# one run, of pvcm VM <-> pvcm VM (two TCG VMs on one pvcm-backend, default options)
# next to kernel CM <-> kernel CM (two TCG guests of the RDMA image, rdma-core's
# cmtime), at each size in $IOP_SIZES. Runs inside the network lab's namespace like
# host.sh.
#
# CPU per connection: the busy time (user + nice + system + irq + softirq) that each
# guest's own /proc/stat counts over the benchmark command, both guests summed, plus the
# pvcm-backend process's CPU time for the pvcm side. Every side is measured the same way
# from inside its guests, so the figures compare; TCG inflates them all alike.
set -uo pipefail

work="$IOP_WORK" share="$IOP_SHARE" rounds="${IOP_ROUNDS:-3}"
k_ip=10.99.0.2 srv_ip=10.99.0.1 cli_ip=10.99.0.4
out="$work/bench.txt"
: >"$out"

# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_backend "srv:$srv_ip" "cli:$cli_ip"
wait_kernel_peers
start_listener k || echo "k: $(cat "$work/k.listener.out")"

# Busy jiffies (USER_HZ 100) of the first /proc/stat line read by the awk below.
busy='awk "/^cpu /{print \$2+\$3+\$4+\$7+\$8; exit}" /proc/stat'
# The backend's CPU time in clock ticks (utime + stime).
backend_ticks() { awk '{print $14 + $15}' "/proc/$backend_pid/stat"; }

for n in ${IOP_SIZES//,/ }; do
    echo "== $n connections: kernel CM <-> kernel CM"
    kexec k "busy0-$n" 10 "$busy"
    kexec j "kk-$n" 900 "$busy; for r in \$(seq $rounds); do echo round \$r; cmtime -s $k_ip -c $n; sleep 1; done; $busy"
    kexec k "busy1-$n" 10 "$busy"
    echo "== $n connections: pvcm VM <-> pvcm VM"
    vm_start "srv$n" "$busy; pvcm-guest cmtime --server --connections $n --rounds $rounds --timeout 600; echo \"rc \$?\"; $busy" srv
    if vm_console "srv$n" 'cmtime server on' 120; then
        t0="$(backend_ticks)"
        vm_start "cli$n" "$busy; pvcm-guest cmtime --dest $srv_ip --connections $n --rounds $rounds --timeout 120; echo \"rc \$?\"; $busy" cli
        vm_wait "cli$n"
        vm_wait "srv$n"
        t1="$(backend_ticks)"
        echo "$t0 $t1" >"$work/backend-ticks-$n"
    else
        vm_wait "srv$n"
        echo "server VM never listened" >"$work/backend-ticks-$n"
    fi
    stat_json "after-$n"
done

# Idle cost: host CPU of a QEMU VM whose pvcm-guest listens and nothing happens, next
# to the same VM idling without it (the difference is the driver's timed poll), and of
# pvcm-backend meanwhile, each over $idle_secs seconds.
idle_secs=20
qemu_ticks() { # the CPU ticks of the QEMU process of VM NAME
    local pid
    pid="$(pgrep -f -- "qemu-system-x86_64 -name $1 " | head -n 1)"
    [ -n "$pid" ] && awk '{print $14 + $15}' "/proc/$pid/stat"
}
idle_run() { # idle_run NAME 'CMD': prints QEMU ticks over idle_secs, once settled
    vm_start "$1" "$2" srv
    vm_console "$1" "${3:-idle-ready}" 120 || true
    sleep 2
    local a b
    a="$(qemu_ticks "$1")"
    b0="$(backend_ticks)"
    sleep "$idle_secs"
    b="$(qemu_ticks "$1")"
    b1="$(backend_ticks)"
    echo "${a:-0} ${b:-0} $b0 $b1" >"$work/idle-$1"
    kill "$(eval "echo \$vmpid_$1")" 2>/dev/null
    pkill -f -- "qemu-system-x86_64 -name $1 " 2>/dev/null
    vm_wait "$1" 2>/dev/null
}
echo "== idle: pvcm-guest listen, then the same VM without it"
idle_run idlepvcm "pvcm-guest listen --port 7999" 'listening on'
idle_run idlebase "echo idle-ready; sleep $((idle_secs + 60))"

python3 - "$work" "$IOP_SIZES" "$(getconf CLK_TCK)" "$rounds" <<'PY' | tee "$out"
import json, os, re, statistics, sys
wd, sizes, tck = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
rounds = int(sys.argv[4])
def read(n):
    p = f"{wd}/{n}"
    return open(p, errors="replace").read() if os.path.exists(p) else ""
def nums(text):
    return [int(x) for x in re.findall(r"^(\d+)\s*$", text, re.M)]
def totals(text, step):  # the step's total in every round's table, in order
    return [float(x) for x in re.findall(rf"^{step}\s*:?\s+([\d.]+)", text, re.M)]
def med(v):
    return statistics.median(v) if v else None
bad = []
print(f"{rounds} round(s) per size and side, back to back in VMs that stay up; the "
      "figures are medians of the rounds, round 1 is the cold start")
print(f"{'N':>6} {'side':<22} {'connect ms':>11} {'disconnect ms':>14} {'CPU ms/conn':>12}  rounds (connect / disconnect ms)")
for n in sizes:
    kk = read(f"j.kk-{n}.out")
    jb = nums(kk)
    kb = nums(read(f"k.busy0-{n}.out")) + nums(read(f"k.busy1-{n}.out"))
    kcpu = None
    if len(jb) >= 2 and len(kb) >= 2:
        # jiffies are 10 ms
        kcpu = ((jb[-1] - jb[0]) + (kb[1] - kb[0])) * 10.0 / (n * rounds)
    kcs, kds = totals(kk, "connect"), totals(kk, "disconnect")
    cli, srv = read(f"cli{n}.out"), read(f"srv{n}.out")
    pcs, pds = totals(cli, "establish"), totals(cli, "disconnect")
    cb, sb = nums(cli), nums(srv)
    ticks = read(f"backend-ticks-{n}").split()
    pcpu = None
    if len(cb) >= 2 and len(sb) >= 2 and len(ticks) == 2 and all(t.isdigit() for t in ticks):
        backend_ms = (int(ticks[1]) - int(ticks[0])) * 1000.0 / tck
        pcpu = ((cb[-1] - cb[0]) + (sb[-1] - sb[0])) * 10.0 / (n * rounds) + backend_ms / (n * rounds)
    ok = re.findall(rf"connections {n} established {n} failed 0 disconnected {n}", cli)
    if len(ok) != rounds:
        bad.append(f"pvcm {n}: {len(ok)} of {rounds} rounds established and tore down every connection")
    if len(kcs) != rounds:
        bad.append(f"kernel {n}: {len(kcs)} of {rounds} rounds reported (cmtime output in j.kk-{n}.out)")
    s = json.load(open(f"{wd}/after-{n}.stat.json"))["host"] if os.path.exists(f"{wd}/after-{n}.stat.json") else None
    if s:
        d = {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}
        r = sum(s["cm"]["cm_tx_retries"].values())
        if d or r: bad.append(f"pvcm {n}: drops {d} retries {r}")
    f = lambda v, p=1: f"{v:.{p}f}" if v is not None else "-"
    each = lambda c, d: " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(c, d))
    kc, kd, pc, pd = med(kcs), med(kds), med(pcs), med(pds)
    print(f"{n:>6} {'kernel CM <-> kernel CM':<22} {f(kc):>11} {f(kd):>14} {f(kcpu, 2):>12}  {each(kcs, kds)}")
    print(f"{n:>6} {'pvcm VM <-> pvcm VM':<22} {f(pc):>11} {f(pd):>14} {f(pcpu, 2):>12}  {each(pcs, pds)}")
    if kc and pc and kd and pd:
        cold = (f"round 1 (cold): {kcs[0] / pcs[0]:.1f}x / {kds[0] / pds[0]:.1f}x"
                if kcs and pcs and kds and pds and pcs[0] and pds[0] else "")
        print(f"{n:>6} {'pvcm speed-up':<22} {kc / pc:>10.1f}x {kd / pd:>13.1f}x "
              f"{(f'{kcpu / pcpu:.1f}x less' if kcpu and pcpu else '-'):>12}  {cold}")
def idle(name):
    v = read(f"idle-{name}").split()
    if len(v) != 4: return None, None
    a, b, b0, b1 = map(int, v)
    secs = 20.0
    return (b - a) / tck / secs * 100, (b1 - b0) / tck / secs * 100
ip, bp = idle("idlepvcm")
ib, _ = idle("idlebase")
if ip is not None and ib is not None:
    print(f"idle: QEMU VM with pvcm-guest listen {ip:.1f}% of a host core, without it {ib:.1f}%: "
          f"the driver's poll costs {ip - ib:.1f}%; pvcm-backend {bp:.2f}%")
for b in bad: print("bench: " + b)
print("bench goal: pvcm at least 20x faster than the kernel CM in both steps at every size")
sys.exit(1 if bad else 0)
PY
rc=$?
touch "$share/flag.stop"
kill "$backend_pid" 2>/dev/null
wait "$backend_pid" 2>/dev/null
exit "$rc"
