#!/usr/bin/env bash
# The host side of QP1 for a VM with its own RDMA NIC: divert the RoCEv2 frames to QP1
# that the bridge sends towards the VM's tap to a device the host reads instead.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: qemu-scripts/qp1-divert.sh add|del TAP DEV
       qemu-scripts/qp1-divert.sh show TAP
       qemu-scripts/qp1-divert.sh dev DEV

For a VM whose NIC is TAP (the VM runs rdma_rxe on it without the kernel CM), the
host takes the VM's CM traffic: every RoCEv2 frame to QP1 that would leave TAP
towards the VM is redirected to DEV instead, where it arrives as a received frame
(a packet socket on DEV reads it; pvcm-backend --port packet:DEV does). Every other
frame still reaches the VM: data QPs, ARP, IPv6 ND, everything else.

  add   creates DEV if it does not exist (a dummy device, or, on a kernel without
        dummy, a veth pair DEV + DEVp), sets it up, turns off IPv4 forwarding and
        IPv6 on it (so the host's IP stack never routes or answers a diverted frame),
        adds a clsact qdisc to TAP if it has none, and two tc filters on TAP's egress:
          IPv4 (pref 4791): version 4 with a 20-byte header (0x45), protocol 17 (UDP),
            UDP destination port 4791, BTH destination QP (bytes 32-35, low 24 bits) 1
          IPv6 (pref 4792): next header 17 (UDP) right after the fixed 40-byte
            header, UDP destination port 4791, BTH destination QP (bytes 52-55) 1
        each with "action mirred ingress redirect dev DEV". Running add again
        replaces the filters.
  del   removes the two filters from TAP (the qdisc and DEV stay: other taps may
        divert to DEV too).
  show  prints TAP's egress filters with their counters.
  dev   only creates DEV (as add does) and sets it up.

What it does not match: IPv4 with options (IHL > 5), IPv6 with extension headers
before UDP, RoCEv1 (ethertype 0x8915), VLAN-tagged frames, IP fragments other than
the first (RoCEv2 frames are sent with DF), frames the VM sends (only TAP's egress,
towards the VM, is filtered).

Needs CAP_NET_ADMIN in TAP's network namespace (root, or run it inside the
namespace with "ip netns exec NS"), and tc (iproute2) with the clsact qdisc, the u32
classifier and the mirred action (CONFIG_NET_SCH_INGRESS, CONFIG_NET_CLS_U32,
CONFIG_NET_ACT_MIRRED). On this project's host kernel the redirect is "ingress": a
packet socket on DEV then sees the frame as received (an "egress" redirect would
show it only as outgoing).

Exit status: 0 done, 1 failure (the message says what), 2 usage error.
EOF
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage_error() {
    printf '[%s] ERROR: %s (see --help)\n' "$_pvcm_prog" "$*" >&2
    exit 2
}
case "${1:-}" in
-h | --help)
    usage
    exit 0
    ;;
add | del) [ $# = 3 ] || usage_error "$1 needs TAP and DEV" ;;
show) [ $# = 2 ] || usage_error "show needs TAP" ;;
dev) [ $# = 2 ] || usage_error "dev needs DEV" ;;
"") usage_error "no action" ;;
*) usage_error "unknown action '$1'" ;;
esac
action="$1" tap="$2" dev="${3:-}"
if [ "$action" = dev ]; then
    tap="" dev="$2"
fi
command -v tc >/dev/null || die "tc not found (apt-get install iproute2)"
if [ -n "$tap" ]; then
    ip link show dev "$tap" >/dev/null 2>&1 || die "no network device $tap here"
fi
if [ -n "$dev" ]; then
    [ "${#dev}" -le 14 ] || die "DEV name '$dev' is longer than 14 characters"
    [ "$dev" != "$tap" ] || die "TAP and DEV must differ"
fi

PREF4=4791 PREF6=4792

# quiet DEV: no IPv4 forwarding and no IPv6 on it, so the stack drops what lands there.
quiet() {
    local d="$1"
    [ -w "/proc/sys/net/ipv4/conf/$d/forwarding" ] && echo 0 >"/proc/sys/net/ipv4/conf/$d/forwarding"
    [ -w "/proc/sys/net/ipv6/conf/$d/disable_ipv6" ] && echo 1 >"/proc/sys/net/ipv6/conf/$d/disable_ipv6"
    return 0
}

make_dev() {
    if ! ip link show dev "$dev" >/dev/null 2>&1; then
        if ! ip link add "$dev" type dummy 2>/dev/null; then
            # No dummy driver: a veth pair whose peer is up gives DEV a carrier, which
            # mirred needs; frames redirected into DEV never cross to the peer.
            ip link add "$dev" type veth peer name "${dev}p" ||
                die "cannot create $dev (neither dummy nor veth works here)"
            quiet "${dev}p"
            ip link set "${dev}p" up
        fi
    fi
    quiet "$dev"
    ip link set "$dev" up || die "cannot set $dev up"
}

del_filters() {
    tc filter del dev "$tap" egress protocol ip pref "$PREF4" 2>/dev/null || true
    tc filter del dev "$tap" egress protocol ipv6 pref "$PREF6" 2>/dev/null || true
}

case "$action" in
add)
    make_dev
    if ! tc qdisc show dev "$tap" | grep -q 'qdisc clsact'; then
        tc qdisc add dev "$tap" clsact || die "cannot add a clsact qdisc to $tap"
    fi
    del_filters
    tc filter add dev "$tap" egress protocol ip pref "$PREF4" u32 \
        match u8 0x45 0xff at 0 \
        match u8 17 0xff at 9 \
        match u16 4791 0xffff at 22 \
        match u32 0x00000001 0x00ffffff at 32 \
        action mirred ingress redirect dev "$dev" ||
        die "cannot add the IPv4 QP1 filter to $tap"
    tc filter add dev "$tap" egress protocol ipv6 pref "$PREF6" u32 \
        match u8 17 0xff at 6 \
        match u16 4791 0xffff at 42 \
        match u32 0x00000001 0x00ffffff at 52 \
        action mirred ingress redirect dev "$dev" ||
        die "cannot add the IPv6 QP1 filter to $tap"
    ;;
del)
    del_filters
    ;;
show)
    tc -s filter show dev "$tap" egress
    ;;
dev)
    make_dev
    ;;
esac
