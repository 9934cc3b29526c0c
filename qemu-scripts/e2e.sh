#!/usr/bin/env bash
# pvcm end-to-end tests in real (TCG) QEMU guests (the tests: see usage below).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: qemu-scripts/e2e.sh [--allow-missing] [--only LIST] [--workdir DIR] [--budget SECS]

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
    8192) connections per client pair (16,384 per host), set up and torn down all at
    once on default options: 0 drops, 0 retries, every connection up and down, 0 live
    entries after quiesce.
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

A test whose pieces are missing (no pvcm-backend or pvcm-guest binary, a missing
subcommand) prints SKIP with the reason. Exit status: 0 if every selected test passed
(skips allowed only with --allow-missing), 1 otherwise. The last line reads
"e2e: N passed, N failed, N skipped". On a failure each guest's console log and the
backends' logs and counters are printed.

Options:
  --allow-missing  exit 0 when tests were skipped for missing pieces
  --only LIST      comma-separated test numbers (default 1-10)
  --workdir DIR    keep logs here (default: a new dir under /tmp, removed on success)
  --budget SECS    overall deadline (default 900); tests not started by then fail
  -h, --help       this help

Environment: PVCM_CACHE, PVCM_E2E_CONNS (test 3), PVCM_E2E_BURST (tests 5, 6),
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

allow_missing=0 only="1,2,3,4,5,6,7,8,9,10" workdir="" budget=900
while [ $# -gt 0 ]; do
    case "$1" in
    --allow-missing) allow_missing=1 ;;
    --only | --workdir | --budget)
        [ $# -ge 2 ] || die "$1 needs a value"
        case "$1" in
        --only) only="$2" ;;
        --workdir) workdir="$2" ;;
        --budget) budget="$2" ;;
        esac
        shift
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *) die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

conns="${PVCM_E2E_CONNS:-8192}"
burst="${PVCM_E2E_BURST:-4000}"
restart_conns="${PVCM_E2E_RESTART:-400}"
migrate_conns="${PVCM_E2E_MIGRATE:-100}"
net="${PVCM_E2E_NET:-127.10}" # host H's VM V is at $net.H.V (loopback)
vm_timeout="${PVCM_E2E_VM_TIMEOUT:-150}"
t_start="$(now_s)"
end_at=$((SECONDS + budget))
keep_workdir=1
if [ -z "$workdir" ]; then
    workdir="$(mktemp -d /tmp/pvcm-e2e.XXXXXX)"
    keep_workdir=0
fi
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"

passed=0 failed=0 skipped=0
results=()
bg_pids=()
backend_extra=()

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
trap cleanup EXIT
trap 'exit 130' INT TERM

selected() { [[ ",$only," == *",$1,"* ]]; }
result() { # result N pass|fail|skip TEXT
    results+=("$(printf '%-4s test %s: %s' "$(echo "$2" | tr a-z A-Z)" "$1" "$3")")
    case "$2" in
    pass) passed=$((passed + 1)) ;;
    fail) failed=$((failed + 1)) ;;
    skip) skipped=$((skipped + 1)) ;;
    esac
    echo "== $(echo "$2" | tr a-z A-Z) test $1: $3"
}

# ---------------------------------------------------------------- build (cached)

echo "== build (cached under $PVCM_CACHE)"
missing_backend="" missing_guest="" missing_qemu=""
t="$(now_s)"
qemu_patched="$("$PVCM_SCRIPTS_DIR/build-qemu.sh" --print-path)" || missing_qemu="build-qemu.sh failed"
echo "   patched QEMU: ${qemu_patched:-$missing_qemu} ($(elapsed "$t") s)"

