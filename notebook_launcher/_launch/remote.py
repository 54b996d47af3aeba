"""The kernel's end of the nodes: agents that connect, and the ranks they run for us.

One kernel drives every node of a job (a single controller). On each node an agent
(:mod:`notebook_launcher._agent`, started by a scheduler or by hand) connects to the
:class:`AgentHub`, proves it holds the job's secret (:mod:`notebook_launcher._wire.agent`),
and from then on starts and stops that node's ranks when told, relaying everything they
say. :class:`RemoteGroup` is a :class:`~notebook_launcher._launch.group.WorkerGroup` whose
ranks live on those nodes: the same ``start / pump / terminate / send / close`` and the same
callbacks, so whatever drives a local group (a launch, a session) drives a remote one::

    kernel                                   node i (agent)                 rank r
      AgentHub.wait_for(n) <-- connect, handshake, NodeHello
      RemoteGroup.start() --- Start(specs, task) --> WorkerGroup.start() --> fork
        pump() <=========== Batch(events, Output, FromRank, ===== pump() <== control, pipes
                            RankStarted, RankExited)
        send(proc, msg) --- ToRank(r, msg) -------> group.send(r, msg) ----> control
        terminate() ------- Terminate -------------> SIGTERM, SIGKILL after grace
        close() ----------- CloseRanks ------------> kill, reap --> RanksClosed
      AgentHub.close() ---- Leave ------------------> exits (what started it ends)

The ranks join one process group on a TCPStore the kernel holds on 127.0.0.1, behind an
authenticating proxy on the hub's interface (``master_addr:master_port``); each agent
forwards its ranks' store clients there (:mod:`notebook_launcher._wire.store`). An agent whose connection ends takes its ranks
with it (they die with their parent): they are reported as died, naming the node and why.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import secrets
import select
import selectors
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _placement
from .._events import PHASES, Event, LaunchStarted, RankStacks, WorkerPhase, WorkerStarted
from .._posix import deferred_interrupts
from .._spec import WorkerSpec
from .._wire import agent as wire
from .._wire.control import Raised, Returned
from .._wire.refusals import Refusals
from .._wire.store import StoreProxy
from ..errors import ClusterError, PreflightError, RankFailure
from . import preflight
from .forkserver import warm_modules
from .plan import LaunchPlan, rank_specs
from .rendezvous import endpoint_text

log = logging.getLogger("notebook_launcher.cluster")
#: Refused connections logged one by one; then one line per REFUSED_SUMMARY_EVERY seconds.
REFUSED_LOGGED = 10
REFUSED_SUMMARY_EVERY = 10.0
#: Refused connections kept in ``AgentHub.refused`` (the last ones).
REFUSED_KEPT = 200

#: Seconds an agent has to finish its handshake once connected.
HANDSHAKE_TIMEOUT = 5.0
#: Seconds the nodes' agents have to report their ranks' exits after CloseRanks.
CLOSE_TIMEOUT = 10.0
#: Seconds an agent has, beyond the ranks' own time, to send the stacks it took.
STACKS_GRACE = 1.0
#: What a rank's error says when a value it read from the store does not decode (a C++
#: string or buffer of a garbage length): see RemoteGroup._store_hint.
_UNDECODABLE = ("basic_string", "_M_create", "bad_alloc", "length_error", "bad_array_new_length")

#: Seconds a node's agent has, once told to stop its ranks (after their grace period), to
#: report their ends; then the node is named as not answering and the stop as unconfirmed.
STOP_ANSWER = 5.0


@dataclass
class RemoteNode:
    """One node's agent, as the kernel knows it."""

    index: int
    link: wire.Link
    hello: wire.NodeHello
    #: why the agent is gone (its connection ended, it said so), once it is
    gone: str | None = None
    #: what the agent said about ending, before its connection ended, and why (typed)
    ending: str = ""
    end_reason: wire.Ending | None = None

    @property
    def label(self) -> str:
        return f"node {self.index} ({self.host})" if self.host else f"node {self.index}"

    @property
    def host(self) -> str:
        return self.hello.labels.get("node") or self.hello.host

    def drain(self) -> bool:
        """Read what the agent said while nothing listened: that it is ending (``ending``).
        False when its connection ended (or failed its check: see :meth:`lost`)."""
        if self.gone is not None:
            return True  # (its link may be closed: nothing to read)
        poller = select.poll()
        poller.register(self.link.fileno(), select.POLLIN)
        while poller.poll(0):
            messages = self.link.read()
            for message in messages or ():
                if isinstance(message, wire.AgentEnding):
                    self.ending, self.end_reason = message.why, message.reason
            if messages is None or self.link.failed is not None:
                return False
        return True

    def lost(self) -> str:
        """Why its connection is of no more use: tampered with (a frame failed its check,
        and the kernel closes it), or ended."""
        if self.link.failed is not None:
            return tampered(self.link.failed)
        return self.ending or "its connection ended"


