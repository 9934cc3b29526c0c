#!/usr/bin/env bash
# A pvcm VM run by libvirt: defined, started and destroyed with virsh.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: qemu-scripts/libvirt.sh [--conns N] [--timeout SECS] [--workdir DIR]

Runs libvirt's QEMU driver (libvirtd, Debian's packages, installed if missing) with a
private configuration, state and socket, and a TCG domain made from
qemu-scripts/libvirt/pvcm-domain.xml: the patched QEMU of build-qemu.sh as
<emulator>, libvirt's shared memfd memory, the test guest of build-guest.sh booted
from its kernel and initramfs, and the pvcm device through <qemu:commandline>.
Two pvcm-backend processes ("hosts") on loopback: host A has the domain's VM lv
($NET.1.1), host P the peer VM ($NET.2.1), attached in-process with `pvcm-lab attach`
and running `pvcm-guest cmtime --server`. Checks:

  1 libvirtd up on its private socket; `virsh define` and `virsh start` of the domain;
    the QEMU command line libvirt built has the memfd memory with share=on and the
    vhost-user-device-pci device
  2 the VM attaches to host A and its `pvcm-guest cmtime` client establishes N
    connections to the peer through pvcm (both hosts hold N live entries)
  3 `virsh destroy` while the N connections are up: host A sees the VM detach and
    releases every connection on its behalf (DREQs to the peer, answered); the peer's
    cmtime server counts N disconnected; both hosts drain to 0 live entries; no drops
    but `absorbed` (MADs the mux answers for the departed VM), no DREQ retries
  4 `virsh undefine`: the domain is gone from `virsh list --all`
  5 the QP1 divert comes and goes with the domain: the domain also has a NIC (tap
    pvcmlv0) named in its <pvcm:divert> metadata, and the host package's libvirt hook
    (packaging/host/pvcm-libvirt-hook, installed in the private libvirt's
    hooks/qemu.d) installs the tap's divert (tc filters, the nftables egress table) when
    the domain starts and removes it when it is destroyed

Prints figures and "PASS  N: ..." / "FAIL  N: ..." lines; the last line reads
"libvirt: N passed, N failed". Exit 0 when all passed. On a failure it prints the
console, libvirt's logs and the backends' logs and counters.

