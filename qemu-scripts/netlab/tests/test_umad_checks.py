import gzip
import json
import os
import shutil
import tempfile
import unittest

from netlab import umad_checks

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "umad")


class UmadRun(unittest.TestCase):
    """umad.sh's checks over a real run's work directory (fixtures/umad), and over copies
    of it with one thing changed."""

    def setUp(self):
        self.wd = tempfile.mkdtemp(prefix="umad-fixture-")
        for f in os.listdir(FIX):
            shutil.copy(os.path.join(FIX, f), self.wd)
        with gzip.open(os.path.join(FIX, "v6.pcap.gz")) as src, open(os.path.join(self.wd, "v6.pcap"), "wb") as dst:
            dst.write(src.read())

    def tearDown(self):
        shutil.rmtree(self.wd)

    def lines(self):
        res, fig = umad_checks.check(self.wd, 500, 200)
        return umad_checks.result_lines(res), fig

    def failed(self):
        return {line.split(":")[0][6:]: line for line in self.lines()[0] if line.startswith("FAIL")}

    def edit(self, name, fn):
        p = os.path.join(self.wd, name)
        with open(p) as f:
            text = f.read()
        with open(p, "w") as f:
            f.write(fn(text))

    def edit_json(self, name, fn):
        def change(text):
            d = json.loads(text)
            fn(d)
            return json.dumps(d)
        self.edit(name, change)

    def test_the_runs_own_results_and_figures(self):
        # What the run printed (results.txt, figures.txt) is what the checks print now.
        lines, fig = self.lines()
        with open(os.path.join(FIX, "results.txt")) as f:
            self.assertEqual("\n".join(lines) + "\n", f.read())
        with open(os.path.join(FIX, "figures.txt")) as f:
            self.assertEqual("\n".join(fig) + "\n", f.read())
        # That run's guest-a setup answered late: tests 1 and 6a say so, the rest passed.
        self.assertEqual(sorted(self.failed()), ["1", "6a"])

    def test_setup_in_time(self):
        self.edit("a.setup.rc", lambda _: "0\n")
        self.assertEqual(self.failed(), {})

    def test_kernel_retry_fails_4(self):
        self.edit("b.counters-after.out", lambda t: t.replace("cm_tx_retries/req 0", "cm_tx_retries/req 2"))
        self.assertIn("kernel b: cm_tx_retries/req +2", self.failed()["4"])

    def test_drops(self):
        # A few REPs crossing the kernel's withdrawals (unknown_connection) are allowed;
        # VM c's not_attached (test 5) is expected; anything else fails test 4.
        self.edit_json("final.stat.json", lambda d: d["host"]["drops"].update(unknown_connection=12))
        self.assertNotIn("4", self.failed())
        self.edit_json("final.stat.json", lambda d: d["host"]["drops"].update(unknown_connection=13, bad_mad=1))
        self.assertIn("pvcm-backend drops: {'bad_mad': 1, 'unknown_connection': 13}", self.failed()["4"])

    def test_a_mad_the_kernel_did_not_take(self):
        self.edit("b.counters-after.out", lambda t: t.replace("cm_rx_msgs/rtu 500", "cm_rx_msgs/rtu 499"))
        self.assertIn("rtu: pvcm sent 500, the kernel CM took 499", self.failed()["4"])

    def test_ipv6_frames_on_the_wire_match_the_port(self):
        self.edit_json("v6after.stat.json",
                       lambda d: [v["figures"]["io"].update(wire_rx_frames=v["figures"]["io"]["wire_rx_frames"] + 1)
                                  for v in d["vms"] if v["name"] == "a6"])
        self.assertIn("1000 IPv6 CM frames fd99::3 -> fd99::11 on br0, the umad port received 1001 for VM a6",
                      self.failed()["6c"])

    def test_no_capture(self):
        os.remove(os.path.join(self.wd, "v6.pcap"))
        self.assertIn("no capture of br0", self.failed()["6c"])

    def test_ack_delay(self):
        self.assertEqual(umad_checks.ack_delay_from_device(
            "INFO pvcm: ca_ack_delay=15 local CA ACK delay (ibv_devinfo) of rxe0"), "15")
        self.edit("backend.log", lambda t: t.replace("ca_ack_delay=15", "ca_ack_delay=16"))
        self.assertIn("from the device: '16'", self.failed()["5b"])

    def test_routing_by_gid(self):
        self.edit("t3b.log", lambda t: t.replace('"accepted":5', '"accepted":4'))
        self.assertIn("VM b:", self.failed()["3a"])

    def test_an_empty_workdir_fails_every_test_without_an_error(self):
        empty = tempfile.mkdtemp(prefix="umad-empty-")
        try:
            res, fig = umad_checks.check(empty, 500, 200)
        finally:
            shutil.rmtree(empty)
        lines = umad_checks.result_lines(res)
        self.assertEqual(len(lines), 12)
        self.assertEqual([t for t, bad, _ in res if not bad], [])
        self.assertEqual(fig, [])


if __name__ == "__main__":
    unittest.main()
