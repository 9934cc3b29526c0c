#!/usr/bin/env bash
# pvcm end-to-end tests in real (TCG) QEMU guests (the tests: see usage below).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: qemu-scripts/e2e.sh [--allow-missing] [--only LIST] [--workdir DIR] [--budget SECS]
                           [--scale N]

Builds what it needs (cached: build-qemu.sh, build-guest.sh, cargo build of
pvcm-backend), then runs, each with fresh pvcm-backend processes ("hosts") on
loopback addresses 127.10.H.V (PVCM_E2E_NET=127.10), control sockets, and TCG VMs
(run-vm.sh):

  1 connect/disconnect, generic route (patched QEMU, virtio ID 63): VM B listens,
    VM A connects with private data, both see established, A disconnects, both see
    disconnected; each backend counted REQ/REP/RTU/DREQ/DREP once, 0 retries,
    0 drops, and its live entries drain to 0.
  2 rdma_connect/destroy: A connects and destroys at once; B's half-open
    connection is rejected by the routed REJ(TIMEOUT).
  3 seed 000 at full scale: 2 hosts x 2 VMs, cmtime with PVCM_E2E_CONNS (default
    8192 x --scale) connections per client pair (16,384 per host; --scale 2: 32,768),
    set up and torn down all at once on default options: 0 drops, 0 retries, every
    connection up and down, 0 live entries after quiesce.
  4 test 1 through Debian's stock QEMU 10 and vhost-user-gpio-pci (ID 41).
  5 burst: one backend, two VMs, PVCM_E2E_BURST (default 4000) connections set up at
    once and torn down at once with cmtime, on default options: 0 drops, 0 retries,
    every connection up and down, live entries drain to 0.
  6 test 5 through the gpio-stub route (stock QEMU, queues fixed at 64).
  7 an application that reacts 8 s late to a disconnect: 0 DREQ retries (the agent
    answers the DREQ at once).
  8 the control for 7: the same with --linux-drep, where the peer must retry its DREQ.
  9 restart without loss: VM C (on a backend with --state-dir) holds PVCM_E2E_RESTART
    (default 400) connections to VM S on another backend; its backend is killed with
    SIGKILL and started again with the same options; QEMU (patched, reconnect-ms)
    reconnects; then C tears every connection down: all DREQs answered, 0 drops,
    the restored backend shows every entry right after the restart, 0 live after.
 10 live migration: VM C (id-range, on backend A) holds PVCM_E2E_MIGRATE (default 100)
    connections to VM S on backend P; C is live-migrated (QMP migrate, vhost-user
    device state) to a second QEMU on backend B, which has it as incoming=yes; the
    source backend holds nothing right after; C's cmtime then tears every connection
    down from B: all DREQs answered, 0 drops anywhere. Prints QEMU's downtime.

Each test is a file in qemu-scripts/e2e/ (NN-*.sh, NN its first number), with the
helpers they share in e2e/lib.sh and the checks of their results in e2e/checks.py.

A test whose pieces are missing (no pvcm-backend or pvcm-guest binary, a missing
subcommand) prints SKIP with the reason. Exit status: 0 if every selected test passed
(skips allowed only with --allow-missing), 1 otherwise. The run ends with a summary, a
line per test ("PASS  N: ...", "FAIL  N: what: why", "SKIP  N: why"), written to the
file PVCM_RESULTS names if it is set; the last line reads "e2e: N passed, N failed, N
skipped". On a failure each guest's console log and the backends' logs and counters
are printed.

Options:
  --allow-missing  exit 0 when tests were skipped for missing pieces
  --only LIST      comma-separated test numbers (default 1-10), e.g. --only 5
  --workdir DIR    keep logs here (default: a new dir under /tmp, removed on success)
  --budget SECS    overall deadline (default 900); tests not started by then fail
  --scale N        test 3 at N times the seed's size (default 1; its cmtime
                   timeouts grow with it), e.g. --scale 2 --only 3
  -h, --help       this help

