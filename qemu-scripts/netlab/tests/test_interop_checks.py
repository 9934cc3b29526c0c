import json
import os
import shutil
import tempfile
import unittest

from netlab import interop_checks as ic
from netlab.toolout import WorkDir

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "interop")


class InteropRun(unittest.TestCase):
    """interop.sh's checks over a real run's work directory (fixtures/interop: 1,000
    connections; its test 8 failed on the kernel's MRA and RTU retries on a loaded
    machine), and over copies of it with one thing changed."""

    def setUp(self):
        self.wd = tempfile.mkdtemp(prefix="interop-fixture-")
        for f in os.listdir(FIX):
            shutil.copy(os.path.join(FIX, f), self.wd)
        self.w = WorkDir(self.wd)

    def tearDown(self):
        shutil.rmtree(self.wd)

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
        # In the order interop/host.sh runs them: what that run printed.
        lines = ic.active(self.w, 1000) + ic.passive(self.w, 1000)
        counted, fig = ic.counters(self.w)
        lines += counted
        v6, fig6 = ic.ipv6(self.w, 1000)
        lines += v6
        loss, fig_loss = ic.loss(self.w, 200, 2)
        lines.append(loss)
        fig += fig6 + fig_loss + ic.trials(self.w, 2)
        with open(os.path.join(FIX, "results.txt")) as f:
            want = [line for line in f.read().splitlines() if not line.startswith("PASS  1:")]
        self.assertEqual(lines, want)
        with open(os.path.join(FIX, "figures.txt")) as f:
            self.assertEqual(fig, f.read().splitlines())

    def test_8_passes_without_the_retries(self):
        lines, _ = ic.counters(self.w)
        self.assertTrue(lines[-1].startswith("FAIL  8: kernel j: cm_tx_retries/mra +335"))
        self.edit("j.counters-after.out", lambda t: "\n".join(
            line for line in t.splitlines() if "retries" not in line and "duplicates" not in line))
        self.edit_json("final.stat.json", lambda d: d["host"]["cm"]["cm_tx_retries"].update(rep=0))
        lines, _ = ic.counters(self.w)
        # Without the retries, the MADs of the retried MRAs and RTUs remain unmatched.
        self.assertIn("rtu: pvcm sent 1000, the kernel CMs took 998", lines[-1])
        self.assertNotIn("retries", lines[-1])

    def test_2_counts_every_connection(self):
        self.edit("client.out", lambda t: t.replace("established 1000 failed 0", "established 999 failed 1"))
        self.assertEqual(ic.active(self.w, 1000)[0],
                         "FAIL  2: connections 1000 established 999 failed 1 disconnected 1000")

    def test_3_wants_the_rejection(self):
        self.edit("client.out", lambda t: t.replace('"reason":"InvalidServiceId","reason_code":8',
                                                    '"reason":"Timeout","reason_code":1'))
        self.assertEqual(ic.active(self.w, 1000)[1], "FAIL  3: rejected, but reason Timeout")

    def test_7_withdrawals(self):
        self.edit("server.out", lambda t: t.replace('"event":"withdrawn"', '"event":"established"', 1))
        self.assertIn("a withdrawn request was established", ic.passive(self.w, 1000)[2])

    def test_9c_ipv4_vm_carried_nothing(self):
        self.edit_json("v6after.stat.json", lambda d: [v["figures"]["io"].update(wire_tx_frames=v["figures"]["io"]["wire_tx_frames"] + 2)
                                                      for v in d["vms"] if v["name"] == "vm"])
        lines, _ = ic.ipv6(self.w, 1000)
        self.assertIn("the IPv4 VM carried frames: {'wire_tx_frames': 2, 'wire_rx_frames': 0}", lines[2])

    def test_9c_neighbor_discards(self):
        self.edit("unresolved.v6after", lambda t: str(int(t) + 3))
        self.assertIn("the host dropped 3 frames while resolving a neighbor", ic.ipv6(self.w, 1000)[0][2])

    def test_10_ratio(self):
        line, fig = ic.loss(self.w, 200, 2)
        self.assertTrue(line.startswith("PASS  10: 5% loss"))
        self.assertIn("frames dropped by the bridge 215;", fig[-1])
        # pvcm's disconnect at 2x the kernel's fails the test.
        self.edit("j.kp-loss2.out", lambda t: t.replace("disconnect   :     6807.51", "disconnect   :    40000.00"))
        line, _ = ic.loss(self.w, 200, 2)
        self.assertRegex(line, r"^FAIL  10: disconnect kernel -> pvcm VM \d+ ms is 2\.\d\dx kernel -> kernel")

    def test_trials_want_every_run(self):
        os.remove(os.path.join(self.wd, "pk2.out"))
        self.assertEqual(ic.trials(self.w, 2), ["connect: trials incomplete (kernel 3, pvcm 2 of 3)",
                                                "disconnect: trials incomplete (kernel 3, pvcm 2 of 3)"])

    def test_an_empty_workdir_fails_without_an_error(self):
        empty = WorkDir(tempfile.mkdtemp(prefix="interop-empty-"))
        try:
            lines = ic.active(empty, 10) + ic.passive(empty, 10) + ic.counters(empty)[0] + ic.ipv6(empty, 10)[0]
            lines.append(ic.loss(empty, 10, 2)[0])
        finally:
            shutil.rmtree(empty.path)
        self.assertEqual([line.split(":")[0] for line in lines],
                         ["FAIL  " + t for t in ("2", "3", "4", "5", "6", "7", "8", "9a", "9b", "9c", "10")])


