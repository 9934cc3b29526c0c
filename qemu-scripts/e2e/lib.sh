# shellcheck shell=bash disable=SC2154 # e2e.sh sets what the list below names
# Helpers for the tests of qemu-scripts/e2e.sh (e2e/NN-*.sh). e2e.sh sources this, and
# sets before the first test runs:
#
#   workdir         the run's work directory (sockets, logs, stat JSON, guest output)
#   backend         the pvcm-backend binary; guest_dir the guest image
#   missing_backend missing_guest missing_qemu   why a piece is missing ("" if present)
#   guest_cmds      the guest's pvcm-guest subcommands, space-separated
#   vm_timeout budget end_at scale   see e2e.sh
#
# A test is a function that starts with test_begin, records its outcome with result,
# and may call fail to note a reason; see 01-connect.sh for the shape.

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Processes started in the background (killed on exit), and by name.
bg_pids=()
declare -gA backend_pid=() # backend name -> pid
declare -gA vm_pid=()      # VM name -> pid of its run-vm.sh

cleanup() {
    local p
    for p in "${bg_pids[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    sleep 0.3
    for p in "${bg_pids[@]}"; do
        kill -9 "$p" 2>/dev/null || true
    done
}

# ---------------------------------------------------------------- results

passed=0 failed=0 skipped=0
# One line per test in lib.sh's result format (results_report).
results=()
# The current test's start time (read by the tests) and the reasons it failed.
# shellcheck disable=SC2034
t0="" reasons=()

# result N pass|fail|skip TEXT: records the test's outcome and prints it. A failure's
# reasons (fail, check) follow its text.
result() {
    local status text="$3"
    status="$(echo "$2" | tr a-z A-Z)"
    if [ "$2" = fail ] && [ "${#reasons[@]}" -gt 0 ]; then
        local r sep=": "
        for r in "${reasons[@]}"; do
            text="$text$sep$r"
            sep="; "
        done
    fi
    results+=("$(printf '%-5s %s: %s' "$status" "$1" "$text")")
    case "$2" in
    pass) passed=$((passed + 1)) ;;
    fail) failed=$((failed + 1)) ;;
    skip) skipped=$((skipped + 1)) ;;
    esac
    echo "== $status test $1: $text"
}

# fail TEXT: prints TEXT as a finding of the current test and keeps it as a reason.
fail() {
    echo "   $*"
    reasons+=("$*")
}

# check NAME ARGS...: runs `checks.py NAME WORKDIR ARGS...`; prints its output and keeps
# its findings ("check: ...") as reasons; its status is the verdict.
check() {
    local name="$1" out rc=0 line
    shift
    out="$(python3 "$E2E_DIR/checks.py" "$name" "$workdir" "$@")" || rc=$?
    [ -z "$out" ] || printf '%s\n' "$out"
    while IFS= read -r line; do
        case "$line" in *"check: "*) reasons+=("${line#*check: }") ;; esac
    done <<<"$out"
    [ "$rc" = 0 ] || [ "${#reasons[@]}" -gt 0 ] || reasons+=("checks.py $name exited $rc")
    return "$rc"
}

# need_guest_cmd CMD...: prints why the guest cannot run CMD, if it cannot.
need_guest_cmd() {
    [ -z "$missing_guest" ] || {
        echo "$missing_guest"
        return
    }
    local c
    for c in "$@"; do
        [[ " $guest_cmds " == *" $c "* ]] || {
            echo "pvcm-guest has no '$c' subcommand yet"
            return
        }
    done
}

# test_begin N patched|stock GUEST_CMD...: the start of test N, which needs the patched
# QEMU or only Debian's stock one, and these pvcm-guest subcommands. Records a SKIP (a
# missing piece: the backend, the patched QEMU, a guest subcommand) or a FAIL (the
# --budget is spent) and returns 1; otherwise sets t0 and returns 0.
test_begin() {
    local n="$1" qemu="$2" why
    shift 2
    reasons=()
    why="$(need_guest_cmd "$@")"
    [ -z "$missing_backend" ] || why="$missing_backend"
    if [ "$qemu" = patched ] && [ -n "$missing_qemu" ]; then why="$missing_qemu"; fi
    if [ -n "$why" ]; then
        result "$n" skip "$why"
        return 1
    fi
    if [ "$SECONDS" -ge "$end_at" ]; then
        result "$n" fail "over the ${budget} s budget before it started"
        return 1
    fi
    # shellcheck disable=SC2034 # read by the tests
    t0="$(now_s)"
}

# ---------------------------------------------------------------- backends