def tampered(why: str) -> str:
    """What a node's connection that failed its check is called, wherever it is noticed."""
    return (
        f"its connection was tampered with: {why}; something on the network between this "
        "kernel and the node changes what they send. The kernel closed that connection"
    )


@dataclass
class _Pending:
    """A connection that has not proven the secret yet."""

    sock: socket.socket
    peer: str
    nonce: bytes
    deadline: float
    reader: wire.PlainReader = field(default_factory=wire.PlainReader)


class AgentHub:
    """The kernel's listener for one job's agents, and the agents that joined.

    A fresh secret per hub; :meth:`write_secret` puts it in a file only the user can read,
    :meth:`secret_env` gives it for a child's environment. Never printed, never in a repr.
    ``refused`` lists (and the ``notebook_launcher.cluster`` logger warns about) the
    connections that were turned away, with why: a flood is summed up, not logged line by
    line.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        job: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.job = job or uuid.uuid4().hex[:12]
        self.handshake_timeout = handshake_timeout
        self._secret = secrets.token_bytes(32)
        self.nodes: dict[int, RemoteNode] = {}
        #: why connections were turned away (the last REFUSED_KEPT kept; see
        #: _wire.refusals: the first REFUSED_LOGGED logged one by one, then a flood in a
        #: line per REFUSED_SUMMARY_EVERY seconds, so that a port scan does not fill the cell)
        self.refusals = Refusals(
            log,
            "refused a connection from %s: %s",
            "refused %d more connection(s) (%d in all; the last: %s)",
            one_by_one=REFUSED_LOGGED,
            kept=REFUSED_KEPT,
            every=REFUSED_SUMMARY_EVERY,
        )
        self._pending: dict[int, _Pending] = {}
        self._selector = selectors.DefaultSelector()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind((host, port))
            self._listen.listen(64)
            self._listen.setblocking(False)
        except OSError as exc:
            self._listen.close()
            raise ClusterError(
                f"cannot listen for the nodes' agents on {host}:{port} ({exc}). Pass the "
                "address of an interface the nodes reach (host=...), and a free port (or 0)."
            ) from None
        self._selector.register(self._listen, selectors.EVENT_READ, None)
        self.host = host
        self.port = self._listen.getsockname()[1]
        self.closed = False

    def __repr__(self) -> str:
        return f"<AgentHub {self.host}:{self.port} job={self.job} nodes={sorted(self.nodes)}>"

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # -- the secret, out of band -------------------------------------------------------------

    def write_secret(self, path: str) -> str:
        """Write the secret to ``path``, readable by this user only (0600, created so: never
        readable by anyone else, even for a moment)."""
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self._secret.hex().encode())
        finally:
            os.close(fd)
        return path

    def store_proxy(self, store_port: int) -> StoreProxy:
        """The proxy in front of the ranks' store (on 127.0.0.1:``store_port``), on the
        hub's interface: it lets through only the connections that prove the job's secret
        (each node's agent forwards its ranks' store clients there)."""
        return StoreProxy(self.host, store_port, self._secret)

    def secret_env(self) -> dict[str, str]:
        """The secret for the environment of a child that starts agents (a job step)."""
        return {wire.SECRET_ENV: self._secret.hex()}

    # -- agents joining ------------------------------------------------------------------------

    def wait_for(
        self,
        count: int,
        timeout: float,
        check: Callable[[], None] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> list[RemoteNode]:
        """Accept agents until nodes ``0 .. count-1`` have all joined; then stop listening.

        ``check()`` runs every half second and may raise (the job that should start them
        ended); ``tick()`` keeps a view alive. Raises :class:`ClusterError` naming the
        missing nodes after ``timeout`` seconds. Ctrl-C works while waiting.
        """
        deadline = time.monotonic() + timeout
        while len([i for i in self.nodes if i < count]) < count:
            now = time.monotonic()
            if now >= deadline:
                missing = [i for i in range(count) if i not in self.nodes]
                raise ClusterError(
                    f"node(s) {missing} did not join within {timeout:g} s: their agents never "
                    f"connected to {self.address}"
                    + (f" (refused: {'; '.join(self.refused[-3:])})" if self.refused else "")
                )
            self.serve(min(0.5, deadline - now), count)
            if check is not None:
                check()
            if tick is not None:
                tick()
        self.stop_listening()
        return [self.nodes[i] for i in range(count)]

    def serve(self, timeout: float, count: int) -> None:
        """Accept, and advance every pending handshake, for up to ``timeout`` seconds."""
        next_deadline = min((p.deadline for p in self._pending.values()), default=None)
        if next_deadline is not None:
            timeout = max(0.0, min(timeout, next_deadline - time.monotonic()))
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._accept()
            else:
                self._advance(key.data, count)
        now = time.monotonic()
        for pending in list(self._pending.values()):
            if now >= pending.deadline:
                self._refuse(pending, f"no handshake within {self.handshake_timeout:g} s")

    def _accept(self) -> None:
        assert self._listen is not None
        while True:
            try:
                sock, addr = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return
                raise
            sock.setblocking(False)
            hello, nonce = wire.challenge()
            try:
                sock.send(hello)
            except OSError:
                sock.close()
                continue
            peer = f"{addr[0]}:{addr[1]}"
            pending = _Pending(sock, peer, nonce, time.monotonic() + self.handshake_timeout)
            self._pending[sock.fileno()] = pending
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _advance(self, pending: _Pending, count: int) -> None:
        try:
            data = pending.sock.recv(wire.MAX_PLAIN_FRAME)
        except BlockingIOError:
            return
        except OSError as exc:
            self._refuse(pending, f"connection failed ({exc})", answer=False)
            return
        if not data:
            self._refuse(pending, "closed the connection during the handshake", answer=False)
            return
        try:
            payload = pending.reader.feed(data)
            if payload is None:
                return
            claim, nonce_a, text = wire.check_answer(self._secret, pending.nonce, payload)
        except wire.AuthError as exc:
            self._refuse(pending, str(exc))
            return
        why = self._claim_problem(claim, count)
        if why is not None:
            self._refuse(pending, why)
            return
        self._join(pending, claim, nonce_a, text)

    def _claim_problem(self, claim: dict[str, Any], count: int) -> str | None:
        if claim.get("job") != self.job:
            return f"an agent of another job ({claim.get('job')!r}, this is {self.job!r})"
        node = claim.get("node")
        if not isinstance(node, int) or not -1 <= node < count:
            return f"an agent claiming node {node!r} (this job has nodes 0..{count - 1})"
        if node in self.nodes:
            taken = self.nodes[node]
            return f"a second agent claiming node {node}, which {taken.hello.host} (pid {taken.hello.pid}) holds"
        if node == -1 and len(self.nodes) >= count:
            return f"an extra agent: all {count} nodes have joined"
        return None

    def _join(self, pending: _Pending, claim: dict[str, Any], nonce_a: bytes, text: bytes) -> None:
        sock = pending.sock
        self._forget(pending)
        sock.setblocking(True)
        try:
            sock.sendall(wire.accepted(self._secret, pending.nonce, nonce_a, text))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.keepalive(sock)
        except OSError as exc:
            sock.close()
            self.refusals.note(pending.peer, f"connection failed after the handshake ({exc})")
            return
        key = wire.session_key(self._secret, pending.nonce, nonce_a)
        link = wire.kernel_link(sock, key)
        try:
            hello = self._first_message(link, pending.reader.rest())
        except ClusterError as exc:
            link.close()
            self.refusals.note(pending.peer, str(exc))
            return
        node = (
            claim["node"]
            if claim["node"] >= 0
            else min(set(range(len(self.nodes) + 1)) - set(self.nodes))
        )
        self.nodes[node] = RemoteNode(node, link, hello)
        log.info("%s joined from %s (pid %s)", self.nodes[node].label, pending.peer, hello.pid)

    def _first_message(self, link: wire.Link, rest: bytes) -> wire.NodeHello:
        messages = link.receive(rest) if rest else []
        deadline = time.monotonic() + self.handshake_timeout
        while not messages:
            if link.failed is not None:
                raise ClusterError(tampered(link.failed))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ClusterError("the agent sent nothing after its handshake")
            link.sock.settimeout(remaining)
            try:
                data = link.sock.recv(1 << 16)
            except TimeoutError:
                continue
            finally:
                link.sock.settimeout(None)
            if not data:
                raise ClusterError("the agent closed the connection after its handshake")
            messages = link.receive(data)
        if link.failed is not None:
            raise ClusterError(tampered(link.failed))
        hello = messages[0]
        if not isinstance(hello, wire.NodeHello):
            raise ClusterError(f"the agent's first message was a {type(hello).__name__}")
        return hello

    def _refuse(self, pending: _Pending, why: str, answer: bool = True) -> None:
        self._forget(pending)
        if answer:
            try:
                pending.sock.send(wire.refused(why))
            except OSError:
                pass
        pending.sock.close()
        self.refusals.note(pending.peer, why)

    @property
    def refused(self) -> list[str]:
        """The last refusals, ``peer: why``."""
        return self.refusals.last

    @property
    def refused_count(self) -> int:
        """Connections refused in all (``refused`` keeps the last ones only)."""
        return self.refusals.count

    def _forget(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock.fileno(), None)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def stop_listening(self) -> None:
        """Every node joined: nothing else may connect."""
        for pending in list(self._pending.values()):
            self._refuse(pending, "the job's nodes have all joined")
        self.refusals.flush()
        if self._listen is not None:
            self._selector.unregister(self._listen)
            self._listen.close()
            self._listen = None

    # -- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Tell every agent to leave, and close every connection. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.stop_listening()
        for node in self.nodes.values():
            if node.gone is None:
                node.link.send(wire.Leave())
            node.link.close()
        self._selector.close()


# --- ranks on the nodes -------------------------------------------------------------------------


@dataclass
class RemoteRank:
    """A rank on another node: what :class:`~notebook_launcher._launch.group.WorkerProcess`
    says of a local one, as the node's agent reports it."""

    rank: int
    node: RemoteNode
    pid: int = 0
    returncode: int | None = None
    result: bytes | None = None
    failure: RankFailure | None = None
    exc_data: bytes | None = None
    stage: str = "starting"
    note: str = ""
    #: its agent (or we, for a node gone) had sent it SIGTERM or SIGKILL
    signalled: bool = False
    #: why its end was not reported (its node's agent did not answer)
    unconfirmed: str = ""
    #: why it never started (its node refused it, or was gone before it started): then it
    #: has no pid and no exit status
    never_started: str = ""

    @property
    def exited(self) -> bool:
        return self.returncode is not None or bool(self.never_started)

    @property
    def host(self) -> str:
        return self.node.host

    @property
    def conn_open(self) -> bool:
        return self.node.gone is None and not self.exited

    def send_signal(self, sig: int) -> None:
        if not self.exited and self.node.gone is None:
            self.node.link.send(wire.Signal(self.rank, int(sig)))

    def interrupt(self) -> None:
        """SIGINT to the rank's main thread (where a session's task runs)."""
        if not self.exited and self.node.gone is None:
            self.node.link.send(wire.Signal(self.rank, int(signal.SIGINT), main_thread=True))


