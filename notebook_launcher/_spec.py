"""What the kernel tells a rank about itself before it starts: plain data, no torch.

Bottom layer: imported by the kernel side (``_launch``), which builds one spec per rank,
and by the rank side (``_worker``), which applies it. With ``fork`` the child inherits the
object; otherwise it travels pickled as the first message of the control channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Set to "1" in every rank the launcher starts.
LAUNCHER_ENV = "NOTEBOOK_LAUNCHER_WORKER"


@dataclass
class WorkerSpec:
    """One rank's identity, rendezvous and environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    backend: str
    #: Variables the rank adds to its environment (all of it when ``replace_environ``).
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    sys_path: list[str] = field(default_factory=list)
    #: True when the rank does not inherit the kernel's environment (forkserver, spawn).
    replace_environ: bool = False
    pg_timeout_s: float = 1800.0
    #: torch's intra-op threads in the rank (None: leave torch's default).
    num_threads: int | None = None
    #: the kernel's RNG and torch settings (``_settings.capture``), applied in the rank
    settings: dict[str, Any] | None = None
    #: a session's rank: after its set-up it serves tasks until told to leave
    session: bool = False
    #: a launch across nodes (or with restarts): the rendezvous store at
    #: ``master_addr:master_port`` is held by a node's kernel, and this rank joins its
    #: process group as a client under this key prefix (one per attempt); None: rank 0
    #: holds the store itself (one node, the kernel's listening socket)
    store_prefix: str | None = None
    #: where this rank's store client connects instead of ``master_addr:master_port`` (its
    #: node's agent's forwarder, on 127.0.0.1, which proves the job's secret to the kernel's
    #: proxy there); None: straight there
    store_via: tuple[str, int] | None = None
    num_nodes: int = 1
    #: which restart this is (0: the first attempt) and how many are allowed
    restart_count: int = 0
    max_restarts: int = 0
    #: where this rank runs ("cpu", "cuda:1"), decided by ``_placement.place``; the rank
    #: makes it its current device before any other CUDA work
    device: str = "cpu"
    #: this rank's share of its GPU's memory when ranks share one (None: all of it)
    memory_fraction: float | None = None


__all__ = ["LAUNCHER_ENV", "WorkerSpec"]
