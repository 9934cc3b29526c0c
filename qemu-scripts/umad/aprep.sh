#!/bin/sh
# Runs inside lab guest a (no kernel CM), from the 9p share: gives eth0 the pvcm
# VMs' addresses so rxe0 gets their RoCE v2 GIDs, waits for the GIDs, then starts
# pvcm-backend on umad:rxe0:1 with VMs a and b (and c, whose address is NOT added: it
# must be refused at attach). Sockets live in the guest's /tmp (not on 9p).
# Usage: aprep.sh A_IP B_IP C_IP
set -u
gids=/sys/class/infiniband/rxe0/ports/1/gids
hex() { echo "$1" | awk -F. '{ printf "%02x%02x:%02x%02x", $1, $2, $3, $4 }'; }
for ip in "$1" "$2"; do
    ip addr add "$ip/24" dev eth0 || exit 1
done
for ip in "$1" "$2"; do
    h="$(hex "$ip")"
    i=0
    until cat $gids/* 2>/dev/null | grep -q "ffff:$h"; do
        i=$((i + 1))
        [ $i -lt 100 ] || { echo "no GID for $ip"; exit 1; }
        sleep 0.1
    done
done
echo "GID table:"
for f in $gids/*; do
    g="$(cat "$f")"
    [ "$g" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
    echo "  $(basename "$f") $g $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/"$(basename "$f")" 2>/dev/null)"
done
ls -l /dev/infiniband/
rm -f /tmp/a.sock /tmp/b.sock /tmp/c.sock /tmp/h.ctl
LD_LIBRARY_PATH=/host/lib RUST_LOG=info NO_COLOR=1 /host/bin/pvcm-backend --port umad:rxe0:1 \
    --vm "socket=/tmp/a.sock,gid=::ffff:$1,name=a" \
    --vm "socket=/tmp/b.sock,gid=::ffff:$2,name=b" \
    --vm "socket=/tmp/c.sock,gid=::ffff:$3,name=c" \
    --control /tmp/h.ctl >/host/backend.log 2>&1 &
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
