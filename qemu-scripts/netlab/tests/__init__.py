"""Unit tests of netlab's pure parts (addresses, parsers of tool output, the suites'
checks) against outputs captured from real runs (fixtures/). From qemu-scripts:

    python3 -m unittest discover -s netlab/tests -t .
"""
