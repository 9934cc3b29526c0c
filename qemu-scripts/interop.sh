#!/usr/bin/env bash
# pvcm against the real Linux kernel CM: interop tests over RoCEv2 with the network lab.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: qemu-scripts/interop.sh [--conns N] [--trials N] [--only LIST] [--mtu N] [--workdir DIR] [--pcap FILE]
       qemu-scripts/interop.sh --bench [--sizes 1000,4000] [--rounds 3] [--workdir DIR]

Runs pvcm against the Linux 6.1 kernel CM over rdma_rxe in the network lab
(qemu-scripts/netlab, python3 -m netlab run): two TCG guests of the RDMA image
(build-guest.sh --rdma) with the kernel CM (k 10.99.0.2 and fd99::2 with a cmtime
listener, j 10.99.0.3 and fd99::3) and, on the same bridge in a private network
namespace, a pvcm-backend whose VM addresses are 10.99.0.1 (VM vm) and fd99::21 (VM
vm6) with a pvcm QEMU VM (TCG, patched QEMU) on one of them at a time. Tests:

  1 kernel -> kernel: cmtime -s k -c N (the baseline figures)
  2 pvcm VM -> kernel listener: pvcm-guest cmtime, N connections up and down
  3 pvcm VM -> a kernel port nobody listens on: rejected, invalid service ID (8)
  4 pvcm VM connect-and-destroy -> a kernel listener (kcm listen, built here from
    interop/kcm.c, which destroys each child cm_id when its connection ends): the
    kernel keeps only its listener (rdma res show cm_id) and sends no REP retry
  5 kernel -> pvcm VM: cmtime -s VM -c N against pvcm-guest cmtime --server
  6 kernel (ucmatose) -> a pvcm VM port nobody listens on: rejected by pvcm
  7 kernel connect-and-destroy (kcm withdraw)
    -> pvcm listener: every request reported withdrawn, none established
  8 counters: the kernels' infiniband_cm counters show no retries or duplicates,
    pvcm-backend shows 0 drops and 0 retries, and every MAD pvcm sent was taken by a
    kernel CM (tests 1-7)
  9 IPv6 on the soft port, a pvcm VM on vm6 (fd99::21 on br0):
    9a pvcm VM -> kernel listener bound to fd99::2: pvcm-guest cmtime, N connections
    9b kernel j -> pvcm VM: cmtime -s fd99::21 -b fd99::3 -c N
    9c over 9a and 9b: no retries or duplicates in the kernels' counters, 0 drops and
       0 retries in pvcm-backend, every pvcm MAD taken by a kernel CM, every frame
       through the IPv6 VM
 10 DREQs under loss: 5% of the RoCE frames lost each way on the bridge (nftables),
    kernel j -> kernel k next to kernel j -> a pvcm VM whose cmtime server exits right
    after its last DREP (the backend answers the DREQ retries of lost DREPs), 200
    connections (IOP_LOSS_CONNS), two rounds each, alternating: every connection up
    and down, and the pvcm side's disconnect at most 1.5x the kernel's

Prints the connect/disconnect totals of tests 1, 2 and 5 from this one run, then runs
tests 1 and 2's cmtime --trials more times each, alternating, and prints the medians of
kernel -> kernel and pvcm VM -> kernel and their ratio (figures, not asserted; one
sample each is noise on a shared machine). The last line reads "interop: N passed, N
failed", after a summary of a line per test (PASS or FAIL, the test, what failed),
written to the file PVCM_RESULTS names if it is set. Exit 0 when all selected tests
passed.

--bench runs the benchmark instead (interop/bench.sh): at each size, all in one run,
kernel CM <-> kernel CM (cmtime between k and j) next to pvcm VM <-> pvcm VM (two TCG
VMs on one pvcm-backend, default options): connect and disconnect totals, the speed-up
and the CPU per connection on each side. Each side runs --rounds bursts back to back in
VMs that stay up (the kernel guests run cmtime again; pvcm's VMs run one cmtime process
with --rounds), so both are warm after the first; it prints every round, the medians,
and the speed-up of the medians and of the first (cold) round. It fails only when pvcm
loses a connection, a MAD or needs a retry; the figures are for reading, not asserted.

