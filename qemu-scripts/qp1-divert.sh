#!/usr/bin/env bash
# The host side of QP1 for a VM with its own RDMA NIC: divert the RoCEv2 frames to QP1
# that the bridge sends towards the VM's tap to a device the host reads instead, and stop
# the VM's own QP1 frames and spoofed frames before they reach the fabric.
set -euo pipefail

usage() {
    cat <<'EOF_USAGE'
Usage: pvcm-qp1-divert add TAP DEV MAC ADDR[/LEN]...
       pvcm-qp1-divert del TAP [DEV]
       pvcm-qp1-divert show TAP
       pvcm-qp1-divert dev DEV
       pvcm-qp1-divert ifup TAP | ifdown TAP
(in the source tree: qemu-scripts/qp1-divert.sh)

For a VM whose NIC is TAP (the VM runs rdma_rxe on it without the kernel CM), the
host takes the VM's CM traffic both ways:

  towards the VM: every RoCEv2 frame to QP1 that would leave TAP towards the VM is
    redirected to DEV instead, where it arrives as a received frame (a packet socket
    on DEV reads it; pvcm-backend --port packet:DEV does). Every other frame still
    reaches the VM: data QPs, ARP, IPv6 ND, everything else.
  from the VM: what the VM transmits is checked on TAP's ingress (an nftables netdev
    table "pvcm-TAP", chain "egress") before the bridge sees it:
      - a frame whose Ethernet source is not MAC, an ARP whose sender is not MAC or
        not one of the ADDRs (0.0.0.0 allowed: ARP probes), an IPv4 or IPv6 frame
        whose source is not one of the ADDRs (0.0.0.0 for DHCP requests and :: for
        ICMPv6, as in duplicate address detection, allowed) is dropped, counted
        "spoofed";
      - a RoCEv2 frame (UDP destination port 4791) to BTH destination QP 1 is
        forwarded to DEV, where it is transmitted (a packet socket on DEV sees it as
        outgoing, and pvcm-backend counts it on the VM's counters as vm_qp1_egress),
        counted "qp1"; IPv4 with options and IPv6 with extension headers alike (the
        kernel finds the UDP header), with or without a VLAN tag;
      - a frame the table cannot classify is forwarded to DEV the same way, counted
        "unclassified": an IPv4 or IPv6 fragment of UDP other than the first (its UDP
        port is unknown), an IPv6 extension-header chain the kernel cannot walk or that
        ends in a header it does not know (mobility, HIP, shim6, experimental), a frame
        with a second VLAN tag, a RoCEv1 frame (EtherType 0x8915);
      - at most 1000 stopped frames a second (burst 1000) go to DEV; past that they
        are dropped on TAP, counted "over_rate";
      - everything else passes (frames to other QPs, ARP, ND, the VM's other traffic).
    A RoCEv2 frame's first fragment is classified like a whole frame; the fragments
    after it never reach the fabric, so a split QP1 frame cannot be reassembled there.

  add   creates DEV if it does not exist (a dummy device, or, on a kernel without
        dummy, a veth pair DEV + DEVp), sets it up, turns off IPv4 forwarding and
        IPv6 on it (so the host's IP stack never routes or answers a diverted frame),
        adds a clsact qdisc to TAP if it has none, two tc filters on TAP's egress:
          IPv4 (pref 4791): version 4 with a 20-byte header (0x45), protocol 17 (UDP),
            UDP destination port 4791, BTH destination QP (bytes 32-35, low 24 bits) 1
          IPv6 (pref 4792): next header 17 (UDP) right after the fixed 40-byte
            header, UDP destination port 4791, BTH destination QP (bytes 52-55) 1
        each with "action mirred ingress redirect dev DEV", and the nftables table
        for TAP's ingress. MAC is the VM's NIC's address; each ADDR is an IPv4 or IPv6
        address of the VM, or a prefix (fe80::/64 allows every link-local address).
        Running add again replaces both.
  del   removes the two filters from TAP and TAP's nftables table (DEV stays: other
        taps may divert to it; TAP's clsact qdisc goes when it holds no other
        filter). TAP may be gone already (the VM stopped): the table is removed all
        the same.
  show  prints TAP's egress filters and its nftables table with their counters.
  dev   only creates DEV (as add does) and sets it up.
  ifup, ifdown
        what QEMU runs for a tap it creates and closes when given them as
        -netdev tap,...,script=...,downscript=... (the host package installs
        /usr/lib/pvcm/qemu-ifup and qemu-ifdown, which run these): the divert comes
        and goes with the tap. They read /etc/pvcm/divert.d/TAP.conf
        (PVCM_DIVERT_CONF_DIR names another directory), KEY=VALUE lines:
          dev=pvcm-qp1                     the divert device (DEV)
          mac=52:54:00:99:00:11            the VM's NIC's MAC
          addresses="10.99.0.11 fe80::/64" the VM's addresses (ADDR...)
          bridge=br0                       optional: the bridge to put TAP on
        ifup sets TAP up (on the bridge, if named), then runs add; ifdown runs del.

What it does not match towards the VM: IPv4 with options (IHL > 5), IPv6 with
extension headers before UDP, RoCEv1 (ethertype 0x8915), VLAN-tagged frames, IP
fragments other than the first (RoCEv2 frames are sent with DF). From the VM it
classifies the outer frame only: a tunnel or IPsec ESP payload a peer decapsulates
is not looked into.

Needs CAP_NET_ADMIN in TAP's network namespace (root, or run it inside the
namespace with "ip netns exec NS"), tc (iproute2) with the clsact qdisc, the u32
classifier and the mirred action (CONFIG_NET_SCH_INGRESS, CONFIG_NET_CLS_U32,
CONFIG_NET_ACT_MIRRED), and nft (nftables) with netdev tables and their fwd statement
(CONFIG_NF_TABLES_NETDEV, CONFIG_NFT_FWD_NETDEV). On this project's host kernel the
tc redirect is "ingress": a packet socket on DEV then sees the frame as received (an
"egress" redirect would show it only as outgoing, which the packet port takes for a
VM's own frame).

Exit status: 0 done, 1 failure (the message says what), 2 usage error.
EOF_USAGE
}

_here="$(dirname "${BASH_SOURCE[0]}")"
if [ -r "$_here/lib.sh" ]; then
    # shellcheck source-path=SCRIPTDIR source=lib.sh
    . "$_here/lib.sh"
else
    # Installed on its own (pvcm-qp1-divert in the host package): the two helpers it uses.
    _pvcm_prog="$(basename "$0")"
    die() {
        printf '[%s] ERROR: %s\n' "$_pvcm_prog" "$*" >&2
        exit 1
    }
fi

usage_error() {
    printf '[%s] ERROR: %s (see --help)\n' "$_pvcm_prog" "$*" >&2
    exit 2
}
case "${1:-}" in
-h | --help)
    usage
    exit 0
    ;;
