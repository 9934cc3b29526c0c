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

netlab_py netlab.interop_checks bench "$work" "$IOP_SIZES" "$(getconf CLK_TCK)" "$rounds" | tee "$out"
rc=$?
touch "$share/flag.stop"
kill "$backend_pid" 2>/dev/null
wait "$backend_pid" 2>/dev/null
exit "$rc"
