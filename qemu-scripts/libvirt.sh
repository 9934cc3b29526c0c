#!/usr/bin/env bash
# A pvcm VM run by libvirt: defined, started and destroyed with virsh.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: qemu-scripts/libvirt.sh [--migrate] [--conns N] [--timeout SECS] [--workdir DIR]

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

With --migrate, tests 1, 2, 6 and 4 instead (the domain has no NIC then):

  6 `virsh migrate --live` of the domain holding N connections from libvirtd A to a
    second libvirtd B (its own host_uuid, hostname, configuration, state and socket;
    migration stream over a Unix socket, `--migrateuri unix://...`; `--xml` gives the
    destination its own vhost-user socket and console file) served by a third
    pvcm-backend, host B. The host package's hook adds the VM to host B
    (`vm add ...,incoming=yes`, from the domain's <pvcm:vm> metadata) when B's libvirt
    prepares the incoming migration, and removes it from host A (`vm remove`, the VM
    `departed`) when A's libvirt releases the domain. Checked: host B had no VM lv
    before; host A holds nothing right after and no longer has the VM; the domain runs
    at B, shut off at A; the VM's cmtime (its hold over) tears the N connections down
    itself, through host B: B sent N DREQs and got N DREPs, A sent none, the peer's
    cmtime server counts N established and N disconnected, none failed; 0 drops on the
    three hosts, no DREQ retries

Prints figures and "PASS  N: ..." / "FAIL  N: ..." lines; the last line reads
"libvirt: N passed, N failed". Exit 0 when all passed. On a failure it prints the
console, libvirt's logs and the backends' logs and counters.

Needs root (apt-get, libvirt's system driver, a private mount namespace for libvirt's
/etc, /run, /var/lib, /var/cache and /var/log directories). It creates the system user
libvirt-qemu if it does not exist (the QEMU driver looks it up at start even when
qemu.conf runs QEMU as root, which this test's does).

Options:
  --migrate       the live migration run (tests 1, 2, 6, 4) instead of the destroy run
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

conns=200 timeout=300 workdir="" migrate=0
parse_options --migrate:migrate=1 --conns=conns --timeout=timeout --workdir=workdir -- "$@"
[[ "$conns" =~ ^[1-9][0-9]*$ ]] || die "--conns must be a positive number"
[[ "$timeout" =~ ^[1-9][0-9]*$ ]] || die "--timeout must be whole seconds"
need_root "libvirt.sh"

net="${PVCM_LIBVIRT_NET:-127.12}"
ip_lv="$net.1.1" ip_peer="$net.2.1" ip_b="$net.3.1" port=7100 dom=pvcm-libvirt-lv
# --migrate: the VM's ID range and quota (it must be migratable), and how long its
# cmtime holds the connections before it tears them down itself (the move comes first).
id_range=0x80120000/16 quota=4096 hold=45
if [ "$migrate" = 1 ] && [ "$conns" -gt "$quota" ]; then
    die "--migrate: at most $quota connections"
fi
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
lvb="$workdir/libvirt-b" # --migrate: the second libvirtd's
virsh_b_uri="qemu+unix:///system?socket=$lvb/sock/libvirt-sock"
virsh_b_cmd=(virsh -q -c "$virsh_b_uri")
vsh_b() { "${virsh_b_cmd[@]}" "$@"; }

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

bg_pids=() libvirtd_pid="" libvirtd_b_pid="" made_dirs=()
tap=pvcmlv0 divert_dev=pvcmlvq
# stop_libvirtd PID DIR VIRSH...: destroys and undefines the domain (libvirtd leaves
# running domains running when it stops), stops libvirtd, kills a QEMU left behind.
stop_libvirtd() {
    local pid="$1" dir="$2" qpid=""
    shift 2
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        timeout 30 "$@" destroy "$dom" >/dev/null 2>&1 || true
        timeout 30 "$@" undefine "$dom" >/dev/null 2>&1 || true
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    [ -f "$dir/run/qemu/$dom.pid" ] && qpid="$(cat "$dir/run/qemu/$dom.pid" 2>/dev/null || true)"
    if [ -n "$qpid" ] && kill -0 "$qpid" 2>/dev/null; then
        kill -9 "$qpid" 2>/dev/null || true
    fi
}
cleanup() {
    local p
    stop_libvirtd "$libvirtd_pid" "$lv" "${virsh_cmd[@]}"
    stop_libvirtd "$libvirtd_b_pid" "$lvb" "${virsh_b_cmd[@]}"
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

# start_backend HOST VM IP [KEYS]: pvcm-backend with one VM (KEYS: more of its --vm
# spec, e.g. its ID range); socket $workdir/VM.sock, control $workdir/HOST.ctl.
start_backend() {
    local h="$1" vm="$2" ip="$3" keys="${4:+,$4}"
    rm -f "$workdir/$vm.sock" "$workdir/$h.ctl"
    RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$backend" \
        --vm "socket=$workdir/$vm.sock,gid=$(netlab_py netlab addr vm-gid "$ip"),name=$vm$keys" \
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
# vm_state HOST VM: VM's state in HOST's `vm list` (attached, awaiting, departed, ...),
# "none" when HOST has no such VM.
vm_state() {
    "$backend" vm --control "$workdir/$1.ctl" list 2>/dev/null |
        python3 -c 'import json, sys; print(next((v["state"] for v in json.load(sys.stdin) if v["name"] == sys.argv[1]), "none"))' "$2"
}
vm_state_is() { [ "$(vm_state "$1" "$2")" = "$3" ]; }
dom_state_is() { [ "$(vsh domstate "$dom" 2>/dev/null)" = "$1" ]; }
peer_exited() { ! kill -0 "$peer_pid" 2>/dev/null; }
lv_connected_or_stopped() { ! dom_state_is running || live_is a "$conns"; }

dump() {
    local f
    for f in "$workdir/lv.console.log" "$lv/log/qemu/$dom.log" "$lv/libvirtd.log" \
        "$workdir/libvirtd-a.out" "$workdir/lv-b.console.log" "$lvb/log/qemu/$dom.log" \
        "$lvb/libvirtd.log" "$workdir/libvirtd-b.out" "$workdir/migrate.log" \
        "$workdir/peer.out" "$workdir/peer.err" \
        "$workdir/a.backend.log" "$workdir/b.backend.log" "$workdir/p.backend.log"; do
        [ -s "$f" ] || continue
        echo "----- $f -----"
        tr -d '\r' <"$f" | tail -n 120
    done
    for f in a b p; do
        [ -s "$workdir/$f.stat.json" ] || continue
        echo "----- host $f: non-zero figures -----"
        python3 "$PVCM_SCRIPTS_DIR/e2e/checks.py" nonzero "$workdir/$f.stat.json" || true
    done
}

# ---------------------------------------------------------------- libvirtd

# libvirt's system driver keeps its configuration, state, cache and logs in fixed
# directories. libvirtd runs in a private mount namespace with DIR's directories bound
# over them, so the host's own libvirt (if any) is neither read nor touched; its
# sockets are in DIR/sock, which virsh reaches with ?socket=. Its own UTS namespace
# (hostname pvcm-libvirt-HOST) and host_uuid make it another host to libvirt's
# migration, which refuses a destination with the source's hostname or host UUID.
# start_libvirtd DIR HOST UUID: HOST names the backend (its control socket) the hook
# talks to; sets started_pid.
start_libvirtd() {
    local d dir="$1" host="$2" uuid="$3"
    mkdir -p "$dir"/{etc,run,lib,cache,log,sock}
    cat >"$dir/etc/libvirtd.conf" <<EOF
host_uuid = "$uuid"
unix_sock_dir = "$dir/sock"
unix_sock_group = "root"
unix_sock_rw_perms = "0700"
auth_unix_rw = "none"
auth_unix_ro = "none"
log_outputs = "3:file:$dir/libvirtd.log"
EOF
    # QEMU as root, no security driver, no cgroups, no per-VM /dev namespace, QEMU's
    # output in a file (no virtlogd): what a machine without systemd or AppArmor
    # policy for libvirt needs. docs/libvirt.md says what a real host keeps instead.
    cat >"$dir/etc/qemu.conf" <<'EOF'
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
stdio_handler = "file"
EOF
    # The host package's hook, from the source tree (libvirtd looks for hooks when it
    # starts), with this host's backend and state directories.
    mkdir -p "$dir/etc/hooks/qemu.d"
    {
        echo '#!/bin/sh'
        echo "export PVCM_QP1_DIVERT='$PVCM_SCRIPTS_DIR/qp1-divert.sh' PVCM_DIVERT_STATE='$dir/divert-state'"
        echo "export PVCM_BACKEND='$backend' PVCM_BACKEND_CONTROL='$workdir/$host.ctl' PVCM_VM_STATE='$dir/vm-state'"
        echo "exec python3 '$PVCM_REPO_DIR/packaging/host/pvcm-libvirt-hook' \"\$@\""
    } >"$dir/etc/hooks/qemu.d/pvcm"
    chmod 755 "$dir/etc/hooks/qemu.d/pvcm"
    for d in /etc/libvirt /run/libvirt /var/lib/libvirt /var/cache/libvirt /var/log/libvirt; do
        if [ ! -d "$d" ]; then
            mkdir -p "$d"
            made_dirs+=("$d")
        fi
    done
    unshare --mount --uts --propagation private bash -c '
        set -e
        dir="$1"
        hostname "$2"
        mount --bind "$dir/etc" /etc/libvirt
        mount --bind "$dir/run" /run/libvirt
        mount --bind "$dir/lib" /var/lib/libvirt
        mount --bind "$dir/cache" /var/cache/libvirt
        mount --bind "$dir/log" /var/log/libvirt
        exec libvirtd -f "$dir/etc/libvirtd.conf" -p "$dir/libvirtd.pid"
    ' libvirtd "$dir" "pvcm-libvirt-$host" >"$workdir/libvirtd-$host.out" 2>&1 &
    started_pid=$!
    for _ in $(seq 150); do
        [ -S "$dir/sock/libvirt-sock" ] && break
        kill -0 "$started_pid" 2>/dev/null || {
            echo "   libvirtd exited"
            return 1
        }
        sleep 0.2
    done
    [ -S "$dir/sock/libvirt-sock" ] || {
        echo "   timeout: no libvirtd socket $dir/sock/libvirt-sock after 30 s"
        return 1
    }
}

# ---------------------------------------------------------------- the test

lv_spec="gid=$(netlab_py netlab addr vm-gid "$ip_lv"),name=lv"
if [ "$migrate" = 1 ]; then
    # Migratable: its own ID range. Host B serves a VM of its own (a backend needs one)
    # and learns lv from the hook.
    lv_spec="$lv_spec,id-range=$id_range,quota=$quota"
    echo "== pvcm-backend hosts: A (VM lv, $ip_lv), B (VM bvm, $ip_b; lv by migration), P (peer, $ip_peer)"
    start_backend a lv "$ip_lv" "id-range=$id_range,quota=$quota"
    start_backend b bvm "$ip_b"
else
    echo "== pvcm-backend hosts: A (VM lv, $ip_lv), P (peer, $ip_peer)"
    start_backend a lv "$ip_lv"
fi
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
started_pid=""
start_libvirtd "$lv" a 5c0fa11e-0000-4000-8000-00000000000a || ok=0
libvirtd_pid="$started_pid"
if [ "$ok" = 1 ]; then
    # The versions, for the log. Without Debian's qemu-system-x86 libvirt finds no
    # default emulator and cannot name the hypervisor's version: the domain names its own.
    timeout 30 "${virsh_cmd[@]}" version >"$workdir/virsh-version.txt" 2>&1 || true
    echo "   $(tr '\n' ' ' <"$workdir/virsh-version.txt")"
fi
if [ "$ok" = 1 ] && [ "$migrate" = 1 ]; then
    started_pid=""
    start_libvirtd "$lvb" b 5c0fa11e-0000-4000-8000-00000000000b || ok=0
    libvirtd_b_pid="$started_pid"
fi
# The VM holds its connections; in the migration run for $hold s, then it tears them
# down itself (at host B by then).
hold_s=3600
[ "$migrate" = 1 ] && hold_s="$hold"
guest_cmd="pvcm-guest --json cmtime --dest $ip_peer --port $port --connections $conns --hold $hold_s --timeout $timeout"
cmdline="console=ttyS0 panic=-1 hugepages=64 pvcm.cmd=$(printf '%s\n' "$guest_cmd" | base64 -w0)"
: >"$workdir/lv.console.log"
netlab_py netlab.libvirt_suite fill "$PVCM_SCRIPTS_DIR/libvirt/pvcm-domain.xml" "$workdir/$dom.xml" \
    NAME="$dom" MEM_MIB=512 EMULATOR="$qemu" KERNEL="$guest_dir/vmlinuz" \
    INITRD="$guest_dir/initramfs.img" CMDLINE="$cmdline" \
    CONSOLE_LOG="$workdir/lv.console.log" SOCKET="$workdir/lv.sock"
if [ "$migrate" = 1 ]; then
    # The VM's spec (less its socket) for the hook on a migration.
    netlab_py netlab.libvirt_suite add-vm "$workdir/$dom.xml" "$lv_spec"
else
    # A NIC whose QP1 frames the divert takes (test 5): its tap, and the metadata the
    # hook reads.
    netlab_py netlab.libvirt_suite add-nic "$workdir/$dom.xml" "$tap" "$divert_dev" "$ip_lv"
    bash "$PVCM_SCRIPTS_DIR/qp1-divert.sh" dev "$divert_dev" >"$workdir/divert.log" 2>&1 ||
        die "qp1-divert.sh dev failed: $(cat "$workdir/divert.log")"
fi
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
if [ "$migrate" = 0 ]; then
    wait_for 10 "the hook's divert of $tap" divert_on && divert_at_start=yes
    echo "   the QP1 divert of $tap after virsh start: $divert_at_start"
else
    # Host B's libvirt probes the emulator the first time it sees it: now, while the VM
    # boots, not in the migration.
    t="$(now_s)"
    timeout 120 "${virsh_b_cmd[@]}" domcapabilities --emulatorbin "$qemu" --arch x86_64 \
        --machine q35 --virttype qemu >/dev/null 2>"$workdir/domcaps-b.err" ||
        echo "   host B's libvirt did not probe $qemu: $(head -c 300 "$workdir/domcaps-b.err")"
    echo "   host B's libvirt probed the emulator ($(elapsed "$t") s)"
fi

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

# destroy_run: tests 3 and 5 (the run without --migrate).
destroy_run() {
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
}

# migrate_run: test 6 (the run with --migrate).
migrate_run() {
    local ok6=1 dst_xml="$workdir/$dom-b.xml" mig_t mig_s
    echo "== 6: virsh migrate --live to libvirtd B with the connections up"
    t="$(now_s)"
    if [ "$ok" != 1 ]; then
        fail 6 "live migration: the VM never held its connections"
        return
    fi
    echo "   host B before: VM lv $(vm_state b lv)"
    vm_state_is b lv none || ok6=0
    # The destination's domain: the source's migratable XML with host B's socket and a
    # console file of its own (--xml; on two real hosts the same paths would do).
    vsh dumpxml --migratable "$dom" >"$workdir/$dom-a.xml" || ok6=0
    sed -e "s|path=$workdir/lv.sock,|path=$workdir/lv-b.sock,|" \
        -e "s|$workdir/lv.console.log|$workdir/lv-b.console.log|" \
        "$workdir/$dom-a.xml" >"$dst_xml"
    : >"$workdir/lv-b.console.log"
    rm -f "$workdir/mig.sock"
    mig_t="$(now_s)"
    timeout 300 "${virsh_cmd[@]}" migrate --live --verbose "$dom" "$virsh_b_uri" \
        --migrateuri "unix://$workdir/mig.sock" --xml "$dst_xml" >"$workdir/migrate.log" 2>&1 || {
        sed 's/^/   virsh: /' "$workdir/migrate.log" | tail -n 5
        ok6=0
    }
    mig_s="$(elapsed "$mig_t")"
    echo "   virsh migrate returned after $mig_s s: at A $(vsh domstate "$dom" 2>&1), at B $(vsh_b domstate "$dom" 2>&1)"
    stat_json a || ok6=0
    stat_json b || ok6=0
    echo "   right after: host A live $(figure a host.live) quarantined $(figure a host.quarantined), host B live $(figure b host.live)"
    [ "$(figure a host.live)" = 0 ] && [ "$(figure a host.quarantined)" = 0 ] || {
        echo "   host A still holds entries"
        ok6=0
    }
    dom_state_is "shut off" || ok6=0
    [ "$(vsh_b domstate "$dom" 2>/dev/null)" = running ] || ok6=0
    echo "   VM lv at host B: $(vm_state b lv) ($(figure b host.live) live)"
    [ "$(figure b host.live)" = "$conns" ] || ok6=0
    # The hook's release at A: the VM departed, A forgets it.
    wait_for 30 "host A to forget VM lv (the hook's vm remove)" vm_state_is a lv none || ok6=0
    echo "   host A after: VM lv $(vm_state a lv)"
    peer_rc=""
    if wait_for $((hold + 120)) "the VM's teardown (its hold is $hold s) and the peer's cmtime server to exit" peer_exited; then
        peer_rc=0
        wait "$peer_pid" || peer_rc=$?
        echo "   peer's cmtime server exited $peer_rc after $(elapsed "$t") s"
    else
        ok6=0
    fi
    wait_for 60 "host B to drain to 0 live entries" live_is b 0 || ok6=0
    wait_for 30 "host P to drain to 0 live entries" live_is p 0 || ok6=0
    stat_json a || ok6=0
    stat_json b || ok6=0
    stat_json p || ok6=0
    netlab_py netlab.libvirt_suite migrated "$workdir" "$conns" "${peer_rc:-none}" || ok6=0
    if [ "$ok6" = 1 ]; then
        pass 6 "virsh migrate --live to a second libvirtd: host B learnt VM lv from the hook, host A let it go and forgot it, the $conns connections lived on and were torn down by the VM through host B, 0 drops (virsh migrate $mig_s s; $(elapsed "$t") s)"
    else
        fail 6 "virsh migrate --live and the VM's connections ($(elapsed "$t") s)"
    fi
}

if [ "$migrate" = 1 ]; then
    migrate_run
else
    destroy_run
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
