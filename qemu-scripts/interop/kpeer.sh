#!/bin/sh
# Runs inside an rxe-peer guest (Linux kernel CM over rdma_rxe), from the 9p share at
# /host: optionally a cmtime listener, then the host's requests, one at a time, until
# /host/flag.stop appears. A request is a file /host/q/NAME.sh; its output goes to
# NAME.out and its exit status to NAME.rc (written last). See interop.sh.
me="${1:?usage: kpeer.sh NAME [listen]}"
if [ "${2:-}" = listen ]; then
    cmtime -p 7471 >"/host/cmtime-listener.$me.log" 2>&1 &
    echo $! >"/host/cmtime-listener.$me.pid"
fi
echo ready >"/host/flag.ready.$me"
while [ ! -e /host/flag.stop ]; do
    for f in /host/q/"$me".*.sh; do
        [ -e "$f" ] || continue
        n="${f%.sh}"
        mv "$f" "$n.run"
        sh "$n.run" >"$n.out" 2>&1
        echo $? >"$n.rc"
    done
    sleep 0.1
done
echo "kpeer $me: stopping"
