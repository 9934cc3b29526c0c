# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Tests 7 and 8: a late application (seed 000's mechanism at its source). VM B's
# application destroys a connection the peer disconnected only 8 s later, past one DREQ
# attempt (~6.1 s with rdma_cm's timeouts; pvcm's ~4.3 s). Test 7: by default B's agent
# answers the DREQ at once, so A's host counts 0 DREQ retries. Test 8, the control that
# shows test 7 can fail: with --linux-drep on B (DREP only when the application acts, as
# rdma_cm), A retries its DREQ.

# late_app N LINUX_DREP(0|1) PORT
late_app() {
    local n="$1" linux="$2" port="$3" h="t${1}h" a="t${1}a" b="t${1}b" ok=1 flag=""
    [ "$linux" = 1 ] && flag="--linux-drep"
    test_begin "$n" patched listen connect || return 0
    start_backend "$h" "$a:$net.$n.1" "$b:$net.$n.2" || {
        result "$n" fail "backend did not start"
        dump "$h"
        return
    }
    start_vm "$b" generic "pvcm-guest $flag --json listen --port $port --count 1 --react-after 8"
    if wait_console "$b" '"event": ?"listening"' 120; then
        start_vm "$a" generic "pvcm-guest --json connect --dest $net.$n.2 --port $port --timeout 20"
    else
        fail "$b never listened"
        ok=0
    fi
    wait_vms "$a" "$b" || ok=0
    stat_json "$h" || ok=0
    check late-app "$h" "$linux" || ok=0
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
