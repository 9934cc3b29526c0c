#!/usr/bin/env bash
# The network lab's smoke test: the RDMA image's userland between kernel-CM guests, and
# a pvcm VM with its own RDMA NIC (no kernel CM, QP1 diverted to the host).
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: qemu-scripts/netlab-smoke.sh [--workdir DIR] [--pcap FILE]

Runs qemu-scripts/netlab/smoke.py (python3 -m netlab.smoke) as root:
  0 qp1-divert.sh in a namespace of its own (a veth pair stands in for the tap)
  1 two kernel-CM guests of the RDMA image: rping -v (64, 1024, 4000 bytes) and
    ucmatose with data
  2 a pvcm VM (NIC 10.99.0.11, its pvcm device on a pvcm-backend at 10.99.0.250):
    rxe0's RoCE v2 GID is ::ffff:10.99.0.11; the kernel CM is absent and cannot be
    loaded; /dev/cuse; pvcm-guest info; ibv_rc_pingpong with a kernel guest in both
    roles; a CM REQ to the VM lands on pvcm-qp1 and the VM never answers it
Builds what it needs first (cached): the patched QEMU, the RDMA image, pvcm-backend.
It ends with a summary, a line per check (PASS or FAIL, the check, what it found),
written to the file PVCM_RESULTS names if it is set. The last line reads
"netlab-smoke: N passed, N failed"; exit 0 when all passed.

Options:
  --workdir DIR  keep logs here (default: a new dir under /tmp)
  --pcap FILE    capture br0 into FILE (dumpcap; tshark is installed if missing)
  -h, --help     this help
USAGE
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

args=()
# pass_on OPTION VALUE: an option for the Python suite (--pcap: tshark reads the capture).
pass_on() {
    if [ "$1" = --pcap ]; then apt_install tshark; fi
    args+=("$1" "$2")
}
parse_options '--workdir=pass_on()' '--pcap=pass_on()' -- "$@"
need_root "netlab-smoke.sh (network namespace, taps)"
apt_install iproute2 util-linux python3
echo "== build (cached)"
"$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path >/dev/null || die "build-qemu.sh failed"
"$PVCM_SCRIPTS_DIR/build-guest.sh" --rdma --print-dir >/dev/null || die "build-guest.sh --rdma failed"
(cd "$PVCM_REPO_DIR" && cargo build --release -q -p pvcm-backend --bin pvcm-backend) ||
    die "cargo build -p pvcm-backend failed"
cd "$PVCM_SCRIPTS_DIR"
lines="$(mktemp /tmp/pvcm-netlab-smoke-results.XXXXXX)"
rc=0
PVCM_RESULT_LINES="$lines" netlab_py netlab.smoke ${args[@]+"${args[@]}"} || rc=$?
results_run "$lines" "$rc" "netlab.smoke"
echo "== summary"
results_report "$lines"
rm -f "$lines"
echo "netlab-smoke: $results_passed passed, $results_failed failed"
[ "$results_failed" = 0 ]
