import gzip
import os
import unittest

from netlab import toolout

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
UMAD = toolout.WorkDir(os.path.join(FIX, "umad"))


class Cmtime(unittest.TestCase):
    def test_pvcm_client(self):
        # pvcm-lab attach cmtime, 500 connections (umad test 1)
        text = UMAD.read("a.t1.out")
        s = toolout.client_summary(text)
        self.assertEqual(s.counts, (500, 500, 0, 500))
        self.assertEqual(s.text, "connections 500 established 500 failed 0 disconnected 500")
        self.assertEqual(toolout.step_total(text, "establish"), "6091.65")
        self.assertEqual(toolout.step_ms(text, "disconnect"), 5349.97)
        # pvcm's table has a "connect" row of its own (the posting of the requests).
        self.assertEqual(toolout.step_ms(text, "connect"), 45.58)
        self.assertEqual(toolout.exit_codes(text), ["0"])
        self.assertFalse(toolout.has_step_line(text, "connect"))

    def test_rdma_core_cmtime(self):
        text = UMAD.read("b.t2.out")
        self.assertIsNone(toolout.client_summary(text))
        self.assertTrue(toolout.has_step_line(text, "connect"))
        self.assertEqual(toolout.step_total(text, "connect"), "4649.62")
        self.assertEqual(toolout.step_ms(text, "disconnect"), 3526.29)
        self.assertIsNone(toolout.step_ms(text, "establish"))
        self.assertEqual(toolout.step_lines(text, (r"connect\s*:", r"disconnect\s*:")),
                         ["connect      :     4649.62    4326.35  909861.00    9299.24",
                          "disconnect   :     3526.29     488.89    4667.00    7052.58"])

    def test_pvcm_server(self):
        s = toolout.server_summary(UMAD.read("t6srv.log"))
        self.assertEqual(s.counts, (200, 200, 200, 0))
        self.assertIsNone(toolout.server_summary(UMAD.read("a.t1.out")))

    def test_every_round(self):
        one = "connections 4 established 4 failed 0 disconnected 4\n"
        two = "connections 4 established 3 failed 1 disconnected 3\n"
        self.assertEqual(toolout.client_summaries(one + "x\n" + two),
                         [(4, 4, 0, 4), (4, 3, 1, 3)])
        self.assertEqual(toolout.step_totals("establish 1.5\nestablish   2\n", "establish"), ["1.5", "2"])

    def test_nothing_found(self):
        for f in (toolout.client_summary, toolout.server_summary):
            self.assertIsNone(f(""))
        self.assertIsNone(toolout.step_ms("connections 1 established 1", "connect"))
        self.assertIsNone(toolout.step_ms("disconnected 3", "disconnect"))


class Counters(unittest.TestCase):
    def test_kcounters_output(self):
        before, after = UMAD.counters("b.counters-before.out"), UMAD.counters("b.counters-after.out")
        self.assertEqual(len(before), 44)
        self.assertEqual(after["cm_rx_msgs/req"] - before["cm_rx_msgs/req"], 500)
        rx = toolout.counter_deltas(before, after, "cm_rx_msgs/")
        self.assertEqual({k: v for k, v in rx.items() if v}, {"drep": 508, "dreq": 500, "rep": 508, "req": 500,
                                                               "rtu": 500})
        self.assertEqual(toolout.kernel_retries(before, after), [])

    def test_retries_and_duplicates_grow(self):
        before = {"cm_tx_retries/req": 1, "cm_rx_duplicates/rep": 0, "cm_tx_msgs/req": 5}
        after = {"cm_tx_retries/req": 3, "cm_rx_duplicates/rep": 1, "cm_tx_msgs/req": 9}
        self.assertEqual(toolout.kernel_retries(before, after),
                         ["cm_tx_retries/req +2", "cm_rx_duplicates/rep +1"])

    def test_other_lines_skipped(self):
        self.assertEqual(toolout.kernel_counters("kexec b counters: no answer in 20 s\ncm_tx_msgs/req 3\nx y z\n"),
                         {"cm_tx_msgs/req": 3})