class Bench(unittest.TestCase):
    """The benchmark's table from the files bench.sh leaves, made of real cmtime outputs."""

    def setUp(self):
        self.wd = tempfile.mkdtemp(prefix="bench-")
        with open(os.path.join(FIX, "j.kk.out")) as f:
            kernel = f.read()
        with open(os.path.join(FIX, "client.out")) as f:
            pvcm = f.read().split("@@ closed")[0]
        files = {
            # Two rounds each; the kernel guests' CPU ticks around them, the client's and
            # the server's in their outputs, the backend's in backend-ticks-N.
            "j.kk-1000.out": "100\n" + kernel + kernel + "150\n",
            "k.busy0-1000.out": "40\n", "k.busy1-1000.out": "90\n",
            "cli1000.out": "10\n" + pvcm + pvcm + "30\n", "srv1000.out": "5\n15\n",
            "backend-ticks-1000": "100 200",
            "idle-idlepvcm": "0 400 0 20", "idle-idlebase": "0 200 0 0",
        }
        for name, text in files.items():
            with open(os.path.join(self.wd, name), "w") as f:
                f.write(text)

    def tearDown(self):
        shutil.rmtree(self.wd)

    def test_table(self):
        out, bad = ic.bench(WorkDir(self.wd), [1000], 100, 2)
        self.assertEqual(bad, [])
        # Kernel CPU: (50 + 50) jiffies of 10 ms over 2,000 connections.
        self.assertEqual(out[2], "  1000 kernel CM <-> kernel CM      6441.4         5937.4         0.50  6441/5937 6441/5937")
        # pvcm CPU: (20 + 10) jiffies, plus 100 backend ticks at 100 a second.
        self.assertEqual(out[3], "  1000 pvcm VM <-> pvcm VM         2268.7         6109.3         0.65  2269/6109 2269/6109")
        self.assertEqual(out[4], "  1000 pvcm speed-up                 2.8x           1.0x    0.8x less  round 1 (cold): 2.8x / 1.0x")
        self.assertEqual(out[5], "idle: QEMU VM with pvcm-guest listen 20.0% of a host core, without it 10.0%: "
                                 "the driver's poll costs 10.0%; pvcm-backend 1.00%")

    def test_a_lost_round(self):
        out, bad = ic.bench(WorkDir(self.wd), [1000], 100, 3)
        self.assertEqual(bad, ["pvcm 1000: 2 of 3 rounds established and tore down every connection",
                               "kernel 1000: 2 of 3 rounds reported (cmtime output in j.kk-1000.out)"])
        self.assertEqual(out[-3:-1], ["bench: " + b for b in bad])


if __name__ == "__main__":
    unittest.main()
