#!/usr/bin/env python3
"""Independent RoCEv2 ICRC test vector for pvcm-wire (wire/tests/roce.rs).

What it computes
----------------
One IPv4 datagram carrying a CM MAD the way pvcm frames it (UD SEND only to QP1):

    IPv4 192.0.2.1 -> 192.0.2.2, ID 0, DF, TTL 64, TOS 0, proto 17, total length 308
    UDP  49152 -> 4791, length 288, checksum 0
    BTH  opcode 0x64, P_Key 0xFFFF, DestQP 1, PSN 0x00ABCD, all flags clear
    DETH Q_Key 0x80010000, SrcQP 1
    MAD  256 bytes: a CM REQ MAD header (TID 0x0000000100000001) + a fixed byte pattern
    ICRC 4 bytes, little-endian

and its ICRC (IBTA Annex A17, as Linux rdma_rxe computes it) in two ways that share no
code with the Rust crate:

1. by hand: zlib.crc32 over 8 x 0xFF (masked LRH) + the IPv4 header with TOS, TTL and
   checksum set to ones + the UDP header with checksum 0xFFFF + the BTH with byte 4
   (FECN/BECN/resv6) set to 0xFF + DETH + MAD;
2. with scapy's RoCE layer (scapy.contrib.roce.BTH, whose post_build fills the ICRC),
   if scapy is installed (`pip install scapy`; tested with scapy 2.8.0).

Both must agree. The script also checks with scapy that TTL, TOS, the UDP checksum and
FECN/BECN do not change the ICRC, and with the hand method that the IP source does.

How to rerun
------------
    pip install scapy            # optional; without it only the hand method runs
    python3 wire/tests/data/icrc_vector.py

It prints the datagram as hex (Rust string literal lines) and the ICRC; these are
hard-coded in wire/tests/roce.rs (DATAGRAM_HEX, ICRC).
"""

import struct
import zlib

SRC, DST = "192.0.2.1", "192.0.2.2"
SPORT, DPORT = 49152, 4791
PSN = 0x00ABCD


def mad_bytes():
    # MAD header: base version 1, class CM (0x07), class version 2, method SEND (0x03),
    # status 0, class-specific 0, TID, attribute REQ (0x0010), reserved, attr modifier 0.
    hdr = bytes([1, 7, 2, 3, 0, 0, 0, 0]) + struct.pack(">Q", 0x0000000100000001)
    hdr += struct.pack(">HHI", 0x0010, 0, 0)
    body = bytes(((i * 37) + 11) & 0xFF for i in range(256 - len(hdr)))
    return hdr + body


def ipv4_header(src, dst, total_len, ident=0, df=True, ttl=64, tos=0, proto=17):
    flags = 0x4000 if df else 0
    h = struct.pack(">BBHHHBBH4s4s", 0x45, tos, total_len, ident, flags, ttl, proto, 0,
                    bytes(map(int, src.split("."))), bytes(map(int, dst.split("."))))
    s = sum(struct.unpack(">10H", h))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return h[:10] + struct.pack(">H", ~s & 0xFFFF) + h[12:]


def bth_deth():
    bth = struct.pack(">BBHI I", 0x64, 0x00, 0xFFFF, 1 & 0xFFFFFF, PSN & 0xFFFFFF)
    deth = struct.pack(">II", 0x80010000, 1)
    return bth, deth


def icrc_by_hand(ip, udp, covered):
    ip = bytearray(ip)
    ip[1] = 0xFF                  # TOS
    ip[8] = 0xFF                  # TTL
    ip[10:12] = b"\xff\xff"       # header checksum
    udp = bytearray(udp)
    udp[6:8] = b"\xff\xff"        # UDP checksum
    covered = bytearray(covered)
    covered[4] = 0xFF             # BTH FECN | BECN | resv6
    return zlib.crc32(b"\xff" * 8 + bytes(ip) + bytes(udp) + bytes(covered)) & 0xFFFFFFFF


def build_by_hand():
    bth, deth = bth_deth()
    covered = bth + deth + mad_bytes()
    udp_len = 8 + len(covered) + 4
    ip = ipv4_header(SRC, DST, 20 + udp_len)
    udp = struct.pack(">HHHH", SPORT, DPORT, udp_len, 0)
    icrc = icrc_by_hand(ip, udp, covered)
    return ip + udp + covered + struct.pack("<I", icrc), icrc


def build_with_scapy(ttl=64, tos=0, udp_chksum=0, fecn=0, becn=0):
    from scapy.layers.inet import IP, UDP
    from scapy.contrib.roce import BTH
    _, deth = bth_deth()
    pkt = (IP(src=SRC, dst=DST, id=0, flags="DF", ttl=ttl, tos=tos)
           / UDP(sport=SPORT, dport=DPORT, chksum=udp_chksum)
           / BTH(opcode=0x64, pkey=0xFFFF, dqpn=1, psn=PSN, fecn=fecn, becn=becn)
           / (deth + mad_bytes()))
    raw = bytes(pkt)
    return raw, struct.unpack("<I", raw[-4:])[0]


def main():
    dgram, icrc = build_by_hand()
    assert len(dgram) == 308, len(dgram)

    # The source address is covered.
    ip2 = ipv4_header("192.0.2.9", DST, 308)
    assert icrc_by_hand(ip2, dgram[20:28], dgram[28:-4]) != icrc

    try:
        scapy_dgram, scapy_icrc = build_with_scapy()
    except ImportError:
        print("# scapy not installed: hand-computed zlib.crc32 only")
    else:
        assert scapy_dgram == dgram, "scapy frame differs from the hand-built one"
        assert scapy_icrc == icrc, (hex(scapy_icrc), hex(icrc))
        # Variant fields do not change the ICRC (scapy computes a real UDP checksum
        # when chksum=None).
        _, v = build_with_scapy(ttl=1, tos=0xB8, udp_chksum=None, fecn=1, becn=1)
        assert v == icrc, (hex(v), hex(icrc))
        print("# scapy.contrib.roce agrees with the hand computation")

    print(f"# ICRC = {icrc:#010x} (stored little-endian: {struct.pack('<I', icrc).hex()})")
    print("const DATAGRAM_HEX: &str = concat!(")
    for i in range(0, len(dgram), 32):
        print(f'    "{dgram[i:i + 32].hex()}",')
    print(");")
    print(f"const ICRC: u32 = {icrc:#010x};")


if __name__ == "__main__":
    main()
