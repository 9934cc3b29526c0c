# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Test 3: seed 000 at full scale. Two hosts with two VMs each; the VMs of host 2 run
# cmtime servers, those of host 1 cmtime clients, $conns connections per pair set up and
# torn down all at once on default options: 0 drops, 0 retries, every connection up and
# down, 0 live entries after quiesce.

seed000() {
    local n=3 h1=t3h1 h2=t3h2 ok=1 vm
    local vms=(t3a1 t3a2 t3b1 t3b2)
    test_begin "$n" patched cmtime || return 0
    start_backend "$h1" "t3a1:$net.1.1" "t3a2:$net.1.2" &&
        start_backend "$h2" "t3b1:$net.2.1" "t3b2:$net.2.2" || {
        result "$n" fail "backends did not start"
        dump "$h1" "$h2"
        return
    }
    # The cmtime timeouts grow with --scale (the seed's size took ~20 s of them).
    local srv_timeout=$((120 * scale)) cli_timeout=$((60 * scale))
    start_vm t3b1 generic "pvcm-guest --json cmtime --server --port 7471 --connections $conns --timeout $srv_timeout"
    start_vm t3b2 generic "pvcm-guest --json cmtime --server --port 7471 --connections $conns --timeout $srv_timeout"
    for vm in t3b1 t3b2; do
        wait_console "$vm" '"event": ?"listening"' 120 || {
            fail "$vm never listened"
            ok=0
        }
    done
    if [ "$ok" = 1 ]; then
        start_vm t3a1 generic "pvcm-guest --json cmtime --dest $net.2.1 --port 7471 --connections $conns --timeout $cli_timeout"
        start_vm t3a2 generic "pvcm-guest --json cmtime --dest $net.2.2 --port 7471 --connections $conns --timeout $cli_timeout"
    fi
    wait_vms "${vms[@]}" || ok=0
    local drained=1
    wait_drained "$h1" 60 && wait_drained "$h2" 60 || drained=0
    stat_json "$h1" && stat_json "$h2" || ok=0
    check seed000 "$h1" "$h2" "$drained" "$conns" || ok=0
    for vm in "${vms[@]}"; do
        echo "   $vm: $(tr '\n' ' ' <"$workdir/$vm.out" | cut -c1-300)"
    done
    stop_backend "$h1" "$h2"
    if [ "$ok" = 1 ]; then
        result "$n" pass "2 hosts x 2 VMs, $((2 * conns)) connections torn down concurrently ($(elapsed "$t0") s)"
    else
        result "$n" fail "multi-VM teardown ($(elapsed "$t0") s)"
        dump "${vms[@]}" "$h1" "$h2"
    fi
}