add) [ $# -ge 5 ] || usage_error "add needs TAP, DEV, the VM's MAC and at least one address" ;;
del) [ $# = 2 ] || [ $# = 3 ] || usage_error "del needs TAP (and DEV)" ;;
show) [ $# = 2 ] || usage_error "show needs TAP" ;;
dev) [ $# = 2 ] || usage_error "dev needs DEV" ;;
ifup | ifdown) [ $# = 2 ] || usage_error "$1 needs TAP (QEMU's script= and downscript= pass it)" ;;
"") usage_error "no action" ;;
*) usage_error "unknown action '$1'" ;;
esac
# ifup/ifdown TAP: add/del with what TAP's configuration file names.
if [ "$1" = ifup ] || [ "$1" = ifdown ]; then
    conf="${PVCM_DIVERT_CONF_DIR:-/etc/pvcm/divert.d}/$2.conf"
    [ -r "$conf" ] || die "no $conf (it names the divert device, the VM's MAC and addresses for $2)"
    c_dev="" c_mac="" c_addrs="" c_bridge=""
    while IFS= read -r line || [ -n "$line" ]; do
        line="${line%%#*}"
        [ -n "${line//[[:space:]]/}" ] || continue
        re='^[[:space:]]*([a-z]+)[[:space:]]*=[[:space:]]*"?([^"]*)"?[[:space:]]*$'
        [[ "$line" =~ $re ]] || die "$conf: cannot read '$line' (KEY=VALUE)"
        case "${BASH_REMATCH[1]}" in
        dev) c_dev="${BASH_REMATCH[2]}" ;;
        mac) c_mac="${BASH_REMATCH[2]}" ;;
        addresses) c_addrs="${BASH_REMATCH[2]}" ;;
        bridge) c_bridge="${BASH_REMATCH[2]}" ;;
        *) die "$conf: unknown key '${BASH_REMATCH[1]}' (dev, mac, addresses, bridge)" ;;
        esac
    done <"$conf"
    [ -n "$c_dev" ] && [ -n "$c_mac" ] && [ -n "$c_addrs" ] || die "$conf needs dev, mac and addresses"
    self="${BASH_SOURCE[0]}"
    if [ "$1" = ifdown ]; then
        exec bash "$self" del "$2" "$c_dev"
    fi
    ip link set "$2" up || die "cannot set $2 up"
    if [ -n "$c_bridge" ]; then
        ip link set "$2" master "$c_bridge" || die "cannot put $2 on the bridge $c_bridge"
    fi
    read -r -a c_list <<<"$c_addrs"
    exec bash "$self" add "$2" "$c_dev" "$c_mac" "${c_list[@]}"
