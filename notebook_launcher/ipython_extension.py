"""IPython extension loaded by the ``notebook-launcher`` kernel: the ``%nl_info`` magic.

The shipped kernelspec starts ipykernel with ``--ext=notebook_launcher.ipython_extension``;
any other IPython loads it with ``%load_ext notebook_launcher.ipython_extension``. Loading
puts nothing in the user's namespace and imports neither torch nor the launcher, so kernel
start-up stays fast; ``%nl_info`` imports them when it runs.

``%nl_info`` prints what a student needs to know before a launch: the versions in use, the
devices torch sees, how workers will be started (fork, or a forkserver once CUDA is
initialised in the kernel), and whether the next launch would pass its preflight checks (no
process group or ``PartialState`` created in the kernel itself).

Example (in a notebook)::

    %nl_info
    # notebook_launcher 0.1.0   (/path/to/notebook_launcher)
    # python            3.11.9  (/opt/venv/bin/python)
    # torch             2.13.0+cpu
    # ...
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from ._launch import preflight
from .errors import LaunchError, PreflightError

#: The magic's name (``%nl_info``).
MAGIC_NAME = "nl_info"


def info_lines() -> list[str]:
    """The report ``%nl_info`` prints, one ``name  value`` line each (imports torch)."""
    import notebook_launcher

    pkg_dir = os.path.dirname(notebook_launcher.__file__ or "")
    lines = [
        ("notebook_launcher", f"{notebook_launcher.__version__}  ({pkg_dir})"),
        ("python", f"{platform.python_version()}  ({sys.executable})"),
    ]
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        lines.append(("torch", f"not importable: {exc}"))
        return _format(lines)
    from ._placement import inventory

    found = inventory()  # never the CUDA runtime: the kernel forks the ranks
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_available() and dist.is_gloo_available()),
            ("nccl", dist.is_available() and dist.is_nccl_available()),
        )
        if ok
    ]
    method, reason = preflight.resolve_start_method(
        None, preflight.cuda_unusable_in_fork(found.count > 0)
    )
    if found.count:
        devices = f"{found.count} CUDA device(s): " + ", ".join(
            g.name or f"cuda:{g.index}" for g in found.gpus
        )
        workers = (
            f"one per GPU on NCCL (num_processes <= {found.count}); more ranks share the "
            "GPUs on gloo; devices='cpu' for CPU ranks"
        )
    else:
        devices = f"CPU only ({os.cpu_count()} cores; {found.source})"
        workers = "CPU processes, backend gloo"
    lines += [
        ("torch", torch.__version__),
        ("devices", devices),
        ("backends", ", ".join(backends) or "none (torch.distributed unavailable)"),
        ("workers", workers),
        ("start method", f"{method} ({reason})"),
        ("ready to launch", _launch_readiness()),
        ("in a worker", "yes" if os.environ.get("NOTEBOOK_LAUNCHER_WORKER") == "1" else "no"),
    ]
    return _format(lines)


def _launch_readiness() -> str:
    """``"yes"``, or the first preflight error the next launch from this kernel would raise."""
    state = sys.modules.get("notebook_launcher.state")
    try:
        preflight.check_no_process_group_in_parent()
        preflight.check_no_state_in_parent(getattr(state, "state_in_use", None))
    except PreflightError as exc:
        return f"no: {exc}"
    return "yes"


def _format(pairs: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"{k:<{width}}  {v}" for k, v in pairs]


def nl_info(line: str = "") -> None:
    """``%nl_info``: print versions, devices and how workers will start."""
    print("\n".join(info_lines()))


# --- sessions: %dist, %%distributed, %%rank ---------------------------------------------------

DIST_USAGE = """\
%dist start [-n N] [--start-method M] [--mixed-precision P] [--dashboard D] [--port P]
            [--devices auto|gpu|cpu|0,2]  (where the ranks run; auto: one per GPU, more share)
            [--stall-after SECONDS|off]   (where every rank is, after that long without progress)
            [--slurm "SBATCH OPTIONS"]    (N ranks in all on a Slurm job's nodes, e.g.
                                           --slurm "--nodes 2 --partition debug --time 10")
            [--cluster NAME]              (on the nodes of a SlurmCluster/AgentCluster here)
            [--detach]                    (the ranks outlive this kernel; prints the id)
