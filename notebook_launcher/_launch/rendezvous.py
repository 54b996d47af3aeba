"""Nodes meeting as one job, on torch's own rendezvous (``torch.distributed.elastic``).

Used when a launch spans several nodes (one notebook or script per machine), asks for the
c10d rendezvous, or may restart its ranks (``max_restarts``). Who holds what::

    the kernel of node 0 (static), or of the node that could bind the endpoint (c10d)
      TCPStore server on the endpoint's address only: we bind the socket and hand it over
      (a store torch creates itself listens on every interface); torch's rendezvous
      handler then shares this server (``multi_tenant``)
    every node's kernel
      lobby      a key per node that arrived, so a node that never comes is named (not
                 waited for forever), and Ctrl-C works while waiting
      handler    torch's ``RendezvousHandler`` from its registry ("static" or "c10d"):
                 this node's rank in the job and the number of nodes
      exchange   each node's number of ranks -> its first global rank, the world size
      bell       a thread blocked in ``store.wait`` on this node's bell; another node
                 rings it (a failure announced, a report published) and the pump wakes
    heartbeat  a counter each kernel bumps while it pumps and waits: a node waiting for
               the others' reports takes one whose counter stopped for a node gone
    every rank, on any node
      TCPStore client to the endpoint, ``PrefixStore(<job>/a<attempt>/pg)``: its group

One attempt, as every node sees it (keys under the job's prefix; ``g`` = a node's rank)::

    a rank fails here      set a<n>/failed, ring every other node
    a<n>/failed is set     stop this node's ranks: collateral of another node's failure
    this node's ranks end  set a<n>/report/<g> (its records), ring the others
    all reports in         the same verdict on every node (diagnosis.diagnose)
    restart or not         set a<n>/decision/<g>; restart only if every node says so
    end of the job         set done/<g>; the store's holder waits for all before closing

Restarts do not meet again through the handler: the nodes stay, only the ranks start
again, under the next attempt's prefix (no 1 s polling rounds of the c10d handler).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .._posix import close_quietly
from ..errors import RankFailure, RendezvousError

#: Seconds a node waits for the other nodes' reports once an attempt failed somewhere
#: (their ranks are being stopped: this is the time to notice a node whose kernel died).
REPORT_TIMEOUT = 30.0
#: Seconds the node holding the store waits for the others to be done with it.
EXIT_TIMEOUT = 30.0
_POLL = 0.05  # seconds between two looks at the lobby (Ctrl-C stays responsive)
#: Seconds between two heartbeats of a node's kernel (it beats while it pumps and waits)...
BEAT_INTERVAL = 2.0
#: ...and without one after which the others take that node for gone.
LOST_AFTER = 20.0
#: Seconds a node's kernel may take to answer its bell (its bell thread answers at once,
#: whatever the kernel does) before the others take it for gone: a node killed while its
#: ranks train is named within seconds, not after LOST_AFTER.
ANSWER_TIMEOUT = 3.0
_NS = "notebook_launcher"


@dataclass(frozen=True)
class RendezvousConfig:
    """What the user asked for, checked (see ``preflight.check_rendezvous``)."""

    backend: str  # "static" | "c10d"
    host: str
    port: int  # 0: any free port (one node: nobody else needs to find it)
    run_id: str
    conf: dict[str, Any]
    num_nodes: int
    #: static: this node's rank; c10d: only a label (torch assigns the ranks)
    node_rank: int
    join_timeout: float

    @property
    def endpoint(self) -> str:
        return endpoint_text(self.host, self.port)


def endpoint_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class NodeInfo:
    """One node of the job, as the others learn of it."""

    group_rank: int
    nproc: int
    label: str  # "host-a (pid 12)"
    holds_store: bool = False


@dataclass
class NodeReport:
    """How one attempt ended on one node: what the others need to diagnose the job."""

    group_rank: int
    failures: list[RankFailure]
    finished_at: dict[int, float]
    #: rank -> its pickled exception (ranks that raised, not collateral)
    exc_data: dict[int, bytes | None] = field(default_factory=dict)
    stranded: Any = None  # diagnosis.Stranded | None


# --- joining ------------------------------------------------------------------------------


def join(config: RendezvousConfig, nproc: int) -> NodeJob:
    """Meet the other nodes (blocks up to ``config.join_timeout``); this node's job.

    Raises :class:`~notebook_launcher.errors.RendezvousError` naming the missing nodes
    and the endpoint when they do not all come in time.
    """
    import torch.distributed as dist

    deadline = time.monotonic() + config.join_timeout
    listen: socket.socket | None = None
    server = main = bell = handler = info = job = lobby = None
    watch = _Connection(None)  # a non-holder's watch on the holder's store
    try:
        listen = _bind(config)
        host = config.host
        port = listen.getsockname()[1] if listen is not None else config.port
        if listen is not None:
            server = dist.TCPStore(
                host,
                port,
                is_master=True,
                master_listen_fd=listen.fileno(),
                multi_tenant=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=max(60.0, config.join_timeout)),
            )
            listen.detach()  # the store closes it when it goes
            listen = None
        else:
            _wait_for_holder(config, deadline)
            watch = _store_answers(host, port, config, deadline)
        main = _client(host, port, config, deadline)
        bell = _client(host, port, config, deadline)
        lobby = Lobby(main, config, watch)
        try:
            lobby.arrive(label_for(config))
            lobby.wait_for_all(deadline)
            handler, info = _meet(config, host, port, server is not None, lobby, deadline)
            job = NodeJob(config, host, port, server, handler, main, bell)
            job.exchange(info, nproc)
        except RendezvousError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's store or handler: say what it means
            raise lobby.failed(exc) from None
        return job
    except BaseException as exc:
        if lobby is not None:  # the others need not wait for this node any more
            lobby.leave(exc, linger=server is not None)
        if listen is not None:
            listen.close()
        if job is not None:
            job.close()
        # The traceback keeps this frame (IPython keeps the last one): without these
        # references the store stops listening now, not at the next error.
        server = main = bell = handler = info = job = lobby = None
        raise
    finally:
        watch.close()


def label_for(config: RendezvousConfig, lobby: bool = True) -> str:
    """``node_rank 1 on host-a (pid 12)`` in the lobby (what the user called the node);
    ``host-a (pid 12)`` once ranked, where c10d's rank may differ from that name."""
    where = f"{socket.gethostname()} (pid {os.getpid()})"
    return f"node_rank {config.node_rank} on {where}" if lobby else where