fi
action="$1" tap="$2" dev="${3:-}"
if [ "$action" = dev ]; then
    tap="" dev="$2"
fi
mac="" v4=() v6=()
if [ "$action" = add ]; then
    mac="${4,,}"
    [[ "$mac" =~ ^([0-9a-f]{2}:){5}[0-9a-f]{2}$ ]] || usage_error "'$4' is not a MAC address"
    for a in "${@:5}"; do
        if [[ "$a" =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}(/[0-9]{1,2})?$ ]]; then
            v4+=("$a")
        elif [[ "$a" =~ ^[0-9a-fA-F:.]*:[0-9a-fA-F:.]*(/[0-9]{1,3})?$ ]]; then
            v6+=("${a,,}")
        else
            usage_error "'$a' is not an IPv4 or IPv6 address or prefix"
        fi
    done
fi
command -v tc >/dev/null || die "tc not found (apt-get install iproute2)"
if [ "$action" != dev ]; then
    command -v nft >/dev/null || die "nft not found (apt-get install nftables)"
fi
if [ -n "$tap" ] && [ "$action" != del ]; then
    ip link show dev "$tap" >/dev/null 2>&1 || die "no network device $tap here"
fi
if [ -n "$dev" ]; then
    [ "${#dev}" -le 14 ] || die "DEV name '$dev' is longer than 14 characters"
    [ "$dev" != "$tap" ] || die "TAP and DEV must differ"
fi

PREF4=4791 PREF6=4792
# Stopped frames forwarded to DEV per second and tap, at most (the rest dropped): a VM
# flooding its own QP1 frames costs the backend no more than this.
RATE=1000
# nft identifiers are letters, digits and _ - . / only.
TABLE="pvcm-${tap//[^A-Za-z0-9_.-]/_}"

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
            # mirred needs; frames redirected into DEV never cross to the peer, frames
            # forwarded out of DEV reach the peer, whose stack drops them (quiet).
            ip link add "$dev" type veth peer name "${dev}p" ||
                die "cannot create $dev (neither dummy nor veth works here)"
            quiet "${dev}p"
            ip link set "${dev}p" up
        fi
    fi
    quiet "$dev"
    ip link set "$dev" up || die "cannot set $dev up"
}

# has_clsact: TAP has a clsact qdisc. The listing is read whole before it is matched:
# under pipefail, grep -q leaving early could make tc die of SIGPIPE and fail the test.
has_clsact() {
    local q
    q="$(tc qdisc show dev "$tap" 2>/dev/null || true)"
    [[ "$q" == *"qdisc clsact"* ]]
}

del_filters() {
    tc filter del dev "$tap" egress protocol ip pref "$PREF4" 2>/dev/null || true
    tc filter del dev "$tap" egress protocol ipv6 pref "$PREF6" 2>/dev/null || true
}

