#!/usr/bin/env bash
# The host side of qemu-scripts/umad.sh, run inside the network lab's namespace (python3
# -m netlab run). Guest a (10.99.0.2, pvcm.cm=pvcm: no kernel CM) runs pvcm-backend on
# umad:rxe0:1 with pvcm VMs a (10.99.0.11) and b (10.99.0.12) attached in-process by
# pvcm-lab attach; guest b (10.99.0.3) runs the kernel CM with a cmtime listener
# (started here). Both guests run the RDMA image's agent, so requests go to them
# through the 9p share (kexec).
#
# IPv6 (test 6): the guests also have fd99::2 (a) and fd99::3 (b) on eth0; pvcm VM a6
# (fd99::11, added to a's eth0 as a /128) is on the same pvcm-backend, and the kernel
# in b listens on fd99::3 port 7476 (cmtime -b). br0 is captured (dumpcap) while test
# 6 runs.
#
# Environment (set by umad.sh): IOP_WORK, IOP_SHARE, IOP_CONNS, IOP_CONNS6.
set -uo pipefail
cap_pid=""
trap '[ -z "$cap_pid" ] || kill "$cap_pid" 2>/dev/null; touch "$IOP_SHARE/flag.stop"' EXIT

work="$IOP_WORK" share="$IOP_SHARE" conns="$IOP_CONNS" conns6="$IOP_CONNS6"
b_ip=10.99.0.3 vm_a=10.99.0.11 vm_b=10.99.0.12 vm_c=10.99.0.13 vm_d=10.99.0.14
b_ip6=fd99::3 vm_a6=fd99::11
results="$work/results.txt"
figures="$work/figures.txt"
: >"$results"
: >"$figures"
lab="env LD_LIBRARY_PATH=/host/lib /host/bin/pvcm-lab"

say() { echo "== $*"; }
pyresult() { tee -a "$results"; }

# shellcheck source-path=SCRIPTDIR source=../interop/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../interop/common.sh"

for p in a b; do
    for _ in $(seq 300); do [ -e "$share/flag.ready.$p" ] && break; sleep 0.2; done
done
start_listener b || echo "b: $(cat "$work/b.listener.out")"
# guest_wait FILE SECS: until FILE (in the share) exists.
guest_wait() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do [ -e "$share/$1" ] && return 0; sleep 0.1; done
    return 1
}
guest_grep() { # guest_grep FILE PATTERN SECS
    local i
    for ((i = 0; i < $3 * 10; i++)); do grep -Eq "$2" "$share/$1" 2>/dev/null && return 0; sleep 0.1; done
    return 1
}

say "0. pvcm-backend --port umad:rxe0 where ib_cm is loaded (guest b): refused at startup"
kexec b t0 30 "/host/bin/pvcm-backend --port umad:rxe0 --vm socket=/tmp/x.sock,gid=$b_ip,name=x; echo rc=\$?"
say "setup: guest a: VM addresses on eth0, pvcm-backend --port umad:rxe0:1"
# The VMs' GIDs for aprep.sh: "ADDR SYSFS_GID VM_GID" lines.
netlab_py netlab addr table "$vm_a" "$vm_b" "$vm_c" "$vm_a6" >"$share/gids.txt"
# Up to 180 s: the GIDs and the backend's start take over a minute in a TCG guest on a
# loaded host.
kexec a setup 180 "sh /host/aprep.sh $vm_a $vm_b $vm_c $vm_a6"
echo $? >"$work/a.setup.rc"
cat "$work/a.setup.out"
kcounters b before

say "1. pvcm VM a -> kernel b: cmtime, $conns connections"
kexec a t1 900 "$lab attach --socket /tmp/a.sock cmtime --dest $b_ip --connections $conns --timeout 300; echo rc=\$?"

say "2. kernel b -> pvcm VM a: cmtime -s $vm_a -c $conns"
kexec a t2srv 10 "($lab attach --socket /tmp/a.sock cmtime --server --connections $conns --timeout 600 >/host/t2srv.log 2>&1; echo \$? >/host/t2srv.rc) &"
guest_grep t2srv.log 'cmtime server on' 60
kexec b t2 900 "cmtime -s $vm_a -c $conns; echo rc=\$?"
guest_wait t2srv.rc 120

say "3a. two VMs behind one umad port, same TCP port 7475: routing by GID (3 to a, 5 to b)"
kexec a t3srv 10 "($lab attach --socket /tmp/a.sock --json cmtime --server --port 7475 --connections 3 --timeout 120 >/host/t3a.log 2>&1; echo \$? >/host/t3a.rc) &
($lab attach --socket /tmp/b.sock --json cmtime --server --port 7475 --connections 5 --timeout 120 >/host/t3b.log 2>&1; echo \$? >/host/t3b.rc) &"
guest_grep t3a.log listening 60 && guest_grep t3b.log listening 60
kexec b t3 300 "cmtime -s $vm_a -p 7475 -c 3; echo rc=\$?; cmtime -s $vm_b -p 7475 -c 5; echo rc=\$?"
guest_wait t3a.rc 60
guest_wait t3b.rc 60

