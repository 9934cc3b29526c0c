#!/usr/bin/env bash
# The host side of qemu-scripts/umad.sh, run inside the network lab's namespace (python3
# -m netlab run). Guest a (10.99.0.2, pvcm.cm=pvcm: no kernel CM) runs pvcm-backend on
# umad:rxe0:1 with pvcm VMs a (10.99.0.11) and b (10.99.0.12) attached in-process by
# pvcm-lab attach; guest b (10.99.0.3) runs the kernel CM with a cmtime listener
# (started here). Both guests run the RDMA image's agent, so requests go to them
# through the 9p share (kexec).
#
# IPv6 (test 6): the guests also have fd99::2 (a) and fd99::3 (b) on eth0; pvcm VM a6
# (fd99::11, added to a's eth0 as a /128) is on the same pvcm-backend, and the kernel
# in b listens on fd99::3 port 7476 (cmtime -b). br0 is captured (dumpcap) while test
# 6 runs.
#
# Environment (set by umad.sh): IOP_WORK, IOP_SHARE, IOP_CONNS, IOP_CONNS6.
set -uo pipefail
cap_pid=""
trap '[ -z "$cap_pid" ] || kill "$cap_pid" 2>/dev/null; touch "$IOP_SHARE/flag.stop"' EXIT

work="$IOP_WORK" share="$IOP_SHARE" conns="$IOP_CONNS" conns6="$IOP_CONNS6"
b_ip=10.99.0.3 vm_a=10.99.0.11 vm_b=10.99.0.12 vm_c=10.99.0.13 vm_d=10.99.0.14
b_ip6=fd99::3 vm_a6=fd99::11
results="$work/results.txt"
figures="$work/figures.txt"
: >"$results"
: >"$figures"
lab="env LD_LIBRARY_PATH=/host/lib /host/bin/pvcm-lab"

say() { echo "== $*"; }
pyresult() { tee -a "$results"; }

# shellcheck source-path=SCRIPTDIR source=../interop/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/../interop/common.sh"

for p in a b; do
    for _ in $(seq 300); do [ -e "$share/flag.ready.$p" ] && break; sleep 0.2; done
done
start_listener b || echo "b: $(cat "$work/b.listener.out")"
# guest_wait FILE SECS: until FILE (in the share) exists.
guest_wait() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do [ -e "$share/$1" ] && return 0; sleep 0.1; done
    return 1
}
guest_grep() { # guest_grep FILE PATTERN SECS
    local i
    for ((i = 0; i < $3 * 10; i++)); do grep -Eq "$2" "$share/$1" 2>/dev/null && return 0; sleep 0.1; done
    return 1
}

say "0. pvcm-backend --port umad:rxe0 where ib_cm is loaded (guest b): refused at startup"
kexec b t0 30 "/host/bin/pvcm-backend --port umad:rxe0 --vm socket=/tmp/x.sock,gid=$b_ip,name=x; echo rc=\$?"
say "setup: guest a: VM addresses on eth0, pvcm-backend --port umad:rxe0:1"
kexec a setup 60 "sh /host/aprep.sh $vm_a $vm_b $vm_c $vm_a6"
echo $? >"$work/a.setup.rc"
cat "$work/a.setup.out"
kcounters b before

say "1. pvcm VM a -> kernel b: cmtime, $conns connections"
kexec a t1 900 "$lab attach --socket /tmp/a.sock cmtime --dest $b_ip --connections $conns --timeout 300; echo rc=\$?"

say "2. kernel b -> pvcm VM a: cmtime -s $vm_a -c $conns"
kexec a t2srv 10 "($lab attach --socket /tmp/a.sock cmtime --server --connections $conns --timeout 600 >/host/t2srv.log 2>&1; echo \$? >/host/t2srv.rc) &"
guest_grep t2srv.log 'cmtime server on' 60
kexec b t2 900 "cmtime -s $vm_a -c $conns; echo rc=\$?"
guest_wait t2srv.rc 120

say "3a. two VMs behind one umad port, same TCP port 7475: routing by GID (3 to a, 5 to b)"
kexec a t3srv 10 "($lab attach --socket /tmp/a.sock --json cmtime --server --port 7475 --connections 3 --timeout 120 >/host/t3a.log 2>&1; echo \$? >/host/t3a.rc) &
($lab attach --socket /tmp/b.sock --json cmtime --server --port 7475 --connections 5 --timeout 120 >/host/t3b.log 2>&1; echo \$? >/host/t3b.rc) &"
guest_grep t3a.log listening 60 && guest_grep t3b.log listening 60
kexec b t3 300 "cmtime -s $vm_a -p 7475 -c 3; echo rc=\$?; cmtime -s $vm_b -p 7475 -c 5; echo rc=\$?"
guest_wait t3a.rc 60
guest_wait t3b.rc 60

