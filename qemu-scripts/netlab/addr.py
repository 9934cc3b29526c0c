"""The lab's addresses, IPv4 and IPv6: what differs between the families, in one place.

    address(addr)        an IPv4Address or IPv6Address; ValueError naming the text
                         when it is neither
    family(addr)         4 or 6
    ipv4(text)           an IPv4 address, checked (ValueError saying what is wrong)
    ipv6_interface(text) an IPv6 address with an optional prefix length, checked
    sysfs_gid(addr)      the RoCE v2 GID of an address as sysfs prints it (rxe0's GID
                         table: IPv4 as ::ffff:a.b.c.d, 0000:...:ffff:0a63:000b)
    vm_gid(addr)         the GID pvcm-backend's --vm gid= takes: ::ffff:a.b.c.d for IPv4,
                         the address itself for IPv6
    ip_udp(frame)        an Ethernet frame's IP family, addresses and UDP header offset

From the shell (the scripts under interop/ and umad/ use these), a line per ADDR:

    python3 -m netlab addr family ADDR...      4 or 6
    python3 -m netlab addr sysfs-gid ADDR...   its sysfs GID
    python3 -m netlab addr vm-gid ADDR...      its --vm gid=
    python3 -m netlab addr table ADDR...       "ADDR SYSFS_GID VM_GID"
"""

import ipaddress
import struct
import sys

ETH_IPV4 = 0x0800
ETH_IPV6 = 0x86DD
IPPROTO_UDP = 17


def address(addr):
    """ADDR (text or an ipaddress object) as an IPv4Address or IPv6Address; ValueError
    naming the text when it is neither."""
    try:
        return ipaddress.ip_address(addr)
    except ValueError:
        raise ValueError(f"{addr!r} is not an IPv4 or IPv6 address") from None


def family(addr):
    """4 or 6: the family of ADDR."""
    return address(addr).version


def ipv4(text):
    """TEXT as an IPv4Address; ValueError saying it is not one."""
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an IPv4 address") from None


def ipv6_interface(text):
    """TEXT (an IPv6 address, with /LEN or without) as an IPv6Interface; ValueError saying
    it is not one."""
    try:
        a = ipaddress.ip_interface(text)
    except ValueError:
        a = None
    if a is None or a.version != 6:
        raise ValueError(f"{text!r} is not an IPv6 address")
    return a


def _as_gid(addr):
    """ADDR as the 16 bytes of its RoCE v2 GID (IPv4: the IPv4-mapped IPv6 address)."""
    a = address(addr)
    if a.version == 4:
        a = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + a.packed)
    return a


def sysfs_gid(addr):
    """The GID of ADDR as /sys/class/infiniband/*/ports/*/gids/* prints it: eight groups
    of four hex digits, IPv4 mapped (::ffff:a.b.c.d)."""
    h = _as_gid(addr).packed.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def vm_gid(addr):
    """The GID pvcm-backend's --vm gid= takes for a VM at ADDR: ::ffff:a.b.c.d for IPv4,
    the IPv6 address as given."""
    return f"::ffff:{ipv4(addr)}" if family(addr) == 4 else str(addr)


def ip_udp(frame):
    """(family, src, dst, offset of the UDP header) of an Ethernet frame carrying UDP
    over IPv4 or IPv6 (no VLAN tag; IPv6 without extension headers); None for anything
    else. src and dst are ipaddress objects."""
    if len(frame) < 14:
        return None
    ethertype = struct.unpack(">H", frame[12:14])[0]
    if ethertype == ETH_IPV6 and len(frame) >= 54 and frame[20] == IPPROTO_UDP:
        return (6, ipaddress.IPv6Address(frame[22:38]), ipaddress.IPv6Address(frame[38:54]), 54)
    if ethertype == ETH_IPV4 and len(frame) >= 34 and frame[23] == IPPROTO_UDP:
        ihl = (frame[14] & 15) * 4
        return (4, ipaddress.IPv4Address(frame[26:30]), ipaddress.IPv4Address(frame[30:34]), 14 + ihl)
    return None


def table_line(addr):
    """ADDR, its sysfs GID and its --vm gid=, separated by a blank."""
    return f"{addr} {sysfs_gid(addr)} {vm_gid(addr)}"


ACTIONS = {"family": family, "sysfs-gid": sysfs_gid, "vm-gid": vm_gid, "table": table_line}


def main(argv):
    if len(argv) < 2 or argv[0] not in ACTIONS:
        print(f"usage: python3 -m netlab addr {'|'.join(ACTIONS)} ADDR...", file=sys.stderr)
        return 2
    fn = ACTIONS[argv[0]]
    try:
        lines = [str(fn(a)) for a in argv[1:]]
    except ValueError as e:
        print(f"netlab addr: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0
