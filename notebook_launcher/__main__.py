"""Command line: ``python -m notebook_launcher <command>`` (also installed as ``notebook-launcher``).

Commands:

``install-kernel [--user | --sys-prefix | --prefix P] [--name NAME]``
    Install the "Python 3 (notebook_launcher)" kernelspec for this interpreter: ipykernel
    with the project's IPython extension loaded. Default: ``--sys-prefix`` inside a virtual
    environment, ``--user`` otherwise. Then ``jupyter kernelspec list`` shows it.

``demo [--num-processes N] [--steps S]``
    Train a tiny model on N CPU ranks (synthetic data, a few seconds) and print every
    rank's loss and a checksum of its weights: equal checksums show the ranks stayed in sync.

Example::

    python -m notebook_launcher install-kernel --sys-prefix
    python -m notebook_launcher demo --num-processes 2
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _in_virtualenv() -> bool:
    return sys.prefix != getattr(sys, "base_prefix", sys.prefix)


def _install_kernel(args: argparse.Namespace) -> int:
    from ._kernelspec import DISPLAY_NAME, install

    if args.prefix is not None:
        path = install(prefix=args.prefix, kernel_name=args.name)
    elif args.sys_prefix or (not args.user and _in_virtualenv()):
        path = install(prefix=sys.prefix, kernel_name=args.name)
    else:
        path = install(user=True, kernel_name=args.name)
    print(f"Installed kernelspec {args.name!r} ({DISPLAY_NAME}) in {path}")
    print(f"It runs {sys.executable} with the notebook_launcher IPython extension loaded.")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import os

    from ._demo import run_demo

    # The demo is the CPU path: hide GPUs before torch looks for them (this process only).
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    return run_demo(num_processes=args.num_processes, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    from ._kernelspec import KERNEL_NAME

    parser = argparse.ArgumentParser(
        prog="python -m notebook_launcher",
        description="Notebook-first distributed execution for PyTorch.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    kernel = commands.add_parser(
        "install-kernel",
        help="install the 'Python 3 (notebook_launcher)' Jupyter kernel for this interpreter",
        description="Install the Jupyter kernelspec: ipykernel for this interpreter with the "
        "notebook_launcher IPython extension (%nl_info) loaded. Default: --sys-prefix "
        "inside a virtual environment, --user otherwise.",
    )
    where = kernel.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user")
    where.add_argument(
        "--sys-prefix",
        action="store_true",
        help=f"install into this environment ({sys.prefix})",
    )
    where.add_argument("--prefix", metavar="P", help="install into P/share/jupyter/kernels")
    kernel.add_argument("--name", default=KERNEL_NAME, help=f"kernel name (default {KERNEL_NAME})")
    kernel.set_defaults(func=_install_kernel)

    demo = commands.add_parser(
        "demo",
        help="train a tiny model on CPU ranks and print each rank's result",
        description="Train a tiny model on N CPU ranks (synthetic data) and print each "
        "rank's loss and weights checksum.",
    )
    demo.add_argument("-n", "--num-processes", type=int, default=2, metavar="N")
    demo.add_argument("--steps", type=int, default=200, metavar="S", help="optimizer steps")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m notebook_launcher`` and the ``notebook-launcher`` script."""
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