say "3b. two VMs: kernel connect-and-destroy (REJ(TIMEOUT)) to each, routed to the right VM"
kexec a t3lsn 10 "$lab attach --socket /tmp/a.sock --json listen --port 7472 >/host/t3la.log 2>&1 & echo \$! >/tmp/t3la.pid
$lab attach --socket /tmp/b.sock --json listen --port 7472 >/host/t3lb.log 2>&1 & echo \$! >/tmp/t3lb.pid"
guest_grep t3la.log listening 60 && guest_grep t3lb.log listening 60
kexec b t3w 120 "/host/bin/kcm withdraw -s $vm_a -p 7472 -c 5; echo rc=\$?; /host/bin/kcm withdraw -s $vm_b -p 7472 -c 7; echo rc=\$?"
sleep 3
kexec a t3stop 10 'kill $(cat /tmp/t3la.pid) $(cat /tmp/t3lb.pid); sleep 1; true'

say "5. VM c, whose address is not in rxe0's GID table: refused at attach"
kexec a t5 60 "$lab attach --socket /tmp/c.sock --json connect --dest $b_ip --port 7471 --timeout 3; echo rc=\$?"
sleep 1

kcounters b after
kexec a stat 20 "/host/bin/pvcm-backend stat --control /tmp/h.ctl --json >/host/final.stat.json; /host/bin/pvcm-backend stat --control /tmp/h.ctl"
cp "$share/backend.log" "$work/backend.log" 2>/dev/null

say "6. IPv6: pvcm VM a6 ($vm_a6 on guest a's eth0) <-> kernel b ($b_ip6), $conns6 connections each way"
start_listener b "$b_ip6" 7476 || echo "b: $(cat "$work/b.listener7476.out")"
kcounters b v6before
kexec a stat6before 20 "/host/bin/pvcm-backend stat --control /tmp/h.ctl --json >/host/v6before.stat.json"
rm -f "$work/v6.pcap"
dumpcap -q -i br0 -P -f "udp port 4791" -w "$work/v6.pcap" >"$work/dumpcap.log" 2>&1 &
cap_pid=$!
for _ in $(seq 100); do [ -s "$work/v6.pcap" ] && break; sleep 0.1; done
say "6a. pvcm VM a6 -> kernel b over IPv6: cmtime --dest $b_ip6 --port 7476"
kexec a t6a 900 "$lab attach --socket /tmp/a6.sock cmtime --dest $b_ip6 --port 7476 --connections $conns6 --timeout 300; echo rc=\$?"
say "6b. kernel b -> pvcm VM a6 over IPv6: cmtime -s $vm_a6 -c $conns6"
kexec a t6srv 10 "($lab attach --socket /tmp/a6.sock cmtime --server --connections $conns6 --timeout 600 >/host/t6srv.log 2>&1; echo \$? >/host/t6srv.rc) &"
guest_grep t6srv.log 'cmtime server on' 60
kexec b t6b 900 "cmtime -s $vm_a6 -c $conns6; echo rc=\$?"
guest_wait t6srv.rc 120
sleep 1
kill -INT "$cap_pid" 2>/dev/null
wait "$cap_pid" 2>/dev/null
cap_pid=""
kcounters b v6after
kexec a stat6 20 "/host/bin/pvcm-backend stat --control /tmp/h.ctl --json >/host/v6after.stat.json"

