"""The Python of qemu-scripts/libvirt.sh: its domain XML and its checks.

    python3 -m netlab.libvirt_suite fill TEMPLATE OUT KEY=VALUE...
        TEMPLATE (libvirt/pvcm-domain.xml) with each @KEY@ replaced by VALUE (XML
        escaped), to OUT; exit 1 naming the fields left unfilled
    python3 -m netlab.libvirt_suite add-nic XML TAP DEV ADDR
        adds to the domain XML a virtio NIC on TAP and the <pvcm:divert> metadata the
        libvirt hook reads (divert device DEV, the NIC's addresses ADDR and fe80::/64)
    python3 -m netlab.libvirt_suite add-vm XML SPEC
        adds to the domain XML the <pvcm:vm> metadata the libvirt hook reads on a live
        migration (SPEC: the VM's `--vm` spec without its socket)
    python3 -m netlab.libvirt_suite figure FILE PATH
        one figure of a `stat --json` FILE, PATH its keys and list indexes with dots
        (host.live, vms.0.attached), printed as Python prints it
    python3 -m netlab.libvirt_suite release WORKDIR CONNS PEER_RC
        test 3's figures (the peer's cmtime server report in peer.out, hosts a and p's
        a.stat.json, p.stat.json) and its check: exit 1 on a finding
    python3 -m netlab.libvirt_suite migrated WORKDIR CONNS PEER_RC
        test 6's figures (the peer's report, the VM's own in lv-b.console.log, hosts a,
        b and p's stat JSON) and its check: exit 1 on a finding
"""

import html
import re
import sys

from .toolout import WorkDir, json_lines, stat_drops

NIC_MAC = "52:54:00:12:01:01"


def fill(template, fields):
    """TEMPLATE with each @KEY@ of FIELDS replaced by its value, XML escaped;
    ValueError naming the @FIELDS@ left."""
    for k, v in fields.items():
        template = template.replace(f"@{k}@", html.escape(v))
    left = re.findall(r"@[A-Z_]+@", template)
    if left:
        raise ValueError(f"unfilled fields in the template: {left}")
    return template


def add_divert_nic(xml, tap, dev, ip, mac=NIC_MAC):
    """The domain XML with a NIC on TAP (type ethernet, virtio, no ROM) and, after its
    <name>, the metadata that names DEV and the NIC's addresses for the divert hook."""
    meta = (f"  <metadata>\n    <pvcm:divert xmlns:pvcm='urn:pvcm:divert:1' dev='{dev}'>\n"
            f"      <pvcm:nic mac='{mac}' addresses='{ip} fe80::/64'/>\n"
            f"    </pvcm:divert>\n  </metadata>\n")
    nic = (f"    <interface type='ethernet'>\n      <mac address='{mac}'/>\n"
           f"      <target dev='{tap}' managed='yes'/>\n      <model type='virtio'/>\n"
           f"      <rom enabled='no'/>\n"
           f"    </interface>\n")
    return xml.replace("</name>\n", "</name>\n" + meta, 1).replace("  </devices>", nic + "  </devices>", 1)


def add_vm_meta(xml, spec):
    """The domain XML with <pvcm:vm spec=SPEC> in its <metadata> (made if missing)."""
    vm = f"    <pvcm:vm xmlns:pvcm='urn:pvcm:vm:1' spec='{html.escape(spec)}'/>\n"
    if "<metadata>\n" in xml:
        return xml.replace("<metadata>\n", "<metadata>\n" + vm, 1)
    return xml.replace("</name>\n", "</name>\n  <metadata>\n" + vm + "  </metadata>\n", 1)


def figure(doc, path):
    """The value at PATH (keys and list indexes, dot-separated) in DOC."""
    v = doc
    for p in path.split("."):
        v = v[int(p)] if isinstance(v, list) else v[p]
    return v


def report(text, key):
    """The last JSON report (a line with KEY) in TEXT, a console's or a program's
    output, or None."""
    rep = None
    for e in json_lines("\n".join(line.strip() for line in text.splitlines())):
        if key in e:
            rep = e
    return rep


def peer_and_hosts(w, conns, peer_rc, names, out, bad):
    """The peer's cmtime server report (CONNS established and disconnected, exit 0) and
    the figures of hosts NAMES; findings: other drops than `absorbed`, DREQ retries.
    Returns {name: stat or None}."""
    rep = report(w.read("peer.out"), "accepted")
    if rep is None:
        bad.append("the peer printed no cmtime server report")
    else:
        out.append(f"   peer: accepted {rep['accepted']} established {rep['established']} "
                   f"disconnected {rep['disconnected']} failed {rep['failed']}")
        if rep["established"] != conns or rep["disconnected"] != conns:
            bad.append(f"peer: {rep['established']} established, {rep['disconnected']} disconnected of {conns}")
        if rep["failed"]:
            bad.append(f"peer: {rep['failed']} failed")
    if peer_rc != "0":
        bad.append(f"the peer's cmtime server exited {peer_rc}")
    hosts = {h: w.host_stat(f"{h}.stat.json") for h in names}
    for h, s in hosts.items():
        if s is None:
            bad.append(f"host {h.upper()}: no stat ({h}.stat.json)")
            continue
        cm = s["cm"]
        drops = stat_drops(s)
        out.append(f"   host {h.upper()}: DREQ tx {cm['cm_tx_msgs']['dreq']} rx {cm['cm_rx_msgs']['dreq']}, "
                   f"DREP tx {cm['cm_tx_msgs']['drep']} rx {cm['cm_rx_msgs']['drep']}, "
                   f"retries {sum(cm['cm_tx_retries'].values())}, drops {drops or 0}, live {s['live']}")
        other = {k: v for k, v in drops.items() if k != "absorbed"}
        if other:
            bad.append(f"host {h.upper()}: drops {other}")
        if cm["cm_tx_retries"]["dreq"]:
            bad.append(f"host {h.upper()}: {cm['cm_tx_retries']['dreq']} DREQ retries")
    return hosts


