"""Command line: ``python -m notebook_launcher <command>`` (also installed as ``notebook-launcher``).

Commands:

``install-kernel [--user | --sys-prefix | --prefix P] [--name NAME]``
    Install the "Python 3 (notebook_launcher)" kernelspec for this interpreter: ipykernel
    with the project's IPython extension loaded. Default: ``--sys-prefix`` inside a virtual
    environment, ``--user`` otherwise. Then ``jupyter kernelspec list`` shows it.

``demo [--num-processes N] [--steps S]``
    Train a tiny model on N CPU ranks (synthetic data, a few seconds) and print every
    rank's loss and a checksum of its weights: equal checksums show the ranks stayed in sync.

``run [--num-processes N] [--num-nodes M --node-rank R | --rdzv-backend c10d
--rdzv-endpoint HOST:PORT] [--max-restarts K] [-m] TARGET [ARGS...]``
    Run a script (``train.py``), a module (``-m pkg.train``) or a function
    (``pkg.train:main``, called with ARGS as strings) on N ranks of this machine -- and of M
    machines, this command on each -- with the launcher's failure reports and a text
    dashboard. A script that uses ``PartialState``/``Accelerator`` runs unchanged, as it
    would under ``torchrun``. Exit status: 0, 1 when a rank failed, 2 for a bad argument,
    130 when interrupted.

``agent --connect HOST:PORT --job ID [--secret-file F] [--node I] [--label K=V ...]
[--on-sigterm TEXT]``
    Serve a kernel on another machine as one node of its job: the kernel (``SlurmCluster``,
    ``RayCluster``, or ``AgentCluster`` for any other scheduler) listens at HOST:PORT and
    runs this node's ranks through the agent. The job's secret comes from F (readable by
    this user only) or from ``NOTEBOOK_LAUNCHER_AGENT_SECRET`` (the agent then starts again
    without it in its environment, which its ranks would inherit); never from the command
    line. ``--node I``: this node's index in the job (default: the next free one);
    ``--label K=V``: what the agent says of its node (``node=`` names it in the views);
    either's value may be ``$NAME``, a variable the agent reads from its own environment
    (``--node '$SLURM_NODEID'``: what a scheduler sets on each node). ``--on-sigterm``: what
    a SIGTERM to the agent means where it runs (said to the kernel when it comes).

Example::

    python -m notebook_launcher install-kernel --sys-prefix
    python -m notebook_launcher demo --num-processes 2
    python -m notebook_launcher run --num-processes 2 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


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


def _parse_conf(text: str) -> dict[str, str]:
    """``join_timeout=600,read_timeout=60`` -> a dict (torch's handlers parse the values)."""
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--rdzv-conf wants key=value pairs, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def _from_user_code(exc: BaseException) -> BaseException:
    """``exc`` with its traceback starting at the first frame of the user's code (this
    command, the launcher and runpy left out), as ``python script.py`` would show it."""
    from .errors import library_module

    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        module = library_module(tb.tb_frame.f_code.co_filename) or ""
        if not module.startswith(("notebook_launcher", "runpy")):
            break
        tb = tb.tb_next
    return exc.with_traceback(tb)


def _run(args: argparse.Namespace) -> int:
    import os
    import traceback

    from ._worker.script import run_function, run_module, run_script
    from .errors import PreflightError, RendezvousError
    from .launcher import notebook_launcher

    target, rest = args.target, list(args.args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    function: Any
    if args.module:
        function = run_module
    elif ":" in target and not os.path.exists(target):
        function = run_function
    elif os.path.isfile(target):
        function = run_script
    else:
        print(f"notebook_launcher run: no such script: {target}", file=sys.stderr)
        return 2
    try:
        results = notebook_launcher(
            function,
            (target, rest),
            num_processes=args.num_processes,
            mixed_precision=args.mixed_precision,
            use_port=args.master_port,
            master_addr=args.master_addr,
            node_rank=args.node_rank,
            num_nodes=args.num_nodes,
            rdzv_backend=args.rdzv_backend,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_conf=args.rdzv_conf,
            rdzv_id=args.rdzv_id,
            max_restarts=args.max_restarts,
            log_line_prefix_template=args.log_line_prefix_template,
            start_method=args.start_method,
            dashboard="text",
            join_timeout=args.join_timeout,
            restart_on_exception=True if args.restart_on_exception else None,
            stall_after=args.stall_after,
        )
    except KeyboardInterrupt as exc:
        for note in getattr(exc, "__notes__", []):  # where each rank was, if they were stuck
            print(note, file=sys.stderr)
        return 130
    except (PreflightError, RendezvousError) as exc:
        print(f"notebook_launcher run: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, PreflightError) else 1
    except BaseException as exc:  # noqa: BLE001 - the rank's failure, reported as a script's
        traceback.print_exception(_from_user_code(exc))
        return 1
    if function is run_function and any(r is not None for r in results):
        for rank, value in enumerate(results):
            print(f"rank {rank} returned {value!r}")
    return 0


def _agent(args: argparse.Namespace) -> int:
    from ._agent.serve import run

    host, sep, port = args.connect.rpartition(":")
    if not sep or not port.isdigit():
        print(
            f"notebook_launcher agent: --connect wants HOST:PORT, got {args.connect!r}",
            file=sys.stderr,
        )
        return 2
    return run(
        host.strip("[]"),
        int(port),
        args.secret_file,
        args.job,
        args.node,
        args.secret_fd,
        args.label,
        args.on_sigterm,
    )


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

    run = commands.add_parser(
        "run",
        help="run a script, module or module:function on N ranks (of M machines)",
        description="Run TARGET on N ranks of this machine (and of M machines: this command "
        "on each) with the launcher's failure reports and a text dashboard. TARGET is a "
        "script, a module with -m, or module:function (called with ARGS as strings).",
    )
    run.add_argument("-n", "--num-processes", "--nproc-per-node", type=int, metavar="N")
    run.add_argument("--num-nodes", "--nnodes", type=int, default=1, metavar="M")
    run.add_argument("--node-rank", type=int, default=0, metavar="R")
    run.add_argument("--master-addr", default="127.0.0.1", metavar="ADDR")
    run.add_argument("--master-port", "--use-port", default="29500", metavar="PORT")
    run.add_argument("--rdzv-backend", default="static", choices=("static", "c10d"))
    run.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT")
    run.add_argument("--rdzv-id", default="none", metavar="ID")
    run.add_argument("--rdzv-conf", type=_parse_conf, default=None, metavar="K=V,...")
    run.add_argument("--join-timeout", type=float, default=300.0, metavar="SECONDS")
    run.add_argument("--max-restarts", type=int, default=0, metavar="K")
    run.add_argument(
        "--restart-on-exception",
        action="store_true",
        help="with --max-restarts: restart on an exception too, not only on a death",
    )
    run.add_argument("--start-method", choices=("fork", "forkserver", "spawn"), default=None)
    run.add_argument("--mixed-precision", default="no", choices=("no", "fp16", "bf16"))
    run.add_argument(
        "--log-line-prefix-template",
        default=None,
        metavar="T",
        help="label of output lines, e.g. '[${rank}]:' (default [rankN])",
    )
    run.add_argument(
        "--stall-after",
        type=lambda v: None if v.lower() in ("none", "off") else float(v),
        default=30.0,
        metavar="SECONDS",
        help="after that long without progress, print where every rank is ('off': never)",
    )
    run.add_argument("-m", "--module", action="store_true", help="TARGET is a module")
    run.add_argument("target", metavar="TARGET")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    run.set_defaults(func=_run)

    agent = commands.add_parser(
        "agent",
        help="serve a kernel on another machine as one node of its job (a scheduler starts it)",
        description="Connect to a kernel's hub at HOST:PORT, prove the job's secret and run "
        "this node's ranks for it until the kernel lets it go or goes away.",
    )
    agent.add_argument("--connect", required=True, metavar="HOST:PORT")
    agent.add_argument("--job", required=True, metavar="ID", help="the job's id (not secret)")
    agent.add_argument(
        "--secret-file",
        metavar="F",
        help="the job's secret (default: env NOTEBOOK_LAUNCHER_AGENT_SECRET)",
    )
    agent.add_argument(
        "--node", default=None, metavar="I", help="this node's index (or $NAME of a variable)"
    )
    agent.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="K=V",
        help="what the agent says of its node (node=NAME names it; V may be $NAME)",
    )
    agent.add_argument(
        "--on-sigterm", default="", metavar="TEXT", help="what a SIGTERM means where it runs"
    )
    # the agent's own: the secret it read from its environment, on a pipe (see
    # _agent.serve.without_secret_in_environ)
    agent.add_argument("--secret-fd", type=int, default=None, help=argparse.SUPPRESS)
    agent.set_defaults(func=_agent)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m notebook_launcher`` and the ``notebook-launcher`` script."""
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
