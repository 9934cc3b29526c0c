#!/usr/bin/env bash
# Unmodified rdma-core programs in pvcm VMs, against the Linux kernel CM and each other.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: qemu-scripts/apps.sh [--rdma-suite SUITE] [--workdir DIR] [--pcap FILE] [--conns N]
                             [--only LIST] [--vcpus N] [--threads N]
       qemu-scripts/apps.sh --cli [--workdir DIR] [--pcap FILE] [--conns N] [--only LIST]
       qemu-scripts/apps.sh --bench [--workdir DIR] [--conns N] [--rounds N] [--idle SECS]
                             [--idle-windows N]
       qemu-scripts/apps.sh --bench --procs P [--conns N] [--vcpus N] [--threads LIST]
       qemu-scripts/apps.sh --migrate [--workdir DIR] [--only LIST] [--hold SECS] [--failed]

Runs qemu-scripts/netlab/apps.py (python3 -m netlab.apps) as root: a kernel-CM guest
(10.99.0.2) and two pvcm VMs (10.99.0.11, .12: the pvcm device on one pvcm-backend
with --port packet:pvcm-qp1, rxe on their NICs, pvcm-guestd serving
/dev/infiniband/rdma_cm) on one bridge. Sections:
  0 the CM goes through pvcm (kernel CM modules absent, the service's and the
    backend's counters)
  1 rping -v, ucmatose, udaddy, rdma_client/rdma_server, ib_send_bw -R, cmtime -c N,
    for pvcm VM -> kernel, kernel -> pvcm VM and pvcm VM -> pvcm VM
  2 seed 002's connect-and-destroy (interop/kcm.c) from a pvcm VM: the kernel keeps
    only its listener
  3 16 processes in a pvcm VM, 8 killed with kill -9: survivors finish, the kernel peer
    keeps only its listeners, the backend reaches 0 live entries; with pvcm-guestd on
    more than one thread, the requests were spread over them
  5 a misbehaving process (interop/ucflood.c: garbage, bad addresses, other files'
    ids, for 15 s) beside rping and ucmatose in the same VM: all pass, the service
    survives and holds no id
  4 counters: 0 drops; the VMs' MADs went through the backend
  7 root in a pvcm VM goes around pvcm: stops pvcm-guestd, loads the kernel CM
    (insmod), rping both ways with k, crafted QP1 frames (interop/rawqp1.c): nothing
    reaches another CM, the tap's egress table and the backend count what was
    stopped, pvcm's own connections from that VM go on
  8 signals to a program blocked in rdma_get_cm_event, in a pvcm VM and in the
    kernel guest (the reference): SIGSTOP/SIGCONT, strace -p, a debugger's attach,
    SIGALRM handlers with and without SA_RESTART (interop/sigwait.c), SIGTERM
  12 the VM's RDMA device changes under a waiting rping -s, in a pvcm VM and in the
    kernel guest (the reference): rdma link delete rxe0 (pvcm: DEVICE_REMOVAL, the
    program exits; the kernel with rxe: the delete waits for the program), rdma link
    add again (a new rping works, pvcm-guestd not restarted), ip addr del and add of
    the server's address (no ADDR_CHANGE; connected to afterwards), a second address
    (the kernel binds it; pvcm: EADDRNOTAVAIL, the cause logged)
  9 pvcm-guestd stopped under running programs: they end with an error, none hangs,
    the kernel peer loses their connections at once; started again, it serves
  11 address resolution next to the kernel guest: rping -c to an address nobody has
    (ADDR_ERROR -110 within rping's 2000 ms; both times printed), to an address with no
    route, through a gateway nobody has; a process killed while it resolves; rping
    client and server in one VM on its own address and on 127.0.0.1; rping through a
    gateway (a second subnet of k reached via the host side of the bridge)
  10 multicast: mckey (rdmacm-utils) receiver and sender, pvcm VM -> kernel and
    kernel -> pvcm VM: data received, the IGMP membership held while joined; an IPv6
    group fails to join in both (the IPv6 lab, booted for it)
  13 librdmacm 60's commands (interop/usrevent.c): rdma_write_cm_event to a thread
    waiting in rdma_get_cm_event and rdma_resolve_addrinfo (an INTERNAL event), and
    RESOLVE_IB_SERVICE's errno, in pvcm VM a and in the kernel guest (the reference);
    with a librdmacm that has them (--rdma-suite sid)
  14 TOS: ucmatose -t 0x60, pvcm VM -> kernel and kernel -> pvcm VM: every data frame
    both ways (captured on the kernel guest's tap) carries TOS 0x60
  6 IPv6: a second lab with IPv6 GIDs (kernel fd99::2, pvcm VMs fd99::11, fd99::12)
    and an IPv4 pvcm VM on the same backend: rping -v and ucmatose across them; a
    second address: the dual-stack pvcm VM a6 has two GIDs (10.99.0.11, fd99::11),
    rping with k over both, two rping -s on one port (one per address) connected to
    from k as in k, while an address that is none of b6's GIDs is EADDRNOTAVAIL
Builds what it needs first (cached): the patched QEMU, the Debian packages
(packaging/build-debs.sh), the RDMA image with the pvcm-guest package installed (the
VMs start pvcm-guestd as its systemd unit does), pvcm-backend, kcm, ucflood, rawqp1,
sigwait, usrevent. It ends with a
summary, a line per check (PASS or FAIL, the check, what it found), written to the file
PVCM_RESULTS names if it is set; the last line reads "apps: N passed, N failed"
("cli_via_service: ..." with --cli).

--cli runs qemu-scripts/netlab/cli_via_service.py instead (python3 -m
netlab.cli_via_service): pvcm-guest's own commands in a pvcm VM going through
pvcm-guestd (its default --via auto) against the kernel CM; sections 0-5 there.

--migrate runs qemu-scripts/netlab/migrate.py instead (python3 -m netlab.migrate): a
pvcm VM running rping and rstream both ways, 50 held connections and cmtime loops
against the kernel-CM guest is live-migrated (QMP migrate) from one pvcm-backend to a second one
with its own divert device and the destination QEMU's own tap on the bridge; the
programs go on, the host side follows the VM, the source releases everything; it
prints the figures (downtime, the CM's pause, rping's stall, retries). Sections: 4
IPv4, 6 IPv6 (default 4,6); --failed first adds a migration the destination refuses
and one whose stream is cut (the destination QEMU killed mid-transfer);
--hold SECS how long the runs around the move last (default 30).

--bench runs qemu-scripts/netlab/bench.py instead (python3 -m netlab.bench): cmtime -c N
between two pvcm VMs next to two kernel-CM guests in one lab, every step, retries and
drops, and pvcm-guestd's idle cost; it prints figures and asserts none. With --procs P:
P processes of cmtime -c N at once, kernel pair and pvcm pair (the latter once per
pvcm-guestd thread count of --threads LIST, e.g. 1,4), the batch's wall time and each
step, with ratios.

--rdma-suite SUITE (any mode) gives every guest, the pvcm VMs and the kernel guest k,
the rdma-core userland of that Debian suite: bookworm (Debian 12, rdma-core 44, the
default), trixie (Debian 13, rdma-core 56) or sid (unstable); the kernel stays Debian
12's (build-guest.sh --rdma-suite; docs/apps.md lists the versions tried).

Options:
  --rdma-suite SUITE  the guests' rdma-core: bookworm, trixie or sid (default bookworm)
  --cli          pvcm-guest through the service (above)
  --bench        the benchmark (above)
  --migrate      the live migration suite (above)
  --failed       (--migrate) a refused and a cut migration first
  --hold SECS    (--migrate) how long the runs around the move last
  --rounds N     benchmark rounds of both pairs (default 2)
  --procs P      benchmark: P cmtime processes at once (above)
  --vcpus N      every guest's vCPUs (default 1)
  --threads N    pvcm-guestd's --threads (default: one per vCPU up to 8); with
                 --bench --procs, a comma-separated list of thread counts to compare
  --idle SECS    benchmark idle-cost window (default 20; 0 skips it)
  --idle-windows N  benchmark idle-cost windows of each state (default 4)
  --workdir DIR  keep logs here (default: a new dir under /tmp)
  --pcap FILE    capture br0 into FILE
  --conns N      cmtime connections (default 1000)
  --only LIST    sections, comma-separated (default 0,1,2,3,5,8,12,9,11,13,10,14,4,7,6)
  -h, --help     this help
USAGE
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

args=() module=netlab.apps
# rdma_suite --rdma-suite SUITE: the guests' rdma-core suite, for build-guest.sh here and
# in the lab (netlab.lab builds the image through it too).
rdma_suite() {
    export PVCM_RDMA_SUITE="$2"
}
# pass_on OPTION [VALUE]: an option for the Python suite (--pcap: tshark reads the
# capture).
pass_on() {
    if [ "$1" = --pcap ]; then apt_install tshark; fi
    args+=("$@")
}
parse_options --bench:module=netlab.bench --cli:module=netlab.cli_via_service \
    --migrate:module=netlab.migrate '--failed:pass_on()' '--workdir=pass_on()' \
    '--pcap=pass_on()' '--conns=pass_on()' '--only=pass_on()' '--rounds=pass_on()' '--idle=pass_on()' \
    '--idle-windows=pass_on()' '--hold=pass_on()' '--rdma-suite=rdma_suite()' \
    '--procs=pass_on()' '--vcpus=pass_on()' '--threads=pass_on()' -- "$@"
need_root "apps.sh (network namespace, taps)"
apt_install iproute2 util-linux python3 gcc librdmacm-dev
# The migration suite and apps section 14 capture k's tap (rping's data frames: the
# stall across the move; the traffic class of ucmatose -t's frames).
apt_install tcpdump
echo "== build (cached)"
"$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path >/dev/null || die "build-qemu.sh failed"
# The pvcm VMs run what the pvcm-guest package installs: the package goes into the
# RDMA image, and the VMs start pvcm-guestd as its systemd unit does.
# One build directory per checkout: runs from two checkouts at once do not share debs.
work="$PVCM_CACHE/apps/$(printf %s "$PVCM_REPO_DIR" | sha256sum | cut -c1-12)"
debs="$work/debs"
rm -rf "$debs" && mkdir -p "$debs"
bash "$PVCM_REPO_DIR/packaging/build-debs.sh" --out "$debs" >&2 || die "packaging/build-debs.sh failed"
PVCM_GUEST_DEBS="$(echo "$debs"/pvcm-guest_*.deb)"
export PVCM_GUEST_DEBS
"$PVCM_SCRIPTS_DIR/build-guest.sh" --rdma --print-dir >/dev/null || die "build-guest.sh --rdma failed"
(cd "$PVCM_REPO_DIR" && cargo build --release -q -p pvcm-backend --bin pvcm-backend) ||
    die "cargo build -p pvcm-backend failed"
kcm="$work/kcm"
gcc -O2 -Wall -Wextra -Werror -o "$kcm" "$PVCM_SCRIPTS_DIR/interop/kcm.c" -lrdmacm ||
    die "building kcm failed"
cd "$PVCM_SCRIPTS_DIR"
ucbench="$work/ucbench"
gcc -O2 -Wall -Wextra -Werror -o "$ucbench" "$PVCM_SCRIPTS_DIR/interop/ucbench.c" -lrdmacm ||
    die "building ucbench failed"
ucflood="$work/ucflood"
gcc -O2 -Wall -Wextra -Werror -pthread -o "$ucflood" "$PVCM_SCRIPTS_DIR/interop/ucflood.c" ||
    die "building ucflood failed"
rawqp1="$work/rawqp1"
gcc -O2 -Wall -Wextra -Werror -o "$rawqp1" "$PVCM_SCRIPTS_DIR/interop/rawqp1.c" ||
    die "building rawqp1 failed"
sigwait="$work/sigwait"
gcc -O2 -Wall -Wextra -Werror -o "$sigwait" "$PVCM_SCRIPTS_DIR/interop/sigwait.c" -lrdmacm ||
    die "building sigwait failed"
usrevent="$work/usrevent"
gcc -O2 -Wall -Wextra -Werror -pthread -o "$usrevent" "$PVCM_SCRIPTS_DIR/interop/usrevent.c" -lrdmacm ||
    die "building usrevent failed"
[ "$module" = netlab.apps ] && args+=(--kcm "$kcm" --ucflood "$ucflood" --rawqp1 "$rawqp1"
    --sigwait "$sigwait" --usrevent "$usrevent")
[ "$module" = netlab.bench ] && args+=(--ucbench "$ucbench")
export PYTHONPATH="$PVCM_SCRIPTS_DIR${PYTHONPATH:+:$PYTHONPATH}"
# The benchmark prints figures and asserts none: no summary.
[ "$module" = netlab.bench ] && exec python3 -m "$module" "${args[@]}"
lines="$(mktemp /tmp/pvcm-apps-results.XXXXXX)"
rc=0
PVCM_RESULT_LINES="$lines" python3 -m "$module" "${args[@]}" || rc=$?
results_run "$lines" "$rc" "$module"
echo "== summary"
results_report "$lines"
rm -f "$lines"
suite=apps
[ "$module" = netlab.cli_via_service ] && suite=cli_via_service
[ "$module" = netlab.migrate ] && suite=migrate
echo "$suite: $results_passed passed, $results_failed failed"
[ "$results_failed" = 0 ]