def release(w, conns, peer_rc):
    """Test 3: the VM was destroyed holding CONNS connections. Returns (figure lines,
    findings)."""
    out, bad = [], []
    hosts = peer_and_hosts(w, conns, peer_rc, ("a", "p"), out, bad)
    a, p = hosts["a"], hosts["p"]
    if a is not None and p is not None:
        # The VM was killed holding every connection: each DREQ of the teardown came from
        # host A on the VM's behalf, the peer answered each, and host A's mux took each
        # DREP for the departed VM (counted as absorbed).
        got = (a["cm"]["cm_tx_msgs"]["dreq"], p["cm"]["cm_rx_msgs"]["dreq"],
               p["cm"]["cm_tx_msgs"]["drep"], a["drops"]["absorbed"])
        if got != (conns,) * 4:
            bad.append("DREQ sent by A, received by P, DREP sent by P, absorbed by A: "
                       f"{', '.join(map(str, got))}; want {conns} each")
        if p["drops"]["absorbed"]:
            bad.append(f"host P: {p['drops']['absorbed']} absorbed")
    return out, bad


def migrated(w, conns, peer_rc):
    """Test 6: the VM moved from host A to host B holding CONNS connections and then
    tore them down itself, through B. Returns (figure lines, findings)."""
    out, bad = [], []
    hosts = peer_and_hosts(w, conns, peer_rc, ("a", "b", "p"), out, bad)
    rep = report(w.read("lv-b.console.log"), "connections")
    if rep is None:
        bad.append("the VM printed no cmtime report on its console at host B")
    else:
        out.append(f"   VM lv (at B): established {rep['established']} disconnected {rep['disconnected']} "
                   f"failed {rep['failed']}")
        if (rep["established"], rep["disconnected"], rep["failed"]) != (conns, conns, 0):
            bad.append(f"the VM's cmtime: {rep['established']} established, {rep['disconnected']} "
                       f"disconnected, {rep['failed']} failed of {conns}")
    a, b, p = hosts["a"], hosts["b"], hosts["p"]
    if a is not None and b is not None and p is not None:
        # Every DREQ came from the VM at host B and every DREP reached it there: none
        # from A (it let the VM go), none absorbed anywhere (no VM departed unannounced).
        got = (b["cm"]["cm_tx_msgs"]["dreq"], p["cm"]["cm_rx_msgs"]["dreq"],
               p["cm"]["cm_tx_msgs"]["drep"], b["cm"]["cm_rx_msgs"]["drep"])
        if got != (conns,) * 4:
            bad.append("DREQ sent by B, received by P, DREP sent by P, received by B: "
                       f"{', '.join(map(str, got))}; want {conns} each")
        if a["cm"]["cm_tx_msgs"]["dreq"]:
            bad.append(f"host A sent {a['cm']['cm_tx_msgs']['dreq']} DREQs after the VM left")
        for h, s in hosts.items():
            if s["drops"]["absorbed"]:
                bad.append(f"host {h.upper()}: {s['drops']['absorbed']} absorbed")
    return out, bad


def main(argv):
    usage = __doc__.split("\n\n", 1)[1]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, args = argv[0], argv[1:]
    if cmd == "fill" and len(args) >= 2:
        with open(args[0]) as f:
            text = f.read()
        try:
            text = fill(text, dict(kv.split("=", 1) for kv in args[2:]))
        except ValueError as e:
            print(f"netlab.libvirt_suite fill: {e}", file=sys.stderr)
            return 1
        with open(args[1], "w") as f:
            f.write(text)
        return 0
    if cmd == "add-nic" and len(args) == 4:
        with open(args[0]) as f:
            text = add_divert_nic(f.read(), *args[1:])
        with open(args[0], "w") as f:
            f.write(text)
        return 0
    if cmd == "add-vm" and len(args) == 2:
        with open(args[0]) as f:
            text = add_vm_meta(f.read(), args[1])
        with open(args[0], "w") as f:
            f.write(text)
        return 0
    if cmd == "figure" and len(args) == 2:
        doc = WorkDir(".").json(args[0])
        try:
            print(figure(doc, args[1]))
        except (KeyError, IndexError, TypeError, ValueError):
            print(f"netlab.libvirt_suite figure: no {args[1]} in {args[0]}", file=sys.stderr)
            return 1
        return 0
    if cmd in ("release", "migrated") and len(args) == 3:
        check = release if cmd == "release" else migrated
        out, bad = check(WorkDir(args[0]), int(args[1]), args[2])
        for line in out + [f"   check: {x}" for x in bad]:
            print(line)
        return 1 if bad else 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