del_table() {
    if nft list table netdev "$TABLE" >/dev/null 2>&1; then
        nft delete table netdev "$TABLE" || die "cannot delete the nftables table $TABLE"
    fi
}

# The nftables table for TAP's ingress (what the VM transmits), on stdout.
egress_table() {
    local set4="" set6="" q
    q='"'
    if [ "${#v4[@]}" -gt 0 ]; then
        set4="$(
            IFS=,
            echo "${v4[*]}"
        )"
    fi
    if [ "${#v6[@]}" -gt 0 ]; then
        set6="$(
            IFS=,
            echo "${v6[*]}"
        )"
    fi
    cat <<EOF_NFT
table netdev $TABLE {
    counter spoofed {}
    counter qp1 {}
    counter unclassified {}
    counter over_rate {}
EOF_NFT
    [ -z "$set4" ] || printf '    set own4 { type ipv4_addr; flags interval; elements = { %s } }\n' "$set4"
    [ -z "$set6" ] || printf '    set own6 { type ipv6_addr; flags interval; elements = { %s } }\n' "$set6"
    cat <<EOF_NFT
    chain stop {
        limit rate over $RATE/second burst $RATE packets counter name over_rate drop
        fwd to $q$dev$q
    }
    chain egress {
        type filter hook ingress device $q$tap$q priority -500; policy accept;
        ether saddr != $mac counter name spoofed drop
        arp saddr ether != $mac counter name spoofed drop
        arp saddr ip 0.0.0.0 accept
EOF_NFT
    if [ -n "$set4" ]; then
        echo "        arp saddr ip != @own4 counter name spoofed drop"
        echo "        ip saddr 0.0.0.0 udp sport 68 udp dport 67 accept"
        echo "        ip saddr != @own4 counter name spoofed drop"
    else
        echo "        meta protocol arp counter name spoofed drop"
        echo "        ip saddr 0.0.0.0 udp sport 68 udp dport 67 accept"
        echo "        meta protocol ip counter name spoofed drop"
    fi
    echo "        ip6 saddr :: meta l4proto ipv6-icmp accept"
    if [ -n "$set6" ]; then
        echo "        ip6 saddr != @own6 counter name spoofed drop"
    else
        echo "        meta protocol ip6 counter name spoofed drop"
    fi
    cat <<EOF_NFT
        meta protocol { 8021q, 8021ad, 0x8915 } counter name unclassified goto stop
        udp dport 4791 @th,104,24 1 counter name qp1 goto stop
        ip frag-off & 0x1fff != 0 ip protocol udp counter name unclassified goto stop
        meta protocol ip6 frag frag-off != 0 meta l4proto udp counter name unclassified goto stop
        meta protocol ip6 meta l4proto { 135, 139, 140, 253, 254 } counter name unclassified goto stop
        meta protocol ip6 ip6 nexthdr { 0, 43, 44, 51, 60 } meta l4proto != { 0, 43, 44, 51, 60 } @th,0,8 0-255 accept
        meta protocol ip6 ip6 nexthdr { 0, 43, 44, 51, 60 } counter name unclassified goto stop
    }
}
EOF_NFT
}

case "$action" in
add)
    make_dev
    if ! has_clsact; then
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
    # One transaction: the old table (if any) goes and the new one comes at once.
    {
        if nft list table netdev "$TABLE" >/dev/null 2>&1; then
            echo "delete table netdev $TABLE"
        fi
        egress_table
    } | nft -f - || die "cannot install the nftables table $TABLE on $tap's ingress"
    ;;
del)
    if ip link show dev "$tap" >/dev/null 2>&1; then
        del_filters
        if has_clsact &&
            [ -z "$(tc filter show dev "$tap" egress)$(tc filter show dev "$tap" ingress)" ]; then
            tc qdisc del dev "$tap" clsact 2>/dev/null || true
        fi
    fi
    del_table
    ;;
show)
    tc -s filter show dev "$tap" egress
    nft list table netdev "$TABLE" 2>/dev/null || echo "(no nftables table $TABLE)"
    ;;
dev)
    make_dev
    ;;
esac
