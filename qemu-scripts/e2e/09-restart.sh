# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Test 9: restart without loss. VM C (on a backend with --state-dir) holds $restart_conns
# connections to VM S on another backend; C's backend is killed with SIGKILL and started
# again over the same --state-dir; the patched QEMU reconnects (reconnect-ms), and C
# tears every connection down afterwards: all DREQs answered, 0 drops, the restored
# backend shows every entry right after the restart, 0 live after.

restart() {
    local n=9 h="t9h" hp="t9p" s="t9s" c="t9c" port=7009 ok=1 pid
    test_begin "$n" patched cmtime || return 0
    rm -rf "$workdir/t9state"
    start_backend "$hp" "$s:$net.9.1" &&
        start_backend --state-dir "$workdir/t9state" "$h" "$c:$net.9.2" || {
        result "$n" fail "backends did not start"
        dump "$hp" "$h"
        return
    }
    start_vm "$s" generic "pvcm-guest cmtime --server --port $port --connections $restart_conns --timeout 300"
    if wait_console "$s" 'cmtime server on' 120; then
        start_vm "$c" generic "pvcm-guest --json cmtime --dest $net.9.1 --port $port --connections $restart_conns --hold 15 --timeout 120"
    else
        fail "$s never listened"
        ok=0
    fi
    # Every connection established: the client's backend holds them all.
    local live=0
    [ "$ok" = 1 ] && { wait_live "$h" "$restart_conns" || ok=0; }
    local restored="none"
    if [ "$ok" = 1 ]; then
        pid="${backend_pid[$h]}"
        kill -9 "$pid"
        wait "$pid" 2>/dev/null || true
        echo "   killed the client's backend (SIGKILL) with $live live entries"
        sleep 1
        if start_backend --state-dir "$workdir/t9state" "$h" "$c:$net.9.2"; then
            stat_json "$h" && restored="$(live_of "$h")"
            echo "   restarted: $restored live entries restored"
            [ "$restored" = "$live" ] || {
                reasons+=("$restored of $live live entries restored")
                ok=0
            }
        else
            fail "the backend did not start again"
            ok=0
        fi
    fi
    wait_vms "$s" "$c" || ok=0
    local drained=1
    wait_drained "$h" 60 && wait_drained "$hp" 60 || drained=0
    stat_json "$h" && stat_json "$hp" || ok=0
    check restart "$h" "$hp" "$c" "$drained" "$restart_conns" || ok=0
    stop_backend "$h" "$hp"
    if [ "$ok" = 1 ]; then
        result "$n" pass "restart: SIGKILL of the backend under $restart_conns connections, restored ($restored live), QEMU reconnected, all torn down ($(elapsed "$t0") s)"
    else
        result "$n" fail "restart without loss ($(elapsed "$t0") s)"
        dump "$s" "$c" "$h" "$hp"
    fi
}