class Stat(unittest.TestCase):
    def test_backend_stat(self):
        h = UMAD.host_stat("final.stat.json")
        self.assertEqual(h["cm"]["cm_tx_msgs"]["req"], 500)
        self.assertEqual(toolout.stat_drops(h, exclude=("not_attached",)), {})
        self.assertIn("not_attached", toolout.stat_drops(h))
        s = UMAD.json("v6after.stat.json")
        self.assertEqual(toolout.vm_io(s, "a6")["wire_tx_frames"] - toolout.vm_io(UMAD.json("v6before.stat.json"), "a6")["wire_tx_frames"], 1000)
        self.assertEqual(toolout.vm_io(s, "nobody"), {})

    def test_missing_or_broken(self):
        self.assertIsNone(UMAD.json("no-such.stat.json"))
        self.assertIsNone(UMAD.host_stat("a.t1.out"))
        self.assertEqual(UMAD.read("no-such.out"), "")
        self.assertIsNone(UMAD.read_bytes("no-such.pcap"))

    def test_deltas(self):
        self.assertEqual(toolout.deltas({"a": 1, "b": 2}, {"a": 1, "b": 5, "c": 1}), {"b": 3, "c": 1})


class Events(unittest.TestCase):
    def test_json_lines(self):
        ev = UMAD.json_lines("t3la.log")
        self.assertEqual(len([e for e in ev if e.get("event") == "connect_request"]), 5)
        self.assertEqual(toolout.json_lines('{"a": 1}\n{broken\nplain\n{"b": 2}'), [{"a": 1}, {"b": 2}])

    def test_sections(self):
        out = "@@ cmtime\nconnections 1\n@@ rc 0\n@@ closed\n{\"event\": \"rejected\"}\n@@ rc 3\n"
        parts, rcs, order = toolout.sections(out)
        self.assertEqual(parts, {"cmtime": "connections 1\n", "closed": "{\"event\": \"rejected\"}\n"})
        self.assertEqual(rcs, {"cmtime": "0", "closed": "3"})
        self.assertEqual(order, ["0", "3"])
        self.assertEqual(toolout.sections("no markers"), ({}, {}, []))


class Pcap(unittest.TestCase):
    def test_capture_of_test_6(self):
        # dumpcap of br0 during umad test 6: 200 connections over IPv6 each way.
        with gzip.open(os.path.join(FIX, "umad", "v6.pcap.gz")) as f:
            fr = toolout.rocev2_frames(f.read())
        self.assertEqual(len(fr), 2000)
        self.assertEqual({(fam, cls) for fam, _, _, cls in fr}, {(6, 7)})
        self.assertEqual(sum(1 for f in fr if f[1:3] == ("fd99::11", "fd99::3")), 1000)

    def test_packets_with_times_and_traffic_class(self):
        with gzip.open(os.path.join(FIX, "umad", "v6.pcap.gz")) as f:
            data = f.read()
        pk = toolout.rocev2_packets(data)
        self.assertEqual(len(pk), 2000)
        # CM MADs: to QP1, traffic class 0, times in capture order.
        self.assertEqual({(tc, qp) for _, _, _, tc, qp in pk}, {(0, 1)})
        times = [t for t, *_ in pk]
        self.assertEqual(times, sorted(times))
        self.assertGreater(times[0], 1.7e9)

    def test_traffic_class_of_each_family(self):
        v4 = b"\0" * 12 + b"\x08\x00" + b"\x45\x60" + b"\0" * 18
        v6 = b"\0" * 12 + b"\x86\xdd" + b"\x66\x00" + b"\0" * 38
        self.assertEqual(toolout.ip_tclass(v4), 0x60)
        self.assertEqual(toolout.ip_tclass(v6), 0x60)
        self.assertIsNone(toolout.ip_tclass(b"\0" * 12 + b"\x08\x06" + b"\0" * 28))

    def test_not_a_capture(self):
        self.assertIsNone(toolout.rocev2_frames(b""))
        self.assertIsNone(toolout.rocev2_frames(b"x" * 64))
        self.assertIsNone(toolout.pcap_frames(b"\xd4\xc3\xb2\xa1"))

    def test_truncated_record(self):
        with gzip.open(os.path.join(FIX, "umad", "v6.pcap.gz")) as f:
            data = f.read()
        # The last record cut short (a capture killed mid-write): its frame is shorter
        # than recorded, not an error. Cut inside the MAD it still counts (its class is
        # there); cut inside the IPv6 header it is no RoCEv2 frame.
        self.assertEqual(toolout.rocev2_frames(data[:-100])[-1], toolout.rocev2_frames(data)[-1])
        self.assertEqual(len(toolout.rocev2_frames(data[:-300])), 1999)


if __name__ == "__main__":
    unittest.main()