class RemoteGroup:
    """Ranks on the nodes of an :class:`AgentHub`: a ``WorkerGroup`` across machines.

    ``specs`` are every rank's, each on node ``spec.node_rank``. Callbacks as
    ``WorkerGroup``'s: ``on_event(event)`` for events and output lines,
    ``on_exit(rank)`` once per rank that ended, and ``on_message(rank, message)`` for the
    control messages that are not events (else a rank's Returned/Raised is kept on it).
    """

    def __init__(
        self,
        nodes: list[RemoteNode],
        specs: list[WorkerSpec],
        task: bytes | None,
        on_event: Callable[[Event], None],
        on_exit: Callable[[Any], None],
        grace: float = 1.0,
        on_message: Callable[[Any, Any], None] | None = None,
        attempt: int = 0,
        explain: Callable[[], str] | None = None,
    ) -> None:
        """``explain()``: what the scheduler says of the job, asked when an agent ends or
        goes (the scheduler's words: ``Cluster.job_state``)."""
        self.nodes = nodes
        self._explain = explain
        self.specs = specs
        self.start_method = "agent"
        self._task = task
        self._on_event, self._on_exit, self._on_message = on_event, on_exit, on_message
        self.grace = grace
        self.attempt = attempt
        by_index = {n.index: n for n in nodes}
        self.procs = [RemoteRank(s.rank, by_index[s.node_rank]) for s in specs]
        self._by_rank = {p.rank: p for p in self.procs}
        self._selector = selectors.DefaultSelector()
        self._wake: int | None = None
        self._closed_nodes: set[int] = set()
        self._closed = False
        #: stacks asked of the nodes: request -> node -> its answer (see stall_ranks)
        self._stacks: dict[int, dict[int, wire.StacksOf]] = {}
        self._stacks_cond = threading.Condition()
        self._requests = itertools.count(1)
        self._pumping: threading.Thread | None = None
        #: where the ranks' store is (for what a rank that read garbage from it is told)
        self._store = (specs[0].master_addr, specs[0].master_port) if specs else None
        #: when the nodes told to stop must have reported their ranks' ends
        self._stop_by: float | None = None
        #: rank -> why its end is not confirmed (its node's agent did not answer)
        self.unconfirmed: dict[int, str] = {}

    # -- start -------------------------------------------------------------------------------

    def start(self, on_abort: Callable[[BaseException], None] | None = None) -> None:
        """Ask every node's agent to start its ranks (it answers as they come up). Ctrl-C
        meanwhile: ``on_abort(error)`` is told, and the ranks asked for so far are closed
        (``WorkerGroup.start``'s contract)."""
        try:
            with deferred_interrupts():  # a Start is sent whole or not at all
                for node in self.nodes:
                    if node.gone is not None:
                        self._node_gone(node, node.gone)
                        continue
                    self._drain_stale(node)
                    specs = tuple(s for s in self.specs if s.node_rank == node.index)
                    setup = wire.NodeSetup(specs, self.attempt, self.grace)
                    node.link.send(wire.Start(setup, self._task, warm_modules()))
                    self._selector.register(node.link.fileno(), selectors.EVENT_READ, node)
        except BaseException as exc:
            if on_abort is not None:
                on_abort(exc)
            self.close()
            raise

    def _drain_stale(self, node: RemoteNode) -> None:
        """What the agent said while no group listened (it may be ending)."""
        if not node.drain():
            self._node_gone(node, node.lost())

    def send(self, proc: RemoteRank, message: Any) -> bool:
        if not proc.conn_open:
            return False
        proc.node.link.send(wire.ToRank(proc.rank, message))
        return True

    # -- pump ----------------------------------------------------------------------------------

    @property
    def running(self) -> list[RemoteRank]:
        return [p for p in self.procs if not p.exited]

    @property
    def finished(self) -> bool:
        return all(p.exited for p in self.procs)

    def proc(self, rank: int) -> RemoteRank:
        return self._by_rank[rank]

    def pump(self, timeout: float | None, wake: int | None = None) -> None:
        """Wait up to ``timeout`` for any node to speak; handle all that is there."""
        if wake is not None and wake != self._wake:
            if self._wake is not None:
                self._selector.unregister(self._wake)
            self._selector.register(wake, selectors.EVENT_READ, "wake")
            self._wake = wake
        if not self._selector.get_map():
            return
        self._pumping = threading.current_thread()
        for key, _ in self._selector.select(timeout):
            if key.data == "wake":
                continue
            node: RemoteNode = key.data
            messages = node.link.read() if node.gone is None else None
            for message in messages or ():  # what was verified before a frame that failed
                self._handle(node, message)
            if messages is None or node.link.failed is not None:
                self._node_gone(node, node.lost())
        if self._stop_by is not None and time.monotonic() >= self._stop_by:
            self._silent_after_stop()

    def _silent_after_stop(self) -> None:
        """The nodes that still have ranks running after being told to stop them are named
        as not answering (stopped, swapping, unreachable), and left: their ranks' ends are
        unconfirmed (an agent that wakes up finds its kernel gone and ends them)."""
        waited = self.grace + STOP_ANSWER
        for node in self._live_nodes():
            running = [p for p in self.procs if p.node is node and not p.exited]
            if running:
                why = (
                    f"did not answer within {waited:g} s of being told to stop its ranks "
                    "(its agent is stopped or swapping, or the node is unreachable)"
                )
                self._unanswered(node, why)

    def _unanswered(self, node: RemoteNode, why: str) -> None:
        for p in self.procs:
            if p.node is node and not p.exited:
                p.unconfirmed = self.unconfirmed[p.rank] = f"{node.label} {why}"
        self._node_gone(node, why, stopped=True)

    def _handle(self, node: RemoteNode, message: Any) -> None:
        if isinstance(message, wire.Batch):
            for item in message.items:
                self._item(item)
        elif isinstance(message, wire.RanksClosed):
            self._closed_nodes.add(node.index)
        elif isinstance(message, wire.StacksOf):
            with self._stacks_cond:
                if message.request in self._stacks:
                    self._stacks[message.request][node.index] = message
                    self._stacks_cond.notify_all()
        elif isinstance(message, wire.AgentEnding):
            node.ending = self._with_reason(message.why)
            node.end_reason = message.reason

    def _with_reason(self, why: str) -> str:
        said = self._explain() if self._explain is not None else ""
        return f"{why}; {said}" if said else why

    def _item(self, item: Any) -> None:
        if isinstance(item, wire.RankStarted):
            self.proc(item.rank).pid = item.pid
        elif isinstance(item, wire.FromRank):
            proc = self.proc(item.rank)
            message = item.message
            if isinstance(message, Raised):  # the record names the rank's host
                failure = dataclasses.replace(
                    message.failure, host=proc.host, message=self._store_hint(proc, message)
                )
                message = dataclasses.replace(message, failure=failure)
            if self._on_message is not None:
                self._on_message(proc, message)
            elif isinstance(message, Returned):
                proc.result = message.data
            elif isinstance(message, Raised):
                proc.failure, proc.exc_data = message.failure, message.exc_data
        elif isinstance(item, wire.RankExited):
            proc = self.proc(item.rank)
            if proc.exited:
                return
            proc.pid = proc.pid or item.pid
            proc.returncode, proc.stage, proc.note = item.returncode, item.stage, item.note
            proc.signalled = item.signalled
            if item.returncode < 0 and proc.node.ending and not proc.note:
                proc.note = f"{proc.node.label}: {proc.node.ending}"
            self._on_exit(proc)
        else:  # an event or an output line
            if isinstance(item, WorkerStarted):
                self.proc(item.rank).stage = "running"
            elif isinstance(item, WorkerPhase) and self.proc(item.rank).stage != "running":
                self.proc(item.rank).stage = PHASES.get(item.phase, item.phase)
            self._on_event(item)

    def _store_hint(self, proc: RemoteRank, raised: Raised) -> str:
        """A rank that failed joining its group on something that reads like a value of the
        store that does not decode (gloo's peer addresses are C++ strings): say that the
        store may have been written to by something else than the job's ranks."""
        message = raised.failure.message
        if proc.stage != PHASES["joining"] or not any(sign in message for sign in _UNDECODABLE):
            return message
        address = endpoint_text(*self._store) if self._store else "the kernel's store"
        return (
            f"{message} -- while joining its process group it read a value from the job's "
            f"store ({address}) that does not decode: something other than this job's ranks "
            "may have written there (possible tampering: the nodes reach the store only "
            "through forwarders that prove the job's secret, but a program of this machine's "
            "users can reach it on 127.0.0.1; see the README's Security section)"
        )

    def _node_gone(self, node: RemoteNode, why: str, stopped: bool = False) -> None:
        """The agent's connection ended (or was tampered with, and ends now): its ranks
        died with it (``stopped``: we had told them to stop)."""
        if node.gone is None:
            plain = node.ending or node.link.failed is not None
            node.gone = why if plain else self._with_reason(why)
            node.link.close()
            if node.link.failed is not None:
                log.error("%s: %s", node.label, node.gone)
        try:
            self._selector.unregister(node.link.fileno())
        except (KeyError, ValueError, OSError):
            pass
        for proc in self.procs:
            if proc.node is node and not proc.exited:
                if proc.pid == 0:  # the agent never said it started: no process to tell of
                    proc.never_started = _refused_or_gone(node)
                else:
                    proc.returncode = -int(signal.SIGKILL)
                    proc.note = f"{node.label}'s agent is gone: {node.gone}"
                proc.signalled = self._closed or stopped  # (we were stopping them)
                self._on_exit(proc)

    # -- where the ranks are (the stall view) ----------------------------------------------------

    def stall_ranks(self, ranks: Any = None) -> RemoteStacks:
        """The running ranks (of ``ranks``), whose stacks each node's agent takes."""
        return RemoteStacks(self, None if ranks is None else frozenset(ranks))

    def take_stacks(self, ranks: frozenset[int] | None, timeout: float) -> Any:
        """Ask every node that runs some of ``ranks`` for their stacks, and wait (pumping,
        when this thread is the one that pumps; else for the pump to hear the answers)."""
        nodes = {
            p.node.index: p.node
            for p in self.running
            if p.node.gone is None and (ranks is None or p.rank in ranks)
        }
        request = next(self._requests)
        with self._stacks_cond:
            self._stacks[request] = {}
        wanted = tuple(sorted(ranks)) if ranks is not None else None
        for node in nodes.values():
            node.link.send(wire.TakeStacks(request, wanted, timeout))
        deadline = time.monotonic() + timeout + STACKS_GRACE
        try:
            while True:
                with self._stacks_cond:
                    got = self._stacks[request]
                    if set(got) >= set(nodes) or time.monotonic() >= deadline:
                        break
                    if self._pumping is not threading.current_thread():
                        self._stacks_cond.wait(max(0.0, deadline - time.monotonic()))
                        continue
                self.pump(max(0.0, min(0.05, deadline - time.monotonic())))
        finally:
            with self._stacks_cond:
                got = self._stacks.pop(request, {})
        stacks = tuple(s for answer in got.values() for s in answer.stacks)
        flight = tuple(line for answer in got.values() for line in answer.flight)
        silent = {p.rank for p in self.running if p.node.index in set(nodes) - set(got)} & (
            set(ranks) if ranks is not None else {p.rank for p in self.procs}
        )
        waited = timeout + STACKS_GRACE
        stacks += tuple(
            RankStacks(
                rank,
                self.proc(rank).pid,
                error=f"did not answer within {waited:g}s: {self.proc(rank).node.label}'s "
                "agent sent nothing (stopped or swapping, or the node is unreachable)",
            )
            for rank in sorted(silent)
        )
        return tuple(sorted(stacks, key=lambda s: s.rank)), flight

    # -- stop ------------------------------------------------------------------------------------

    def terminate(self) -> None:
        """Tell every node to stop its ranks (SIGTERM, SIGKILL after the grace period);
        a node that then reports nothing within :data:`STOP_ANSWER` more seconds is named
        as not answering (see :meth:`pump`)."""
        for node in self._live_nodes():
            node.link.send(wire.Terminate())
        if self._stop_by is None:
            self._stop_by = time.monotonic() + self.grace + STOP_ANSWER

    def stop(self) -> None:
        try:
            self.terminate()
            deadline = time.monotonic() + self.grace + 5.0
            while not self.finished and time.monotonic() < deadline:
                self.pump(0.05)
        finally:
            self.close()

    def close(self) -> None:
        """Kill what is left on every node and wait (bounded) for their exits. The agents
        stay for the next group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        waiting = [n for n in self._live_nodes() if n.index not in self._closed_nodes]
        for node in waiting:
            node.link.send(wire.CloseRanks())
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while any(n.index not in self._closed_nodes and n.gone is None for n in waiting):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.pump(min(remaining, 0.5))
        for node in waiting:
            if node.index not in self._closed_nodes and node.gone is None:
                self._unanswered(node, f"did not answer to close within {CLOSE_TIMEOUT:g} s")
        for proc in self.running:  # never left unreported
            proc.returncode = -int(signal.SIGKILL)
            proc.note = proc.note or f"{proc.node.label} did not report its end"
            proc.signalled = True
            self.unconfirmed.setdefault(proc.rank, proc.note)
            self._on_exit(proc)
        self._selector.close()

    def _live_nodes(self) -> list[RemoteNode]:
        return [n for n in self.nodes if n.gone is None]


#: How an agent that refuses to start its node's ranks begins to say why (``_agent.serve``).
_COULD_NOT_START = "its ranks could not start: "


def _refused_or_gone(node: RemoteNode) -> str:
    """Why a rank of ``node`` never started: the node refused it (its agent said why), or
    was gone before it started."""
    if node.end_reason is wire.Ending.COULD_NOT_START:
        why = node.ending.removeprefix(_COULD_NOT_START)
        return f"{node.label} refused to start it: {why}"
    return f"{node.label} was gone before it started: {node.gone}"


@dataclass
class ClusterPlan(LaunchPlan):
    """A launch on the nodes of a cluster: every rank of the job is planned here (one
    controller), each attempt on the kernel's store under a prefix of its own."""

    nodes: list[RemoteNode] = field(default_factory=list)
    #: the secret root of the job's keys in the store (see :func:`plan_cluster`)
    store_key: str = field(default="", repr=False)
    launch_no: int = 0
    #: what the scheduler says of the job (see RemoteGroup)
    explain: Callable[[], str] | None = None
    #: told when the run on these nodes ended (the cluster's ``_after_run``)
    on_finished: Callable[[], None] | None = None

    def finished(self) -> None:
        if self.on_finished is not None:
            self.on_finished()

    def for_attempt(self, job: Any, attempt: int) -> list[WorkerSpec]:
        prefix = f"{self.store_key}/l{self.launch_no}/a{attempt}/pg"
        return [
            dataclasses.replace(spec, store_prefix=prefix, restart_count=attempt)
            for spec in self.specs
        ]

    def started_event(self, job: Any = None, line_prefix: str | None = None) -> LaunchStarted:
        event = super().started_event(None, line_prefix)
        by_index = {n.index: n.host for n in self.nodes}
        hosts = tuple(by_index[s.node_rank] for s in self.specs)
        return dataclasses.replace(event, hosts=hosts, node_rank=-1)

    def group(
        self,
        specs: list[WorkerSpec],
        task: Any,
        listen: socket.socket | None,
        on_event: Callable[..., None],
        on_exit: Callable[..., None],
        on_message: Callable[..., None] | None = None,
        attempt: int = 0,
    ) -> RemoteGroup:
        return RemoteGroup(
            self.nodes,
            specs,
            task,
            on_event,
            on_exit,
            self.grace_period,
            on_message,
            attempt,
            self.explain,
        )


