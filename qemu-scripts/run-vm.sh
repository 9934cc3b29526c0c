#!/usr/bin/env bash
# Start one TCG VM (optionally attached to a pvcm-backend), run a command in it, and
# exit with the command's status.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: qemu-scripts/run-vm.sh [options] --cmd 'COMMAND'

Boots the guest image of build-guest.sh (Debian kernel + busybox initramfs) in QEMU,
runs COMMAND in it with /bin/sh, prints what COMMAND wrote (the console text between
PVCM-BEGIN and PVCM-END rc=N) and exits with COMMAND's exit status. On any failure
(QEMU error, timeout, no markers) it prints the whole console log.

Options:
  --route generic|gpio-stub  how the pvcm device is attached (default: generic)
        generic:   patched QEMU (build-qemu.sh), vhost-user-device-pci with
                   virtio-id=63 (PCI 1af4:107f), 2 queues of --vq-size, 8 config bytes
        gpio-stub: Debian's QEMU 10 (qemu-system-x86 from bookworm-backports, installed
                   if missing), vhost-user-gpio-pci: virtio ID 41 (PCI 1af4:1069),
                   2 queues of 64
  --socket PATH      pvcm-backend's vhost-user socket; without it, no pvcm device
  --reconnect-ms N   chardev reconnect-ms (default: 1000 with the patched QEMU, which
                     waits for the backend at start and reconnects after a backend
                     restart; 0 with any other QEMU, whose vhost-user-base devices
                     fail at start with reconnect-ms: then run-vm.sh waits for the
                     socket file itself before starting QEMU)
  --cmd 'COMMAND'    shell command(s) to run in the guest (default: uname -a)
  --cmd-file FILE    run FILE (a sh script) instead
  --file SRC[:DEST]  put SRC into the guest at DEST (default /root/<name>) through a
                     per-run overlay initramfs (repeatable)
  --mem SIZE         guest memory (default 512M); shared memfd, as vhost-user needs
  --smp N            vCPUs (default 1)
  --hugepages N      2 MiB hugepages reserved at boot (default 64)
  --log FILE         serial console log (default: a new file under $PVCM_CACHE/logs)
  --timeout SECS     kill the VM and fail after SECS (default 120)
  --qemu PATH        QEMU binary (default: the patched build for generic, Debian's
                     /usr/bin/qemu-system-x86_64 for gpio-stub)
  --kvm              try KVM first (-accel kvm -accel tcg); default is TCG only
  --guest-dir DIR    image directory (default: build-guest.sh --print-dir)
  --append ARGS      extra kernel command line arguments
  --virtio-id N      generic route: virtio device ID (default 63)
  --vq-size N        generic route: queue size (default 1024, QEMU's maximum)
  --num-vqs N        generic route: number of queues (default 2)
  --config-size N    generic route: config space bytes (default 8)
  --name NAME        VM name (log file names, QEMU -name)
  --qmp PATH         a QMP socket at PATH (qemu-scripts/qmp.py drives it: migrate, quit)
  --incoming URI     start as a live-migration destination (QEMU -incoming URI, e.g.
                     unix:/tmp/m.sock): the guest arrives running its command, so the
                     console has its PVCM-END but not its PVCM-BEGIN
  --quiet            print only the command's output (no progress lines)
  --print-cmdline    print the QEMU command line and exit
  -h, --help         this help

Exit status: COMMAND's status; 124 timeout; 125 no PVCM-END marker (guest crashed or
command killed the VM); 126 QEMU failed to start; 2 usage error.

Environment: PVCM_CACHE (default ~/.cache/pvcm).
EOF
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

route=generic socket="" cmd="uname -a" cmd_file="" mem=512M smp=1 hugepages=64
log_file="" timeout=120 qemu="" kvm=0 guest_dir="" append="" virtio_id=63 vq_size=1024
num_vqs=2 config_size=8 name="" quiet=0 print_cmdline=0 reconnect_ms="" qmp="" incoming=""
files=()
usage_error() {
    printf '[%s] ERROR: %s (see --help)\n' "$_pvcm_prog" "$*" >&2
    exit 2
}
parse_options --kvm:kvm=1 --quiet:quiet=1 --print-cmdline:print_cmdline=1 --route=route --socket=socket \
    --cmd=cmd --cmd-file=cmd_file '--file=files[]' --mem=mem --smp=smp --hugepages=hugepages \
    --log=log_file --timeout=timeout --qemu=qemu --guest-dir=guest_dir --append=append \
    --virtio-id=virtio_id --vq-size=vq_size --num-vqs=num_vqs --config-size=config_size --name=name \
    --reconnect-ms=reconnect_ms --qmp=qmp --incoming=incoming -- "$@"

say() { [ "$quiet" = 1 ] || log "$@"; }