say "7. a VM added at runtime (pvcm-backend vm add) to the umad port: $vm_d on eth0, 100 connections to kernel b, then vm remove"
start_listener b "$b_ip" 7477 || echo "b: $(cat "$work/b.listener7477.out")"
ctl="/host/bin/pvcm-backend vm --control /tmp/h.ctl"
kexec a t7add 60 "ip addr add $vm_d/24 dev eth0
i=0
until grep -qs 0000:0000:0000:0000:0000:ffff:$(echo "$vm_d" | awk -F. '{ printf "%02x%02x:%02x%02x", $1, $2, $3, $4 }') /sys/class/infiniband/rxe0/ports/1/gids/*; do
    i=\$((i + 1)); [ \$i -lt 100 ] || { echo 'no GID for $vm_d'; break; }; sleep 0.1
done
$ctl add socket=/tmp/d.sock,gid=$vm_d,name=d; echo add_rc=\$?
$ctl list"
kexec a t7 300 "$lab attach --socket /tmp/d.sock cmtime --dest $b_ip --port 7477 --connections 100 --timeout 120; echo rc=\$?"
kexec a t7rm 60 "$ctl remove d; echo remove_rc=\$?; $ctl list"

for f in t2srv.log t2srv.rc t3a.log t3a.rc t3b.log t3b.rc t3la.log t3lb.log final.stat.json \
    t6srv.log t6srv.rc v6before.stat.json v6after.stat.json; do
    cp "$share/$f" "$work/$f" 2>/dev/null
done

python3 - "$work" "$conns" "$figures" "$conns6" <<'PY' | pyresult
import json, re, sys
wd, conns, figures, conns6 = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def read(n):
    try:
        return open(f"{wd}/{n}", errors="replace").read()
    except OSError:
        return ""
def jsonl(n):
    out = []
    for l in read(n).splitlines():
        if l.startswith("{"):
            try:
                out.append(json.loads(l))
            except ValueError:
                pass
    return out
res = []
def result(t, bad, text):
    res.append((t, bad, text))
fig = open(figures, "a")

# 0: refused where ib_cm holds the class
o = read("b.t0.out")
bad = []
if "rc=1" not in o:
    bad.append(f"exit status: {o[-200:]!r}")
if "ib_cm" not in o or "modprobe -r" not in o:
    bad.append(f"the error does not name ib_cm and how to unload it: {o[-400:]!r}")
result("0", bad, "umad port refused at startup where ib_cm is loaded, saying so and what to do")
m = re.search(r"pvcm-backend: (.*)", o)
if m:
    fig.write(f"test 0 error: {m.group(1)[:300]}\n")

setup_ok = read("a.setup.rc").strip() == "0"
# 1: VM -> kernel
o = read("a.t1.out")
bad = [] if setup_ok else ["setup failed: " + read("a.setup.out")[-300:]]
m = re.search(r"connections (\d+) established (\d+) failed (\d+) disconnected (\d+)", o)
if not m:
    bad.append("no cmtime summary: " + o[-300:])
elif tuple(map(int, m.groups())) != (conns, conns, 0, conns):
    bad.append(m.group(0))
if "rc=0" not in o:
    bad.append("pvcm cmtime exit " + str(re.findall(r"rc=(\d+)", o)))
result("1", bad, f"pvcm VM behind umad -> kernel CM: {conns} connections established and torn down")
for l in o.splitlines():
    if re.match(r"\s*(establish|disconnect)", l):
        fig.write(f"pvcm VM -> kernel   {l.strip()}\n")

# 2: kernel -> VM
o = read("b.t2.out")
srv = read("t2srv.log")
bad = []
if "rc=0" not in o:
    bad.append("kernel cmtime: " + o[-300:])
if read("t2srv.rc").strip() != "0":
    bad.append(f"pvcm cmtime server exit {read('t2srv.rc').strip()!r}: {srv[-300:]}")
result("2", bad, f"kernel CM -> pvcm VM behind umad: {conns} connections established and torn down")
for l in o.splitlines():
    if re.match(r"\s*(connect|disconnect)\s*:", l):
        fig.write(f"kernel -> pvcm VM   {l.strip()}\n")

# 3a: routing by GID
bad = []
o = read("b.t3.out")
if o.count("rc=0") != 2:
    bad.append("kernel cmtime: " + o[-300:])
for vm, n in (("a", 3), ("b", 5)):
    ev = jsonl(f"t3{vm}.log")
    fin = [e for e in ev if "accepted" in e]
    if read(f"t3{vm}.rc").strip() != "0" or not fin:
        bad.append(f"VM {vm}: server exit {read(f't3{vm}.rc').strip()!r} {read(f't3{vm}.log')[-200:]}")
    elif (fin[-1]["accepted"], fin[-1]["established"], fin[-1]["disconnected"]) != (n, n, n):
        bad.append(f"VM {vm}: {fin[-1]} (want {n} each)")
result("3a", bad, "two VMs on one umad port and one TCP port: each got exactly its own connections (3, 5)")

# 3b: REJ(TIMEOUT) routing
bad = []
o = read("b.t3w.out")
if o.count("rc=0") != 2:
    bad.append("kcm withdraw: " + o[-300:])
for vm, n, other in (("a", 5, "b"), ("b", 7, "a")):
    ev = jsonl(f"t3l{vm}.log")
    reqs = {e["id"] for e in ev if e.get("event") == "connect_request"}
    gone = {e["id"] for e in ev if e.get("event") in ("withdrawn", "rejected")}
    est = {e["id"] for e in ev if e.get("event") == "established"}
    if len(reqs) != n or gone != reqs or est:
        bad.append(f"VM {vm}: {len(reqs)} requests (want {n}), {len(gone & reqs)} withdrawn, {len(est)} established")
result("3b", bad, "kernel connect-and-destroy to two VMs (5, 7): every REJ(TIMEOUT) reached the VM it was for")

# 5: VM c refused
o = read("a.t5.out")
log = read("backend.log")
bad = []
if "rc=0" in o:
    bad.append("VM c connected")
if "attach refused" not in log or "not a RoCE v2 entry" not in log:
    bad.append("no attach refusal in the backend log")
result("5", bad, "a VM whose GID is not in the port's GID table is refused at attach")
m = re.search(r"attach refused.*", log)
if m:
    fig.write(f"test 5 log: {m.group(0)[:300]}\n")

# 5b: the device's own ACK delay (rdma_rxe: RXE_LOCAL_CA_ACK_DELAY 15)
bad = []
m = re.search(r"ca_ack_delay=(\d+).*local CA ACK delay \(ibv_devinfo\)|local CA ACK delay \(ibv_devinfo\).*ca_ack_delay=(\d+)", log)
got = m and (m.group(1) or m.group(2))
if got != "15":
    bad.append(f"the backend did not read rxe0's local CA ACK delay (15) from the device: {got!r}")
result("5b", bad, "the backend took the ACK delay VMs report from the device (ibv_devinfo: rxe0's 15)")

# 4: teardown at once, 0 retries, counters
def counters(tag):
    c = {}
    for l in read(f"b.counters-{tag}.out").splitlines():
        p = l.split()
        if len(p) == 2 and p[1].isdigit():
            c[p[0]] = int(p[1])
    return c
bad = []
b0, b1 = counters("before"), counters("after")
if not b1:
    bad.append("no kernel counters")
for k, v in b1.items():
    d = v - b0.get(k, 0)
    if d and (k.startswith("cm_tx_retries/") or k.startswith("cm_rx_duplicates/")):
        bad.append(f"kernel b: {k} +{d}")
try:
    s = json.load(open(f"{wd}/final.stat.json"))["host"]
except (OSError, ValueError, KeyError):
    s = None
    bad.append("no backend stat")
if s:
    r = sum(s["cm"]["cm_tx_retries"].values())
    if r:
        bad.append(f"pvcm-backend: {r} retries")
    drops = {k: v for g in ("drops", "device_drops") for k, v in s.get(g, {}).items() if v}
    crossed = drops.pop("unknown_connection", 0)
    if crossed > 12:
        drops["unknown_connection"] = crossed
    drops.pop("not_attached", None)  # VM c (test 5)
    if drops:
        bad.append(f"pvcm-backend drops: {drops}")
    fig.write("pvcm-backend (umad) cm_tx_msgs: " + json.dumps(s["cm"]["cm_tx_msgs"]) + "\n")
    fig.write("pvcm-backend (umad) io: " + json.dumps(s["io"]) + "\n")
    ktx = {k.split("/")[1]: b1.get(k, 0) - b0.get(k, 0) for k in b1 if k.startswith("cm_rx_msgs/")}
    fig.write("kernel b cm_rx_msgs delta: " + json.dumps({k: v for k, v in ktx.items() if v}) + "\n")
    # Every MAD pvcm sent reached the kernel CM (guest b is the only other CM here).
    for m, sent in s["cm"]["cm_tx_msgs"].items():
        if sent != ktx.get(m, 0):
            bad.append(f"{m}: pvcm sent {sent}, the kernel CM took {ktx.get(m, 0)}")
result("4", bad, f"teardown of {conns} connections at once (tests 1, 2), both directions: 0 retries and 0 duplicates on both sides, no drops, every pvcm MAD taken by the kernel CM")

# 6a, 6b: IPv6 both ways
A6, B6 = "fd99::11", "fd99::3"
o = read("a.t6a.out")
bad = [] if setup_ok else ["setup failed: " + read("a.setup.out")[-300:]]
m = re.search(r"connections (\d+) established (\d+) failed (\d+) disconnected (\d+)", o)
if not m:
    bad.append("no cmtime summary: " + o[-300:])
elif tuple(map(int, m.groups())) != (conns6, conns6, 0, conns6):
    bad.append(m.group(0))
if "rc=0" not in o:
    bad.append("pvcm cmtime exit " + str(re.findall(r"rc=(\d+)", o)))
result("6a", bad, f"IPv6: pvcm VM {A6} behind umad -> kernel CM {B6}: {conns6} connections established and torn down")
for l in o.splitlines():
    if re.match(r"\s*(establish|disconnect)", l):
        fig.write(f"IPv6 pvcm VM -> kernel   {l.strip()}\n")
o = read("b.t6b.out")
srv = read("t6srv.log")
bad = []
if "rc=0" not in o:
    bad.append("kernel cmtime: " + o[-300:])
m = re.search(r"accepted (\d+) established (\d+) disconnected (\d+) failed (\d+)", srv)
if read("t6srv.rc").strip() != "0":
    bad.append(f"pvcm cmtime server exit {read('t6srv.rc').strip()!r}: {srv[-300:]}")
elif not m or tuple(map(int, m.groups())) != (conns6, conns6, conns6, 0):
    bad.append(f"pvcm server summary: {m.group(0) if m else srv[-300:]}")
result("6b", bad, f"IPv6: kernel CM {B6} -> pvcm VM {A6} behind umad: {conns6} connections established and torn down")
for l in o.splitlines():
    if re.match(r"\s*(connect|disconnect)\s*:", l):
        fig.write(f"IPv6 kernel -> pvcm VM   {l.strip()}\n")

# 6c: over test 6 only: counters, drops, and what went over br0
def stat(n):
    try:
        return json.load(open(f"{wd}/{n}"))
    except (OSError, ValueError):
        return None
def frames(path):
    """RoCEv2 frames of a pcap capture: (family, src, dst, MAD class or None) each."""
    import ipaddress, struct
    try:
        data = open(path, "rb").read()
    except OSError:
        return None
    if len(data) < 24:
        return None
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        end = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        end = ">"
    else:
        return None
    out, off = [], 24
    while off + 16 <= len(data):
        incl = struct.unpack(end + "I", data[off + 8:off + 12])[0]
        f = data[off + 16:off + 16 + incl]
        off += 16 + incl
        if len(f) < 14:
            continue
        et = struct.unpack(">H", f[12:14])[0]
        if et == 0x86DD and len(f) >= 54 and f[20] == 17:
            fam, src, dst, udp = 6, ipaddress.IPv6Address(f[22:38]), ipaddress.IPv6Address(f[38:54]), 54
        elif et == 0x0800 and len(f) >= 34 and f[23] == 17:
            ihl = (f[14] & 15) * 4
            fam, src, dst, udp = 4, ipaddress.IPv4Address(f[26:30]), ipaddress.IPv4Address(f[30:34]), 14 + ihl
        else:
            continue
        if len(f) < udp + 8 or struct.unpack(">H", f[udp + 2:udp + 4])[0] != 4791:
            continue
        bth = udp + 8
        # BTH (12 bytes): UD SEND only (0x64) to QP1; then DETH (8), then the MAD.
        mad = bth + 20
        qp1 = len(f) > mad + 1 and f[bth] == 0x64 and f[bth + 5:bth + 8] == b"\x00\x00\x01"
        out.append((fam, str(src), str(dst), f[mad + 1] if qp1 else None))
    return out
bad = []
kb, ka = counters("v6before"), counters("v6after")
if not ka:
    bad.append("no kernel counters")
for k, v in ka.items():
    d = v - kb.get(k, 0)
    if d and (k.startswith("cm_tx_retries/") or k.startswith("cm_rx_duplicates/")):
        bad.append(f"kernel b: {k} +{d}")
s0, s1 = stat("v6before.stat.json"), stat("v6after.stat.json")
if not s0 or not s1 or "host" not in s0 or "host" not in s1:
    bad.append("no backend stat around test 6")
else:
    s0, s1 = {**s0["host"], "vms": s0.get("vms", [])}, {**s1["host"], "vms": s1.get("vms", [])}
    r = sum(v - s0["cm"]["cm_tx_retries"].get(k, 0) for k, v in s1["cm"]["cm_tx_retries"].items())
    if r:
        bad.append(f"pvcm-backend: {r} retries")
    drops = {k: v - s0.get(g, {}).get(k, 0) for g in ("drops", "device_drops")
             for k, v in s1.get(g, {}).items() if v - s0.get(g, {}).get(k, 0)}
    if drops:
        bad.append(f"pvcm-backend drops: {drops}")
    ptx = {m: v - s0["cm"]["cm_tx_msgs"].get(m, 0) for m, v in s1["cm"]["cm_tx_msgs"].items()}
    krx = {m: ka.get(f"cm_rx_msgs/{m}", 0) - kb.get(f"cm_rx_msgs/{m}", 0) for m in ptx}
    ktx = {m: ka.get(f"cm_tx_msgs/{m}", 0) - kb.get(f"cm_tx_msgs/{m}", 0) for m in ptx}
    for m, sent in ptx.items():
        if sent != krx[m]:
            bad.append(f"{m}: pvcm sent {sent}, the kernel CM took {krx[m]}")
    fig.write("IPv6: pvcm-backend cm_tx_msgs: " + json.dumps({m: v for m, v in ptx.items() if v}) + "\n")
    fig.write("IPv6: kernel b cm_tx_msgs:     " + json.dumps({m: v for m, v in ktx.items() if v}) + "\n")
    # The capture of br0: every RoCEv2 frame of test 6 is IPv6, between the VM and b,
    # a CM MAD to QP1, one for every frame the umad port counted for VM a6 each way.
    io = lambda s, n: next((v["figures"]["io"] for v in s.get("vms", []) if v.get("name") == n), {})
    a6tx = io(s1, "a6").get("wire_tx_frames", 0) - io(s0, "a6").get("wire_tx_frames", 0)
    a6rx = io(s1, "a6").get("wire_rx_frames", 0) - io(s0, "a6").get("wire_rx_frames", 0)
    if a6tx != sum(ptx.values()):
        bad.append(f"VM a6 sent {a6tx} frames, pvcm-backend counted {sum(ptx.values())} MADs")
    fr = frames(f"{wd}/v6.pcap")
    if fr is None:
        bad.append("no capture of br0 (dumpcap: " + read("dumpcap.log")[-200:] + ")")
    else:
        per = {}
        for fam, src, dst, cls in fr:
            per[(fam, src, dst, cls)] = per.get((fam, src, dst, cls), 0) + 1
        out6 = per.pop((6, A6, B6, 7), 0)
        in6 = per.pop((6, B6, A6, 7), 0)
        if per:
            bad.append(f"other RoCEv2 frames on br0: {per}")
        if not out6 or out6 != a6tx:
            bad.append(f"{out6} IPv6 CM frames {A6} -> {B6} on br0, the umad port sent {a6tx} for VM a6")
        if not in6 or in6 != a6rx:
            bad.append(f"{in6} IPv6 CM frames {B6} -> {A6} on br0, the umad port received {a6rx} for VM a6")
        fig.write(f"IPv6: br0 capture: {out6} CM MADs {A6} -> {B6}, {in6} {B6} -> {A6}, "
                  f"{len(fr) - out6 - in6} other RoCEv2 frames\n")
result("6c", bad, "IPv6 (tests 6a, 6b): 0 retries and 0 duplicates on both sides, no drops, every pvcm MAD taken by the kernel CM, every frame on br0 an IPv6 RoCEv2 CM MAD between the VM and the kernel")

# 7: a VM added and removed at runtime
add, run, rm = read("a.t7add.out"), read("a.t7.out"), read("a.t7rm.out")
bad = []
if "add_rc=0" not in add or '"name":"d"' not in add.replace(" ", ""):
    bad.append(f"vm add failed or d not listed: {add[-300:]!r}")
if "rc=0" not in run or "established 100" not in run or "failed 0" not in run:
    bad.append(f"the runtime VM's cmtime: {run[-300:]!r}")
if "remove_rc=0" not in rm or '"name":"d"' in rm.replace(" ", ""):
    bad.append(f"vm remove failed or d still listed: {rm[-300:]!r}")
result("7", bad, "a VM added at runtime to the umad port (vm add) set up and tore down 100 connections with the kernel CM, then left (vm remove)")

for t, b, text in sorted(res, key=lambda x: x[0]):
    print(("FAIL  " if b else "PASS  ") + t + ": " + ("; ".join(b) if b else text))
PY
touch "$share/flag.stop"
grep -q '^FAIL' "$results" && exit 1
exit 0