@dataclass(frozen=True)
class Spelling:
    """How a rank count is written where the user typed it, for the hints of
    :func:`cluster_ranks`: Python's ``num_processes=4`` (the default) or ``%dist start``'s
    ``-n 4``."""

    #: no rank count given
    unset: str = "num_processes=None"
    #: a rank count ("{}": the number)
    count: str = "num_processes={}"
    #: the cluster's GPUs per node ("{}": the number)
    gpus: str = "gpus_per_node={}"
    #: a cluster without GPUs
    no_gpus: str = "gpus_per_node=0"


def cluster_ranks(
    num_processes: Any,
    nodes: int,
    gpus_per_node: int,
    spelling: Spelling = Spelling(),
    devices: Any = "auto",
) -> tuple[int, int]:
    """(ranks in all, ranks per node) of a launch or session on ``nodes`` nodes of
    ``gpus_per_node`` GPUs: everything it needs is known before a job is submitted, so it
    is checked then (a queue is a long wait to be told to add ``-n``).

    >>> cluster_ranks(None, 2, 4), cluster_ranks(6, 3, 0)
    ((8, 4), (6, 2))
    >>> cluster_ranks(None, 2, 0, Spelling(unset="no -n", count="-n {}", no_gpus="no GPU asked"))
    Traceback (most recent call last):
    notebook_launcher.errors.PreflightError: no -n means one rank per GPU, and the cluster has no GPUs (no GPU asked). Say how many ranks in all, a multiple of its 2 node(s): e.g. -n 4.
    """
    __tracebackhide__ = True
    say = spelling
    if num_processes is None:
        if not gpus_per_node:
            raise PreflightError(
                f"{say.unset} means one rank per GPU, and the cluster has no GPUs "
                f"({say.no_gpus}). Say how many ranks in all, a multiple of its "
                f"{nodes} node(s): e.g. {say.count.format(2 * nodes)}."
            )
        num_processes = gpus_per_node * nodes
    total = preflight.resolve_num_processes(num_processes, 0)
    if total % nodes:
        raise PreflightError(
            f"{say.count.format(total)} does not split evenly over the cluster's {nodes} nodes: "
            f"ask for a multiple of {nodes} "
            f"(e.g. {say.count.format(nodes * max(1, round(total / nodes)))})."
        )
    per_node = total // nodes
    if total > preflight.MAX_WORLD:
        raise PreflightError(
            f"{say.count.format(total)}: one kernel drives {preflight.MAX_WORLD:,} ranks at "
            "most. Ask for fewer."
        )
    # more ranks than GPUs share them (devices="auto", as on one machine); "gpu" refuses
    if gpus_per_node and per_node > gpus_per_node and _placement.check_devices(devices) == "gpu":
        raise PreflightError(
            f"{say.count.format(total)} is {per_node} ranks per node, but the nodes have "
            f"{say.gpus.format(gpus_per_node)}, and devices='gpu' asks for one rank per GPU: "
            f"at most {gpus_per_node * nodes} in all (or devices='auto' to share them)."
        )
    return total, per_node


