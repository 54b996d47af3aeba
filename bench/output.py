"""What a rank's output costs the kernel: with newlines, without, and drawn with ``\\r``.

One rank writes ``N`` MiB to stdout (10, 20 and 40 by default) in 4 KiB writes: as lines,
as one endless line (no newline at all), and as progress redrawn with ``\\r``. The kernel's
CPU time for the launch (this process: it reads the pipes and splits the text) is printed
for each, with the ratio endless/lines. Linear cost means the ratio stays flat as ``N``
doubles (it was 5x, 10x, 17x before output was read in bounded pieces).

Usage::

    python bench/output.py [--mib 10 20 40]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from notebook_launcher import notebook_launcher
from notebook_launcher.ui import NullView

CHUNK = 4096


def write(mib: int, style: str) -> None:
    out = sys.stdout
    block = "x" * (CHUNK - 1)
    end = {"lines": "\n", "endless": "x", "carriage": "\r"}[style]
    for _ in range(mib * 1024 * 1024 // CHUNK):
        out.write(block + end)
    out.flush()


def kernel_cpu(mib: int, style: str) -> float:
    before = os.times()
    notebook_launcher(write, (mib, style), 1, dashboard=NullView())
    after = os.times()
    return (after.user - before.user) + (after.system - before.system)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, nargs="+", default=[10, 20, 40])
    args = parser.parse_args()
    kernel_cpu(1, "lines")  # warm up
    header = ("MiB", "lines s", "endless s", "cr s", "endless/lines")
    print("{:>4} {:>9} {:>10} {:>8} {:>14}".format(*header))
    for mib in args.mib:
        lines = kernel_cpu(mib, "lines")
        endless = kernel_cpu(mib, "endless")
        carriage = kernel_cpu(mib, "carriage")
        print(f"{mib:>4} {lines:>9.2f} {endless:>10.2f} {carriage:>8.2f} {endless / lines:>14.2f}")


if __name__ == "__main__":
    main()
