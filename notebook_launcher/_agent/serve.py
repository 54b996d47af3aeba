"""The agent's life: connect, serve the kernel's requests, relay what the ranks say, leave.

One loop, one thread (the link's writer aside): it waits on the kernel's connection and,
while ranks run, on everything they send (``WorkerGroup.pump`` with the connection as its
wake fd). What the ranks said in one turn goes up as one :class:`~notebook_launcher._wire.
agent.Batch`.

The agent forks its ranks itself: it is a fresh interpreter that imported torch and the
rank modules before connecting and never runs a torch op or starts CUDA, so ``fork`` is safe
and fast here (the kernel's own fork checks are about the kernel). The task arrives as
bytes and is unpickled in the rank, never in the agent.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._events import MetricsLogged, Output, ProgressUpdate
from .._launch import preflight, stall
from .._launch.group import WorkerGroup, WorkerProcess
from .._launch.plan import FORK_PRELOAD, threads_per_rank
from .._posix import close_in_children, import_without_cuda
from .._wire import agent as wire
from .._wire.control import Raised, Returned
from .._wire.store import StoreForwarder
from ..errors import RankFailure

#: Seconds a turn of the loop waits when nothing happens (a pending SIGTERM is seen then).
TURN = 0.5
#: Seconds the agent gathers chatty items (output lines, progress, metrics) before it sends
#: them as one Batch: a rank printing 100 lines/s cost the kernel a frame per line. Anything
#: else (a rank started, returned, raised, exited; a barrier) is sent at once.
COALESCE = 0.02
_CHATTY = (Output, ProgressUpdate, MetricsLogged)

#: Bytes of a frame beside a rank's pickled result (the Batch and FromRank around it).
FRAME_MARGIN = 4096

#: The exit status of an agent that could not join (bad secret, unreachable kernel).
EXIT_CANNOT_JOIN = 2
#: The exit status of an agent whose connection to the kernel was tampered with.
EXIT_TAMPERED = 3


class Agent:
    """One node's agent, after it joined the kernel's hub."""

    def __init__(self, link: wire.Link, secret: bytes = b"", on_sigterm: str = "") -> None:
        """``on_sigterm``: what a SIGTERM means where this agent runs, in words (what
        started it says: ``--on-sigterm``)."""
        self.link = link
        self._secret = secret
        self.on_sigterm = on_sigterm
        #: this node's ranks reach the kernel's store through it (made at the first Start)
        self.forwarder: StoreForwarder | None = None
        self.group: WorkerGroup | None = None
        self.batch: list[Any] = []
        #: when the batch's oldest chatty item came (None: nothing waits)
        self._chatty_since: float | None = None
        #: the batch holds something that is not chatty: send it now
        self._urgent = False
        #: why the agent ends on its own (its SIGTERM, tampering), in words and typed
        self.ending: str | None = None
        self.reason = wire.Ending.TERMINATED
        self._announced = False

    # -- the loop ------------------------------------------------------------------------------

    def serve(self, first: bytes) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the kernel's
        # A forked rank must not hold the kernel's connection (the kernel would not see it
        # end when the agent goes) -- nor its writer's lock, which it never touches.
        link_fd = self.link.fileno()
        close_in_children(link_fd)
        pending = self.link.receive(first) if first else []
        selector = selectors.DefaultSelector()
        selector.register(link_fd, selectors.EVENT_READ)
        try:
            while True:
                for message in pending:  # what was verified before a frame that failed
                    if self._handle(message) is False:
                        return 0
                pending = []
                if self.link.failed is not None:
                    return self._tampered(self.link.failed)
                if self.forwarder is not None and self.forwarder.tampered is not None:
                    return self._store_tampered(self.forwarder.tampered)
                if self.ending is not None:
                    return self._end()
                if self.group is not None and not self.group._closed:
                    self.group.pump(self._turn(), wake=link_fd)
                    if self._due():
                        self._flush()
                    ready = _readable(selector)
                else:
                    ready = bool(selector.select(TURN))
                if ready:
                    messages = self.link.read()
                    if messages is None and self.link.failed is not None:
                        return self._tampered(self.link.failed)
                    if messages is None:  # the kernel is gone: so are we
                        self._close_ranks()
                        return 0
                    pending = messages
        finally:
            selector.close()
            self._close_ranks()
            if self.forwarder is not None:
                self.forwarder.close()
            self.link.close()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.reason = wire.Ending.TERMINATED
        said = f": {self.on_sigterm}" if self.on_sigterm else ""
        self.ending = f"its agent got SIGTERM{said}"

    def _tampered(self, why: str) -> int:
        """A frame from the kernel failed its check: nothing more from it is trusted. The
        ranks stop and the agent leaves, telling the kernel why first (what it sends is still
        sealed: the kernel can check it)."""
        self.reason = wire.Ending.TAMPERED
        self.ending = (
            f"its agent left: the connection from the kernel was tampered with ({why}); "
            "something on the network between them changes what they send"
        )
        return self._leave_tampered(
            f"the kernel's connection was tampered with ({why}): stopping this node's ranks "
            "and leaving"
        )

    def _store_tampered(self, why: str) -> int:
        """The kernel's end of the store's connection failed its proof: this node's ranks
        cannot meet the others safely. They stop and the agent leaves, saying why."""
        self.reason = wire.Ending.TAMPERED
        self.ending = (
            f"its agent left: the connection to the ranks' store failed its authentication "
            f"({why}): something on the network between this node and the kernel changes "
            "what they send, or another program answers at the store's address (tampering)"
        )
        return self._leave_tampered(self.ending)

    def _leave_tampered(self, said: str) -> int:
        """Say it on the node's log, tell the kernel why (``ending``), stop the ranks."""
        print(
            f"notebook_launcher agent on {socket.gethostname()}: {said}",
            file=sys.stderr,
            flush=True,
        )
        self._flush()
        self._close_ranks()
        return EXIT_TAMPERED

    def _end(self) -> int:
        """Say why we end, stop the ranks, report their exits, leave."""
        self._flush()
        if self.group is not None:
            self.group.stop()  # SIGTERM, SIGKILL after the grace period; their exits reported
        self._close_ranks()
        return 128 + signal.SIGTERM

    # -- requests ----------------------------------------------------------------------------

    def _handle(self, message: Any) -> bool:
        if isinstance(message, wire.Start):
            return self._start(message)
        elif isinstance(message, wire.ToRank):
            if self.group is not None:
                self.group.send(self.group.proc(message.rank), message.message)
        elif isinstance(message, wire.Signal):
            self._signal(message)
        elif isinstance(message, wire.TakeStacks):
            self._stacks(message)
        elif isinstance(message, wire.Terminate):
            if self.group is not None:
                self.group.terminate()
        elif isinstance(message, wire.CloseRanks):
            self._close_ranks()
            self.link.send(wire.RanksClosed())
        elif isinstance(message, wire.Leave):
            self._close_ranks()
            return False
        return True

    def _start(self, message: wire.Start) -> bool:
        """Start this node's ranks; False (the agent leaves, saying why) when this node
        cannot hold them (the kernel cannot know its cores and memory)."""
        self._close_ranks()  # a new attempt: nothing of the last one is left
        setup = message.setup
        too_many = preflight.capacity_problem(len(setup.specs), "this node")
        if too_many is not None:
            self.link.send(
                wire.AgentEnding(
                    f"its ranks could not start: {too_many}", wire.Ending.COULD_NOT_START
                )
            )
            return False
        try:
            via = self._store_via(setup.specs)
        except OSError as exc:
            self.link.send(
                wire.AgentEnding(
                    f"its ranks could not start: cannot listen for their store clients "
                    f"on 127.0.0.1 ({exc})",
                    wire.Ending.COULD_NOT_START,
                )
            )
            return False
        specs = [_on_this_node(s, len(setup.specs), via) for s in setup.specs]
        import_without_cuda(message.warm)  # (once: what the kernel has, the ranks inherit)
        group = WorkerGroup(
            specs,
            "fork",
            message.task,
            None,
            self._event,
            self._exited,
            setup.grace_period,
            self._message,
        )
        self.group = group
        try:
            group.start()
        except BaseException as exc:  # noqa: BLE001 - the kernel must hear why
            self.link.send(
                wire.AgentEnding(f"its ranks could not start: {exc!r}", wire.Ending.COULD_NOT_START)
            )
        for proc in group.procs:
            self._add(wire.RankStarted(proc.rank, proc.pid))
        self._flush()
        return True

    def _store_via(self, specs: tuple[Any, ...]) -> tuple[str, int] | None:
        """This node's forwarder to the kernel's store proxy (``master_addr:master_port``
        of the specs), made once: the address the ranks' store clients connect to."""
        if not specs or specs[0].store_prefix is None:
            return None
        proxy = (specs[0].master_addr, specs[0].master_port)
        if self.forwarder is None or self.forwarder.proxy != proxy:
            if self.forwarder is not None:
                self.forwarder.close()
            self.forwarder = StoreForwarder(proxy, self._secret)
        return self.forwarder.address

    def _stacks(self, message: wire.TakeStacks) -> None:
        """Where this node's ranks are, read here (their fault handlers write to files only
        this node can read)."""
        stacks: tuple[Any, ...] = ()
        flight: tuple[tuple[int, str], ...] = ()
        if self.group is not None:
            try:
                ranks = stall.of_group(self.group, message.ranks)
                if ranks.alive():
                    stacks, flight = ranks.take(message.timeout)
            except Exception:  # noqa: BLE001 - the kernel then says this node did not answer
                pass
        self.link.send(wire.StacksOf(message.request, stacks, flight))

    def _signal(self, message: wire.Signal) -> None:
        if self.group is None:
            return
        try:
            proc = self.group.proc(message.rank)
        except KeyError:
            return
        if message.main_thread:
            proc.interrupt()
        else:
            proc.send_signal(message.signum)

    def _event(self, event: Any) -> None:
        self._add(event)

    def _exited(self, proc: WorkerProcess) -> None:
        self._add(
            wire.RankExited(
                proc.rank, proc.pid, proc.returncode or 0, proc.stage, proc.note, proc.signalled
            )
        )

    def _message(self, proc: WorkerProcess, message: Any) -> None:
        if isinstance(message, Returned) and len(message.data) > wire.MAX_FRAME - FRAME_MARGIN:
            message = _too_large(proc, message)
        self._add(wire.FromRank(proc.rank, message))

    def _add(self, item: Any) -> None:
        self.batch.append(item)
        if not isinstance(item, _CHATTY):
            self._urgent = True

    def _due(self) -> bool:
        """Send the batch now: it holds something other than chatty items, or the oldest
        chatty one waited ``COALESCE`` seconds."""
        if not self.batch:
            return False
        if self._urgent:
            return True
        if self._chatty_since is None:
            self._chatty_since = time.monotonic()
        return time.monotonic() - self._chatty_since >= COALESCE

    def _turn(self) -> float:
        if self._chatty_since is None:
            return TURN
        return max(0.0, self._chatty_since + COALESCE - time.monotonic())

    def _flush(self) -> None:
        if self.ending is not None and not self._announced:  # before the exits it explains
            self._announced = True
            self.link.send(wire.AgentEnding(self.ending, self.reason))
        self._chatty_since, self._urgent = None, False
        if self.batch:
            items, self.batch = self.batch, []
            try:
                self.link.send(wire.Batch(items))
            except ValueError:  # together larger than a frame: each goes on its own
                for item in items:
                    self.link.send(wire.Batch([item]))

    def _close_ranks(self) -> None:
        if self.group is not None:
            self.group.close()  # reports every exit through _exited
            self.group = None
            self._flush()