def plan_cluster(
    nodes: list[RemoteNode],
    store: tuple[str, int],
    store_key: str,
    launch_no: int,
    num_processes: int | None,
    gpus_per_node: int,
    *,
    mixed_precision: str = "no",
    grace_period: Any = 1.0,
    max_restarts: int = 0,
    session: bool = False,
    explain: Callable[[], str] | None = None,
    devices: Any = "auto",
) -> ClusterPlan:
    """Check a launch on a cluster's ``nodes`` and plan every rank of it. Its groups' keys
    in the ``store`` (the kernel's proxy in front of it: each node's agent forwards its
    ranks there, proving the job's secret) begin with ``store_key``: a secret of the cluster
    (it travels only in the sealed Start frames), so that whatever else reaches the store --
    torch's TCPStore authenticates nobody, and it listens on this machine's 127.0.0.1 --
    cannot name the keys the ranks will read, to poison them."""
    grace = preflight.check_grace_period(grace_period)
    count = len(nodes)
    total, per_node = cluster_ranks(num_processes, count, gpus_per_node, devices=devices)
    wanted = _placement.check_devices(devices)
    # every node is placed alike (the agents said how many GPUs each has)
    where = _placement.place(
        _placement.Inventory.of_count(gpus_per_node, "agent"),
        per_node,
        wanted,
        world_size=total,
        given=devices,
    )
    precision = preflight.check_mixed_precision(mixed_precision, where.on_gpu)
    prefix = f"{store_key}/l{launch_no}/a0/pg"  # each launch and session: a group of its own
    specs = [
        spec
        for node in nodes
        for spec in rank_specs(
            where,
            first_rank=node.index * per_node,
            world_size=total,
            node_rank=node.index,
            num_nodes=count,
            store=store,
            precision=precision,
            threads=None,
            method="agent",
            store_prefix=prefix,
            max_restarts=max_restarts,
            session=session,
        )
    ]
    hosts = ", ".join(n.host for n in nodes)
    return ClusterPlan(
        specs,
        "agent",
        f"{count} nodes ({hosts}), {per_node} ranks each",
        None,
        count,
        0,
        grace,
        None,
        max_restarts,
        nodes=nodes,
        store_key=store_key,
        launch_no=launch_no,
        explain=explain,
    )


class RemoteStacks:
    """A cluster's ranks for the stall watch (``stall.Ranks``): the agents take the stacks."""

    def __init__(self, group: RemoteGroup, ranks: frozenset[int] | None) -> None:
        self.group = group
        self.ranks = ranks

    def alive(self) -> bool:
        return any(self.ranks is None or p.rank in self.ranks for p in self.group.running)

    def take(self, timeout: float) -> Any:
        return self.group.take_stacks(self.ranks, timeout)


__all__ = [
    "CLOSE_TIMEOUT",
    "HANDSHAKE_TIMEOUT",
    "AgentHub",
    "ClusterError",
    "RemoteGroup",
    "RemoteNode",
    "ClusterPlan",
    "RemoteRank",
    "Spelling",
    "cluster_ranks",
    "plan_cluster",
]