Options:
  --conns N      connections for tests 1, 2, 5, 9a and 9b (default 1000)
  --trials N     more alternating runs of tests 1 and 2 for the medians (default 2)
  --only LIST    comma-separated test numbers (default: all; 8 always runs)
  --mtu N        MTU of the bridge, its taps and the kernel guests' NICs (default 9000,
                 a jumbo RoCE fabric: rxe and pvcm-backend's soft port then give paths
                 4096 bytes; 1500 gives 1024). With --pcap, the decode checks that every
                 REQ, pvcm's and the kernels', carries that path MTU: the kernel passive
                 side sets its QP's path MTU from the REQ (cm_req_handler)
  --workdir DIR  keep logs here (default: a new dir under /tmp, removed on success)
  --pcap FILE    capture br0 to FILE (dumpcap) and check its tshark decode
  --bench        run the benchmark instead of the tests
  --sizes LIST   benchmark sizes (default 1000,4000)
  --rounds N     benchmark bursts per size and side (default 3)
  -h, --help     this help

Needs root (network namespace, taps, raw socket), and builds and installs what it
needs: the patched QEMU, the default and RDMA guest images, pvcm-backend, gcc and
librdmacm-dev (for kcm), tshark with --pcap.
USAGE
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

conns=1000 only="1,2,3,4,5,6,7,8,9,10" workdir="" pcap="" bench=0 sizes="1000,4000" trials=2 rounds=3 mtu=9000
only_given=""
parse_options --bench:bench=1 --conns=conns --only=only_given --workdir=workdir --pcap=pcap --sizes=sizes \
    --trials=trials --rounds=rounds --mtu=mtu -- "$@"
# Test 8 (the counters over the others) runs whichever tests are chosen.
[ -z "$only_given" ] || only="$only_given,8"
case "$rounds" in '' | *[!0-9]* | 0) die "--rounds needs a positive number, not '$rounds'" ;; esac
case "$mtu" in '' | *[!0-9]*) die "--mtu needs a number of bytes, not '$mtu'" ;; esac
[ "$mtu" -ge 1280 ] && [ "$mtu" -le 9000 ] || die "--mtu must be 1280 to 9000, not $mtu"
need_root "interop.sh (network namespace, raw socket)"

keep=1
if [ -z "$workdir" ]; then
    workdir="$(mktemp -d /tmp/pvcm-interop.XXXXXX)"
    keep=0
fi
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"
share="$workdir/share"
rm -rf "$share"
mkdir -p "$share/q" "$share/bin"

echo "== build (cached)"
t="$(now_s)"
apt_install iproute2 util-linux python3 gcc librdmacm-dev nftables
[ -z "$pcap" ] || apt_install tshark
"$PVCM_SCRIPTS_DIR/build-guest.sh" --rdma --print-dir >/dev/null 2>"$workdir/build-rdma-guest.log" || {
    cat "$workdir/build-rdma-guest.log"
    die "build-guest.sh --rdma failed"
}
(cd "$PVCM_REPO_DIR" && cargo build --release -q -p pvcm-backend --bin pvcm-backend) ||
    die "cargo build -p pvcm-backend failed"
backend="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/release/pvcm-backend"
guest_dir="$("$PVCM_SCRIPTS_DIR/build-guest.sh" --print-dir 2>"$workdir/build-guest.log")" || {
    cat "$workdir/build-guest.log"
    die "build-guest.sh failed"
}
"$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path >/dev/null || die "build-qemu.sh failed"
gcc -O2 -Wall -Wextra -Werror -o "$share/bin/kcm" \
    "$PVCM_SCRIPTS_DIR/interop/kcm.c" -lrdmacm || die "building kcm failed"
