"""qemu-scripts/lib.sh's parse_options, the scripts' option loop, run by bash."""

import os
import subprocess
import unittest

LIB = os.path.join(os.path.dirname(__file__), "..", "..", "lib.sh")
SCRIPT = r"""
set -euo pipefail
. "$LIB"
usage() { echo "usage text"; }
name=default files=() flag=0 calls=""
record() { calls+="[$*]"; }
parse_options --name=name '--file=files[]' --flag:flag=1 --mode:mode=fast '--hook=record()' '--bare:record()' \
    -- "$@"
echo "name=$name files=${files[*]+${files[*]}} count=${#files[@]} flag=$flag mode=${mode:-unset} calls=$calls"
"""


def run(*args, extra=""):
    p = subprocess.run(["bash", "-c", extra + SCRIPT, "script.sh", *args], capture_output=True, text=True,
                       env=dict(os.environ, LIB=LIB))
    return p.returncode, p.stdout.strip(), p.stderr.strip()


class ParseOptions(unittest.TestCase):
    def test_defaults_stay(self):
        self.assertEqual(run(), (0, "name=default files= count=0 flag=0 mode=unset calls=", ""))

    def test_each_kind(self):
        rc, out, _ = run("--name", "x y", "--file", "a", "--file", "b c", "--flag", "--mode", "--hook", "v",
                         "--bare")
        self.assertEqual(rc, 0)
        self.assertEqual(out, "name=x y files=a b c count=2 flag=1 mode=fast calls=[--hook v][--bare]")

    def test_a_value_is_the_next_word_whatever_it_is(self):
        self.assertEqual(run("--name", "--flag")[1], "name=--flag files= count=0 flag=0 mode=unset calls=")

    def test_help(self):
        self.assertEqual(run("--name", "x", "-h"), (0, "usage text", ""))
        self.assertEqual(run("--help")[:2], (0, "usage text"))

    def test_unknown_option(self):
        rc, out, err = run("--name", "x", "--nmae", "y")
        self.assertEqual((rc, out), (1, ""))
        self.assertIn("ERROR: unknown option '--nmae' (see --help)", err)
        self.assertIn("ERROR: unknown option 'stray'", run("stray")[2])

    def test_missing_value(self):
        rc, _, err = run("--flag", "--file")
        self.assertEqual(rc, 1)
        self.assertIn("ERROR: --file needs a value (see --help)", err)

    def test_the_scripts_usage_error(self):
        # A script with usage_error (run-vm.sh: exit 2) gets the errors through it.
        extra = 'usage_error() { echo "usage_error: $*" >&2; exit 2; }\n'
        self.assertEqual(run("--bogus", extra=extra), (2, "", "usage_error: unknown option '--bogus'"))

    def test_a_bad_spec_is_refused(self):
        p = subprocess.run(["bash", "-c", '. "$LIB"; usage() { :; }; parse_options --x:flag -- --x'],
                           capture_output=True, text=True, env=dict(os.environ, LIB=LIB))
        self.assertEqual(p.returncode, 1)
        self.assertIn("no action a flag option can take", p.stderr)
        p = subprocess.run(["bash", "-c", '. "$LIB"; parse_options --x=x'], capture_output=True, text=True,
                           env=dict(os.environ, LIB=LIB))
        self.assertIn("no -- after the option spec", p.stderr)


if __name__ == "__main__":
    unittest.main()