def _too_large(proc: WorkerProcess, message: Returned) -> Raised:
    """A result no frame to the kernel can carry: the rank's failure, never a lost value
    (the rank would end as if it returned None)."""
    size = len(message.data)
    failure = RankFailure(
        proc.rank,
        "raised",
        proc.pid,
        "notebook_launcher.errors.SerializationError",
        f"the result of rank {proc.rank} is {size:,} bytes pickled, more than the connection "
        f"from its node's agent to the kernel carries in one message ({wire.MAX_FRAME:,} "
        "bytes). Return something smaller: save large results to a file the kernel can read "
        "(a shared filesystem) and return its path.",
        time=time.time(),
    )
    return Raised(failure, None, message.task)


def _on_this_node(spec: Any, local_count: int, via: tuple[str, int] | None = None) -> Any:
    """The kernel's spec, completed with what only this node knows (``via``: where its
    store client connects: this agent's forwarder)."""
    cwd = spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else os.getcwd()
    threads = threads_per_rank(local_count)  # None: this node's OMP_NUM_THREADS decides
    env = dict(spec.env)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return dataclasses.replace(
        spec, cwd=cwd, env=env, num_threads=threads, replace_environ=False, store_via=via
    )


def _readable(selector: selectors.BaseSelector) -> bool:
    return bool(selector.select(0))