echo "   ready in $(elapsed "$t") s"

# netlab_run TIMEOUT K J [--pcap FILE] -- CMD...: the kernel-CM guests k and j (agents)
# on the lab's bridge with the addresses K and J (IPV4[,IPV6]), CMD in the lab's
# namespace; output in $workdir/host.out.
netlab_run() {
    local t="$1" k="$2" j="$3"
    shift 3
    netlab_py netlab run \
        --workdir "$workdir" --timeout "$t" --guest "k=$k" --guest "j=$j" "$@"
}

if [ "$bench" = 1 ]; then
    echo "== benchmark: kernel CM guests k, j + pvcm-backend and two pvcm VMs on one bridge"
    rc=0
    IOP_WORK="$workdir" IOP_SHARE="$share" IOP_BACKEND="$backend" \
        IOP_RUNVM="$PVCM_SCRIPTS_DIR/run-vm.sh" IOP_GUEST_DIR="$guest_dir" IOP_SIZES="$sizes" \
        IOP_ROUNDS="$rounds" PVCM_CACHE="$PVCM_CACHE" \
        netlab_run 1800 10.99.0.2 10.99.0.3 -- bash "$PVCM_SCRIPTS_DIR/interop/bench.sh" || rc=$?
    cat "$workdir/bench.txt" 2>/dev/null || tail -n 40 "$workdir/host.out"
    [ "$rc" = 0 ] && [ "$keep" = 0 ] && rm -rf "$workdir"
    [ "$rc" = 0 ] || echo "bench: failed (netlab run exit $rc), logs in $workdir"
    exit "$rc"
fi

echo "== run: kernel CM guests k, j + pvcm-backend and a pvcm VM on one bridge (MTU $mtu)"
pcap_args=()
[ -z "$pcap" ] || pcap_args=(--pcap "$pcap")
rc=0
IOP_WORK="$workdir" IOP_SHARE="$share" IOP_BACKEND="$backend" \
    IOP_RUNVM="$PVCM_SCRIPTS_DIR/run-vm.sh" IOP_GUEST_DIR="$guest_dir" IOP_CONNS="$conns" \
    IOP_ONLY="$only" IOP_TRIALS="$trials" PVCM_CACHE="$PVCM_CACHE" \
    netlab_run 1200 10.99.0.2,fd99::2 10.99.0.3,fd99::3 --mtu "$mtu" "${pcap_args[@]}" \
    -- bash "$PVCM_SCRIPTS_DIR/interop/host.sh" || rc=$?
grep -E '^(==|PASS|FAIL)' "$workdir/host.out" 2>/dev/null || true
echo "== figures (one run, $conns connections, totals in ms)"
cat "$workdir/figures.txt" 2>/dev/null || true

results="$workdir/results.txt"
results_run "$results" "$rc" "netlab run" "$(netlab_exit "$rc")"
if [ -n "$pcap" ] && [ -s "$pcap" ]; then
    echo "== tshark decode of $pcap"
    python3 "$PVCM_SCRIPTS_DIR/interop/decode.py" --mtu "$mtu" "$pcap" | tee "$workdir/decode.txt" ||
        echo "FAIL  decode: the tshark decode of $pcap found faults (above)" >>"$results"
fi

if grep -q '^FAIL' "$results"; then
    echo "== logs: $workdir (netlab run exit $rc)"
    for f in "$workdir"/backend.log "$workdir"/host.out "$workdir"/*.err; do
        [ -s "$f" ] && { echo "----- $f"; tail -n 60 "$f"; }
    done
    keep=1
fi
echo "== summary"
results_report "$results"
echo "interop: $results_passed passed, $results_failed failed"
[ "$keep" = 1 ] || rm -rf "$workdir"
[ "$results_failed" = 0 ]