Environment: PVCM_CACHE, PVCM_RESULTS (the summary's file), PVCM_E2E_CONNS (test 3), PVCM_E2E_BURST (tests 5, 6),
PVCM_E2E_BURST_ARGS (extra pvcm-guest cmtime options for the burst client),
PVCM_E2E_GUEST_OPTS (global pvcm-guest options for both burst VMs, e.g. --no-interrupts),
PVCM_E2E_BACKEND_ARGS (extra pvcm-backend options for every backend, e.g. --pcap FILE),
PVCM_E2E_RESTART (test 9), PVCM_E2E_MIGRATE (test 10), PVCM_E2E_VM_TIMEOUT (per VM,
default 150 s), PVCM_E2E_NET (first two octets of the loopback addresses, default
127.10; change it when another run uses those addresses).
EOF
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

allow_missing=0 only="1,2,3,4,5,6,7,8,9,10" workdir="" budget=900 scale=1
parse_options --allow-missing:allow_missing=1 --only=only --workdir=workdir --budget=budget --scale=scale -- "$@"
[[ "$scale" =~ ^[1-9][0-9]*$ ]] || die "--scale: a whole number from 1 ('$scale')"
all_tests=(1 2 3 4 5 6 7 8 9 10)
selected() { [[ ",$only," == *",$1,"* ]]; }
for n in ${only//,/ }; do
    [[ " ${all_tests[*]} " == *" $n "* ]] || die "--only: no test '$n' (tests are 1-10)"
done

# The settings the tests (e2e/NN-*.sh) and their helpers (e2e/lib.sh) read.
# shellcheck disable=SC2034
{
    conns="${PVCM_E2E_CONNS:-$((8192 * scale))}"
    burst="${PVCM_E2E_BURST:-4000}"
    restart_conns="${PVCM_E2E_RESTART:-400}"
    migrate_conns="${PVCM_E2E_MIGRATE:-100}"
    net="${PVCM_E2E_NET:-127.10}" # host H's VM V is at $net.H.V (loopback)
    vm_timeout="${PVCM_E2E_VM_TIMEOUT:-$((150 * scale))}"
}
t_start="$(now_s)"
end_at=$((SECONDS + budget))
keep_workdir=1
if [ -z "$workdir" ]; then
    workdir="$(mktemp -d /tmp/pvcm-e2e.XXXXXX)"
    keep_workdir=0
fi
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"

# The tests: e2e/NN-*.sh define them, e2e/lib.sh the helpers they share, and
# e2e/checks.py the checks of their results.
# shellcheck source-path=SCRIPTDIR source=e2e/lib.sh
. "$PVCM_SCRIPTS_DIR/e2e/lib.sh"
for f in "$PVCM_SCRIPTS_DIR"/e2e/[0-9][0-9]-*.sh; do
    # shellcheck source=/dev/null
    . "$f"
done
trap cleanup EXIT
trap 'exit 130' INT TERM

# run_test N: test N, with its parameters.
run_test() {
    case "$1" in
    1) connect_disconnect 1 generic "" 7001 ;;
    2) connect_destroy ;;
    3) seed000 ;;
    4) connect_disconnect 4 gpio-stub "--device pci:41" 7004 ;;
    5) burst 5 generic "" 7005 ;;
    6) burst 6 gpio-stub "--device pci:41" 7006 ;;
    7) late_app 7 0 7007 ;;
    8) late_app 8 1 7008 ;;
    9) restart ;;
    10) migrate ;;
    esac
}

# ---------------------------------------------------------------- build (cached)

echo "== build (cached under $PVCM_CACHE)"
missing_backend="" missing_guest="" missing_qemu=""
t="$(now_s)"
qemu_patched="$("$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path)" || missing_qemu="build-qemu.sh failed"
echo "   patched QEMU: ${qemu_patched:-$missing_qemu} ($(elapsed "$t") s)"

t="$(now_s)"
bin_targets() { # bin_targets PACKAGE: the package's binary target names
    (cd "$PVCM_REPO_DIR" && cargo metadata --no-deps --format-version 1 2>/dev/null) |
        python3 "$E2E_DIR/checks.py" bin-targets "$1"
}
backend=""
if [[ " $(bin_targets pvcm-backend) " == *" pvcm-backend "* ]]; then
    if (cd "$PVCM_REPO_DIR" && cargo build --release -q -p pvcm-backend --bin pvcm-backend) >"$workdir/cargo-backend.log" 2>&1; then
        backend="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/release/pvcm-backend"
        if ! "$backend" stat --help >/dev/null 2>&1; then
            missing_backend="pvcm-backend has no 'stat' subcommand"
        fi
    else
        tail -n 30 "$workdir/cargo-backend.log"
        missing_backend="cargo build -p pvcm-backend failed (log above)"
    fi
else
    missing_backend="the pvcm-backend package has no pvcm-backend binary yet"
fi
echo "   pvcm-backend: ${backend:-none} ${missing_backend:+($missing_backend)} ($(elapsed "$t") s)"

t="$(now_s)"
guest_dir="$("$PVCM_SCRIPTS_DIR/build-guest.sh" --print-dir 2>"$workdir/build-guest.log")" || {
    cat "$workdir/build-guest.log"
    die "build-guest.sh failed"
}
guest_cmds=""
if grep -q '^bin=/usr/bin/pvcm-guest$' "$guest_dir/info"; then
    host_guest_bin="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/x86_64-unknown-linux-gnu/release/pvcm-guest"
    # The static binary runs on the host too: ask it which subcommands it has.
    guest_cmds="$("$host_guest_bin" --help 2>/dev/null | awk '/^Commands:/ { on = 1; next } on && /^  [a-z]/ { print $1 } /^$/ { on = 0 }' | tr '\n' ' ')"
else
    missing_guest="the guest image has no pvcm-guest (the package has no binary yet)"
fi
echo "   guest image: $guest_dir ($(elapsed "$t") s) pvcm-guest commands: ${guest_cmds:-none}"

# ---------------------------------------------------------------- tests

for n in "${all_tests[@]}"; do
    if selected "$n"; then run_test "$n"; fi
done

echo
echo "== summary ($(elapsed "$t_start") s, logs in $workdir)"
printf '%s\n' ${results[@]+"${results[@]}"} >"$workdir/results.txt"
results_report "$workdir/results.txt"
if [ "$failed" = 0 ] && [ "$keep_workdir" = 0 ]; then rm -rf "$workdir"; fi
echo "e2e: $passed passed, $failed failed, $skipped skipped"
if [ "$failed" -gt 0 ]; then exit 1; fi
if [ "$skipped" -gt 0 ] && [ "$allow_missing" = 0 ]; then
    echo "tests were skipped for missing pieces (pass --allow-missing to accept that)" >&2
    exit 1
fi
exit 0