%dist status | restart | stop            (stop: a job --slurm started ends too)
%dist stacks             where every rank is now (each thread's stack; the odd rank named)
%dist auto on|off        every following cell runs on the ranks (until off)
%dist push NAME [NAME...] [--ranks R]    notebook variables into every rank
%dist pull NAME [--ranks R]              binds NAME to the per-rank list here
%dist runs               the detached runs (notebook_launcher(..., detach=True)) and their state
%dist attach ID [--dashboard D]          follow a detached run here: its history, then live;
                                         a detached session's id: the session of the magics
%dist detach             leave a detached session running; use it no more here
%%distributed [--ranks 0,1] [--post-mortem]   a cell on the ranks (%%rank 1: on rank 1)
%rankdiff NAME [NAME...] [--ranks R]     compare values across ranks ("rng": random state)"""


def _devices_choice(text: str) -> str | list[int]:
    """``--devices cpu`` or ``--devices 0,2`` (GPU indices)."""
    if text.replace(",", "").isdigit():
        return [int(x) for x in text.split(",") if x]
    return text


class RankValues(list):
    """Each rank's value of a cell's last expression, shown one line a rank."""

    def __init__(self, ranks: list[int], values: list[Any]) -> None:
        super().__init__(values)
        self.ranks = ranks

    def __repr__(self) -> str:
        return "\n".join(f"[rank{r}] {v}" for r, v in zip(self.ranks, self, strict=True))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def parse_ranks(text: str | None) -> list[int] | None:
    """``"1"``, ``"0,2"``, ``"[0, 2]"``, ``"0-3"`` -> ranks; None for all."""
    if text is None or not text.strip() or text.strip() == "all":
        return None
    ranks: list[int] = []
    for part in text.strip().strip("[]").replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-", 1)
                ranks += range(int(lo), int(hi) + 1)
            else:
                ranks.append(int(part))
        except ValueError:
            raise UsageError(
                f"ranks {text.strip()!r}: {part!r} is not a rank; write them as 1, 0,2, 0-3 or all"
            ) from None
    return ranks


def _dashboard_choice(text: str) -> bool | str:
    """``--dashboard False`` (or ``off``, ``no``) is ``dashboard=False``; ``True`` is True."""
    lowered = text.lower()
    if lowered in ("false", "off", "no", "0"):
        return False
    if lowered in ("true", "on", "yes", "1"):
        return True
    return text


def _dist_parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog="%dist", add_help=False, exit_on_error=False)
    parser.add_argument("command", nargs="?", default="status")
    parser.add_argument("names", nargs="*")
    parser.add_argument("-n", "--num-processes", "--num_processes", type=int, default=None)
    parser.add_argument("--start-method", "--start_method", default=None)
    parser.add_argument("--mixed-precision", "--mixed_precision", default="no")
    parser.add_argument("--devices", default="auto", type=_devices_choice)
    parser.add_argument("--dashboard", default="auto", type=_dashboard_choice)
    parser.add_argument("--use-port", "--use_port", "--port", default="auto")
    parser.add_argument("--ranks", default=None)
    parser.add_argument(
        "--stall-after", "--stall_after", default=argparse.SUPPRESS, type=_seconds_or_none
    )
    parser.add_argument("--cluster", default=None)
    parser.add_argument("--detach", action="store_true")
    return parser


def _take_option(words: list[str], name: str) -> tuple[list[str], str | None]:
    """``words`` without ``name VALUE`` (or ``name=VALUE``), and the value: one whose text
    starts with ``--`` (sbatch's options) argparse would take for an option of ours."""
    out: list[str] = []
    value = None
    i = 0
    while i < len(words):
        word = words[i]
        if word == name:
            if i + 1 >= len(words):
                raise ValueError(f'{name} needs a value, e.g. {name} "--nodes 2"')
            value = words[i + 1]
            i += 2
            continue
        if word.startswith(name + "="):
            value = word[len(name) + 1 :]
        else:
            out.append(word)
        i += 1
    return out, value


def _seconds_or_none(text: str) -> float | None:
    """``--stall-after 10`` (seconds) or ``--stall-after off``."""
    return None if text.lower() in ("none", "off", "no", "false") else float(text)


class DistMagics:
    """The magics' state: the auto mode, and the cluster ``--slurm`` made; the session is
    the kernel's current one (``session.current()``)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.auto = False
        #: the cluster ``%dist start --slurm`` made (it ends with ``%dist stop``)
        self.cluster: Any = None

    @property
    def session(self) -> Any:
        """The kernel's current session, whichever way it was made (``start()``,
        ``attach(id)``, ``%dist start``, ``%dist attach``): one kernel, one session."""
        from .session import current

        return current()

    @session.setter
    def session(self, session: Any) -> None:
        from .session import make_current

        make_current(session)  # (closing, stopping or letting go of it is what ends that)

    def _need_session(self) -> Any:
        if self.session is None:
            raise UsageError("no session: start one with %dist start -n 2")
        return self.session

    @staticmethod
    def _of_session(session: Any, ranks: list[int] | None, what: str) -> list[int] | None:
        """``ranks`` (``--ranks``), every one a rank of ``session``; else a usage error that
        names the ranks there are."""
        if ranks is None:
            return None
        there = list(session.ranks)
        unknown = sorted({r for r in ranks if r not in there})
        if unknown:
            named = ", ".join(map(str, unknown))
            raise UsageError(
                f"{what}: rank{'s' if len(unknown) > 1 else ''} {named} "
                f"{'are' if len(unknown) > 1 else 'is'} not in this session, whose ranks are "
                f"{', '.join(map(str, there))}"
            )
        return ranks

    # %dist ----------------------------------------------------------------------------------

    def dist(self, line: str) -> Any:
        __tracebackhide__ = True  # a failing rank's traceback reads like the cell's own
        import shlex

        try:
            words, slurm = _take_option(shlex.split(line), "--slurm")
            args = _dist_parser().parse_args(words)
            args.slurm = slurm
        except Exception as exc:  # noqa: BLE001 - argparse errors become usage errors
            raise UsageError(f"{exc}\n{DIST_USAGE}") from None
        command = args.command
        if command == "start":
            return self._start(args)
        if command == "status":
            return self.session.status() if self.session is not None else "no session"
        if command == "stacks":
            return self._need_session().stacks()
        if command == "runs":
            from .detached import runs

            return runs()
        if command == "attach":
            from .detached import attach

            if len(args.names) != 1:
                raise UsageError("%dist attach ID (%dist runs lists the ids)")
            before = self.session
            found = attach(args.names[0], dashboard=args.dashboard)
            if hasattr(found, "detach") and hasattr(found, "run_cell"):  # a session's id
                if getattr(before, "id", None) != found.id and _running(before):
                    from .session import let_go

                    let_go(found)  # attach made it current: the one before stays so
                    self._check_no_session()
                self.session = found  # what %%distributed & co. use from now on
                return None
            return found
        if command == "detach":
            detach = getattr(self.session, "detach", None)
            if detach is None:
                raise UsageError(
                    "%dist detach: no detached session here (start one with "
                    "%dist start -n 2 --detach, or %dist attach ID)"
                )
            detach()  # (no longer the current session)
            self.auto_mode(False)
            return None
        if command == "restart":
            self._need_session().restart()  # says that the variables are lost
            return None
        if command == "stop":
            said = []
            session = self.session
            if session is not None:
                try:
                    ranks = f"{session.world_size} ranks"
                except LaunchError:  # no ranks to count (a restart that failed, a dead one)
                    ranks = "its ranks"
                session.close()  # (no longer the current session)
                detached = getattr(session, "id", None)
                said.append(
                    f"session {detached} stopped: {ranks} and its supervisor ended, its "
                    "record removed"
                    if detached
                    else f"session stopped: {ranks} ended"
                )
            if self.cluster is not None:  # the job %dist start --slurm submitted ends
                self.cluster.close()
                self.cluster = None
                said.append("the Slurm job %dist start --slurm submitted ended")
            self.auto_mode(False)
            print("; ".join(said) if said else "no session to stop")
            return None
        if command == "auto":
            if args.names not in ([], ["on"], ["off"]):
                raise UsageError(f"%dist auto on|off, not {' '.join(args.names)!r}")
            self.auto_mode(args.names != ["off"])
            return None
        if command == "push":
            session = self._need_session()
            missing = [n for n in args.names if n not in self.shell.user_ns]
            if missing or not args.names:
                raise UsageError(f"%dist push NAME...: not defined here: {missing}")
            some = self._of_session(session, parse_ranks(args.ranks), f"%dist {line}")
            session.push(ranks=some, **{n: self.shell.user_ns[n] for n in args.names})
            return None
        if command == "pull":
            session = self._need_session()
            if len(args.names) != 1:
                raise UsageError("%dist pull NAME")
            name = args.names[0]
            some = self._of_session(session, parse_ranks(args.ranks), f"%dist {line}")
            self.shell.user_ns[name] = session.pull(name, ranks=some)
            return None
        raise UsageError(f"unknown %dist command {command!r}\n{DIST_USAGE}")

    def _start(self, args: Any) -> Any:
        from .session import start

        self._check_no_session()
        cluster = self._cluster(args)
        if cluster is not None:
            self._check_ranks(args, cluster)
        try:
            self.session = start(
                args.num_processes,
                start_method=args.start_method,
                mixed_precision=args.mixed_precision,
                dashboard=args.dashboard,
                use_port=args.use_port,
                cluster=cluster,
                devices=args.devices,
                detach=args.detach,
                **({"stall_after": args.stall_after} if hasattr(args, "stall_after") else {}),
            )
        except BaseException:
            if cluster is not None and cluster is self.cluster:  # ours: its job ends
                cluster.close()
                self.cluster = None
            raise
        return self.session.status()

    def _check_no_session(self) -> None:
        if _running(self.session):
            raise UsageError(
                "a session runs already: %dist restart, %dist stop (or %dist detach, for a "
                "detached one) first"
            )

    def _check_ranks(self, args: Any, cluster: Any) -> None:
        """The rank count against the cluster's nodes and GPUs, before a job is submitted
        (a queue is a long wait to be told to add ``-n``), in this magic's words."""
        import shlex

        from ._launch.remote import Spelling, cluster_ranks

        if args.slurm is not None:
            options = f'"{args.slurm}"' if '"' not in args.slurm else shlex.quote(args.slurm)
            where = f"--slurm {options}"
        else:
            where = f"--cluster {args.cluster}"
        spelling = Spelling(
            unset="%dist start without -n",
            count=f"%dist start -n {{}} {where}",
            gpus="--gpus-per-node {}" if args.slurm is not None else "gpus_per_node={}",
            no_gpus="no --gpus-per-node in --slurm"
            if args.slurm is not None
            else "gpus_per_node=0",
        )
        try:
            cluster_ranks(
                args.num_processes,
                cluster.num_nodes,
                cluster.gpus_per_node,
                spelling,
                devices=args.devices,
            )
        except PreflightError as exc:
            if cluster is self.cluster and not cluster.running:
                self.cluster = None  # made for this line: nothing was submitted
            raise UsageError(str(exc)) from None

    def _cluster(self, args: Any) -> Any:
        """The cluster a session starts on: ``--slurm "OPTIONS"`` makes one (this magic's:
        ``%dist stop`` ends its job), ``--cluster NAME`` takes the notebook's."""
        if args.slurm is not None and args.cluster is not None:
            raise UsageError("--slurm or --cluster, not both")
        if args.cluster is not None:
            cluster = self.shell.user_ns.get(args.cluster)
            if cluster is None or not hasattr(cluster, "nodes_for_launch"):
                raise UsageError(
                    f"--cluster {args.cluster}: no SlurmCluster/AgentCluster of that name"
                )
            return cluster
        if args.slurm is None:
            return None
        from .cluster import SlurmCluster

        if self.cluster is None or not self.cluster.running:
            try:
                self.cluster = SlurmCluster.from_sbatch(args.slurm)
            except ValueError as exc:
                raise UsageError(f"--slurm {args.slurm!r}: {exc}") from None
        return self.cluster

    def auto_mode(self, on: bool) -> None:
        cleanup = self.shell.input_transformers_cleanup
        if on and self._to_distributed not in cleanup:
            self._need_session()
            cleanup.append(self._to_distributed)
        elif not on and self._to_distributed in cleanup:
            cleanup.remove(self._to_distributed)
        self.auto = on

    def _to_distributed(self, lines: list[str]) -> list[str]:
        """Auto mode: every cell becomes a ``%%distributed`` cell (not magics, not empty)."""
        first = next((x for x in lines if x.strip()), "")
        if not first or first.lstrip().startswith(("%", "!")):
            return lines
        return ["%%distributed\n", *lines]

    def rankdiff(self, line: str) -> Any:
        """``%rankdiff model optimizer [--ranks 0,1]``: :meth:`Session.compare`."""
        __tracebackhide__ = True
        import shlex

        try:
            words = shlex.split(line)
        except ValueError as exc:  # an unclosed quote
            raise UsageError(
                f"%rankdiff {line}: {exc}\n%rankdiff NAME [NAME...] [--ranks 0,1]"
            ) from None
        ranks = None
        if "--ranks" in words:
            at = words.index("--ranks")
            if at + 1 >= len(words):
                raise UsageError("%rankdiff NAME [NAME...] [--ranks 0,1]")
            ranks = parse_ranks(words[at + 1])
            del words[at : at + 2]
        if not words:
            raise UsageError("%rankdiff NAME [NAME...]: which variables to compare")
        session = self._need_session()
        return session.compare(*words, ranks=self._of_session(session, ranks, f"%rankdiff {line}"))

    # %%distributed, %%rank -----------------------------------------------------------------

    def _raw_cell(self) -> str | None:
        """The cell that runs, as typed (``%%distributed`` line included), from IPython's
        history: its tracebacks then count lines as the editor does. None when the magic
        was not called from a cell of its own (a silent execution, a call from code)."""
        history = getattr(self.shell, "history_manager", None)
        raw = getattr(history, "input_hist_raw", None)
        count = getattr(self.shell, "execution_count", None)
        if not raw or not isinstance(count, int) or len(raw) != count:
            return None  # the newest entry is not the cell that runs
        return str(raw[-1])

    def distributed(self, line: str, cell: str) -> Any:
        __tracebackhide__ = True
        import argparse
        import shlex

        parser = argparse.ArgumentParser(prog="%%distributed", add_help=False, exit_on_error=False)
        parser.add_argument("--ranks", "--rank", default=None)
        parser.add_argument("--post-mortem", "--post_mortem", action="store_true")
        try:
            args = parser.parse_args(shlex.split(line))
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"{exc}\n{DIST_USAGE}") from None
        return self._cell(cell, parse_ranks(args.ranks), args.post_mortem)

    def rank(self, line: str, cell: str) -> Any:
        __tracebackhide__ = True
        ranks = parse_ranks(line)
        if ranks is None:
            raise UsageError("%%rank N (or %%rank 0,2): which ranks run the cell")
        return self._cell(cell, ranks, post_mortem=False)

    def _cell(self, cell: str, ranks: list[int] | None, post_mortem: bool) -> Any:
        __tracebackhide__ = True
        session = self._need_session()
        ranks = self._of_session(session, ranks, "the cell's ranks")
        raw = self._raw_cell()
        try:
            return self._run(session, cell, raw, ranks, post_mortem)
        except SyntaxError as exc:  # the cell's own: from here, not from deep inside
            raise exc.with_traceback(None) from None

    def _run(
        self, session: Any, cell: str, raw: str | None, ranks: list[int] | None, post_mortem: bool
    ) -> Any:
        __tracebackhide__ = True
        if post_mortem:
            if not ranks or len(ranks) != 1:
                raise UsageError(
                    "--post-mortem needs one rank: %%distributed --ranks 1 --post-mortem"
                )
            value = session.post_mortem(ranks[0], cell, _raw_cell=raw)
            return RankValues(ranks, [value]) if value is not None else None
        values = session.run_cell(cell, ranks=ranks, _raw_cell=raw)
        shown = ranks if ranks is not None else session.ranks
        if all(v is None for v in values):
            return None
        return RankValues(shown, values)