case "$route" in generic | gpio-stub) ;; *) usage_error "--route must be generic or gpio-stub" ;; esac
[[ "$timeout" =~ ^[0-9]+$ ]] || usage_error "--timeout must be whole seconds"
[[ "$hugepages" =~ ^[0-9]+$ ]] || usage_error "--hugepages must be a number"
[[ "$mem" =~ ^[0-9]+[MG]$ ]] || usage_error "--mem must look like 512M or 2G"
if [ -n "$cmd_file" ]; then
    [ -f "$cmd_file" ] || usage_error "--cmd-file: no such file: $cmd_file"
fi
name="${name:-pvcm-vm-$$}"

# ---- QEMU binary ----
if [ -z "$qemu" ]; then
    if [ "$route" = generic ]; then
        qemu="$("$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path)" || die "building the patched QEMU failed"
    else
        qemu="$(debian_qemu10 "for the gpio-stub route")" || exit 1
    fi
fi
[ -x "$qemu" ] || die "QEMU binary not executable: $qemu"
# The patched build (build-qemu.sh) waits for a reconnecting chardev at start; stock
# QEMU 10.0.2's vhost-user-base devices do not ("Failed to set msg fds").
patched=0
[ -f "$(dirname "$qemu")/../.pvcm-built" ] && patched=1
if [ -z "$reconnect_ms" ]; then
    if [ "$patched" = 1 ]; then reconnect_ms=1000; else reconnect_ms=0; fi
fi
[[ "$reconnect_ms" =~ ^[0-9]+$ ]] || usage_error "--reconnect-ms must be a number"
if [ "$route" = generic ] && [ "$patched" = 0 ] && [ -n "$socket" ]; then
    warn "$qemu is not the patched build: stock QEMU refuses -device vhost-user-device-pci"
fi

# ---- guest image ----
if [ -z "$guest_dir" ]; then
    guest_dir="$("$PVCM_SCRIPTS_DIR/build-guest.sh" --print-dir 2>"$PVCM_CACHE/build-guest.err")" || {
        cat "$PVCM_CACHE/build-guest.err" >&2
        die "building the guest image failed"
    }
    [ "$quiet" = 1 ] || grep WARNING "$PVCM_CACHE/build-guest.err" >&2 || true
fi
[ -f "$guest_dir/vmlinuz" ] && [ -f "$guest_dir/initramfs.img" ] ||
    die "no vmlinuz/initramfs.img in $guest_dir (run build-guest.sh)"

