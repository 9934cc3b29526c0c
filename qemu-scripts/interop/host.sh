#!/usr/bin/env bash
# The host side of qemu-scripts/interop.sh. It runs inside the network lab's namespace
# (python3 -m netlab run), where br0 holds the pvcm VM's address 10.99.0.1. Two
# kernel-CM guests are on the bridge: k (10.99.0.2, cmtime listener on 7471, started
# here) and j (10.99.0.3). Both run the RDMA image's agent, so this script runs
# commands in them through the 9p share (kexec).
#
# IPv6 (test 9): the guests also have fd99::2 (k) and fd99::3 (j) on eth0, and the same
# pvcm-backend has a second VM, vm6, whose address fd99::21 is on br0 too; k gets a
# cmtime listener bound to fd99::2 port 7476.
#
# Environment (set by interop.sh): IOP_WORK, IOP_SHARE, IOP_BACKEND, IOP_RUNVM,
# IOP_GUEST_DIR, IOP_CONNS, IOP_ONLY, IOP_TRIALS, IOP_LOSS_CONNS (test 10).
set -uo pipefail

work="$IOP_WORK" share="$IOP_SHARE" conns="$IOP_CONNS" only="$IOP_ONLY"
vm_ip=10.99.0.1 k_ip=10.99.0.2 j_ip=10.99.0.3
vm_ip6=fd99::21 k_ip6=fd99::2 j_ip6=fd99::3
results="$work/results.txt"
figures="$work/figures.txt"
: >"$results"
: >"$figures"
pass=0 fail=0

