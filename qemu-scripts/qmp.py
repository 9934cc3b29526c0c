#!/usr/bin/env python3
"""Drive a QEMU QMP socket (run-vm.sh --qmp PATH) for the e2e migration test.

  qmp.py SOCKET migrate URI [TIMEOUT]  start a live migration to URI (the destination runs
                                       with run-vm.sh --incoming URI), wait until it
                                       completes, print query-migrate's final figures as
                                       JSON; exit 1 if it fails or times out
  qmp.py SOCKET quit                   stop QEMU
  qmp.py SOCKET status                 print query-status as JSON
"""
import json
import socket
import sys
import time


class Qmp:
    def __init__(self, path, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.s.connect(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.f = self.s.makefile("rw")
        self.read()  # greeting
        self.cmd("qmp_capabilities")

    def read(self):
        while True:
            line = self.f.readline()
            if not line:
                raise EOFError("QMP socket closed")
            msg = json.loads(line)
            if "event" not in msg:
                return msg

    def cmd(self, name, **args):
        self.f.write(json.dumps({"execute": name, "arguments": args}) + "\n")
        self.f.flush()
        r = self.read()
        if "error" in r:
            raise RuntimeError(f"{name}: {r['error']}")
        return r.get("return")


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    q = Qmp(sys.argv[1])
    what = sys.argv[2]
    if what == "migrate":
        uri = sys.argv[3]
        timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 120.0
        q.cmd("migrate", uri=uri)
        deadline = time.monotonic() + timeout
        while True:
            st = q.cmd("query-migrate")
            status = st.get("status")
            if status == "completed":
                print(json.dumps(st))
                return 0
            if status in ("failed", "cancelled"):
                print(json.dumps(st))
                print(f"migration {status}: {st.get('error-desc', '')}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(json.dumps(st))
                print("migration timed out", file=sys.stderr)
                return 1
            time.sleep(0.1)
    if what == "quit":
        try:
            q.cmd("quit")
        except (EOFError, OSError):
            pass
        return 0
    if what == "status":
        print(json.dumps(q.cmd("query-status")))
        return 0
    print(f"unknown command {what}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