say "3b. two VMs: kernel connect-and-destroy (REJ(TIMEOUT)) to each, routed to the right VM"
kexec a t3lsn 10 "$lab attach --socket /tmp/a.sock --json listen --port 7472 >/host/t3la.log 2>&1 & echo \$! >/tmp/t3la.pid
$lab attach --socket /tmp/b.sock --json listen --port 7472 >/host/t3lb.log 2>&1 & echo \$! >/tmp/t3lb.pid"
guest_grep t3la.log listening 60 && guest_grep t3lb.log listening 60
kexec b t3w 120 "/host/bin/kcm withdraw -s $vm_a -p 7472 -c 5; echo rc=\$?; /host/bin/kcm withdraw -s $vm_b -p 7472 -c 7; echo rc=\$?"
sleep 3
kexec a t3stop 10 'kill $(cat /tmp/t3la.pid) $(cat /tmp/t3lb.pid); sleep 1; true'

say "5. VM c, whose address is not in rxe0's GID table: refused at attach"
kexec a t5 60 "$lab attach --socket /tmp/c.sock --json connect --dest $b_ip --port 7471 --timeout 3; echo rc=\$?"
sleep 1

kcounters b after
kexec a stat 20 "/host/bin/pvcm-backend stat --control /tmp/h.ctl --json >/host/final.stat.json; /host/bin/pvcm-backend stat --control /tmp/h.ctl"
cp "$share/backend.log" "$work/backend.log" 2>/dev/null

say "6. IPv6: pvcm VM a6 ($vm_a6 on guest a's eth0) <-> kernel b ($b_ip6), $conns6 connections each way"
start_listener b "$b_ip6" 7476 || echo "b: $(cat "$work/b.listener7476.out")"
kcounters b v6before
kexec a stat6before 20 "/host/bin/pvcm-backend stat --control /tmp/h.ctl --json >/host/v6before.stat.json"
rm -f "$work/v6.pcap"
dumpcap -q -i br0 -P -f "udp port 4791" -w "$work/v6.pcap" >"$work/dumpcap.log" 2>&1 &
cap_pid=$!
for _ in $(seq 100); do [ -s "$work/v6.pcap" ] && break; sleep 0.1; done
say "6a. pvcm VM a6 -> kernel b over IPv6: cmtime --dest $b_ip6 --port 7476"
kexec a t6a 900 "$lab attach --socket /tmp/a6.sock cmtime --dest $b_ip6 --port 7476 --connections $conns6 --timeout 300; echo rc=\$?"
say "6b. kernel b -> pvcm VM a6 over IPv6: cmtime -s $vm_a6 -c $conns6"
kexec a t6srv 10 "($lab attach --socket /tmp/a6.sock cmtime --server --connections $conns6 --timeout 600 >/host/t6srv.log 2>&1; echo \$? >/host/t6srv.rc) &"
guest_grep t6srv.log 'cmtime server on' 60
kexec b t6b 900 "cmtime -s $vm_a6 -c $conns6; echo rc=\$?"
guest_wait t6srv.rc 120
sleep 1
kill -INT "$cap_pid" 2>/dev/null
wait "$cap_pid" 2>/dev/null
cap_pid=""
kcounters b v6after
kexec a stat6 20 "/host/bin/pvcm-backend stat --control /tmp/h.ctl --json >/host/v6after.stat.json"

say "7. a VM added at runtime (pvcm-backend vm add) to the umad port: $vm_d on eth0, 100 connections to kernel b, then vm remove"
start_listener b "$b_ip" 7477 || echo "b: $(cat "$work/b.listener7477.out")"
ctl="/host/bin/pvcm-backend vm --control /tmp/h.ctl"
gid_d="$(netlab_py netlab addr sysfs-gid "$vm_d")"
kexec a t7add 60 "ip addr add $vm_d/24 dev eth0
i=0
until grep -qs $gid_d /sys/class/infiniband/rxe0/ports/1/gids/*; do
    i=\$((i + 1)); [ \$i -lt 100 ] || { echo 'no GID for $vm_d'; break; }; sleep 0.1
done
$ctl add socket=/tmp/d.sock,gid=$vm_d,name=d; echo add_rc=\$?
$ctl list"
kexec a t7 300 "$lab attach --socket /tmp/d.sock cmtime --dest $b_ip --port 7477 --connections 100 --timeout 120; echo rc=\$?"
kexec a t7rm 60 "$ctl remove d; echo remove_rc=\$?; $ctl list"

for f in t2srv.log t2srv.rc t3a.log t3a.rc t3b.log t3b.rc t3la.log t3lb.log final.stat.json \
    t6srv.log t6srv.rc v6before.stat.json v6after.stat.json; do
    cp "$share/$f" "$work/$f" 2>/dev/null
done

netlab_py netlab.umad_checks "$work" "$conns" "$figures" "$conns6" | pyresult
touch "$share/flag.stop"
grep -q '^FAIL' "$results" && exit 1
exit 0