say() { echo "== $*"; }
result() { # result NAME pass|fail TEXT
    printf '%-5s %s: %s\n' "$(echo "$2" | tr a-z A-Z)" "$1" "$3" | tee -a "$results"
    if [ "$2" = pass ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
}
selected() { [[ ",$only," == *",$1,"* ]]; }

# shellcheck source-path=SCRIPTDIR source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_backend "vm:$vm_ip" "vm6:$vm_ip6"
wait_kernel_peers
prime_neighbors "$k_ip" "$j_ip"
start_listener k || echo "k: $(cat "$work/k.listener.out")"
kcounters k before
kcounters j before

# ---- 1. kernel -> kernel, the baseline (figures only)
if selected 1; then
    say "1. kernel -> kernel: cmtime -s $k_ip -c $conns"
    if kexec j kk 300 "cmtime -s $k_ip -c $conns"; then
        result 1 pass "kernel -> kernel, $conns connections"
    else
        result 1 fail "kernel -> kernel cmtime failed: $(tail -n 3 "$work/j.kk.out")"
    fi
fi

# ---- 2-4. the pvcm VM as the active side, in one VM session
if selected 2 || selected 3 || selected 4; then
    say "2-4. pvcm VM -> kernel: cmtime, connect to a closed port, connect-destroy"
    kexec k kcm-listen 20 '/host/bin/kcm listen -p 7473 >/host/kcm-listen.log 2>&1 &'
    vm_start client "
echo '@@ cmtime'; pvcm-guest cmtime --dest $k_ip --connections $conns --timeout 120; echo \"@@ rc \$?\"
echo '@@ closed'; pvcm-guest --json connect --dest $k_ip --port 7999 --timeout 10; echo \"@@ rc \$?\"
echo '@@ withdraw'; pvcm-guest --json connect-destroy --dest $k_ip --port 7473 --settle 3; echo \"@@ rc \$?\"
true"
    vm_wait client
    stat_json client
    sleep 1
    kexec k res-after-withdraw 20 'rdma res show cm_id | grep "src-addr 0.0.0.0:7473\|dst-addr 10.99.0.1"; echo "-- kcm listen:"; cat /host/kcm-listen.log'
    netlab_py netlab.interop_checks active "$work" "$conns" | tee -a "$results"
fi

# ---- 5-7. the pvcm VM as the passive side, in one VM session
if selected 5 || selected 6 || selected 7; then
    say "5-7. kernel -> pvcm VM: cmtime, a closed port, connect-and-destroy"
    vm_start server "
echo '@@ server'; pvcm-guest cmtime --server --connections $conns --timeout 200; echo \"@@ rc \$?\"
echo '@@ listen'; timeout 30 pvcm-guest --json listen --port 7472; echo \"@@ rc \$?\"
true"
    if vm_console server 'listening|cmtime server' 120; then
        sleep 1
        kexec j closed 30 "ucmatose -s $vm_ip -p 7999 -C 1 -c 1"
        kexec j kp 300 "cmtime -s $vm_ip -c $conns"
        echo $? >"$work/j.kp.rc"
        vm_console server '"event": ?"listening"' 120 && sleep 1
        kexec j withdraw 60 "/host/bin/kcm withdraw -s $vm_ip -p 7472 -c 10"
        echo $? >"$work/j.withdraw.rc"
    fi
    vm_wait server
    stat_json server
    netlab_py netlab.interop_checks passive "$work" "$conns" | tee -a "$results"
fi

# ---- 8. counters on both sides
kcounters k after
kcounters j after
sleep 0.5
stat_json final
netlab_py netlab.interop_checks counters "$work" "$figures" | tee -a "$results"

# ---- 9. IPv6 on the soft port: pvcm VM vm6 (fd99::21 on br0) <-> the kernel CMs, in one
# VM session (after test 8, so each has its own accounting)
if selected 9; then
    say "9. IPv6, soft port: pvcm VM $vm_ip6 -> kernel k $k_ip6, kernel j $j_ip6 -> pvcm VM, $conns connections each"
    start_listener k "$k_ip6" 7476 || echo "k: $(cat "$work/k.listener7476.out")"
    prime_neighbors "$k_ip6" "$j_ip6"
    kcounters k v6before
    kcounters j v6before
    stat_json v6before
    unresolved_discards >"$work/unresolved.v6before"
    vm_start v6 "
echo '@@ cmtime'; pvcm-guest cmtime --dest $k_ip6 --port 7476 --connections $conns --timeout 120; echo \"@@ rc \$?\"
echo '@@ server'; pvcm-guest cmtime --server --connections $conns --timeout 200; echo \"@@ rc \$?\"
true" vm6
    if vm_console v6 'cmtime server on' 240; then
        sleep 1
        kexec j kp6 300 "cmtime -s $vm_ip6 -b $j_ip6 -c $conns"
        echo $? >"$work/j.kp6.rc"
    fi
    vm_wait v6
    kcounters k v6after
    kcounters j v6after
    sleep 0.5
    stat_json v6after
    unresolved_discards >"$work/unresolved.v6after"
    netlab_py netlab.interop_checks ipv6 "$work" "$conns" "$figures" | tee -a "$results"
fi

# ---- 10. DREQs under loss: 5% of the RoCE frames lost each way on the bridge
# (nftables numgen drops in its prerouting and output hooks; this kernel has no netem),
# kernel j -> kernel k next to kernel j -> a pvcm VM whose cmtime server exits right
# after its last DREP, two rounds each, alternating. A DREQ retry for a DREP lost after
# the server exited is answered by the backend, as the kernel CM answers it in TimeWait.
if selected 10; then
    lc="${IOP_LOSS_CONNS:-200}"
    say "10. 5% loss each way: kernel -> kernel and kernel -> pvcm VM (server exits at once), $lc connections, 2 rounds each"
    prime_neighbors "$k_ip" "$j_ip"
    stat_json lossbefore
    kcounters j lossbefore
    nft -f - <<'NFT'
table bridge pvcm_loss {
    chain pre { type filter hook prerouting priority -200; udp dport 4791 numgen random mod 100 < 5 counter drop; }
    chain out { type filter hook output priority -200; udp dport 4791 numgen random mod 100 < 5 counter drop; }
}
NFT
    for r in 1 2; do
        kexec j "kk-loss$r" 300 "cmtime -s $k_ip -c $lc"
        echo $? >"$work/j.kk-loss$r.rc"
        vm_start "srvloss$r" "pvcm-guest cmtime --server --connections $lc --timeout 240"
        if vm_console "srvloss$r" 'cmtime server on' 240; then
            sleep 1
            kexec j "kp-loss$r" 300 "cmtime -s $vm_ip -c $lc"
            echo $? >"$work/j.kp-loss$r.rc"
        fi
        vm_wait "srvloss$r"
    done
    nft list table bridge pvcm_loss >"$work/loss.nft" 2>&1
    nft delete table bridge pvcm_loss
    sleep 0.5
    stat_json lossafter
    kcounters j lossafter
    netlab_py netlab.interop_checks loss "$work" "$lc" 2 "$figures" | tee -a "$results"
fi

# ---- speed: more alternating trials of tests 1 and 2, for medians from this one run
# (after test 8, whose MAD accounting covers tests 1-7 only).
trials="${IOP_TRIALS:-0}"
if [ "$trials" -gt 0 ] && selected 1 && selected 2; then
    say "speed: $trials more trials each of kernel -> kernel and pvcm VM -> kernel, alternating"
    for t in $(seq "$trials"); do
        if [ $((t % 2)) = 1 ]; then
            vm_start "pk$t" "pvcm-guest cmtime --dest $k_ip --connections $conns --timeout 120"
            vm_wait "pk$t"
            kexec j "kk$t" 300 "cmtime -s $k_ip -c $conns"
        else
            kexec j "kk$t" 300 "cmtime -s $k_ip -c $conns"
            vm_start "pk$t" "pvcm-guest cmtime --dest $k_ip --connections $conns --timeout 120"
            vm_wait "pk$t"
        fi
    done
    netlab_py netlab.interop_checks trials "$work" "$trials" "$figures"
fi

touch "$share/flag.stop"
kill "$backend_pid" 2>/dev/null
wait "$backend_pid" 2>/dev/null
cat "$figures"
grep -c '^PASS' "$results" >/dev/null
! grep -q '^FAIL' "$results"