# start_backend [--state-dir DIR] NAME SPEC...: a pvcm-backend "host" with one --vm per
# SPEC (SPEC = vmname:ipv4[:more,--vm,keys]). Sockets: $workdir/vmname.sock, control
# $workdir/NAME.ctl, log $workdir/NAME.backend.log.
start_backend() {
    local args=()
    if [ "$1" = --state-dir ]; then
        args+=(--state-dir "$2")
        shift 2
    fi
    local name="$1" spec vm ip
    shift
    for spec in "$@"; do
        # vmname:ipv4[:more --vm keys] (test 10's id-range=..., incoming=yes)
        local extra=""
        vm="${spec%%:*}" ip="${spec#*:}"
        if [[ "$ip" == *:* ]]; then
            extra=",${ip#*:}" ip="${ip%%:*}"
        fi
        rm -f "$workdir/$vm.sock"
        args+=(--vm "socket=$workdir/$vm.sock,gid=$(netlab_py netlab addr vm-gid "$ip"),name=$vm$extra")
    done
    rm -f "$workdir/$name.ctl"
    # shellcheck disable=SC2086 # PVCM_E2E_BACKEND_ARGS is a list of words
    RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$backend" "${args[@]}" ${PVCM_E2E_BACKEND_ARGS:-} \
        --control "$workdir/$name.ctl" >>"$workdir/$name.backend.log" 2>&1 &
    local pid=$!
    bg_pids+=("$pid")
    backend_pid[$name]=$pid
    for _ in $(seq 100); do
        if [ -S "$workdir/$name.ctl" ]; then
            local ok=1
            for spec in "$@"; do [ -S "$workdir/${spec%%:*}.sock" ] || ok=0; done
            [ "$ok" = 1 ] && return 0
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    cat "$workdir/$name.backend.log"
    echo "pvcm-backend $name did not come up"
    return 1
}

# stop_backend NAME...: SIGTERM, and wait.
stop_backend() {
    local name pid
    for name in "$@"; do
        pid="${backend_pid[$name]:-}"
        [ -n "$pid" ] || continue
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

# stat_json HOST: the backend's counters into $workdir/HOST.stat.json.
stat_json() { "$backend" stat --control "$workdir/$1.ctl" --json >"$workdir/$1.stat.json"; }

# live_of HOST: the live entries in HOST's last stat JSON.
live_of() { python3 "$E2E_DIR/checks.py" live "$workdir/$1.stat.json"; }

# wait_live HOST N: waits up to 60 s until HOST's backend holds N live entries; sets
# $live to the last count seen; says how many when it gives up.
wait_live() {
    local h="$1" want="$2"
    live=0
    for _ in $(seq 300); do
        stat_json "$h" 2>/dev/null && live="$(live_of "$h")"
        [ "$live" -ge "$want" ] && return 0
        sleep 0.2
    done
    fail "only $live of $want connections up"
    return 1
}

# wait_drained HOST SECS: until the backend's live entries are 0 (TimeWait ends).
wait_drained() {
    for _ in $(seq $(($2 * 2))); do
        stat_json "$1" || return 1
        [ "$(live_of "$1")" = 0 ] && return 0
        sleep 0.5
    done
    return 1
}

# ---------------------------------------------------------------- VMs

# start_vm NAME ROUTE 'COMMAND' [run-vm.sh OPTION...]: run-vm.sh in the background;
# console in NAME.console.log, the command's output in NAME.out.
start_vm() {
    local name="$1" route="$2" cmd="$3"
    shift 3
    rm -f "$workdir/$name.console.log" "$workdir/$name.out"
    "$PVCM_SCRIPTS_DIR/run-vm.sh" --quiet --route "$route" --socket "$workdir/$name.sock" \
        --name "$name" --guest-dir "$guest_dir" --log "$workdir/$name.console.log" \
        --timeout "$vm_timeout" --cmd "$cmd" "$@" >"$workdir/$name.out" 2>"$workdir/$name.err" &
    bg_pids+=($!)
    vm_pid[$name]=$!
}

# wait_vm NAME: wait for run-vm.sh; its exit status (the guest command's).
wait_vm() {
    local rc=0
    wait "${vm_pid[$1]}" || rc=$?
    echo "$rc" >"$workdir/$1.rc"
    return "$rc"
}

# wait_vms VM...: waits for every VM that was started, prints their exit codes; 1 if
# any is not 0 (each is a reason).
wait_vms() {
    local vm r rcs="" ok=0
    for vm in "$@"; do
        [ -n "${vm_pid[$vm]:-}" ] || continue
        r=0
        wait_vm "$vm" || r=$?
        rcs="$rcs $vm=$r"
        [ "$r" = 0 ] || {
            reasons+=("$vm exited $r")
            ok=1
        }
    done
    echo "   exit codes:$rcs"
    return "$ok"
}

# wait_console NAME PATTERN SECS: until the console log matches (grep -E).
wait_console() {
    local n=$(($3 * 5))
    for _ in $(seq "$n"); do
        grep -Eq "$2" "$workdir/$1.console.log" 2>/dev/null && return 0
        kill -0 "${vm_pid[$1]}" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

# dump VM... BACKEND...: the logs, for a failure.
dump() {
    local n f
    for n in "$@"; do
        for f in "$workdir/$n.console.log" "$workdir/$n.err" "$workdir/$n.backend.log"; do
            [ -s "$f" ] || continue
            echo "----- $f -----"
            tr -d '\r' <"$f" | tail -n 200
        done
        if [ -s "$workdir/$n.stat.json" ]; then
            echo "----- $workdir/$n.stat.json (non-zero figures) -----"
            python3 "$E2E_DIR/checks.py" nonzero "$workdir/$n.stat.json" || true
        fi
    done
}
