import json
import os
import re
import shutil
import tempfile
import unittest

from netlab import libvirt_suite as lv
from netlab.toolout import WorkDir

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "libvirt")
TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "libvirt", "pvcm-domain.xml")


def read(path):
    with open(path) as f:
        return f.read()


class DomainXml(unittest.TestCase):
    def test_the_runs_domain(self):
        # The XML a real run defined, made again from the template with its values.
        real = read(os.path.join(FIX, "pvcm-libvirt-lv.xml"))

        def field(pattern):
            return re.search(pattern, real).group(1)
        fields = {
            "NAME": field(r"<name>(.*)</name>"), "MEM_MIB": field(r"<memory unit='MiB'>(.*)</memory>"),
            "EMULATOR": field(r"<emulator>(.*)</emulator>"), "KERNEL": field(r"<kernel>(.*)</kernel>"),
            "INITRD": field(r"<initrd>(.*)</initrd>"), "CMDLINE": field(r"<cmdline>(.*)</cmdline>"),
            "CONSOLE_LOG": field(r"<source path='(.*)'/>"), "SOCKET": field(r"path=([^,]*),reconnect-ms"),
        }
        xml = lv.fill(read(TEMPLATE), fields)
        xml = lv.add_divert_nic(xml, field(r"<target dev='(.*)' managed"), field(r"divert:1' dev='(.*)'>"),
                                "127.12.1.1")
        self.assertEqual(xml, real)

    def test_values_are_escaped(self):
        xml = lv.fill("<cmdline>@CMDLINE@</cmdline>", {"CMDLINE": "a<b & 'c'"})
        self.assertEqual(xml, "<cmdline>a&lt;b &amp; &#x27;c&#x27;</cmdline>")

    def test_unfilled_fields_are_named(self):
        with self.assertRaisesRegex(ValueError, r"unfilled fields in the template: \['@MEM_MIB@', '@KERNEL@'"):
            lv.fill(read(TEMPLATE), {"NAME": "x"})


class Release(unittest.TestCase):
    def setUp(self):
        self.wd = tempfile.mkdtemp(prefix="libvirt-fixture-")
        for f in ("peer.out", "a.stat.json", "p.stat.json"):
            shutil.copy(os.path.join(FIX, f), self.wd)
        self.w = WorkDir(self.wd)

    def tearDown(self):
        shutil.rmtree(self.wd)

    def edit_json(self, name, fn):
        p = os.path.join(self.wd, name)
        d = json.loads(read(p))
        fn(d)
        with open(p, "w") as f:
            json.dump(d, f)

    def test_the_runs_release(self):
        out, bad = lv.release(self.w, 200, "0")
        self.assertEqual(bad, [])
        self.assertEqual(out[0], "   peer: accepted 200 established 200 disconnected 200 failed 0")
        self.assertRegex(out[1], r"^   host A: DREQ tx 200 rx 0, DREP tx 0 rx 0, retries 0, drops \{'absorbed': 200\}, live 0$")

    def test_findings(self):
        self.assertEqual(lv.release(self.w, 201, "1")[1], [
            "peer: 200 established, 200 disconnected of 201", "the peer's cmtime server exited 1",
            "DREQ sent by A, received by P, DREP sent by P, absorbed by A: 200, 200, 200, 200; want 201 each"])
        self.edit_json("a.stat.json", lambda d: d["host"]["cm"]["cm_tx_retries"].update(dreq=2))
        self.assertEqual(lv.release(self.w, 200, "0")[1], ["host A: 2 DREQ retries"])

    def test_missing_files(self):
        os.remove(os.path.join(self.wd, "p.stat.json"))
        os.remove(os.path.join(self.wd, "peer.out"))
        self.assertEqual(lv.release(self.w, 200, "none")[1], [
            "the peer printed no cmtime server report", "the peer's cmtime server exited none",
            "host P: no stat (p.stat.json)"])

    def test_figure(self):
        doc = self.w.json("a.stat.json")
        self.assertEqual(lv.figure(doc, "host.live"), 0)
        self.assertIs(lv.figure(doc, "vms.0.attached"), False)
        with self.assertRaises(IndexError):
            lv.figure(doc, "vms.3.attached")


class Migrated(unittest.TestCase):
    def setUp(self):
        self.wd = tempfile.mkdtemp(prefix="libvirt-fixture-")
        src = os.path.join(FIX, "migrate")
        for f in os.listdir(src):
            shutil.copy(os.path.join(src, f), self.wd)
        self.w = WorkDir(self.wd)

    def tearDown(self):
        shutil.rmtree(self.wd)

    def test_the_runs_migration(self):
        out, bad = lv.migrated(self.w, 200, "0")
        self.assertEqual(bad, [])
        self.assertIn("   host B: DREQ tx 200 rx 0, DREP tx 0 rx 200, retries 0, drops 0, live 0", out)
        self.assertIn("   VM lv (at B): established 200 disconnected 200 failed 0", out)

    def test_findings(self):
        # The teardown from A (as if the VM had not moved) and a VM that reported nothing.
        p = os.path.join(self.wd, "a.stat.json")
        d = json.loads(read(p))
        d["host"]["cm"]["cm_tx_msgs"]["dreq"] = 3
        d["host"]["drops"]["absorbed"] = 3
        with open(p, "w") as f:
            json.dump(d, f)
        os.remove(os.path.join(self.wd, "lv-b.console.log"))
        self.assertEqual(lv.migrated(self.w, 200, "0")[1], [
            "the VM printed no cmtime report on its console at host B",
            "host A sent 3 DREQs after the VM left", "host A: 3 absorbed"])

    def test_add_vm_meta(self):
        xml = "<domain>\n  <name>d</name>\n</domain>\n"
        once = lv.add_vm_meta(xml, "name=lv,gid=1.2.3.4")
        self.assertIn("<metadata>\n    <pvcm:vm xmlns:pvcm='urn:pvcm:vm:1' spec='name=lv,gid=1.2.3.4'/>\n  </metadata>", once)
        with_nic = lv.add_vm_meta(lv.add_divert_nic(xml, "t0", "dv", "1.2.3.4"), "name=lv")
        self.assertEqual(with_nic.count("<metadata>"), 1)
        self.assertIn("<pvcm:vm ", with_nic)
        self.assertIn("<pvcm:divert ", with_nic)


if __name__ == "__main__":
    unittest.main()
