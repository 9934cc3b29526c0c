import contextlib
import io
import struct
import unittest

from netlab import addr
from netlab.__main__ import guest_spec


def eth(ethertype, payload):
    return b"\x02" * 6 + b"\x04" * 6 + struct.pack(">H", ethertype) + payload


def ipv4_udp(src, dst, ihl=5):
    h = bytes([0x40 | ihl, 0]) + b"\0" * 7 + bytes([17]) + b"\0\0" + bytes(src) + bytes(dst)
    return h + b"\0" * (ihl * 4 - 20)


def ipv6_udp(src, dst, next_header=17):
    return b"\x60" + b"\0" * 5 + bytes([next_header, 64]) + src + dst


class Family(unittest.TestCase):
    def test_each_family(self):
        self.assertEqual(addr.family("10.99.0.1"), 4)
        self.assertEqual(addr.family("fd99::21"), 6)
        self.assertEqual(addr.family("::ffff:10.99.0.1"), 6)

    def test_not_an_address_names_the_text(self):
        for bad in ("10.99.0", "fd99:::1", "", "10.99.0.1/24", "host"):
            with self.assertRaisesRegex(ValueError, "is not an IPv4 or IPv6 address"):
                addr.family(bad)

    def test_ipv4_refuses_ipv6(self):
        self.assertEqual(str(addr.ipv4("10.99.0.2")), "10.99.0.2")
        with self.assertRaisesRegex(ValueError, "'fd99::2' is not an IPv4 address"):
            addr.ipv4("fd99::2")

    def test_ipv6_interface(self):
        self.assertEqual(str(addr.ipv6_interface("fd99::2")), "fd99::2/128")
        self.assertEqual(str(addr.ipv6_interface("fd99::2/64").network), "fd99::/64")
        for bad in ("10.99.0.2", "10.99.0.2/24", "fd99::zz"):
            with self.assertRaisesRegex(ValueError, "is not an IPv6 address"):
                addr.ipv6_interface(bad)


class Gids(unittest.TestCase):
    # As rxe0's sysfs GID table shows them in the lab's guests.
    def test_sysfs_gid_ipv4_is_mapped(self):
        self.assertEqual(addr.sysfs_gid("10.99.0.11"), "0000:0000:0000:0000:0000:ffff:0a63:000b")
        self.assertEqual(addr.sysfs_gid("10.99.0.14"), "0000:0000:0000:0000:0000:ffff:0a63:000e")

    def test_sysfs_gid_ipv6_is_expanded(self):
        self.assertEqual(addr.sysfs_gid("fd99::11"), "fd99:0000:0000:0000:0000:0000:0000:0011")
        self.assertEqual(addr.sysfs_gid("FE80::5054:ff:fe99:b"), "fe80:0000:0000:0000:5054:00ff:fe99:000b")

    def test_vm_gid(self):
        self.assertEqual(addr.vm_gid("10.99.0.1"), "::ffff:10.99.0.1")
        self.assertEqual(addr.vm_gid("fd99::21"), "fd99::21")
        with self.assertRaises(ValueError):
            addr.vm_gid("10.99.0.300")

    def test_table_line(self):
        self.assertEqual(addr.table_line("10.99.0.12"),
                         "10.99.0.12 0000:0000:0000:0000:0000:ffff:0a63:000c ::ffff:10.99.0.12")

    def test_cli(self):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self.assertEqual(addr.main(["family", "10.99.0.1", "fd99::1"]), 0)
            self.assertEqual(addr.main(["vm-gid", "not-an-address"]), 1)
            self.assertEqual(addr.main(["gid"]), 2)
        self.assertEqual(out.getvalue(), "4\n6\n")
        self.assertIn("'not-an-address' is not an IPv4 or IPv6 address", err.getvalue())


class IpUdp(unittest.TestCase):
    def test_ipv4(self):
        f = eth(0x0800, ipv4_udp([10, 99, 0, 1], [10, 99, 0, 2]) + b"\0" * 8)
        fam, src, dst, udp = addr.ip_udp(f)
        self.assertEqual((fam, str(src), str(dst), udp), (4, "10.99.0.1", "10.99.0.2", 34))

    def test_ipv4_options_move_the_udp_header(self):
        f = eth(0x0800, ipv4_udp([10, 99, 0, 1], [10, 99, 0, 2], ihl=6) + b"\0" * 8)
        self.assertEqual(addr.ip_udp(f)[3], 38)

    def test_ipv6(self):
        a, b = addr.address("fd99::21").packed, addr.address("fd99::2").packed
        fam, src, dst, udp = addr.ip_udp(eth(0x86DD, ipv6_udp(a, b)))
        self.assertEqual((fam, str(src), str(dst), udp), (6, "fd99::21", "fd99::2", 54))

    def test_not_udp_or_not_ip(self):
        a = addr.address("fd99::21").packed
        self.assertIsNone(addr.ip_udp(eth(0x86DD, ipv6_udp(a, a, next_header=6))))
        self.assertIsNone(addr.ip_udp(eth(0x0806, b"\0" * 28)))
        self.assertIsNone(addr.ip_udp(b"\0" * 10))
        # Truncated headers.
        self.assertIsNone(addr.ip_udp(eth(0x86DD, b"\x60" + b"\0" * 10)))
        self.assertIsNone(addr.ip_udp(eth(0x0800, b"\x45" + b"\0" * 10)))


class GuestSpec(unittest.TestCase):
    def test_forms(self):
        self.assertEqual(guest_spec("a=10.99.0.2,fd99::2:pvcm"), ("a", "10.99.0.2", "fd99::2", "pvcm"))
        self.assertEqual(guest_spec("k=10.99.0.2"), ("k", "10.99.0.2", None, "kernel"))
        self.assertEqual(guest_spec("j=10.99.0.3,fd99::3/64:kernel"), ("j", "10.99.0.3", "fd99::3/64", "kernel"))

    def test_errors(self):
        for spec, why in (("a", "want NAME=IP"), ("a=fd99::2", "is not an IPv4 address"),
                          ("a=10.99.0.2,10.99.0.3", "is not an IPv6 address")):
            with self.assertRaisesRegex(ValueError, why):
                guest_spec(spec)


if __name__ == "__main__":
    unittest.main()
