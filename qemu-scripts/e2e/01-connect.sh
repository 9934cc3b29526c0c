# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Tests 1 and 4: connect/disconnect between two hosts, one VM each. VM B listens, VM A
# connects with private data and disconnects after a second; both must see the other's
# data, established and disconnected; each host passes REQ/REP/RTU/DREQ/DREP once with
# 0 retries and 0 drops, and its live entries drain to 0.

# connect_disconnect N ROUTE DEVICE_OPT PORT (test 1: generic; test 4: gpio-stub, pci:41)
connect_disconnect() {
    local n="$1" route="$2" dev="$3" port="$4" a="t${1}a" b="t${1}b" ha="t${1}h1" hb="t${1}h2" ok=1
    local qemu=stock
    [ "$route" = generic ] && qemu=patched
    test_begin "$n" "$qemu" listen connect || return 0
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
        fail "VM A exited $ra"
        ok=0
    }
    [ "$rb" = 0 ] || {
        fail "VM B exited $rb"
        ok=0
    }
    [ "$ok" = 1 ] && { check connect-disconnect "$a" "$b" "$ha" "$hb" || ok=0; }
    if [ "$ok" = 1 ] && ! { wait_drained "$ha" 30 && wait_drained "$hb" 30; }; then
        fail "live entries did not drain to 0 within 30 s"
        ok=0
    fi
    echo "   A: $(tr '\n' ' ' <"$workdir/$a.out" | cut -c1-400)"
    echo "   B: $(tr '\n' ' ' <"$workdir/$b.out" | cut -c1-400)"
    stop_backend "$ha" "$hb"
    if [ "$ok" = 1 ]; then
        result "$n" pass "connect/disconnect via $route ($(elapsed "$t0") s)"
    else
        result "$n" fail "connect/disconnect via $route ($(elapsed "$t0") s)"
        dump "$a" "$b" "$ha" "$hb"
    fi
}