def _bind(config: RendezvousConfig) -> socket.socket | None:
    """The listening socket of the store, when this node holds it; None when another does.

    static: node 0 holds it (a busy port is an error with several nodes). c10d: whoever can
    bind the endpoint's address holds it, as torch decides (``is_host`` in ``rdzv_conf``
    overrides). One node: always here, on a free port if the one asked for is busy.
    """
    if config.backend == "static":
        holder: bool | None = config.node_rank == 0
    else:
        given = config.conf.get("is_host")
        holder = None if given is None else str(given).lower() in ("1", "true", "yes", "y")
    if config.num_nodes == 1:
        holder = True
    if holder is False:
        return None
    try:
        infos = socket.getaddrinfo(config.host, config.port or None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RendezvousError(
            f"cannot resolve the rendezvous host {config.host!r} ({exc})."
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind(address)
        except OSError as exc:
            if config.num_nodes == 1 and exc.errno == errno.EADDRINUSE:
                sock.bind((address[0], 0, *address[2:]))
            elif holder is None and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                sock.close()
                return None  # c10d: another process holds it, or it is another machine
            else:
                raise RendezvousError(
                    f"cannot listen on the rendezvous endpoint {config.endpoint} "
                    f"({exc.strerror}): node {config.node_rank} holds the {config.backend} "
                    "rendezvous there. Choose a free port (use_port= or rdzv_endpoint=) "
                    "that every node reaches this machine on."
                ) from None
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _wait_for_holder(config: RendezvousConfig, deadline: float) -> None:
    """Wait (Ctrl-C works) until the store at the endpoint accepts connections."""
    while True:
        try:
            with socket.create_connection((config.host, config.port), timeout=1.0):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            who = "node 0" if config.backend == "static" else "no node"
            raise RendezvousError(
                f"{who} {'did not ' if who == 'node 0' else ''}hold the {config.backend} "
                f"rendezvous at {config.endpoint} within {config.join_timeout:g} s: nothing "
                "listens there. Start the launch on the machine with that address "
                + ("(node_rank=0) " if config.backend == "static" else "")
                + "with the same num_nodes and endpoint, or give it more time (join_timeout=)."
            )
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


#: Seconds the rendezvous store may take to answer a node that connected to it: a store
#: answers in milliseconds; a program that only listens on the port never does.
STORE_ANSWER_TIMEOUT = 30.0
#: What a client of torch's TCPStore sends first (its validation query and magic number),
#: then a query for the number of keys: any store answers at once (8 bytes).
_STORE_PROBE = b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x07"


def _client(host: str, port: int, config: RendezvousConfig, deadline: float) -> Any:
    """A client of the rendezvous store at ``host:port`` (see :func:`_store_answers`)."""
    import torch.distributed as dist

    _store_answers(host, port, config, deadline).close()
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=timedelta(seconds=max(60.0, config.join_timeout)),
    )


class _Connection:
    """A plain connection to the store that got its answer: while it stays open, so does
    the store; its end (readable, nothing to read) says the store went away, without a
    store call that fails (torch prints C++ frames for those)."""

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock

    def store_gone(self) -> bool:
        if self.sock is None:
            return False
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return False
            return not self.sock.recv(4096)
        except OSError:
            return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _store_answers(host: str, port: int, config: RendezvousConfig, deadline: float) -> _Connection:
    """Ask the endpoint what a store client asks first; :class:`RendezvousError` when it
    stays silent until the deadline (:data:`STORE_ANSWER_TIMEOUT` at most): another
    program holds the port. torch's own client would wait for that answer forever, deaf
    to Ctrl-C; this wait is not. Returns the connection (see :class:`_Connection`)."""
    wait = max(0.0, min(deadline - time.monotonic(), STORE_ANSWER_TIMEOUT))
    try:
        sock = socket.create_connection((host, port), timeout=max(wait, 0.1))
    except OSError as exc:
        raise RendezvousError(
            f"cannot connect to the rendezvous endpoint {config.endpoint} ({exc})."
        ) from None
    try:
        sock.sendall(_STORE_PROBE)
        end = time.monotonic() + wait
        while not select.select([sock], [], [], max(0.0, min(end - time.monotonic(), 0.2)))[0]:
            if time.monotonic() >= end:
                raise RendezvousError(
                    f"something listens on the rendezvous endpoint {config.endpoint} but "
                    f"does not answer as a rendezvous store (no answer within {wait:.3g} s): "
                    "another program holds that port. Choose a free port for the rendezvous "
                    "(use_port= or rdzv_endpoint=, the same on every node)."
                )
        answer = sock.recv(64)
    except BaseException:
        sock.close()
        raise
    if not answer:  # closed: not silence (a store of another torch version, say)
        sock.close()
        return _Connection(None)
    return _Connection(sock)


class Lobby:
    """Who has arrived, before torch's handler forms the job: a key per node, and every
    node's settings (whatever its ``rdzv_id``): nodes started with different settings are
    told so as soon as one sees the other, not after ``join_timeout``."""

    def __init__(
        self, store: Any, config: RendezvousConfig, watch: _Connection | None = None
    ) -> None:
        self.store, self.config = store, config
        self.watch = watch or _Connection(None)
        self.key = f"{_NS}/{config.run_id}/lobby"
        self.label = ""

    def settings(self) -> dict[str, Any]:
        c = self.config
        return {
            "run_id": c.run_id,
            "num_nodes": c.num_nodes,
            "backend": c.backend,
            "label": self.label,
        }

    def arrive(self, label: str) -> None:
        c = self.config
        self.label = label
        # Every node, whatever its run id, says who it is and what it was started with.
        n = self.store.add(f"{_NS}/arrivals", 1)
        self.store.set(f"{_NS}/arrival/{n}", json.dumps(self.settings()))
        self.check()
        if c.backend == "static":
            mine = f"{self.key}/node{c.node_rank}"
            taken = self.store.compare_set(mine, "", label).decode()
            if taken != label:
                raise RendezvousError(
                    f"node_rank={c.node_rank} is taken in the static rendezvous at "
                    f"{c.endpoint} by {taken}: give every node its own node_rank "
                    f"(0..{c.num_nodes - 1})."
                )
        n = self.store.add(f"{self.key}/count", 1)
        self.store.set(f"{self.key}/{n}", label)

    def arrived(self) -> list[str]:
        n = self.store.add(f"{self.key}/count", 0)
        keys = [f"{self.key}/{i}" for i in range(1, n + 1)]
        return [v.decode() for v in self.store.multi_get(keys)] if keys else []

    def others(self) -> list[dict[str, Any]]:
        """The settings of every other node that arrived at this endpoint."""
        n = self.store.add(f"{_NS}/arrivals", 0)
        keys = [f"{_NS}/arrival/{i}" for i in range(1, n + 1)]
        found = [json.loads(v) for v in self.store.multi_get(keys)] if keys else []
        return [f for f in found if f.get("label") != self.label]

    def check(self) -> None:
        """Raise :class:`RendezvousError` if a node came with settings that differ from
        this node's, or a node left the meeting (interrupted, failed)."""
        if self.watch.store_gone():
            raise self._gone()
        if self.store.check([f"{_NS}/left"]):
            why = self.store.get(f"{_NS}/left").decode()
            c = self.config
            self._told()
            raise RendezvousError(
                f"{why} while the nodes met at the {c.backend} rendezvous '{c.run_id}' at "
                f"{c.endpoint}: the job cannot form. Start the launch again on every node."
            )
        mine = self.settings()
        for other in self.others():
            differ = [k for k in ("run_id", "num_nodes", "backend") if other.get(k) != mine[k]]
            if differ:
                self._told()
                raise self._differ(other, differ)

    def _told(self) -> None:
        """This node read why the meeting ends: the node holding the store may go now."""
        with contextlib.suppress(Exception):
            self.store.add(f"{_NS}/told", 1)

    def _differ(self, other: dict[str, Any], keys: list[str]) -> RendezvousError:
        c = self.config
        names = {"run_id": "rdzv_id", "num_nodes": "num_nodes", "backend": "rdzv_backend"}

        def said(settings: dict[str, Any]) -> str:
            return ", ".join(f"{names[k]}={settings.get(k)!r}" for k in keys)

        return RendezvousError(
            f"the nodes' settings differ: {other.get('label')} came to the rendezvous at "
            f"{c.endpoint} with {said(other)}; this node ({self.label}) has "
            f"{said(self.settings())}. Start every node with the same num_nodes, "
            "rdzv_backend, rdzv_id and endpoint."
        )

    def wait_for_all(self, deadline: float) -> None:
        while True:
            self.check()
            if self.store.add(f"{self.key}/count", 0) >= self.config.num_nodes:
                return
            if time.monotonic() >= deadline:
                raise self.timeout_error()
            time.sleep(_POLL)

    def leave(self, error: BaseException, linger: bool = False) -> None:
        """This node gives up on the meeting (Ctrl-C, an error): tell the others at once
        (best effort: the store may be gone already). ``linger``: this node holds the
        store; it keeps it a moment, for the others to read why (a few of their polls)."""
        with contextlib.suppress(Exception):
            if not (isinstance(error, RendezvousError) and "settings differ" in str(error)):
                # (a difference the others see themselves; this node counted itself told)
                what = "was interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
                self.store.compare_set(f"{_NS}/left", "", f"{self.label or 'a node'} {what}")
                self._told()
            if linger:
                self._wait_until_told()

    def _wait_until_told(self, bound: float = 5.0) -> None:
        """Keep the store until every node that came has read why the meeting ends (a
        loaded machine may take a while to look), at most ``bound`` seconds: else it finds
        the store gone and says the holder was killed."""
        deadline = time.monotonic() + bound
        try:
            while time.monotonic() < deadline:
                if self.store.add(f"{_NS}/told", 0) >= self.store.add(f"{_NS}/arrivals", 0):
                    return
                time.sleep(_POLL)
        except KeyboardInterrupt:  # pressed again: stop waiting (the first one is raised)
            return

    def failed(self, error: BaseException) -> RendezvousError:
        """What a store error during the meeting means: a node left (it said why), or the
        node holding the store went away; named without torch's C++ frames."""
        if not self.watch.store_gone():
            try:
                self.check()  # a node that left said why
            except RendezvousError as told:
                return told
            except Exception:  # noqa: BLE001 - the store is gone: say so below
                pass
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return self._gone(f"{type(error).__name__}: {first}")

    def _gone(self, detail: str = "") -> RendezvousError:
        c = self.config
        why = f" ({detail})" if detail else ""
        return RendezvousError(
            f"the {c.backend} rendezvous '{c.run_id}' at {c.endpoint} went away while the "
            f"nodes met{why}: the node holding its store was interrupted, stopped or "
            "killed. Start the launch again on every node."
        )

    def timeout_error(self) -> RendezvousError:
        c = self.config
        joined = self.arrived()
        ranks = {_node_rank_of(label) for label in joined}
        missing = [r for r in range(c.num_nodes) if r not in ranks]
        count = max(c.num_nodes - len(joined), 0)
        if missing and (c.backend == "static" or len(ranks) == len(joined)):
            who = f"node {missing[0]}" if len(missing) == 1 else f"nodes {missing}"
        else:  # c10d ranks are torch's to give: the labels may repeat
            who = f"{count} node{'s' if count != 1 else ''}"
        return RendezvousError(
            f"{who} did not join the {c.backend} rendezvous '{c.run_id}' at {c.endpoint} "
            f"within {c.join_timeout:g} s; {len(joined)} of {c.num_nodes} joined: "
            f"{'; '.join(joined) or 'none'}. Start the same launch on the missing node(s) "
            f"(num_nodes={c.num_nodes}, the same endpoint"
            + (", their own node_rank" if c.backend == "static" else "")
            + "), or give them more time (join_timeout=)."
        )


def _node_rank_of(label: str) -> int:
    try:
        return int(label.split()[1])
    except (IndexError, ValueError):
        return -1


def _meet(
    config: RendezvousConfig, host: str, port: int, holder: bool, lobby: Lobby, deadline: float
) -> tuple[Any, Any]:
    """torch's handler for the backend, and its rendezvous: (handler, RendezvousInfo)."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        RendezvousTimeoutError,
    )
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    left = max(1, int(deadline - time.monotonic()) + 1)
    conf = dict(config.conf)
    if config.backend == "static":
        conf.update(rank=config.node_rank, timeout=left)
    else:
        conf["is_host"] = holder  # decided when binding: torch must not bind on its own
        conf.setdefault("join_timeout", left)
        conf.setdefault("read_timeout", max(60, left))
    params = RendezvousParameters(
        backend=config.backend,
        endpoint=endpoint_text(host, port),
        run_id=config.run_id,
        min_nodes=config.num_nodes,
        max_nodes=config.num_nodes,
        local_addr=conf.pop("local_addr", None) or socket.gethostname(),
        **conf,
    )
    handler: Any = get_rendezvous_handler(params)
    timed_out = False
    try:
        with _no_second_store():
            info = handler.next_rendezvous()
    except RendezvousTimeoutError:
        timed_out = True
    except BaseException:
        handler.shutdown()
        raise
    if timed_out:  # raised out here, so that it holds no reference to the handler
        handler.shutdown()
        handler = None
        raise lobby.timeout_error()
    return handler, info


@contextlib.contextmanager
def _no_second_store() -> Iterator[None]:
    """Keep torch's c10d handler from starting a second store for trainers (on node 0, on
    every interface): our ranks use the rendezvous store, with a prefix per attempt."""
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


# --- the job ------------------------------------------------------------------------------


class NodeJob:
    """This node's part of a job of one or more nodes: who is who, and the coordination of
    each attempt (see the module docstring). ``wake_fd`` becomes readable when another
    node rang this one; :meth:`drain` empties it."""

    def __init__(
        self,
        config: RendezvousConfig,
        host: str,
        port: int,
        server: Any,
        handler: Any,
        store: Any,
        bell_store: Any,
    ) -> None:
        self.config, self.host, self.port = config, host, port
        self._server, self._handler = server, handler
        self._raw, self._bell_raw = store, bell_store
        self.store: Any = None  # the job's keys (PrefixStore), set by exchange()
        self._bell: Any = None
        self.group_rank = config.node_rank
        self.num_nodes = config.num_nodes
        self.nodes: list[NodeInfo] = []
        self.prefix = ""
        self.lost: str | None = None
        self._stopping = False
        self._rung = 0
        self._watcher: threading.Thread | None = None
        self._last_beat = 0.0
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (its count, when it moved)
        #: node -> (its answers when we rang it, when): a ring not answered yet
        self._asked: dict[int, tuple[int, float]] = {}
        self._last_asked: dict[int, float] = {}
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already says "wake up"
        self._closed = False

    @property
    def holds_store(self) -> bool:
        return self._server is not None

    @property
    def endpoint(self) -> str:
        return endpoint_text(self.host, self.port)

    def exchange(self, info: Any, nproc: int) -> None:
        """Learn the job: this node's rank, the others' sizes; start the bell."""
        import torch.distributed as dist

        self.group_rank, self.num_nodes = info.rank, info.world_size
        shared = info.store
        if self.group_rank == 0:
            shared.set(f"{_NS}/job", uuid.uuid4().hex)
        self.prefix = f"{_NS}/{self.config.run_id}/{shared.get(f'{_NS}/job').decode()}"
        me = NodeInfo(self.group_rank, nproc, label_for(self.config, lobby=False), self.holds_store)
        shared.set(f"{_NS}/node/{self.group_rank}", pickle.dumps(me))
        keys = [f"{_NS}/node/{g}" for g in range(self.num_nodes)]
        self.nodes = [pickle.loads(v) for v in shared.multi_get(keys)]
        self.store = dist.PrefixStore(self.prefix, self._raw)
        self._bell = dist.PrefixStore(self.prefix, self._bell_raw)
        self._watcher = threading.Thread(
            target=self._watch, name="notebook-launcher-bell", daemon=True
        )
        self._watcher.start()

    # -- who is who --------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def first_rank(self, group_rank: int | None = None) -> int:
        g = self.group_rank if group_rank is None else group_rank
        return sum(n.nproc for n in self.nodes[:g])

    def ranks_of(self, group_rank: int) -> range:
        start = self.first_rank(group_rank)
        return range(start, start + self.nodes[group_rank].nproc)

    def worker_prefix(self, attempt: int) -> str:
        return f"{self.prefix}/a{attempt}/pg"

    def describe(self) -> str:
        c = self.config
        return f"{c.backend} rendezvous '{c.run_id}' at {self.endpoint}"

    # -- the bell ----------------------------------------------------------------------

    def _watch(self) -> None:
        """Wait for this node's bell; each ring wakes the pump (``wake_fd``), and is
        answered at once (``alive/<g>``): the node that rang learns this kernel lives,
        whatever its own thread is doing (see :meth:`gone`)."""
        from torch.distributed import DistNetworkError, DistStoreError

        seen = 0
        while True:
            key = f"bell/{self.group_rank}/{seen + 1}"
            try:
                self._bell.wait([key], timedelta(hours=1))
            except DistStoreError:  # the hour passed: wait again
                continue
            except (DistNetworkError, RuntimeError, OSError) as exc:
                if not self._stopping:
                    self.lost = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    self._ring_self()
                return
            seen += 1
            if self._stopping:
                return
            try:
                self._bell.add(f"alive/{self.group_rank}", 1)
            except Exception:  # noqa: BLE001 - the store is going: the next wait says so
                pass
            self._ring_self()

    def _ring_self(self) -> None:
        try:
            os.write(self._wake_w, b".")
        except OSError:
            pass

    def ring(self, group_rank: int) -> None:
        """Ring a node's bell (its pump wakes up); its answer is awaited (see :meth:`gone`)."""
        if group_rank not in self._asked and group_rank != self.group_rank:
            answers = self.store.add(f"alive/{group_rank}", 0)
            self._asked[group_rank] = (answers, time.monotonic())
        n = self.store.add(f"bell/{group_rank}", 1)
        self.store.set(f"bell/{group_rank}/{n}", b"")

    def ring_others(self) -> None:
        for g in range(self.num_nodes):
            if g != self.group_rank:
                self.ring(g)

    def drain(self) -> bool:
        """Empty the wake pipe; True when the bell had rung."""
        rang = False
        try:
            while os.read(self.wake_fd, 4096):
                rang = True
        except (BlockingIOError, OSError):
            pass
        return rang

    # -- heartbeats --------------------------------------------------------------------

    def beat(self) -> None:
        """Say this node's kernel is alive (at most every ``BEAT_INTERVAL`` seconds). The
        launch calls it from each of its waits, so no thread is needed."""
        now = time.monotonic()
        if self.num_nodes > 1 and now - self._last_beat >= BEAT_INTERVAL:
            self._last_beat = now
            self.store.add(f"beat/{self.group_rank}", 1)

    def gone(self, nodes: Container[int]) -> list[int]:
        """Those of ``nodes`` whose kernel is gone: rung, it did not answer within
        :data:`ANSWER_TIMEOUT` seconds (a live kernel's bell thread answers at once, busy
        or not), or it has not beaten for :data:`LOST_AFTER` seconds. Nodes not asked
        for :data:`BEAT_INTERVAL` seconds are rung now."""
        self.beat()
        now, found = time.monotonic(), []
        for g in range(self.num_nodes):
            if g not in nodes or g == self.group_rank:
                continue
            asked = self._asked.get(g)
            if asked is not None:
                answers, when = asked
                if self.store.add(f"alive/{g}", 0) != answers:
                    del self._asked[g]  # it answered: alive
                    self._last_asked[g] = now
                elif now - when >= ANSWER_TIMEOUT:
                    found.append(g)
                    continue
            elif now - self._last_asked.get(g, 0.0) >= BEAT_INTERVAL:
                self._last_asked[g] = now
                self.ring(g)
            count = self.store.add(f"beat/{g}", 0)
            seen, since = self._beats.get(g, (-1, now))
            if count != seen:
                self._beats[g] = (count, now)
            elif now - since >= LOST_AFTER:
                found.append(g)
        return found

    # -- one attempt -------------------------------------------------------------------

    def announce_failure(self, attempt: int, what: str = "a rank failed") -> None:
        """Something ended this attempt here (``what``): tell every node (they stop their
        ranks). The first announcement of an attempt is the one kept."""
        if self.num_nodes > 1:
            self.store.compare_set(f"a{attempt}/failed", "", f"{self.group_rank} {what}")
            self.ring_others()

    def failed_elsewhere(self, attempt: int) -> tuple[int, str] | None:
        """(node, what happened there) of the first announcement of ``attempt``, if any."""
        if self.num_nodes == 1 or not self.store.check([f"a{attempt}/failed"]):
            return None
        node, _, what = self.store.get(f"a{attempt}/failed").decode().partition(" ")
        return int(node), what

    def publish(self, attempt: int, report: NodeReport) -> None:
        self.store.set(f"a{attempt}/report/{self.group_rank}", pickle.dumps(report))
        self.ring_others()

    def reports(self, attempt: int, skip: Container[int] = ()) -> dict[int, NodeReport]:
        """The reports of ``attempt`` published so far, by node (but those in ``skip``)."""
        found = {}
        for g in range(self.num_nodes):
            key = f"a{attempt}/report/{g}"
            if g in skip:
                continue
            if self.store.check([key]):
                found[g] = pickle.loads(self.store.get(key))
        return found

    def decide(self, attempt: int, restart: bool, timeout: float = REPORT_TIMEOUT) -> bool:
        """Restart only if every node decided to: the nodes never part ways. A node that
        will not restart says so and leaves at once; one that would waits for the others'
        word (at most ``timeout`` seconds: a node that never says is a no)."""
        self.store.set(f"a{attempt}/decision/{self.group_rank}", b"1" if restart else b"0")
        if self.num_nodes > 1:
            self.ring_others()
        if not restart or self.num_nodes == 1:
            return restart
        keys = [f"a{attempt}/decision/{g}" for g in range(self.num_nodes)]
        deadline = time.monotonic() + timeout
        while True:
            said = [k for k in keys if self.store.check([k])]
            if any(v != b"1" for v in (self.store.multi_get(said) if said else [])):
                return False
            if len(said) == len(keys):
                return True
            if time.monotonic() >= deadline or self.lost:
                return False
            self.beat()
            time.sleep(_POLL)

    # -- the end -----------------------------------------------------------------------

    def close(self) -> None:
        """Leave the job: say so, let the store's holder wait for everyone, stop the bell,
        and release the stores (the holder's listening port with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        handler, self._handler = self._handler, None
        try:
            if handler is not None:  # c10d: stops its keep-alive thread first, lost or not
                with contextlib.suppress(Exception):
                    handler.shutdown()
            if self.store is not None and self.lost is None:
                with contextlib.suppress(Exception):  # a store gone now changes nothing
                    self._leave()
        finally:
            self._stopping = True
            if self._watcher is not None:
                with contextlib.suppress(Exception):
                    self.ring(self.group_rank)  # wakes our own watcher, which sees _stopping
                self._watcher.join(timeout=5.0)
            self.store = self._bell = self._raw = self._bell_raw = None
            del handler
            self._server = None  # the last reference: the store stops listening
            close_quietly(self.wake_fd, self._wake_w)

    def _leave(self) -> None:
        self.store.set(f"done/{self.group_rank}", b"1")
        if not self.holds_store or self.num_nodes == 1:
            return
        deadline = time.monotonic() + EXIT_TIMEOUT
        waiting = set(range(self.num_nodes))
        while waiting and time.monotonic() < deadline:
            waiting = {g for g in waiting if not self.store.check([f"done/{g}"])}
            waiting -= set(self.gone(waiting))  # a node whose kernel died never says
            time.sleep(_POLL)


__all__ = [
    "ANSWER_TIMEOUT",
    "BEAT_INTERVAL",
    "EXIT_TIMEOUT",
    "LOST_AFTER",
    "REPORT_TIMEOUT",
    "NodeInfo",
    "NodeJob",
    "NodeReport",
    "RendezvousConfig",
    "endpoint_text",
    "join",
    "label_for",
]
