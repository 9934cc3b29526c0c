# shellcheck shell=bash disable=SC2154 # the settings and helpers of e2e.sh, e2e/lib.sh
# Test 10: live migration. VM C (id-range, on backend A) holds $migrate_conns connections
# to VM S on backend P; C is live-migrated (QMP migrate, vhost-user device state) to a
# second QEMU on backend B, which has C as incoming=yes; the source backend must hold
# nothing right after; C's cmtime then tears every connection down from B: all DREQs
# answered, 0 drops anywhere. Prints QEMU's downtime.

migrate() {
    local n=10 ha="t10a" hb="t10b" hp="t10p" s="t10s" c="t10c" c2="t10d" port=7010 ok=1
    test_begin "$n" patched cmtime || return 0
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
        rm -f "$workdir/$c.qmp"
        start_vm "$c" generic "$cmd" --qmp "$workdir/$c.qmp"
    else
        fail "$s never listened"
        ok=0
    fi
    local live=0
    [ "$ok" = 1 ] && { wait_live "$ha" "$migrate_conns" || ok=0; }
    if [ "$ok" = 1 ]; then
        # The destination: the same VM, waiting for the migration stream.
        rm -f "$workdir/mig.sock"
        start_vm "$c2" generic "$cmd" --incoming "unix:$workdir/mig.sock"
        for _ in $(seq 100); do
            [ -S "$workdir/mig.sock" ] && break
            sleep 0.2
        done
        echo "   migrating $c ($live connections) from $ha to $hb"
        if "$PVCM_SCRIPTS_DIR/qmp.py" "$workdir/$c.qmp" migrate "unix:$workdir/mig.sock" 120 \
            >"$workdir/migrate.json" 2>"$workdir/migrate.err"; then
            python3 "$E2E_DIR/checks.py" migration "$workdir/migrate.json"
        else
            fail "migration failed: $(cat "$workdir/migrate.err") $(head -c 600 "$workdir/migrate.json")"
            ok=0
        fi
        "$PVCM_SCRIPTS_DIR/qmp.py" "$workdir/$c.qmp" quit >/dev/null 2>&1 || true
        stat_json "$ha" || ok=0
        stat_json "$hb" || ok=0
        check migrated-away "$ha" "$hb" || {
            reasons+=("the source backend held entries right after the migration")
            ok=0
        }
    fi
    wait_vms "$s" "$c2" || ok=0
    [ -n "${vm_pid[$c]:-}" ] && { wait_vm "$c" || true; }
    local drained=1
    wait_drained "$hb" 60 && wait_drained "$hp" 60 || drained=0
    stat_json "$ha" && stat_json "$hb" && stat_json "$hp" || ok=0
    check migrate "$ha" "$hb" "$hp" "$c2" "$drained" "$migrate_conns" || ok=0
    stop_backend "$ha" "$hb" "$hp"
    if [ "$ok" = 1 ]; then
        result "$n" pass "live migration of a VM holding $migrate_conns connections between backends (QEMU migrate), all torn down from the destination, 0 drops ($(elapsed "$t0") s)"
    else
        result "$n" fail "live migration ($(elapsed "$t0") s)"
        dump "$s" "$c" "$c2" "$ha" "$hb" "$hp"
    fi
}
