# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Tests 5 and 6: a burst between two VMs on one backend, on default options: $burst
# connections set up at once and torn down at once with cmtime; 0 drops, 0 retries,
# every connection up and down, and the live entries drain to 0.

# burst N ROUTE DEVICE_OPT PORT (test 5: generic; test 6: gpio-stub, queues of 64)
burst() {
    local n="$1" route="$2" dev="$3" port="$4" h="t${1}h" s="t${1}s" c="t${1}c" ok=1 vm
    test_begin "$n" patched cmtime || return 0
    start_backend "$h" "$s:$net.$n.1" "$c:$net.$n.2" || {
        result "$n" fail "backend did not start"
        dump "$h"
        return
    }
    start_vm "$s" "$route" "pvcm-guest $dev ${PVCM_E2E_GUEST_OPTS:-} cmtime --server --port $port --connections $burst --timeout 200"
    if wait_console "$s" 'cmtime server on' 120; then
        start_vm "$c" "$route" "pvcm-guest $dev ${PVCM_E2E_GUEST_OPTS:-} cmtime --dest $net.$n.1 --port $port --connections $burst --timeout 120 ${PVCM_E2E_BURST_ARGS:-}"
    else
        fail "$s never listened"
        ok=0
    fi
    wait_vms "$s" "$c" || ok=0
    local drained=1
    wait_drained "$h" 60 || drained=0
    stat_json "$h" || ok=0
    check burst "$h" "$drained" "$burst" || ok=0
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