t="$(now_s)"
bin_targets() { # bin_targets PACKAGE: the package's binary target names
    (cd "$PVCM_REPO_DIR" && cargo metadata --no-deps --format-version 1 2>/dev/null) | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == sys.argv[1]:
        print(" ".join(t["name"] for t in p["targets"] if "bin" in t["kind"]))
' "$1"
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

need_guest_cmd() { # prints the reason if a guest subcommand is missing
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

# ---------------------------------------------------------------- helpers

# start_backend NAME SPEC...: a pvcm-backend "host" with one --vm per SPEC
# (SPEC = vmname:ipv4[:more,--vm,keys]). Sockets: $workdir/vmname.sock, control $workdir/NAME.ctl.
start_backend() {
    local name="$1" spec vm ip args=()
    shift
    for spec in "$@"; do
        # vmname:ipv4[:more --vm keys] (test 10's id-range=..., incoming=yes)
        local extra=""
        vm="${spec%%:*}" ip="${spec#*:}"
        if [[ "$ip" == *:* ]]; then
            extra=",${ip#*:}" ip="${ip%%:*}"
        fi
        rm -f "$workdir/$vm.sock"
        args+=(--vm "socket=$workdir/$vm.sock,gid=::ffff:$ip,name=$vm$extra")
    done
    rm -f "$workdir/$name.ctl"
    # backend_extra: more options for this start (test 9's --state-dir).
    # shellcheck disable=SC2086 # PVCM_E2E_BACKEND_ARGS is a list of words
    RUST_LOG="${RUST_LOG:-info}" NO_COLOR=1 "$backend" "${args[@]}" ${backend_extra[@]+"${backend_extra[@]}"} \
        ${PVCM_E2E_BACKEND_ARGS:-} \
        --control "$workdir/$name.ctl" >>"$workdir/$name.backend.log" 2>&1 &
    bg_pids+=($!)
    eval "pid_$name=$!"
    for _ in $(seq 100); do
        if [ -S "$workdir/$name.ctl" ]; then
            local ok=1
            for spec in "$@"; do [ -S "$workdir/${spec%%:*}.sock" ] || ok=0; done
            [ "$ok" = 1 ] && return 0
        fi
        kill -0 "$!" 2>/dev/null || break
        sleep 0.1
    done
    cat "$workdir/$name.backend.log"
    echo "pvcm-backend $name did not come up"
    return 1
}

stop_backend() {
    local pid
    eval "pid=\${pid_$1:-}"
    [ -n "$pid" ] || return 0
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

stat_json() { "$backend" stat --control "$workdir/$1.ctl" --json >"$workdir/$1.stat.json"; }

# wait_live HOST N: waits up to 60 s until HOST's backend holds N live entries; sets
# $live to the last count seen; says how many when it gives up.
wait_live() {
    local h="$1" want="$2"
    live=0
    for _ in $(seq 300); do
        stat_json "$h" 2>/dev/null &&
            live="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["host"]["live"])' "$workdir/$h.stat.json")"
        [ "$live" -ge "$want" ] && return 0
        sleep 0.2
    done
    echo "   only $live of $want connections up"
    return 1
}

# start_vm NAME ROUTE 'COMMAND': run-vm.sh in the background; console in NAME.console.log,
# the command's output in NAME.out.
start_vm() {
    local name="$1" route="$2" cmd="$3"
    rm -f "$workdir/$name.console.log" "$workdir/$name.out"
    "$PVCM_SCRIPTS_DIR/run-vm.sh" --quiet --route "$route" --socket "$workdir/$name.sock" \
        --name "$name" --guest-dir "$guest_dir" --log "$workdir/$name.console.log" \
        --timeout "$vm_timeout" --cmd "$cmd" >"$workdir/$name.out" 2>"$workdir/$name.err" &
    bg_pids+=($!)
    eval "vmpid_$name=$!"
}

# wait_vm NAME: wait for run-vm.sh; its exit status (the guest command's).
wait_vm() {
    local pid rc=0
    eval "pid=\$vmpid_$1"
    wait "$pid" || rc=$?
    echo "$rc" >"$workdir/$1.rc"
    return "$rc"
}

# wait_console NAME PATTERN SECS: until the console log matches (grep -E).
wait_console() {
    local n=$(($3 * 5))
    for _ in $(seq "$n"); do
        grep -Eq "$2" "$workdir/$1.console.log" 2>/dev/null && return 0
        local pid
        eval "pid=\$vmpid_$1"
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

dump() { # dump VM... BACKEND...: the logs, for a failure
    local n
    for n in "$@"; do
        for f in "$workdir/$n.console.log" "$workdir/$n.err" "$workdir/$n.backend.log"; do
            [ -s "$f" ] || continue
            echo "----- $f -----"
            tr -d '\r' <"$f" | tail -n 200
        done
        if [ -s "$workdir/$n.stat.json" ]; then
            echo "----- $workdir/$n.stat.json (non-zero figures) -----"
            python3 - "$workdir/$n.stat.json" <<'PY' || true
import json, sys
def walk(v, path):
    if isinstance(v, dict):
        for k, x in v.items(): walk(x, path + [k])
    elif isinstance(v, list):
        for i, x in enumerate(v): walk(x, path + [str(i)])
    elif v not in (0, False, None, ""):
        print(".".join(path), "=", v)
walk(json.load(open(sys.argv[1])), [])
PY
        fi
    done
}

# check_py SCRIPT ARGS...: run a Python check; prints its findings; status = verdict.
check_py() { python3 - "$@"; }

# Checks shared by tests 1 and 4: guest outputs and counters of a connect/disconnect.
check_connect_disconnect() { # check_connect_disconnect A B HOSTA HOSTB
    check_py "$workdir" "$@" <<'PY'
import json, sys, time
wd, a, b, ha, hb = sys.argv[1:6]
bad = []
def events(vm):
    out = []
    for line in open(f"{wd}/{vm}.out", errors="replace"):
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
ea, eb = events(a), events(b)
def has(evs, name, **kw):
    return any(e.get("event") == name and all(str(v) in str(e.get(k, "")) for k, v in kw.items()) for e in evs)
if not has(eb, "connect_request", data="hello-from-A"): bad.append(f"{b}: no connect_request with A's private data")
if not has(eb, "established"): bad.append(f"{b}: not established")
if not has(eb, "disconnected"): bad.append(f"{b}: no disconnected")
if not has(ea, "established", data="hello-from-B"): bad.append(f"{a}: not established with B's private data")
if not has(ea, "disconnected"): bad.append(f"{a}: no disconnected")
for h in (ha, hb):
    s = json.load(open(f"{wd}/{h}.stat.json"))["host"]
    cm = s["cm"]
    for t in ("req", "rep", "rtu", "dreq", "drep"):
        n = cm["cm_tx_msgs"][t] + cm["cm_rx_msgs"][t]
        if n != 1: bad.append(f"{h}: {t.upper()} sent+received {n}, want 1")
    r = sum(cm["cm_tx_retries"].values())
    if r: bad.append(f"{h}: {r} retries")
    d = sum(s["drops"].values()) + sum(s["device_drops"].values())
    if d: bad.append(f"{h}: {d} drops: " + ", ".join(f"{k}={v}" for g in ("drops", "device_drops") for k, v in s[g].items() if v))
for x in bad:
    print("   check:", x)
sys.exit(1 if bad else 0)
PY
}

# wait_drained HOST SECS: until the backend's live entries are 0 (TimeWait ends).
wait_drained() {
    for _ in $(seq $(($2 * 2))); do
        stat_json "$1" || return 1
        [ "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["host"]["live"])' "$workdir/$1.stat.json")" = 0 ] && return 0
        sleep 0.5
    done
    return 1
}

budget_left() { [ "$SECONDS" -lt "$end_at" ]; }

# ---------------------------------------------------------------- tests

# connect/disconnect between two hosts, one VM each: tests 1 (generic) and 4 (gpio-stub).
run_connect_disconnect() { # N ROUTE DEVICE_OPT PORT
    local n="$1" route="$2" dev="$3" port="$4" a="t${1}a" b="t${1}b" ha="t${1}h1" hb="t${1}h2" why ok=1
    why="$(need_guest_cmd listen connect)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    if [ "$route" = generic ] && [ -n "$missing_qemu" ]; then why="$missing_qemu"; fi
    if [ -n "$why" ]; then
        result "$n" skip "$why"
        return
    fi
    budget_left || {
        result "$n" fail "over the ${budget} s budget before it started"
        return
    }
    local t0
    t0="$(now_s)"
    start_backend "$ha" "$a:$net.1.1" && start_backend "$hb" "$b:$net.2.1" || {
        result "$n" fail "backends did not start"
        dump "$ha" "$hb"
        return
    }
    start_vm "$b" "$route" "pvcm-guest $dev --json listen --port $port --count 1 --data hello-from-B"
    if ! wait_console "$b" '"event": ?"listening"' 90; then
        wait_vm "$b" || true
        result "$n" fail "VM B never listened"
        dump "$b" "$hb"
        return
    fi
    start_vm "$a" "$route" "pvcm-guest $dev --json connect --dest $net.2.1 --port $port --data hello-from-A --hold 1"
    local ra=0 rb=0
    wait_vm "$a" || ra=$?
    wait_vm "$b" || rb=$?
    sleep 0.5
    stat_json "$ha" && stat_json "$hb" || ok=0
    [ "$ra" = 0 ] || {
        echo "   VM A exited $ra"
        ok=0
    }
    [ "$rb" = 0 ] || {
        echo "   VM B exited $rb"
        ok=0
    }
    [ "$ok" = 1 ] && { check_connect_disconnect "$a" "$b" "$ha" "$hb" || ok=0; }
    if [ "$ok" = 1 ] && ! { wait_drained "$ha" 30 && wait_drained "$hb" 30; }; then
        echo "   live entries did not drain to 0 within 30 s"
        ok=0
    fi
    echo "   A: $(tr '\n' ' ' <"$workdir/$a.out" | cut -c1-400)"
    echo "   B: $(tr '\n' ' ' <"$workdir/$b.out" | cut -c1-400)"
    stop_backend "$ha"
    stop_backend "$hb"
    if [ "$ok" = 1 ]; then
        result "$n" pass "connect/disconnect via $route ($(elapsed "$t0") s)"
    else
        result "$n" fail "connect/disconnect via $route ($(elapsed "$t0") s)"
        dump "$a" "$b" "$ha" "$hb"
    fi
}

test2() {
    local a=t2a b=t2b ha=t2h1 hb=t2h2 why ok=1 t0
    why="$(need_guest_cmd listen connect-destroy)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    [ -z "$missing_qemu" ] || why="$missing_qemu"
    if [ -n "$why" ]; then
        result 2 skip "$why"
        return
    fi
    budget_left || {
        result 2 fail "over the ${budget} s budget before it started"
        return
    }
    t0="$(now_s)"
    start_backend "$ha" "$a:$net.1.1" && start_backend "$hb" "$b:$net.2.1" || {
        result 2 fail "backends did not start"
        dump "$ha" "$hb"
        return
    }
    start_vm "$b" generic "timeout 20 pvcm-guest --json listen --port 7002 --count 1; rc=\$?; if [ \$rc = 143 ]; then echo 'listen stopped after 20 s'; rc=0; fi; exit \$rc"
    if ! wait_console "$b" '"event": ?"listening"' 90; then
        wait_vm "$b" || true
        result 2 fail "VM B never listened"
        dump "$b" "$hb"
        return
    fi
    start_vm "$a" generic "pvcm-guest --json connect-destroy --dest $net.2.1 --port 7002 --settle 3"
    local ra=0 rb=0
    wait_vm "$a" || ra=$?
    wait_vm "$b" || rb=$?
    stat_json "$ha" && stat_json "$hb" || ok=0
    [ "$ra" = 0 ] || {
        echo "   VM A exited $ra"
        ok=0
    }
    [ "$rb" = 0 ] || {
        echo "   VM B exited $rb"
        ok=0
    }
    check_py "$workdir" "$a" "$b" "$ha" "$hb" <<'PY' || ok=0
import json, sys
wd, a, b, ha, hb = sys.argv[1:6]
bad = []
def events(vm):
    return [json.loads(l) for l in open(f"{wd}/{vm}.out", errors="replace") if l.strip().startswith("{")]
ea, eb = events(a), events(b)
if not any(e.get("event") == "connect_destroy" for e in ea): bad.append(f"{a}: no connect_destroy report")
if not any(e.get("event") == "connect_request" for e in eb): bad.append(f"{b}: never saw the REQ")
rej = [e for e in eb if e.get("event") == "rejected"]
errs = [e["error"] for e in eb if "error" in e]
if not rej: bad.append(f"{b}: its half-open connection was not reported rejected" + (f" (pvcm-guest error: {errs})" if errs else ""))
elif not any("imeout" in str(e.get("reason", "")) for e in rej): bad.append(f"{b}: rejected, but not with TIMEOUT: {rej}")
if any(e.get("event") == "established" for e in eb): bad.append(f"{b}: established a connection A destroyed")
sa = json.load(open(f"{wd}/{ha}.stat.json"))["host"]["cm"]
sb = json.load(open(f"{wd}/{hb}.stat.json"))["host"]["cm"]
if sa["cm_tx_msgs"]["rej"] + sa["cm_rx_msgs"]["rej"] < 1: bad.append(f"{ha}: no REJ passed")
if sb["cm_tx_msgs"]["rej"] + sb["cm_rx_msgs"]["rej"] < 1: bad.append(f"{hb}: no REJ routed to B")
for x in bad: print("   check:", x)
sys.exit(1 if bad else 0)
PY
    echo "   A: $(tr '\n' ' ' <"$workdir/$a.out" | cut -c1-400)"
    echo "   B: $(tr '\n' ' ' <"$workdir/$b.out" | cut -c1-400)"
    stop_backend "$ha"
    stop_backend "$hb"
    if [ "$ok" = 1 ]; then
        result 2 pass "rdma_connect/destroy: routed REJ(TIMEOUT) ($(elapsed "$t0") s)"
    else
        result 2 fail "rdma_connect/destroy ($(elapsed "$t0") s)"
        dump "$a" "$b" "$ha" "$hb"
    fi
}

test3() {
    local h1=t3h1 h2=t3h2 why ok=1 t0 vm
    why="$(need_guest_cmd cmtime)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    [ -z "$missing_qemu" ] || why="$missing_qemu"
    if [ -n "$why" ]; then
        result 3 skip "$why"
        return
    fi
    budget_left || {
        result 3 fail "over the ${budget} s budget before it started"
        return
    }
    t0="$(now_s)"
    start_backend "$h1" t3a1:$net.1.1 t3a2:$net.1.2 &&
        start_backend "$h2" t3b1:$net.2.1 t3b2:$net.2.2 || {
        result 3 fail "backends did not start"
        dump "$h1" "$h2"
        return
    }
    start_vm t3b1 generic "pvcm-guest --json cmtime --server --port 7471 --connections $conns --timeout 120"
    start_vm t3b2 generic "pvcm-guest --json cmtime --server --port 7471 --connections $conns --timeout 120"
    for vm in t3b1 t3b2; do
        wait_console "$vm" '"event": ?"listening"' 120 || {
            echo "   $vm never listened"
            ok=0
        }
    done
    if [ "$ok" = 1 ]; then
        start_vm t3a1 generic "pvcm-guest --json cmtime --dest $net.2.1 --port 7471 --connections $conns --timeout 60"
        start_vm t3a2 generic "pvcm-guest --json cmtime --dest $net.2.2 --port 7471 --connections $conns --timeout 60"
    fi
    local rcs=""
    for vm in t3a1 t3a2 t3b1 t3b2; do
        local r=0
        eval "[ -n \"\${vmpid_$vm:-}\" ]" || continue
        wait_vm "$vm" || r=$?
        rcs="$rcs $vm=$r"
        [ "$r" = 0 ] || ok=0
    done
    echo "   exit codes:$rcs"
    local drained=1
    wait_drained "$h1" 60 && wait_drained "$h2" 60 || drained=0
    stat_json "$h1" && stat_json "$h2" || ok=0
    check_py "$workdir" "$h1" "$h2" "$drained" "$conns" <<'PY' || ok=0
import json, sys
wd, h1, h2, drained, conns = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5])
bad = []
for h in (h1, h2):
    s = json.load(open(f"{wd}/{h}.stat.json"))["host"]
    cm = s["cm"]
    r = sum(cm["cm_tx_retries"].values())
    req = cm["cm_tx_msgs"]["req"] + cm["cm_rx_msgs"]["req"]
    dreq = cm["cm_tx_msgs"]["dreq"] + cm["cm_rx_msgs"]["dreq"]
    print(f"   {h}: REQ {req} DREQ {dreq} retries {r} live {s['live']} quarantined {s['quarantined']}")
    d = {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}
    if r: bad.append(f"{h}: {r} retries")
    if d: bad.append(f"{h}: drops {d}")
    if s["live"]: bad.append(f"{h}: {s['live']} live (leaked) entries")
    if req != 2 * conns: bad.append(f"{h}: {req} REQs, want {2 * conns}")
if not drained: bad.append("live entries did not drain to 0 within 60 s")
for x in bad: print("   check:", x)
sys.exit(1 if bad else 0)
PY
    for vm in t3a1 t3a2 t3b1 t3b2; do
        echo "   $vm: $(tr '\n' ' ' <"$workdir/$vm.out" | cut -c1-300)"
    done
    stop_backend "$h1"
    stop_backend "$h2"
    if [ "$ok" = 1 ]; then
        result 3 pass "2 hosts x 2 VMs, $((2 * conns)) connections torn down concurrently ($(elapsed "$t0") s)"
    else
        result 3 fail "multi-VM teardown ($(elapsed "$t0") s)"
        dump t3a1 t3a2 t3b1 t3b2 "$h1" "$h2"
    fi
}

# A burst between two VMs on one backend, on default options: N connections set up at
# once and torn down at once; 0 drops, 0 retries, every connection up and down, and the
# live entries drain to 0. Tests 5 (generic route) and 6 (gpio-stub: queues of 64).
run_burst() { # N ROUTE DEVICE_OPT PORT
    local n="$1" route="$2" dev="$3" port="$4" h="t${1}h" s="t${1}s" c="t${1}c" why ok=1 t0
    why="$(need_guest_cmd cmtime)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    [ -z "$missing_qemu" ] || why="$missing_qemu"
    if [ -n "$why" ]; then
        result "$n" skip "$why"
        return
    fi
    budget_left || {
        result "$n" fail "over the ${budget} s budget before it started"
        return
    }
    t0="$(now_s)"
    start_backend "$h" "$s:$net.$n.1" "$c:$net.$n.2" || {
        result "$n" fail "backend did not start"
        dump "$h"
        return
    }
    start_vm "$s" "$route" "pvcm-guest $dev ${PVCM_E2E_GUEST_OPTS:-} cmtime --server --port $port --connections $burst --timeout 200"
    if wait_console "$s" 'cmtime server on' 120; then
        start_vm "$c" "$route" "pvcm-guest $dev ${PVCM_E2E_GUEST_OPTS:-} cmtime --dest $net.$n.1 --port $port --connections $burst --timeout 120 ${PVCM_E2E_BURST_ARGS:-}"
    else
        echo "   $s never listened"
        ok=0
    fi
    local rcs="" vm r
    for vm in "$s" "$c"; do
        r=0
        eval "[ -n \"\${vmpid_$vm:-}\" ]" || continue
        wait_vm "$vm" || r=$?
        rcs="$rcs $vm=$r"
        [ "$r" = 0 ] || ok=0
    done
    echo "   exit codes:$rcs"
    local drained=1
    wait_drained "$h" 60 || drained=0
    stat_json "$h" || ok=0
    check_py "$workdir" "$h" "$drained" "$burst" <<'PY' || ok=0
import json, sys
wd, h, drained, conns = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
bad = []
s = json.load(open(f"{wd}/{h}.stat.json"))["host"]
cm = s["cm"]
r = sum(cm["cm_tx_retries"].values())
d = {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}
print(f"   {h}: REQ {cm['cm_tx_msgs']['req']} DREQ {cm['cm_tx_msgs']['dreq']} retries {r} drops {d} live {s['live']}")
if r: bad.append(f"{h}: {r} retries")
if d: bad.append(f"{h}: drops {d}")
if s["live"]: bad.append(f"{h}: {s['live']} live entries")
if cm["cm_tx_msgs"]["req"] != conns or cm["cm_tx_msgs"]["dreq"] != conns:
    bad.append(f"{h}: REQ {cm['cm_tx_msgs']['req']} DREQ {cm['cm_tx_msgs']['dreq']}, want {conns} each")
if not drained: bad.append("live entries did not drain to 0 within 60 s")
for x in bad: print("   check:", x)
sys.exit(1 if bad else 0)
PY
    for vm in "$s" "$c"; do
        echo "   $vm: $(grep -E '^(step|establish|disconnect|connections|accepted|pacing)' "$workdir/$vm.out" | tr '\n' ' ' | cut -c1-400)"
    done
    stop_backend "$h"
    if [ "$ok" = 1 ]; then
        result "$n" pass "$route route: $burst connections at once between 2 VMs on default options, 0 drops, 0 retries ($(elapsed "$t0") s)"
    else
        result "$n" fail "$route route burst of $burst ($(elapsed "$t0") s)"
        dump "$s" "$c" "$h"
    fi
}

# A late application (seed 000's mechanism at its source): VM B's application destroys
# a connection the peer disconnected only 8 s later, past one DREQ attempt (~6.1 s with
# rdma_cm's timeouts; pvcm's ~4.3 s). Test 7: by default B's agent answers the DREQ at
# once, so A's host counts 0 DREQ retries. Test 8, the control that shows test 7 can
# fail: with --linux-drep on B (DREP only when the application acts, as rdma_cm), A
# retries its DREQ.
run_late_app() { # N LINUX_DREP(0|1) PORT
    local n="$1" linux="$2" port="$3" h="t${1}h" a="t${1}a" b="t${1}b" why ok=1 t0 flag=""
    [ "$linux" = 1 ] && flag="--linux-drep"
    why="$(need_guest_cmd listen connect)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    [ -z "$missing_qemu" ] || why="$missing_qemu"
    if [ -n "$why" ]; then
        result "$n" skip "$why"
        return
    fi
    budget_left || {
        result "$n" fail "over the ${budget} s budget before it started"
        return
    }
    t0="$(now_s)"
    start_backend "$h" "$a:$net.$n.1" "$b:$net.$n.2" || {
        result "$n" fail "backend did not start"
        dump "$h"
        return
    }
    start_vm "$b" generic "pvcm-guest $flag --json listen --port $port --count 1 --react-after 8"
    if wait_console "$b" '"event": ?"listening"' 120; then
        start_vm "$a" generic "pvcm-guest --json connect --dest $net.$n.2 --port $port --timeout 20"
    else
        echo "   $b never listened"
        ok=0
    fi
    local vm r rcs=""
    for vm in "$a" "$b"; do
        r=0
        eval "[ -n \"\${vmpid_$vm:-}\" ]" || continue
        wait_vm "$vm" || r=$?
        rcs="$rcs $vm=$r"
        [ "$r" = 0 ] || ok=0
    done
    echo "   exit codes:$rcs"
    stat_json "$h" || ok=0
    check_py "$workdir" "$h" "$linux" <<'PY' || ok=0
import json, sys
wd, h, linux = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
s = json.load(open(f"{wd}/{h}.stat.json"))["host"]
cm = s["cm"]
r = cm["cm_tx_retries"]["dreq"]
d = {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}
print(f"   {h}: DREQ {cm['cm_tx_msgs']['dreq']} DREQ retries {r} DREP {cm['cm_tx_msgs']['drep']} drops {d}")
bad = []
if linux and r < 1: bad.append("with --linux-drep the late application should have caused a DREQ retry")
if not linux and r: bad.append(f"{r} DREQ retries with the DREP answered at once")
if d: bad.append(f"drops {d}")
for x in bad: print("   check:", x)
sys.exit(1 if bad else 0)
PY
    stop_backend "$h"
    local what="application 8 s late, DREP at once: 0 DREQ retries"
    [ "$linux" = 1 ] && what="control: application 8 s late with --linux-drep: the peer retries its DREQ"
    if [ "$ok" = 1 ]; then
        result "$n" pass "$what ($(elapsed "$t0") s)"
    else
        result "$n" fail "$what ($(elapsed "$t0") s)"
        dump "$a" "$b" "$h"
    fi
}

# Restart without loss: the client's backend is killed with SIGKILL while
# its VM holds connections, and started again over the same --state-dir; the patched
# QEMU reconnects (reconnect-ms) and the VM tears its connections down afterwards.
test9() {
    local n=9 h="t9h" hp="t9p" s="t9s" c="t9c" port=7009 why ok=1 t0 pid
    why="$(need_guest_cmd cmtime)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    [ -z "$missing_qemu" ] || why="$missing_qemu"
    if [ -n "$why" ]; then
        result "$n" skip "$why"
        return
    fi
    budget_left || {
        result "$n" fail "over the ${budget} s budget before it started"
        return
    }
    t0="$(now_s)"
    rm -rf "$workdir/t9state"
    start_backend "$hp" "$s:$net.9.1" && backend_extra=(--state-dir "$workdir/t9state") &&
        start_backend "$h" "$c:$net.9.2" || {
        backend_extra=()
        result "$n" fail "backends did not start"
        dump "$hp" "$h"
        return
    }
    start_vm "$s" generic "pvcm-guest cmtime --server --port $port --connections $restart_conns --timeout 300"
    if wait_console "$s" 'cmtime server on' 120; then
        start_vm "$c" generic "pvcm-guest --json cmtime --dest $net.9.1 --port $port --connections $restart_conns --hold 15 --timeout 120"
    else
        echo "   $s never listened"
        ok=0
    fi
    # Every connection established: the client's backend holds them all.
    local live=0
    [ "$ok" = 1 ] && { wait_live "$h" "$restart_conns" || ok=0; }
    local restored="none"
    if [ "$ok" = 1 ]; then
        eval "pid=\$pid_$h"
        kill -9 "$pid"
        wait "$pid" 2>/dev/null || true
        echo "   killed the client's backend (SIGKILL) with $live live entries"
        sleep 1
        if start_backend "$h" "$c:$net.9.2"; then
            stat_json "$h" && restored="$(python3 -c 'import json,sys; h=json.load(open(sys.argv[1]))["host"]; print(h["live"])' "$workdir/$h.stat.json")"
            echo "   restarted: $restored live entries restored"
            [ "$restored" = "$live" ] || ok=0
        else
            echo "   the backend did not start again"
            ok=0
        fi
    fi
    backend_extra=()
    local rcs="" vm r
    for vm in "$s" "$c"; do
        r=0
        eval "[ -n \"\${vmpid_$vm:-}\" ]" || continue
        wait_vm "$vm" || r=$?
        rcs="$rcs $vm=$r"
        [ "$r" = 0 ] || ok=0
    done
    echo "   exit codes:$rcs"
    local drained=1
    wait_drained "$h" 60 && wait_drained "$hp" 60 || drained=0
    stat_json "$h" && stat_json "$hp" || ok=0
    check_py "$workdir" "$h" "$hp" "$c" "$drained" "$restart_conns" <<'PY' || ok=0
import json, sys
wd, h, hp, c, drained, conns = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1", int(sys.argv[6])
bad = []
rep = None
for line in open(f"{wd}/{c}.out", errors="replace"):
    line = line.strip()
    if line.startswith("{") and '"disconnected"' in line:
        rep = json.loads(line)
if rep is None:
    bad.append(f"{c}: no cmtime report")
else:
    print(f"   {c}: established {rep['established']} disconnected {rep['disconnected']} failed {rep['failed']}")
    if rep["established"] != conns or rep["disconnected"] != conns:
        bad.append(f"{c}: {rep['established']} established, {rep['disconnected']} torn down of {conns}")
for name in (h, hp):
    s = json.load(open(f"{wd}/{name}.stat.json"))["host"]
    cm = s["cm"]
    d = {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}
    r = cm["cm_tx_retries"]["dreq"]
    print(f"   {name}: DREQ {cm['cm_tx_msgs']['dreq']} DREP {cm['cm_rx_msgs']['drep'] + cm['cm_tx_msgs']['drep']} DREQ retries {r} drops {d} live {s['live']}")
    if d: bad.append(f"{name}: drops {d}")
    if r: bad.append(f"{name}: {r} DREQ retries")
if not drained: bad.append("live entries did not drain to 0 within 60 s")
for x in bad: print("   check:", x)
sys.exit(1 if bad else 0)
PY
    stop_backend "$h"
    stop_backend "$hp"
    if [ "$ok" = 1 ]; then
        result "$n" pass "restart: SIGKILL of the backend under $restart_conns connections, restored ($restored live), QEMU reconnected, all torn down ($(elapsed "$t0") s)"
    else
        result "$n" fail "restart without loss ($(elapsed "$t0") s)"
        dump "$s" "$c" "$h" "$hp"
    fi
}

# Live migration: VM C holds $migrate_conns connections to VM S on a third backend; C
# is live-migrated from its QEMU on backend A to a second QEMU on backend B (which has C
# as incoming=yes) while connected; then C tears every connection down from B.
test10() {
    local n=10 ha="t10a" hb="t10b" hp="t10p" s="t10s" c="t10c" c2="t10d" port=7010 why ok=1 t0
    why="$(need_guest_cmd cmtime)"
    [ -z "$missing_backend" ] || why="$missing_backend"
    [ -z "$missing_qemu" ] || why="$missing_qemu"
    if [ -n "$why" ]; then
        result "$n" skip "$why"
        return
    fi
    budget_left || {
        result "$n" fail "over the ${budget} s budget before it started"
        return
    }
    t0="$(now_s)"
    local keys="id-range=0x800a0000/16:quota=1000" ip="$net.10.2"
    keys="${keys//:/,}"
    start_backend "$hp" "$s:$net.10.1" &&
        start_backend "$ha" "$c:$ip:$keys" &&
        start_backend "$hb" "$c2:$ip:$keys,incoming=yes" || {
        result "$n" fail "backends did not start"
        dump "$hp" "$ha" "$hb"
        return
    }
    start_vm "$s" generic "pvcm-guest cmtime --server --port $port --connections $migrate_conns --timeout 300"
    local cmd="pvcm-guest cmtime --dest $net.10.1 --port $port --connections $migrate_conns --hold 20 --timeout 120"
    if wait_console "$s" 'cmtime server on' 120; then
        rm -f "$workdir/$c.console.log" "$workdir/$c.out" "$workdir/$c.qmp"
        "$PVCM_SCRIPTS_DIR/run-vm.sh" --quiet --route generic --socket "$workdir/$c.sock" \
            --name "$c" --guest-dir "$guest_dir" --log "$workdir/$c.console.log" \
            --qmp "$workdir/$c.qmp" --timeout "$vm_timeout" --cmd "$cmd" \
            >"$workdir/$c.out" 2>"$workdir/$c.err" &
        bg_pids+=($!)
        eval "vmpid_$c=$!"
    else
        echo "   $s never listened"
        ok=0
    fi
    local live=0
    [ "$ok" = 1 ] && { wait_live "$ha" "$migrate_conns" || ok=0; }
    if [ "$ok" = 1 ]; then
        # The destination: the same VM, waiting for the migration stream.
        rm -f "$workdir/$c2.console.log" "$workdir/$c2.out" "$workdir/mig.sock"
        "$PVCM_SCRIPTS_DIR/run-vm.sh" --quiet --route generic --socket "$workdir/$c2.sock" \
            --name "$c2" --guest-dir "$guest_dir" --log "$workdir/$c2.console.log" \
            --incoming "unix:$workdir/mig.sock" --timeout "$vm_timeout" --cmd "$cmd" \
            >"$workdir/$c2.out" 2>"$workdir/$c2.err" &
        bg_pids+=($!)
        eval "vmpid_$c2=$!"
        for _ in $(seq 100); do [ -S "$workdir/mig.sock" ] && break; sleep 0.2; done
        echo "   migrating $c ($live connections) from $ha to $hb"
        if "$PVCM_SCRIPTS_DIR/qmp.py" "$workdir/$c.qmp" migrate "unix:$workdir/mig.sock" 120 \
            >"$workdir/migrate.json" 2>"$workdir/migrate.err"; then
            python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print("   migration completed: total %s ms, downtime %s ms, setup %s ms" % (m.get("total-time"), m.get("downtime"), m.get("setup-time")))' "$workdir/migrate.json"
        else
            echo "   migration failed: $(cat "$workdir/migrate.err") $(head -c 600 "$workdir/migrate.json")"
            ok=0
        fi
        "$PVCM_SCRIPTS_DIR/qmp.py" "$workdir/$c.qmp" quit >/dev/null 2>&1 || true
        stat_json "$ha" || ok=0
        stat_json "$hb" || ok=0
        python3 - "$workdir" "$ha" "$hb" <<'PY' || ok=0
import json, sys
wd, ha, hb = sys.argv[1:4]
a = json.load(open(f"{wd}/{ha}.stat.json"))["host"]
b = json.load(open(f"{wd}/{hb}.stat.json"))["host"]
print(f"   right after: source backend live {a['live']} quarantined {a['quarantined']}; destination live {b['live']}")
sys.exit(1 if a["live"] or a["quarantined"] else 0)
PY
    fi
    local rcs="" vm r
    for vm in "$s" "$c2"; do
        r=0
        eval "[ -n \"\${vmpid_$vm:-}\" ]" || continue
        wait_vm "$vm" || r=$?
        rcs="$rcs $vm=$r"
        [ "$r" = 0 ] || ok=0
    done
    eval "[ -n \"\${vmpid_$c:-}\" ]" && { wait_vm "$c" || true; }
    echo "   exit codes:$rcs"
    local drained=1
    wait_drained "$hb" 60 && wait_drained "$hp" 60 || drained=0
    stat_json "$ha" && stat_json "$hb" && stat_json "$hp" || ok=0
    check_py "$workdir" "$ha" "$hb" "$hp" "$c2" "$drained" "$migrate_conns" <<'PY' || ok=0
import json, re, sys
wd, ha, hb, hp, c2, drained, conns = sys.argv[1:7] + [int(sys.argv[7])]
drained = drained == "1"
bad = []
def host(h): return json.load(open(f"{wd}/{h}.stat.json"))["host"]
a, b, p = host(ha), host(hb), host(hp)
out = open(f"{wd}/{c2}.out", errors="replace").read()
if not re.search(rf"connections {conns} established {conns} failed 0 disconnected {conns}", out):
    bad.append(f"the migrated VM's cmtime: {out[-400:]!r}")
for name, h in (("source", a), ("destination", b), ("peer", p)):
    d = {k: v for g in ("drops", "device_drops") for k, v in h.get(g, {}).items() if v}
    r = sum(h["cm"]["cm_tx_retries"].values())
    print(f"   {name}: REQ {h['cm']['cm_tx_msgs']['req']} DREQ tx {h['cm']['cm_tx_msgs']['dreq']} rx {h['cm']['cm_rx_msgs']['dreq']} DREP rx {h['cm']['cm_rx_msgs']['drep']} retries {r} drops {d} live {h['live']}")
    if d: bad.append(f"{name}: drops {d}")
if a["live"] or a["quarantined"]: bad.append("the source still holds entries")
if b["cm"]["cm_tx_msgs"]["dreq"] != conns: bad.append(f"destination sent {b['cm']['cm_tx_msgs']['dreq']} DREQs, want {conns}")
if b["cm"]["cm_rx_msgs"]["drep"] < conns: bad.append(f"destination got {b['cm']['cm_rx_msgs']['drep']} DREPs, want {conns}")
if a["cm"]["cm_tx_msgs"]["dreq"]: bad.append("the source sent DREQs on the VM's behalf")
if not drained: bad.append("live entries did not drain within 60 s")
for x in bad: print("   check:", x)
sys.exit(1 if bad else 0)
PY
    for b in "$ha" "$hb" "$hp"; do stop_backend "$b"; done
    if [ "$ok" = 1 ]; then
        result "$n" pass "live migration of a VM holding $migrate_conns connections between backends (QEMU migrate), all torn down from the destination, 0 drops ($(elapsed "$t0") s)"
    else
        result "$n" fail "live migration ($(elapsed "$t0") s)"
        dump "$s" "$c" "$c2" "$ha" "$hb" "$hp"
    fi
}

selected 1 && run_connect_disconnect 1 generic "" 7001
selected 2 && test2
selected 3 && test3
selected 4 && run_connect_disconnect 4 gpio-stub "--device pci:41" 7004
selected 5 && run_burst 5 generic "" 7005
selected 6 && run_burst 6 gpio-stub "--device pci:41" 7006
selected 7 && run_late_app 7 0 7007
selected 8 && run_late_app 8 1 7008
selected 9 && test9
selected 10 && test10

echo
echo "== summary ($(elapsed "$t_start") s, logs in $workdir)"
for r in "${results[@]}"; do echo "   $r"; done
if [ "$failed" = 0 ] && [ "$keep_workdir" = 0 ]; then rm -rf "$workdir"; fi
echo "e2e: $passed passed, $failed failed, $skipped skipped"
if [ "$failed" -gt 0 ]; then exit 1; fi
if [ "$skipped" -gt 0 ] && [ "$allow_missing" = 0 ]; then
    echo "tests were skipped for missing pieces (pass --allow-missing to accept that)" >&2
    exit 1
fi
exit 0
