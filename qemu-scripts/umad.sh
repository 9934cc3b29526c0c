#!/usr/bin/env bash
# pvcm's umad port against the real Linux kernel CM, both in guests of the RDMA image.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: qemu-scripts/umad.sh [--conns N] [--conns6 N] [--workdir DIR]

Runs pvcm-backend with --port umad:rxe0:1 (CM MADs through rxe0's QP1 via
/dev/infiniband/umad0) inside a guest of the RDMA image (build-guest.sh --rdma) in
the network lab (python3 -m netlab run) without the kernel CM (a, 10.99.0.2),
with in-process pvcm VMs attached by `pvcm-lab attach` (VM a 10.99.0.11 and VM b
10.99.0.12, both added to the guest's eth0 so rxe0 has their RoCE v2 GIDs; VM c
10.99.0.13 is not), against the kernel CM of a second guest (b, 10.99.0.3). Tests:

  0 pvcm-backend --port umad:rxe0 where ib_cm is loaded (guest b): refused at
    startup with an error that names ib_cm and how to unload it
  1 pvcm VM a -> kernel: pvcm-guest cmtime (through pvcm-lab attach), N connections
  2 kernel -> pvcm VM a: cmtime -s VM -c N against pvcm cmtime --server
  3a two VMs, one umad port, the same TCP port: the kernel connects 3 to a and 5 to b,
    each VM gets exactly its own (routing by GID)
  3b the kernel connects and destroys at once (kcm withdraw) 5 times to a and 7 to b:
    each VM sees its requests withdrawn by the REJ(TIMEOUT)s meant for it
  4 the teardowns of tests 1 and 2 (all N connections at once): no CM retries or
    duplicates in the kernel's counters or pvcm-backend's, and no drops
  5 VM c, whose address is not in the GID table: refused at attach
  5b the backend read the device's local CA ACK delay (ibv_devinfo; rxe: 15), which VMs report
  6 IPv6: the guests also have fd99::2 (a) and fd99::3 (b); pvcm VM a6 (fd99::11,
    added to a's eth0 as a /128, nodad) on the same umad port
    6a pvcm VM a6 -> kernel: pvcm-guest cmtime --dest fd99::3 (a listener bound to
       fd99::3), N6 connections
    6b kernel -> pvcm VM a6: cmtime -s fd99::11 -c N6
    6c over 6a and 6b: no CM retries or duplicates in the kernel's counters or
       pvcm-backend's, no drops, every pvcm MAD taken by the kernel CM, and br0's
       capture (dumpcap) holds only IPv6 RoCEv2 CM MADs between fd99::11 and fd99::3,
       as many each way as the umad port sent and received for VM a6
  7 a VM added at runtime: 10.99.0.14 added to a's eth0, `pvcm-backend vm add`
    (listed by `vm list`), 100 connections to the kernel (cmtime --port 7477) set up
    and torn down through it, then `vm remove` (gone from `vm list`)

Prints figures (cmtime connect/disconnect totals, counters), then a summary of a line
per test (PASS or FAIL, the test, what failed), written to the file PVCM_RESULTS names
if it is set. The last line reads "umad: N passed, N failed". Exit 0 when all passed.

Options:
  --conns N      connections for tests 1 and 2 (default 500)
  --conns6 N     connections for tests 6a and 6b (default 200)
  --workdir DIR  keep logs here (default: a new dir under /tmp, removed on success)
  -h, --help     this help

Needs root (network namespace, taps). Builds the patched QEMU and the RDMA image, and
installs gcc and librdmacm-dev (for kcm, qemu-scripts/interop/kcm.c) and
wireshark-common (dumpcap).
USAGE
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

conns=500 conns6=200 workdir=""
parse_options --conns=conns --conns6=conns6 --workdir=workdir -- "$@"
for n in "$conns" "$conns6"; do
    case "$n" in '' | *[!0-9]* | 0) die "--conns and --conns6 need a positive number, not '$n'" ;; esac
done
need_root "umad.sh (network namespace, taps)"

keep=1
if [ -z "$workdir" ]; then
    workdir="$(mktemp -d /tmp/pvcm-umad.XXXXXX)"
    keep=0
fi
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"
share="$workdir/share"
rm -rf "$share"
mkdir -p "$share/q" "$share/bin"

echo "== build (cached)"
t="$(now_s)"
apt_install iproute2 util-linux python3 gcc librdmacm-dev wireshark-common
"$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path >/dev/null || die "build-qemu.sh failed"
"$PVCM_SCRIPTS_DIR/build-guest.sh" --rdma --print-dir >/dev/null 2>"$workdir/build-rdma-guest.log" || {
    cat "$workdir/build-rdma-guest.log"
    die "build-guest.sh --rdma failed"
}
# Dynamic binaries: the guests run Debian 12's glibc, as the host.
(cd "$PVCM_REPO_DIR" && cargo build --release -q -p pvcm-backend --bin pvcm-backend &&
    cargo build --release -q -p pvcm-lab --bin pvcm-lab) || die "cargo build failed"
target="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/release"
cp "$target/pvcm-backend" "$target/pvcm-lab" "$share/bin/"
# The RDMA image has Debian 12's libc6 and what rdma-core needs: bring the libraries the
# binaries need that it may lack (same glibc 2.36 as the host).
mkdir -p "$share/lib"
for lib in $(ldd "$target/pvcm-lab" "$target/pvcm-backend" | awk '$3 ~ /^\// { print $3 }' | sort -u); do
    case "$(basename "$lib")" in libc.so.* | ld-linux*) ;; *) cp -L "$lib" "$share/lib/" ;; esac
done
gcc -O2 -Wall -Wextra -Werror -o "$share/bin/kcm" \
    "$PVCM_SCRIPTS_DIR/interop/kcm.c" -lrdmacm || die "building kcm failed"
cp "$PVCM_SCRIPTS_DIR/umad/aprep.sh" "$share/aprep.sh"
echo "   ready in $(elapsed "$t") s"

echo "== run: guest a (no kernel CM: pvcm-backend on umad:rxe0:1 + pvcm VMs), guest b (kernel CM)"
rc=0
t="$(now_s)"
IOP_WORK="$workdir" IOP_SHARE="$share" IOP_CONNS="$conns" IOP_CONNS6="$conns6" \
    netlab_py netlab run \
    --workdir "$workdir" --timeout 1800 --guest a=10.99.0.2,fd99::2:pvcm --guest b=10.99.0.3,fd99::3 \
    -- bash "$PVCM_SCRIPTS_DIR/umad/host.sh" || rc=$?
echo "   run took $(elapsed "$t") s (netlab run exit $rc)"

echo "== figures"
cat "$workdir/figures.txt" 2>/dev/null || true
results="$workdir/results.txt"
[ -s "$results" ] || {
    echo "no results; host side:"
    tail -n 40 "$workdir/host.out" 2>/dev/null || true
}
results_run "$results" "$rc" "netlab run" "$(netlab_exit "$rc")"
echo "== summary"
results_report "$results"
if [ "$results_failed" = 0 ] && [ "$keep" = 0 ]; then
    rm -rf "$workdir"
elif [ "$results_failed" != 0 ]; then
    echo "logs in $workdir"
fi
echo "umad: $results_passed passed, $results_failed failed"
[ "$results_failed" = 0 ]