# --- joining ----------------------------------------------------------------------------------


def read_secret(path: str | None, fd: int | None = None) -> bytes:
    """The job's secret, from ``path``, or from the pipe ``fd`` that
    :func:`without_secret_in_environ` handed over (then closed)."""
    if path:
        with open(path, "rb") as f:
            text = f.read().strip()
    elif fd is not None:
        with os.fdopen(fd, "rb") as f:
            text = f.read().strip()
    else:
        raise SystemExit(
            f"notebook_launcher agent: no secret: pass --secret-file F or set {wire.SECRET_ENV}"
        )
    try:
        return bytes.fromhex(text.decode())
    except ValueError:
        raise SystemExit(
            "notebook_launcher agent: the secret is not the kernel's (not hex)"
        ) from None


def without_secret_in_environ() -> None:
    """An agent given the secret in its environment (a job step's) starts again without
    it, the secret handed over on an inherited pipe (``--secret-fd``). Removing it from
    ``os.environ`` is not enough: a process's initial environment stays in its memory,
    where ``/proc/PID/environ`` shows it, and every forked rank would carry a copy. Never
    returns (it execs) when the secret is there; SystemExit when it is not."""
    value = os.environ.pop(wire.SECRET_ENV, "")
    if not value:
        read_secret(None)  # says what is missing
    read, write = os.pipe()
    try:
        os.write(write, value.encode())  # 64 bytes: a pipe holds them without a reader
    finally:
        os.close(write)
    os.set_inheritable(read, True)
    argv = [sys.executable, *sys.orig_argv[1:], "--secret-fd", str(read)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, dict(os.environ))