def _running(session: Any) -> bool:
    """``session`` is there and not closed (a detached one whose supervisor is gone is)."""
    try:
        return session is not None and session.status().state != "closed"
    except LaunchError:
        return False


def _usage_error() -> type[Exception]:
    try:
        from IPython.core.error import UsageError as error
    except ImportError:  # pragma: no cover - IPython is a dependency of ipykernel
        return ValueError
    return error


UsageError = _usage_error()
_magics: DistMagics | None = None


def load_ipython_extension(ip: Any) -> None:
    """Called by IPython on ``%load_ext`` (and by the kernelspec's ``--ext``)."""
    global _magics
    ip.register_magic_function(nl_info, magic_kind="line", magic_name=MAGIC_NAME)
    _magics = DistMagics(ip)
    ip.register_magic_function(_magics.dist, magic_kind="line", magic_name="dist")
    ip.register_magic_function(_magics.distributed, magic_kind="cell", magic_name="distributed")
    ip.register_magic_function(_magics.rank, magic_kind="cell", magic_name="rank")
    ip.register_magic_function(_magics.rankdiff, magic_kind="line", magic_name="rankdiff")


def unload_ipython_extension(ip: Any) -> None:
    """Called by IPython on ``%unload_ext``: remove the magics again (and the session)."""
    ip.magics_manager.magics["line"].pop(MAGIC_NAME, None)
    ip.magics_manager.magics["line"].pop("dist", None)
    ip.magics_manager.magics["cell"].pop("distributed", None)
    ip.magics_manager.magics["cell"].pop("rank", None)
    ip.magics_manager.magics["line"].pop("rankdiff", None)
    if _magics is not None:
        _magics.auto_mode(False)
        if _magics.session is not None:  # a detached one goes on
            getattr(_magics.session, "detach", _magics.session.close)()


__all__ = [
    "MAGIC_NAME",
    "DistMagics",
    "RankValues",
    "info_lines",
    "load_ipython_extension",
    "nl_info",
    "parse_ranks",
]
