"""The results of the lab's test suites (smoke, apps, cli_via_service): one line per
check, "PASS  NAME: DETAIL" or "FAIL  NAME: DETAIL", the format of every real-VM
suite's summary (qemu-scripts/lib.sh, results_report).

result() prints the line and, when PVCM_RESULT_LINES names a file (the suite's script,
netlab-smoke.sh or apps.sh, sets it), appends it there; the script prints the summary
from that file.
"""

import os

results = []


def result(name, ok, detail=""):
    """Record and print one check; returns ok."""
    results.append(bool(ok))
    line = f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}"
    print(line, flush=True)
    path = os.environ.get("PVCM_RESULT_LINES")
    if path:
        with open(path, "a") as f:
            f.write(line.replace("\n", " ") + "\n")
    return ok


def counts():
    """(passed, failed) so far."""
    return results.count(True), results.count(False)
