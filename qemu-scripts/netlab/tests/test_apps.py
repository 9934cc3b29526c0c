"""The apps suite's readers of program output: cmtime's step tables (rdma-core 44's
and 59's and later's) and the image's userland line."""

import unittest

from netlab.apps import cmtime_cmds, cmtime_kind, cmtime_steps, short, userland

CMTIME_44 = """\
step              total ms     max ms     min us  us / conn
create id    :       12.34       0.10       1.00      12.34
disconnect   :      100.00       1.00       1.00     100.00
"""

CMTIME_65 = """\
Connect (1000) QPs test
qp_conn              1000
threads                 1
step             avg/conn  total(us)    us/conn    sum(us)    max(us)    min(us)
full connect          120     120000          0          0        500         10
create id               1       1500          1       1000         10          1
disconnect              5       5000          5       5000         10          1
Connect (1000) test - no QPs
cm_conn              1000
threads                 1
step             avg/conn  total(us)    us/conn    sum(us)    max(us)    min(us)
full connect           90      90000          0          0        500         10
"""


class CmtimeSteps(unittest.TestCase):
    def test_rdma_core_44(self):
        self.assertEqual(cmtime_steps(CMTIME_44), [("create id", "12.34"), ("disconnect", "100.00")])

    def test_rdma_core_59_and_later_first_table_in_ms(self):
        self.assertEqual(cmtime_steps(CMTIME_65),
                         [("full connect", "120.00"), ("create id", "1.50"), ("disconnect", "5.00")])

    def test_no_table(self):
        self.assertEqual(cmtime_steps("rdma_resolve_addr: Connection refused\n"), [])


class Guest:
    """A guest whose cmtime prints the given usage text."""

    def __init__(self, ip, usage):
        self.ip, self.usage = ip, usage

    def run(self, cmd, timeout):
        return 1, self.usage


USAGE_44 = "usage: cmtime\n\t[-s server_address]\n\t[-b bind_address]\n\t[-c connections]\n"
USAGE_56 = "usage: cmtime\n\t[-S] (run socket baseline test)\n\t[-s server_address]\n"
USAGE_65 = "usage: cmtime\n\t-B bind_interface\n\t-C controller_address\n\t[-L] run as listening server\n"


class Cmtime(unittest.TestCase):
    def test_kinds_from_the_usage(self):
        self.assertEqual(cmtime_kind(Guest("k", USAGE_44)), "old")
        self.assertEqual(cmtime_kind(Guest("k", USAGE_56)), "oob")
        self.assertEqual(cmtime_kind(Guest("k", USAGE_65)), "mesh")

    def test_commands_of_each_kind(self):
        for usage, want in (
                (USAGE_44, ("cmtime -p 7471", "cmtime -s 10.0.0.2 -p 7471 -c 50")),
                (USAGE_56, ("cmtime -p 7471 -c 50", "cmtime -s 10.0.0.2 -p 7471 -c 50")),
                (USAGE_65, ("cmtime -b 10.0.0.2 -C 10.0.0.2 -L -c 50 -p 7471",
                            "cmtime -b 10.0.0.11 -C 10.0.0.2 -c 50 -p 7471"))):
            server, client = Guest("10.0.0.2", usage), Guest("10.0.0.11", usage)
            self.assertEqual(cmtime_cmds(server, client, 50), want)

    def test_qpn_only_for_the_newer_kinds(self):
        old = (Guest("10.0.0.2", USAGE_44), Guest("10.0.0.11", USAGE_44))
        self.assertNotIn("-q", " ".join(cmtime_cmds(*old, 50, qpn=0x10000)))
        for usage in (USAGE_56, USAGE_65):
            s, c = cmtime_cmds(Guest("10.0.0.2", usage), Guest("10.0.0.11", usage), 50,
                               qpn=0x10100)
            self.assertTrue(s.endswith(" -q 65792") and c.endswith(" -q 65792"), (s, c))


class Userland(unittest.TestCase):
    def test_versions_of_the_suite(self):
        info = ("flavour=rdma\nrdma_suite=sid\ndeb=rdmacm-utils_65.0-1.1_amd64\n"
                "deb=perftest_25.01.0+0.80-1_amd64\ndeb=libc6_2.43-7_amd64\n")
        self.assertEqual(userland(info),
                         "suite sid, rdmacm-utils 65.0-1.1, perftest 25.01.0+0.80-1, libc6 2.43-7")

    def test_an_image_from_before_suites_is_bookworm(self):
        self.assertEqual(userland("deb=rdmacm-utils_44.0-2_amd64\ndeb=perftest_4.5-0.17-2_amd64\n"),
                         "suite bookworm, rdmacm-utils 44.0-2, perftest 4.5-0.17-2")

    def test_epoch_and_no_packages(self):
        self.assertIn("libc6 1:2.0", userland("deb=rdmacm-utils_1_amd64\ndeb=libc6_1%3a2.0_amd64\n"))
        self.assertEqual(userland("flavour=rdma\n"), "")


class Short(unittest.TestCase):
    def test_rping_data_lines_are_counted_and_its_errors_kept(self):
        out = ("cq completion failed status 12\n"
               + "".join(f"ping data: rdma-ping-{i}: ABCDEFG\n" for i in range(3))
               + "rping client failed: -1\n")
        self.assertEqual(short(out), "[3 data lines] cq completion failed status 12 "
                                     "rping client failed: -1")

    def test_other_output_is_its_last_characters_on_one_line(self):
        self.assertEqual(short("a\n  b\tc\n", 3), "b c")


if __name__ == "__main__":
    unittest.main()
