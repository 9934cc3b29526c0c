# shellcheck shell=bash
# Shared by the host-side scripts of qemu-scripts/interop.sh (host.sh: the interop
# tests; bench.sh: the benchmark) and umad.sh (umad/host.sh). Source it inside the
# network lab's namespace (python3 -m netlab run) with $work, $share and the IOP_*
# variables set.

# shellcheck disable=SC2154 # $work and $share come from the script that sources this

# lib.sh: netlab_py, for the checks and the address helpers.
# shellcheck source-path=SCRIPTDIR source=../lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

# kexec PEER NAME TIMEOUT 'CMD': runs CMD in guest PEER through its agent (the RDMA
# image's pvcm.agent loop: /host/q/PEER.*.sh, one at a time); its output goes to
# $work/PEER.NAME.out; returns its status (124 on timeout).
seq_no=0
kexec() {
    local peer="$1" name="$2" t="$3" cmd="$4" q i
    seq_no=$((seq_no + 1))
    q="$share/q/$peer.$seq_no-$name"
    printf '%s\n' "$cmd" >"$q.tmp" && mv "$q.tmp" "$q.sh"
    for ((i = 0; i < t * 10; i++)); do
        if [ -e "$q.rc" ]; then
            cp "$q.out" "$work/$peer.$name.out"
            return "$(cat "$q.rc")"
        fi
        sleep 0.1
    done
    echo "kexec $peer $name: no answer in $t s" >"$work/$peer.$name.out"
    return 124
}

# The kernel CM's counters of rxe0 port 1: "group/message value" lines. Linux 6.1
# keeps them under the port (ib_port_register_client_groups); older kernels had
# /sys/class/infiniband_cm/rxe0/1.
kcounters() { # kcounters PEER TAG
    kexec "$1" "counters-$2" 20 'for d in /sys/class/infiniband/rxe0/ports/1 /sys/class/infiniband_cm/rxe0/1; do [ -d $d/cm_rx_msgs ] && break; done; cd $d && for g in cm_tx_msgs cm_tx_retries cm_rx_msgs cm_rx_duplicates; do for f in $g/*; do echo "$f $(cat $f)"; done; done'
}

# wait_kernel_peers: until the agents of k and j run.
wait_kernel_peers() {
    local p
    for p in k j; do
        for _ in $(seq 300); do [ -e "$share/flag.ready.$p" ] && break; sleep 0.2; done
    done
}

# prime_neighbors ADDR...: resolves each address's link-layer neighbor on the host (one
# datagram to the discard port, then until the entry is usable, at most 5 s each). A host
# that has not talked to a peer yet queues what it sends there while it resolves it, and
# drops what overflows that queue (net.ipv*.neigh.DEV.unres_qlen_bytes): a passive
# side's burst of REPs to a peer whose REQs came in faster than its neighbor solicitation
# was answered loses some, which reach no counter of pvcm's (only the kernel's
# unresolved_discards, see below), and the CM's retries recover them seconds later.
prime_neighbors() {
    local a
    for a in "$@"; do
        echo >"/dev/udp/$a/9" 2>/dev/null || true
        for _ in $(seq 50); do
            ip neigh show to "$a" | grep -Eq 'REACHABLE|STALE|DELAY|PROBE' && break
            sleep 0.1
        done
    done
}

# unresolved_discards: the frames the kernel has dropped while resolving neighbors, ARP
# and NDP together (the sum over CPUs of /proc/net/stat/*_cache's unresolved_discards).
unresolved_discards() {
    local f n=0 cols
    for f in /proc/net/stat/arp_cache /proc/net/stat/ndisc_cache; do
        [ -r "$f" ] || continue
        while read -r -a cols; do
            [[ ${cols[11]:-} =~ ^[0-9a-f]+$ ]] && n=$((n + 16#${cols[11]}))
        done <"$f"
    done
    echo "$n"
}

# start_listener PEER [ADDR PORT]: rdma-core's cmtime listening in PEER, in the
# background (it never exits): on 0.0.0.0 port 7471, or bound to ADDR (cmtime -b, an
# IPv6 address too) on PORT; returns once the kernel lists its listening cm_id. The
# output of the request goes to $work/PEER.listener.out (with ADDR:
# PEER.listenerPORT.out), cmtime's to the share's cmtime-listener.PEER[.PORT].log.
start_listener() {
    local addr="${2:-0.0.0.0}" port="${3:-7471}" bind="" tag=listener log="$1"
    if [ $# -ge 2 ]; then
        bind="-b $addr" tag="listener$port" log="$1.$port"
    fi
    kexec "$1" "$tag" 60 "cmtime $bind -p $port >/host/cmtime-listener.$log.log 2>&1 &
i=0
until rdma res show cm_id | grep -Eq 'src-addr $addr:$port( |\$)'; do
    i=\$((i + 1))
    [ \$i -lt 200 ] || { echo 'cmtime listener not listening'; cat /host/cmtime-listener.$log.log; exit 1; }
    sleep 0.1
done"
}

# start_backend NAME:ADDR...: one pvcm-backend with a VM per argument (socket
# $work/NAME.sock, control $work/h.ctl); ADDR is IPv4 or IPv6, its GID what `netlab addr
# vm-gid` makes of it. Addresses not yet on br0 are added to it (IPv6: a /64, nodad, so
# the backend can bind it at once).
start_backend() {
    local spec args=() ip name fam gid
    for spec in "$@"; do
        name="${spec%%:*}" ip="${spec#*:}"
        rm -f "$work/$name.sock"
        fam="$(netlab_py netlab addr family "$ip")" && gid="$(netlab_py netlab addr vm-gid "$ip")" ||
            return 1
        if [ "$fam" = 6 ]; then
            ip -6 addr show dev br0 | grep -q "inet6 $ip/" || ip addr add "$ip/64" dev br0 nodad
        else
            ip -4 addr show dev br0 | grep -q "inet $ip/" || ip addr add "$ip/24" dev br0
        fi
        args+=(--vm "socket=$work/$name.sock,gid=$gid,name=$name")
    done
    rm -f "$work/h.ctl"
    RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$IOP_BACKEND" "${args[@]}" --control "$work/h.ctl" \
        >"$work/backend.log" 2>&1 &
    # shellcheck disable=SC2034 # used by the scripts that source this
    backend_pid=$!
    for _ in $(seq 100); do [ -S "$work/h.ctl" ] && break; sleep 0.1; done
}
stat_json() { "$IOP_BACKEND" stat --control "$work/h.ctl" --json >"$work/$1.stat.json"; }

# vm_start NAME 'CMD' [SOCKET]: a pvcm QEMU VM (TCG) on the backend, in the background.
vm_start() {
    # A log left by an earlier run in the same --workdir would answer vm_console at once.
    rm -f "$work/$1.console.log" "$work/$1.out" "$work/$1.err"
    "$IOP_RUNVM" --quiet --socket "$work/${3:-vm}.sock" --name "$1" --guest-dir "$IOP_GUEST_DIR" \
        --log "$work/$1.console.log" --timeout 300 --cmd "$2" >"$work/$1.out" 2>"$work/$1.err" &
    eval "vmpid_$1=$!"
}
vm_wait() { local p; eval "p=\$vmpid_$1"; wait "$p"; }
vm_console() { # vm_console NAME PATTERN SECS
    local i p
    eval "p=\$vmpid_$1"
    for ((i = 0; i < $3 * 5; i++)); do
        grep -Eq "$2" "$work/$1.console.log" 2>/dev/null && return 0
        kill -0 "$p" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}
