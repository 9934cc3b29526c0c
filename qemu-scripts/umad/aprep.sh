#!/bin/sh
# Runs inside lab guest a (no kernel CM), from the 9p share: gives eth0 the pvcm
# VMs' addresses so rxe0 gets their RoCE v2 GIDs, waits for the GIDs, then starts
# pvcm-backend on umad:rxe0:1 with VMs a and b (and c, whose address is NOT added: it
# must be refused at attach), and with A6 the IPv6 VM a6 (its address added as a /128,
# nodad, so the GID is usable at once). Sockets live in the guest's /tmp (not on 9p).
# Usage: aprep.sh A_IP B_IP C_IP [A6_IPV6], each address in /host/gids.txt (below).
set -u
gids=/sys/class/infiniband/rxe0/ports/1/gids
types=/sys/class/infiniband/rxe0/ports/1/gid_attrs/types
# The host's table of the VMs' GIDs (python3 -m netlab addr table): "ADDR SYSFS_GID
# VM_GID" lines. sysfs_gid ADDR: the GID rxe0's table shows for ADDR; vm_gid ADDR: the
# GID pvcm-backend's --vm takes.
gid_table=/host/gids.txt
sysfs_gid() { awk -v a="$1" '$1 == a { print $2 }' "$gid_table"; }
vm_gid() { awk -v a="$1" '$1 == a { print $3 }' "$gid_table"; }
# roce_v2 GID: is GID a RoCE v2 entry of the table (the type of the index holding it)?
roce_v2() {
    for f in "$gids"/*; do
        [ "$(cat "$f" 2>/dev/null)" = "$1" ] &&
            grep -q "RoCE v2" "$types/$(basename "$f")" 2>/dev/null && return 0
    done
    return 1
}
a6="${4:-}"
for ip in "$1" "$2"; do
    ip addr add "$ip/24" dev eth0 || exit 1
done
if [ -n "$a6" ]; then
    ip -6 addr add "$a6/128" dev eth0 nodad || exit 1
    g6="$(sysfs_gid "$a6")"
    i=0
    until roce_v2 "$g6"; do
        i=$((i + 1))
        [ $i -lt 100 ] || { echo "no RoCE v2 GID $g6 for $a6"; exit 1; }
        sleep 0.1
    done
fi
for ip in "$1" "$2"; do
    g="$(sysfs_gid "$ip")"
    [ -n "$g" ] || { echo "no GID for $ip in $gid_table"; exit 1; }
    i=0
    until cat $gids/* 2>/dev/null | grep -q "$g"; do
        i=$((i + 1))
        [ $i -lt 100 ] || { echo "no GID for $ip"; exit 1; }
        sleep 0.1
    done
done
echo "GID table:"
for f in "$gids"/*; do
    g="$(cat "$f")"
    [ "$g" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
    echo "  $(basename "$f") $g $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/"$(basename "$f")" 2>/dev/null)"
done
ls -l /dev/infiniband/
rm -f /tmp/a.sock /tmp/b.sock /tmp/c.sock /tmp/a6.sock /tmp/h.ctl
set -- --vm "socket=/tmp/a.sock,gid=$(vm_gid "$1"),name=a" \
    --vm "socket=/tmp/b.sock,gid=$(vm_gid "$2"),name=b" \
    --vm "socket=/tmp/c.sock,gid=$(vm_gid "$3"),name=c"
[ -z "$a6" ] || set -- "$@" --vm "socket=/tmp/a6.sock,gid=$(vm_gid "$a6"),name=a6"
LD_LIBRARY_PATH=/host/lib RUST_LOG=info NO_COLOR=1 /host/bin/pvcm-backend --port umad:rxe0:1 \
    "$@" --control /tmp/h.ctl >/host/backend.log 2>&1 &
i=0
until [ -S /tmp/h.ctl ]; do
    i=$((i + 1))
    if [ $i -ge 100 ] || ! kill -0 $! 2>/dev/null; then
        echo "backend did not start:"
        cat /host/backend.log
        exit 1
    fi
    sleep 0.1
done
echo "backend up (pid $!)"