# ---- the command: kernel command line (base64) or, if long or with files, an overlay ----
mkdir -p "$PVCM_CACHE/logs"
find "$PVCM_CACHE/logs" -type f -mtime +7 -delete 2>/dev/null || true # old default logs
run_dir="$(mktemp -d "${TMPDIR:-/tmp}/pvcm-run.XXXXXX")"
qpid=""
cleanup() {
    if [ -n "$qpid" ] && kill -0 "$qpid" 2>/dev/null; then
        kill "$qpid" 2>/dev/null || true
        sleep 0.5
        kill -9 "$qpid" 2>/dev/null || true
    fi
    rm -rf "$run_dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -n "$cmd_file" ]; then
    cp "$cmd_file" "$run_dir/cmd.sh"
else
    printf '%s\n' "$cmd" >"$run_dir/cmd.sh"
fi
cmd_b64="$(base64 -w0 <"$run_dir/cmd.sh")"
initrd="$guest_dir/initramfs.img"
kcmd="console=ttyS0 panic=-1 hugepages=$hugepages"
if [ "${#files[@]}" -gt 0 ] || [ "${#cmd_b64}" -gt 1200 ]; then
    ov="$run_dir/overlay"
    mkdir -p "$ov/pvcm"
    cp "$run_dir/cmd.sh" "$ov/pvcm/cmd.sh"
    for f in "${files[@]}"; do
        src="${f%%:*}"
        [ -e "$src" ] || die "--file: no such file: $src"
        if [ "$src" = "$f" ]; then dst="/root/$(basename "$src")"; else dst="${f#*:}"; fi
        mkdir -p "$ov/$(dirname "$dst")"
        cp -a "$src" "$ov/$dst"
    done
    (cd "$ov" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner=0:0 --quiet) |
        gzip -n -1 >"$run_dir/overlay.img"
    cat "$guest_dir/initramfs.img" "$run_dir/overlay.img" >"$run_dir/initrd.img"
    initrd="$run_dir/initrd.img"
else
    kcmd="$kcmd pvcm.cmd=$cmd_b64"
fi
[ -n "$append" ] && kcmd="$kcmd $append"

# ---- QEMU command line ----
[ -n "$log_file" ] || log_file="$PVCM_CACHE/logs/$name.$(date +%Y%m%d-%H%M%S).console.log"
qemu_err="$log_file.qemu-stderr"

args=(-name "$name" -nodefaults -no-user-config -nographic -no-reboot)
if [ "$kvm" = 1 ]; then
    args+=(-accel kvm -accel tcg -cpu max)
else
    args+=(-accel tcg)
fi
args+=(
    -machine "q35,memory-backend=mem"
    -object "memory-backend-memfd,id=mem,size=$mem,share=on"
    -m "$mem" -smp "$smp"
    -serial "file:$log_file" -monitor none
    -kernel "$guest_dir/vmlinuz" -initrd "$initrd" -append "$kcmd"
)
[ -n "$qmp" ] && args+=(-qmp "unix:$qmp,server=on,wait=off")
[ -n "$incoming" ] && args+=(-incoming "$incoming")
if [ -n "$socket" ]; then
    chardev="socket,id=pvcm,path=$socket"
    [ "$reconnect_ms" -gt 0 ] && chardev="$chardev,reconnect-ms=$reconnect_ms"
    args+=(-chardev "$chardev")
    if [ "$route" = generic ]; then
        args+=(-device "vhost-user-device-pci,chardev=pvcm,virtio-id=$virtio_id,num_vqs=$num_vqs,vq_size=$vq_size,config_size=$config_size")
    else
        args+=(-device "vhost-user-gpio-pci,chardev=pvcm")
    fi
fi

if [ "$print_cmdline" = 1 ]; then
    for a in "$qemu" "${args[@]}"; do
        if [[ "$a" =~ ^[A-Za-z0-9_.,:=/+@%-]+$ ]]; then printf '%s ' "$a"; else printf "'%s' " "${a//\'/\'\\\'\'}"; fi
    done
    echo
    exit 0
fi
mkdir -p "$(dirname "$log_file")"
: >"$log_file"

# ---- run ----
print_log() {
    echo "----- console log ($log_file) -----" >&2
    tr -d '\r' <"$log_file" >&2 || true
    if [ -s "$qemu_err" ]; then
        echo "----- QEMU stderr ($qemu_err) -----" >&2
        cat "$qemu_err" >&2
    fi
    echo "----- end of log -----" >&2
}

t0="$(now_s)"
deadline=$((SECONDS + timeout))
if [ -n "$socket" ] && [ "$reconnect_ms" = 0 ] && [ ! -S "$socket" ]; then
    say "waiting for $socket (QEMU without reconnect-ms needs the backend listening)"
    while [ ! -S "$socket" ]; do
        [ "$SECONDS" -lt "$deadline" ] ||
            { printf '[%s] ERROR: timeout: no socket %s after %s s\n' "$_pvcm_prog" "$socket" "$timeout" >&2; exit 124; }
        sleep 0.2
    done
fi
say "starting $name: route=$route socket=${socket:-none} qemu=$qemu log=$log_file"
"$qemu" "${args[@]}" </dev/null >"$qemu_err" 2>&1 &
qpid=$!
qrc=""
while :; do
    if ! kill -0 "$qpid" 2>/dev/null; then
        set +e
        wait "$qpid"
        qrc=$?
        set -e
        break
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        break
    fi
    sleep 0.2
done

if [ -z "$qrc" ]; then
    kill "$qpid" 2>/dev/null || true
    sleep 1
    kill -9 "$qpid" 2>/dev/null || true
    wait "$qpid" 2>/dev/null || true
    qpid=""
    print_log
    printf '[%s] ERROR: timeout: %s still running after %s s; killed\n' "$_pvcm_prog" "$name" "$timeout" >&2
    exit 124
fi
qpid=""
secs="$(elapsed "$t0")"

clean="$run_dir/console.txt"
tr -d '\r' <"$log_file" >"$clean"
end_line="$(grep -E '^PVCM-END rc=[0-9]+$' "$clean" | tail -n1 || true)"
# A migration destination's console starts mid-command: no PVCM-BEGIN there.
if [ -n "$incoming" ] && ! grep -qx 'PVCM-BEGIN' "$clean" && [ -n "$end_line" ]; then
    sed -i '1i PVCM-BEGIN' "$clean"
fi
if ! grep -qx 'PVCM-BEGIN' "$clean" || [ -z "$end_line" ]; then
    print_log
    if [ "$qrc" != 0 ] && ! grep -q 'PVCM-BEGIN' "$clean"; then
        printf '[%s] ERROR: QEMU exited with %s before the guest ran the command\n' "$_pvcm_prog" "$qrc" >&2
        exit 126
    fi
    printf '[%s] ERROR: no PVCM-BEGIN/PVCM-END markers in the console log (QEMU exit %s)\n' \
        "$_pvcm_prog" "$qrc" >&2
    exit 125
fi
rc="${end_line#PVCM-END rc=}"
# Print the last BEGIN..END section, without the markers.
awk '/^PVCM-BEGIN$/ { buf = ""; on = 1; next }
     /^PVCM-END rc=[0-9]+$/ { if (on) out = buf; on = 0; next }
     on { buf = buf $0 "\n" }
     END { printf "%s", out }' "$clean"
say "$name: guest command exited $rc; VM ran ${secs} s (QEMU exit $qrc)"
if [ "$rc" != 0 ] && [ "$quiet" = 0 ]; then
    print_log
fi
exit "$rc"
