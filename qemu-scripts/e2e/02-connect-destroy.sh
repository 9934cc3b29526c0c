# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Test 2: rdma_connect/destroy. VM A connects and destroys at once; VM B's half-open
# connection must be rejected by the routed REJ(TIMEOUT) and never established.
#
# B's `listen --count 1` ends by itself once that connection is rejected; its timeout
# only ends a run where the REJ never comes. It must outlast A's boot (B listens before
# A starts, and a TCG boot on a loaded machine can take tens of seconds), and stay
# within run-vm.sh's limit for B's VM (PVCM_E2E_VM_TIMEOUT, 150 s).

connect_destroy() {
    local n=2 a=t2a b=t2b ha=t2h1 hb=t2h2 ok=1
    test_begin "$n" patched listen connect-destroy || return 0
    start_backend "$ha" "$a:$net.1.1" && start_backend "$hb" "$b:$net.2.1" || {
        result "$n" fail "backends did not start"
        dump "$ha" "$hb"
        return
    }
    start_vm "$b" generic "timeout 100 pvcm-guest --json listen --port 7002 --count 1; rc=\$?; if [ \$rc = 143 ]; then echo 'listen stopped after 100 s'; rc=0; fi; exit \$rc"
    if ! wait_console "$b" '"event": ?"listening"' 90; then
        wait_vm "$b" || true
        result "$n" fail "VM B never listened"
        dump "$b" "$hb"
        return
    fi
    start_vm "$a" generic "pvcm-guest --json connect-destroy --dest $net.2.1 --port 7002 --settle 3"
    local ra=0 rb=0
    wait_vm "$a" || ra=$?
    wait_vm "$b" || rb=$?
    stat_json "$ha" && stat_json "$hb" || ok=0
    [ "$ra" = 0 ] || {
        fail "VM A exited $ra"
        ok=0
    }
    [ "$rb" = 0 ] || {
        fail "VM B exited $rb"
        ok=0
    }
    check connect-destroy "$a" "$b" "$ha" "$hb" || ok=0
    echo "   A: $(tr '\n' ' ' <"$workdir/$a.out" | cut -c1-400)"
    echo "   B: $(tr '\n' ' ' <"$workdir/$b.out" | cut -c1-400)"
    stop_backend "$ha" "$hb"
    if [ "$ok" = 1 ]; then
        result "$n" pass "rdma_connect/destroy: routed REJ(TIMEOUT) ($(elapsed "$t0") s)"
    else
        result "$n" fail "rdma_connect/destroy ($(elapsed "$t0") s)"
        dump "$a" "$b" "$ha" "$hb"
    fi
}