def expand(value: str) -> str:
    """``value``, or the variable it names (``$NAME``: what started the agent passes the
    name, the agent reads its own environment -- no shell runs between them).

    >>> os.environ["NL_DOCTEST_NODE"] = "n2"; expand("$NL_DOCTEST_NODE"), expand("n3")
    ('n2', 'n3')
    >>> del os.environ["NL_DOCTEST_NODE"]; expand("$NL_DOCTEST_NODE")
    ''
    """
    return os.environ.get(value[1:], "") if value.startswith("$") else value


def claim(job: str, node: str | int | None, labels: Sequence[str] = ()) -> dict[str, Any]:
    """Who this agent says it is: the job it serves, its node (``--node``: a number, or
    ``$NAME`` of a variable that holds it; none: -1, any node still free) and its labels
    (``KEY=VALUE`` each, a value ``$NAME`` read from the environment)."""
    try:
        index = int(expand(str(node))) if node is not None else -1
    except ValueError:
        index = -1  # (a variable that is not set: any free node)
    said = dict(label.split("=", 1) for label in labels if "=" in label)
    return {
        "job": job,
        "node": index,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "labels": {k: v for k, v in ((k, expand(v)) for k, v in said.items()) if v},
    }


def hello(claimed: dict[str, Any]) -> wire.NodeHello:
    import torch

    from .. import __version__
    from .._placement import inventory

    gpus = inventory().count  # never the CUDA runtime: the agent forks the ranks
    return wire.NodeHello(
        host=claimed["host"],
        pid=os.getpid(),
        gpus=gpus,
        python=sys.version.split()[0],
        torch=torch.__version__,
        package=__version__,
        cwd=os.getcwd(),
        labels=dict(claimed["labels"]),
    )


def preload() -> None:
    """What every rank needs, imported once here so that forked ranks start at once."""
    import torch.distributed  # noqa: F401

    # numpy.random: a kernel that uses numpy hands its random state to the ranks, which
    # would import it (~0.3 s each, all at once; numpy >= 2 loads it on first use)
    for name in (*FORK_PRELOAD, "notebook_launcher._worker.entry", "numpy.random"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # tqdm's lock holds a multiprocessing semaphore, whose first use starts multiprocessing's
    # resource tracker (a new interpreter: 200-300 ms). Made once here, every forked rank
    # inherits both, as ranks forked by a kernel do.
    try:
        import tqdm.std

        tqdm.std.TqdmDefaultWriteLock.create_mp_lock()
    except (ImportError, OSError):
        pass


def run(
    host: str,
    port: int,
    secret_file: str | None,
    job: str,
    node: str | int | None,
    secret_fd: int | None = None,
    labels: Sequence[str] = (),
    on_sigterm: str = "",
) -> int:
    """``python -m notebook_launcher agent``: join, serve, leave. The exit status says how
    it ended (0: the kernel let it go, or went away)."""
    if secret_file is None and secret_fd is None:
        without_secret_in_environ()  # execs again, the secret on a pipe
    secret = read_secret(secret_file, secret_fd)
    preload()
    claimed = claim(job, node, labels)
    try:
        link, first = wire.connect(host, port, secret, claimed)
    except (OSError, wire.AuthError) as exc:
        print(
            f"notebook_launcher agent on {claimed['host']}: cannot join the kernel at "
            f"{host}:{port}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CANNOT_JOIN
    link.send(hello(claimed))
    return Agent(link, secret, on_sigterm).serve(first)


__all__ = ["Agent", "claim", "hello", "read_secret", "run", "without_secret_in_environ"]