Needs root (apt-get, libvirt's system driver, a private mount namespace for libvirt's
/etc, /run, /var/lib, /var/cache and /var/log directories). It creates the system user
libvirt-qemu if it does not exist (the QEMU driver looks it up at start even when
qemu.conf runs QEMU as root, which this test's does).

Options:
  --conns N       connections held when the domain is destroyed (default 200)
  --timeout SECS  boot and connect deadline for the VM (default 300; TCG is slow)
  --workdir DIR   keep logs here (default: a new dir under /tmp, removed on success)
  -h, --help      this help

Environment: PVCM_CACHE, PVCM_LIBVIRT_NET (first two octets of the loopback addresses,
default 127.12).
USAGE
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

conns=200 timeout=300 workdir=""
parse_options --conns=conns --timeout=timeout --workdir=workdir -- "$@"
[[ "$conns" =~ ^[1-9][0-9]*$ ]] || die "--conns must be a positive number"
[[ "$timeout" =~ ^[1-9][0-9]*$ ]] || die "--timeout must be whole seconds"
need_root "libvirt.sh"

net="${PVCM_LIBVIRT_NET:-127.12}"
ip_lv="$net.1.1" ip_peer="$net.2.1" port=7100 dom=pvcm-libvirt-lv
t_start="$(now_s)"
keep_workdir=1
if [ -z "$workdir" ]; then
    workdir="$(mktemp -d /tmp/pvcm-libvirt.XXXXXX)"
    keep_workdir=0
fi
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"
lv="$workdir/libvirt" # libvirtd's private directories
virsh_uri="qemu:///system?socket=$lv/sock/libvirt-sock"
virsh_cmd=(virsh -q -c "$virsh_uri")
vsh() { "${virsh_cmd[@]}" "$@"; }

# Each result line also goes to $PVCM_RESULTS (CI's summary), as the other suites'.
passed=0 failed=0
[ -z "${PVCM_RESULTS:-}" ] || : >"$PVCM_RESULTS"
result() {
    echo "$1  $2: $3"
    [ -z "${PVCM_RESULTS:-}" ] || echo "$1  $2: $3" >>"$PVCM_RESULTS"
}
pass() {
    passed=$((passed + 1))
    result PASS "$1" "$2"
}
fail() {
    failed=$((failed + 1))
    result FAIL "$1" "$2"
}

# ---------------------------------------------------------------- cleanup

bg_pids=() libvirtd_pid="" made_dirs=()
tap=pvcmlv0 divert_dev=pvcmlvq
cleanup() {
    local p qpid=""
    if [ -n "$libvirtd_pid" ] && kill -0 "$libvirtd_pid" 2>/dev/null; then
        # libvirtd leaves running domains running when it stops: destroy first.
        timeout 30 "${virsh_cmd[@]}" destroy "$dom" >/dev/null 2>&1 || true
        timeout 30 "${virsh_cmd[@]}" undefine "$dom" >/dev/null 2>&1 || true
        kill "$libvirtd_pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$libvirtd_pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$libvirtd_pid" 2>/dev/null || true
    fi
    [ -f "$lv/run/qemu/$dom.pid" ] && qpid="$(cat "$lv/run/qemu/$dom.pid" 2>/dev/null || true)"
    if [ -n "$qpid" ] && kill -0 "$qpid" 2>/dev/null; then
        kill -9 "$qpid" 2>/dev/null || true
    fi
    for p in "${bg_pids[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    sleep 0.3
    for p in "${bg_pids[@]}"; do
        kill -9 "$p" 2>/dev/null || true
    done
    for p in "${made_dirs[@]}"; do
        rmdir "$p" 2>/dev/null || true
    done
    bash "$PVCM_SCRIPTS_DIR/qp1-divert.sh" del "$tap" "$divert_dev" >/dev/null 2>&1 || true
    ip link del "$divert_dev" 2>/dev/null || true
    if [ "$keep_workdir" = 0 ] && [ "$failed" = 0 ] && [ "$passed" -gt 0 ]; then
        rm -rf "$workdir"
    else
        echo "logs kept in $workdir"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- what it needs

echo "== setup (builds cached under $PVCM_CACHE)"
t="$(now_s)"
apt_install libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients nftables iproute2
if ! getent passwd libvirt-qemu >/dev/null; then
    # What Debian's libvirt-daemon-system creates; the QEMU driver refuses to start
    # without it. QEMU runs as root here (qemu.conf below).
    log "creating the system user libvirt-qemu"
    useradd --system --user-group --no-create-home --home-dir /var/lib/libvirt \
        --shell /usr/sbin/nologin libvirt-qemu
fi
echo "   libvirt: $(libvirtd --version) ($(elapsed "$t") s)"

t="$(now_s)"
qemu="$("$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path)" || die "build-qemu.sh failed"
echo "   patched QEMU: $qemu ($(elapsed "$t") s)"
t="$(now_s)"
guest_dir="$("$PVCM_SCRIPTS_DIR/build-guest.sh" --print-dir 2>"$workdir/build-guest.log")" || {
    cat "$workdir/build-guest.log"
    die "build-guest.sh failed"
}
echo "   guest image: $guest_dir ($(elapsed "$t") s)"
t="$(now_s)"
(cd "$PVCM_REPO_DIR" && cargo build --release -q -p pvcm-backend --bin pvcm-backend -p pvcm-lab --bin pvcm-lab) \
    >"$workdir/cargo.log" 2>&1 || {
    tail -n 30 "$workdir/cargo.log"
    die "cargo build failed"
}
target="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/release"
backend="$target/pvcm-backend" lab="$target/pvcm-lab"
echo "   pvcm-backend, pvcm-lab: $target ($(elapsed "$t") s)"

# ---------------------------------------------------------------- helpers

# start_backend HOST VM IP: pvcm-backend with one VM; socket $workdir/VM.sock, control
# $workdir/HOST.ctl.
start_backend() {
    local h="$1" vm="$2" ip="$3"
    rm -f "$workdir/$vm.sock" "$workdir/$h.ctl"
    RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$backend" \
        --vm "socket=$workdir/$vm.sock,gid=$(netlab_py netlab addr vm-gid "$ip"),name=$vm" \
        --control "$workdir/$h.ctl" >>"$workdir/$h.backend.log" 2>&1 &
    bg_pids+=($!)
    for _ in $(seq 100); do
        [ -S "$workdir/$h.ctl" ] && [ -S "$workdir/$vm.sock" ] && return 0
        kill -0 "$!" 2>/dev/null || break
        sleep 0.1
    done
    cat "$workdir/$h.backend.log"
    die "pvcm-backend $h did not come up"
}

stat_json() { "$backend" stat --control "$workdir/$1.ctl" --json >"$workdir/$1.stat.json"; }

# figure HOST PATH: one figure of HOST's last stat_json, PATH its keys and list indexes
# with dots, e.g. host.live or vms.0.attached.
figure() { netlab_py netlab.libvirt_suite figure "$workdir/$1.stat.json" "$2"; }

# wait_for SECS WHAT CMD...: until CMD succeeds (every 0.5 s); says what it waited for
# when it gives up.
wait_for() {
    local secs="$1" what="$2" i
    shift 2
    for ((i = 0; i < secs * 2; i++)); do
        "$@" && return 0
        sleep 0.5
    done
    echo "   timeout: $what (after $secs s)"
    return 1
}

live_is() { # live_is HOST N: HOST's backend holds exactly N live entries
    stat_json "$1" 2>/dev/null && [ "$(figure "$1" host.live)" = "$2" ]
}
lv_attached_is() { # lv_attached_is true|false: VM lv's session on host A
    stat_json a 2>/dev/null && [ "$(figure a vms.0.attached)" = "$1" ]
}
dom_state_is() { [ "$(vsh domstate "$dom" 2>/dev/null)" = "$1" ]; }
peer_exited() { ! kill -0 "$peer_pid" 2>/dev/null; }
lv_connected_or_stopped() { ! dom_state_is running || live_is a "$conns"; }

dump() {
    local f
    for f in "$workdir/lv.console.log" "$lv/log/qemu/$dom.log" "$lv/libvirtd.log" \
        "$workdir/libvirtd.out" "$workdir/peer.out" "$workdir/peer.err" \
        "$workdir/a.backend.log" "$workdir/p.backend.log"; do
        [ -s "$f" ] || continue
        echo "----- $f -----"
        tr -d '\r' <"$f" | tail -n 120
    done
    for f in a p; do
        [ -s "$workdir/$f.stat.json" ] || continue
        echo "----- host $f: non-zero figures -----"
        python3 "$PVCM_SCRIPTS_DIR/e2e/checks.py" nonzero "$workdir/$f.stat.json" || true
    done
}

# ---------------------------------------------------------------- libvirtd

# libvirt's system driver keeps its configuration, state, cache and logs in fixed
# directories. libvirtd runs in a private mount namespace with $lv's directories bound
# over them, so the host's own libvirt (if any) is neither read nor touched; its
# sockets are in $lv/sock, which virsh reaches with ?socket=.
start_libvirtd() {
    local d
    mkdir -p "$lv"/{etc,run,lib,cache,log,sock}
    cat >"$lv/etc/libvirtd.conf" <<EOF
unix_sock_dir = "$lv/sock"
unix_sock_group = "root"
unix_sock_rw_perms = "0700"
auth_unix_rw = "none"
auth_unix_ro = "none"
log_outputs = "3:file:$lv/libvirtd.log"
EOF
    # QEMU as root, no security driver, no cgroups, no per-VM /dev namespace, QEMU's
    # output in a file (no virtlogd): what a machine without systemd or AppArmor
    # policy for libvirt needs. docs/libvirt.md says what a real host keeps instead.
    cat >"$lv/etc/qemu.conf" <<'EOF'
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
stdio_handler = "file"
EOF
    # The host package's QP1 divert hook, from the source tree (libvirtd looks for hooks
    # when it starts).
    mkdir -p "$lv/etc/hooks/qemu.d"
    printf '#!/bin/sh\nPVCM_QP1_DIVERT=%s PVCM_DIVERT_STATE=%s exec python3 %s "$@"\n' \
        "'$PVCM_SCRIPTS_DIR/qp1-divert.sh'" "'$lv/divert-state'" \
        "'$PVCM_REPO_DIR/packaging/host/pvcm-libvirt-hook'" \
        >"$lv/etc/hooks/qemu.d/pvcm"
    chmod 755 "$lv/etc/hooks/qemu.d/pvcm"
    for d in /etc/libvirt /run/libvirt /var/lib/libvirt /var/cache/libvirt /var/log/libvirt; do
        if [ ! -d "$d" ]; then
            mkdir -p "$d"
            made_dirs+=("$d")
        fi
    done
    unshare --mount --propagation private bash -c '
        set -e
        lv="$1"
        mount --bind "$lv/etc" /etc/libvirt
        mount --bind "$lv/run" /run/libvirt
        mount --bind "$lv/lib" /var/lib/libvirt
        mount --bind "$lv/cache" /var/cache/libvirt
        mount --bind "$lv/log" /var/log/libvirt
        exec libvirtd -f "$lv/etc/libvirtd.conf" -p "$lv/libvirtd.pid"
    ' libvirtd "$lv" >"$workdir/libvirtd.out" 2>&1 &
    libvirtd_pid=$!
    for _ in $(seq 150); do
        [ -S "$lv/sock/libvirt-sock" ] && break
        kill -0 "$libvirtd_pid" 2>/dev/null || {
            echo "   libvirtd exited"
            return 1
        }
        sleep 0.2
    done
    [ -S "$lv/sock/libvirt-sock" ] || {
        echo "   timeout: no libvirtd socket $lv/sock/libvirt-sock after 30 s"
        return 1
    }
    # The versions, for the log. Without Debian's qemu-system-x86 libvirt finds no default
    # emulator and cannot name the hypervisor's version: the domain names its own.
    timeout 30 "${virsh_cmd[@]}" version >"$workdir/virsh-version.txt" 2>&1 || true
}

# ---------------------------------------------------------------- the test

echo "== pvcm-backend hosts: A (VM lv, $ip_lv), P (peer, $ip_peer)"
start_backend a lv "$ip_lv"
start_backend p peer "$ip_peer"
RUST_LOG=warn "$lab" attach --socket "$workdir/peer.sock" --json cmtime --server --port "$port" \
    --connections "$conns" --timeout $((timeout + 300)) >"$workdir/peer.out" 2>"$workdir/peer.err" &
peer_pid=$!
bg_pids+=("$peer_pid")
wait_for 30 "the peer's cmtime server listening" grep -sEq '"event": ?"listening"' "$workdir/peer.out" || {
    dump
    die "the peer did not start"
}

# 1: libvirtd, define, start.
echo "== 1: libvirtd, virsh define, virsh start"
t="$(now_s)"
ok=1
start_libvirtd || ok=0
[ "$ok" = 1 ] && echo "   $(tr '\n' ' ' <"$workdir/virsh-version.txt")"
guest_cmd="pvcm-guest --json cmtime --dest $ip_peer --port $port --connections $conns --hold 3600 --timeout $timeout"
cmdline="console=ttyS0 panic=-1 hugepages=64 pvcm.cmd=$(printf '%s\n' "$guest_cmd" | base64 -w0)"
: >"$workdir/lv.console.log"
netlab_py netlab.libvirt_suite fill "$PVCM_SCRIPTS_DIR/libvirt/pvcm-domain.xml" "$workdir/$dom.xml" \
    NAME="$dom" MEM_MIB=512 EMULATOR="$qemu" KERNEL="$guest_dir/vmlinuz" \
    INITRD="$guest_dir/initramfs.img" CMDLINE="$cmdline" \
    CONSOLE_LOG="$workdir/lv.console.log" SOCKET="$workdir/lv.sock"
# A NIC whose QP1 frames the divert takes (test 5): its tap, and the metadata the hook reads.
netlab_py netlab.libvirt_suite add-nic "$workdir/$dom.xml" "$tap" "$divert_dev" "$ip_lv"
bash "$PVCM_SCRIPTS_DIR/qp1-divert.sh" dev "$divert_dev" >"$workdir/divert.log" 2>&1 ||
    die "qp1-divert.sh dev failed: $(cat "$workdir/divert.log")"
if [ "$ok" = 1 ]; then
    vsh define "$workdir/$dom.xml" >"$workdir/virsh.log" 2>&1 || ok=0
fi
if [ "$ok" = 1 ]; then
    # With reconnect-ms QEMU waits in device realize until the backend answers, and
    # virsh start returns once QEMU is up: the backend is already listening here.
    timeout 120 "${virsh_cmd[@]}" start "$dom" >>"$workdir/virsh.log" 2>&1 || {
        echo "   virsh start failed or took over 120 s"
        ok=0
    }
fi
qemu_line="$(grep -F -- "$qemu" "$lv/log/qemu/$dom.log" 2>/dev/null | head -n1 || true)"
if [ "$ok" = 1 ]; then
    grep -A200 -F -- "$qemu" "$lv/log/qemu/$dom.log" | tr -d '\\' | tr -s ' \n' ' ' >"$workdir/qemu-cmdline.txt" || true
    for want in '"qom-type":"memory-backend-memfd"' '"share":true' 'memory-backend=pc.ram' \
        "socket,id=pvcm,path=$workdir/lv.sock" 'vhost-user-device-pci,chardev=pvcm'; do
        grep -qF -- "$want" "$workdir/qemu-cmdline.txt" || {
            echo "   QEMU's command line lacks $want"
            ok=0
        }
    done
fi
sed 's/^/   virsh: /' "$workdir/virsh.log"
if [ "$ok" = 1 ]; then
    pass 1 "libvirtd up, domain $dom defined and started, memfd shared memory and the pvcm device on QEMU's command line ($(elapsed "$t") s)"
else
    fail 1 "libvirtd, define, start ($(elapsed "$t") s)${qemu_line:+; QEMU: ${qemu_line:0:200}}"
    dump
    echo "libvirt: $passed passed, $failed failed"
    exit 1
fi

# divert_on: the tap's divert is in place (its tc filters and its nftables table).
divert_on() {
    local filters
    # Read whole, then matched: under pipefail, grep -q leaving early can make tc die
    # of SIGPIPE and the pipeline fail although the filter is there.
    filters="$(tc filter show dev "$tap" egress 2>/dev/null || true)"
    [[ "$filters" == *mirred* ]] && nft list table netdev "pvcm-$tap" >/dev/null 2>&1
}
divert_at_start=no
wait_for 10 "the hook's divert of $tap" divert_on && divert_at_start=yes
echo "   the QP1 divert of $tap after virsh start: $divert_at_start"

# 2: the VM attaches and connects through pvcm.
echo "== 2: VM lv boots (TCG), attaches to host A and connects $conns times to the peer"
t="$(now_s)"
ok=1
wait_for 60 "VM lv attached to host A" lv_attached_is True || ok=0
[ "$ok" = 1 ] && echo "   attached after $(elapsed "$t") s"
if [ "$ok" = 1 ]; then
    # Ends early when the domain stops (the guest's command failed and it powered off).
    wait_for "$timeout" "$conns live entries on host A" lv_connected_or_stopped || ok=0
    if ! dom_state_is running; then
        echo "   the domain stopped: $(vsh domstate --reason "$dom" 2>&1); the guest's output:"
        tr -d '\r' <"$workdir/lv.console.log" | sed -n '/^PVCM-BEGIN$/,$p' | tail -n 20 | sed 's/^/   | /'
        ok=0
    fi
    [ "$ok" = 1 ] && { live_is a "$conns" || ok=0; }
fi
if [ "$ok" = 1 ]; then
    wait_for 30 "$conns live entries on host P" live_is p "$conns" || ok=0
fi
stat_json a || true
stat_json p || true
echo "   host A live $(figure a host.live), VM lv live $(figure a vms.0.figures.live), host P live $(figure p host.live)"
if [ "$ok" = 1 ] && ! dom_state_is running; then
    echo "   domain state: $(vsh domstate "$dom" 2>&1)"
    ok=0
fi
if [ "$ok" = 1 ]; then
    pass 2 "the libvirt VM holds $conns connections to the peer through pvcm ($(elapsed "$t") s after start)"
else
    fail 2 "the libvirt VM did not connect ($(elapsed "$t") s)"
fi

# check_release: the figures of test 3 (the peer's report, both hosts' counters).
check_release() {
    netlab_py netlab.libvirt_suite release "$workdir" "$conns" "${peer_rc:-none}"
}

# 3: virsh destroy releases its connections.
echo "== 3: virsh destroy with the connections up"
t="$(now_s)"
ok3=1
timeout 60 "${virsh_cmd[@]}" destroy "$dom" >"$workdir/destroy.log" 2>&1 || {
    sed 's/^/   virsh: /' "$workdir/destroy.log"
    ok3=0
}
echo "   virsh destroy returned after $(elapsed "$t") s"
wait_for 30 "domain $dom shut off" dom_state_is "shut off" || ok3=0
wait_for 30 "host A to see VM lv detach" lv_attached_is False || ok3=0
echo "   detached after $(elapsed "$t") s"
if [ "$ok" = 1 ]; then
    peer_rc=""
    if wait_for 90 "the peer's cmtime server to count every disconnect" peer_exited; then
        peer_rc=0
        wait "$peer_pid" || peer_rc=$?
        echo "   peer's cmtime server exited $peer_rc after $(elapsed "$t") s"
    else
        ok3=0
    fi
    wait_for 90 "host A to drain to 0 live entries" live_is a 0 || ok3=0
    wait_for 30 "host P to drain to 0 live entries" live_is p 0 || ok3=0
    echo "   both hosts at 0 live entries after $(elapsed "$t") s"
    stat_json a || ok3=0
    stat_json p || ok3=0
    check_release || ok3=0
else
    echo "   the VM never held its connections: nothing to release"
    ok3=0
fi
if [ "$ok" = 1 ] && [ "$ok3" = 1 ]; then
    pass 3 "virsh destroy: host A released all $conns connections on the VM's behalf, the peer saw each disconnect, both hosts at 0 live ($(elapsed "$t") s)"
else
    fail 3 "virsh destroy and the release of the VM's connections ($(elapsed "$t") s)"
fi

# 5: the divert went with the domain.
echo "== 5: the QP1 divert comes and goes with the domain (libvirt hook)"
if [ "$divert_at_start" = yes ] && ! nft list table netdev "pvcm-$tap" >/dev/null 2>&1; then
    pass 5 "the hook installed the divert of $tap (tc filters, nftables table pvcm-$tap) when the domain started and removed it when it was destroyed"
else
    left=gone
    nft list table netdev "pvcm-$tap" >/dev/null 2>&1 && left="still there"
    fail 5 "the divert of $tap: at start $divert_at_start, after destroy $left; libvirtd's log: $(grep -i hook "$lv/libvirtd.log" 2>/dev/null | tail -n 3 | tr '\n' ' ')"
fi

# 4: undefine.
echo "== 4: virsh undefine"
ok=1
vsh undefine "$dom" >"$workdir/undefine.log" 2>&1 || {
    sed 's/^/   virsh: /' "$workdir/undefine.log"
    ok=0
}
if vsh list --all --name | grep -qx "$dom"; then
    echo "   $dom is still listed"
    ok=0
fi
if [ "$ok" = 1 ]; then pass 4 "domain undefined"; else fail 4 "virsh undefine"; fi

[ "$failed" = 0 ] || dump
echo "libvirt: $passed passed, $failed failed ($(elapsed "$t_start") s)"
[ "$failed" = 0 ]
