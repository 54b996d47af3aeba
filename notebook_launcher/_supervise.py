"""The supervisor of a detached run.

Started for the kernel (``detached.launch``) in a session of its own, it forks once more
and the first process exits at once: the supervisor's parent is then init (or the nearest
subreaper), never the kernel, so a kernel that dies, restarts or is shut down leaves the
run going. Two ways to start it, the same supervisor either way:

* warm (:func:`spare`): forked by the kernel's forkserver (``_worker.forkserver``), a
  clean process that imported torch and this package and never touches CUDA, so the
  supervisor has none of the kernel's memory or fds, no CUDA, and no import to wait for;
  it is forked ahead of need and waits for its run (so its ranks start about as soon as
  a warm kernel's); the kernel sends it the fds below through the server;
* cold (:func:`main`, ``python -c ... _supervise.main([run_dir, listen_fd])``), where the
  forkserver cannot be had: a fresh interpreter, which imports torch (seconds).

Its fds: 1, the handshake pipe (it writes its pid there, then fd 1 joins fd 2); 2, its
log (``supervisor.log``); its go (a pipe: the cold one's stdin), where the kernel writes
the run's key once it has the pid -- the supervisor runs nothing before, and the end of
that pipe without a key (the kernel's Ctrl-C, or its death, during the hand-over) ends it
and its record; the rendezvous listener, bound by the kernel. The key checks the run's
task (``_launch.detach.seal``): a task that is not the one the kernel wrote is refused.

It runs the launch exactly as a blocking ``notebook_launcher()`` does (the same
``launcher._Launch``: preflight was done by the kernel, which passes the plan, its bound
rendezvous socket and the task), with a view that appends every event to the run's
``events.log``; then it writes the result and the final state (``_launch.detach``).

A cluster run (``cluster=..., detach=True``) gets the cluster's configuration instead of a
plan: the supervisor starts the cluster (the scheduler's job is its, the agents connect to
its hub), runs the same launch, and closes the cluster at the end (:func:`_run_on_cluster`).
Where the scheduler can, the supervisor runs inside a job of its own instead
(:func:`in_job`).

Its ranks die with it (their parent-death signal; on a cluster, the agents leave when their
hub connection drops and the job ends): a supervisor that is killed takes them along, and
the next attach says so. SIGINT or SIGTERM stop the run as Ctrl-C stops a
launch: every rank stopped, the outcome an interrupt.

Imports stay light until the fork: the kernel waits for the supervisor's pid.

The supervisor never touches CUDA (nor did the forkserver it may come from): its ranks,
forked from it, may.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from ._launch.handover import LaunchJob
    from ._launch.pool import RankPool
    from ._launch.scheduler import Scheduler

#: What the supervisor imports: a forkserver that forks one imports them first, once.
PRELOAD = (
    "notebook_launcher.launcher",
    "notebook_launcher._launch.detach",
    "notebook_launcher._worker.entry",  # what its forked ranks run
)


def main(argv: list[str]) -> None:
    """The cold start, in a fresh interpreter (``detached._Handover``): a kernel's first
    detached run, while its forkserver starts behind it, or where that server cannot be
    had."""
    run_dir, listen_fd = argv[0], int(argv[1])
    if os.fork():
        os._exit(0)  # the kernel reaps this one; init adopts the supervisor
    go = os.dup(0)  # its go comes on its stdin
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    print(
        "supervisor: a fresh interpreter (cold; its imports after the hand-over)", file=sys.stderr
    )
    _supervise(run_dir, listen_fd, go=go)


def in_job(run_dir: str, kind: str) -> None:
    """A run's supervisor inside its own job (``detached._hand_over_to_job``), submitted by
    the scheduler of that ``kind`` (``scheduler.kind_of``; ``Scheduler.submit_supervisor``): the job's first
    process. Nothing to fork away from (the job is not the kernel's); its stdout and stderr
    go to the record's ``supervisor.log``. It starts the agents in this job (the cluster
    uses the allocation it runs in), runs the launch, and the job ends when it does."""
    from ._launch import detach, scheduler

    log = detach.open_private(run_dir, detach.LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for fd in (1, 2):  # its words in the record, as a supervisor's on the kernel's host
        os.dup2(log, fd)
    os.close(log)
    job = scheduler.kind(kind).here()
    print(f"supervisor: in {job.describe() if job else kind}", file=sys.stderr)
    try:  # the run's key, in the job's environment as submitted
        key = bytes.fromhex(os.environ.pop(detach.KEY_ENV, ""))
    except ValueError:
        key = b""
    _supervise(run_dir, -1, handshake=False, key=key, job=job)


def preload() -> None:
    """Import what the supervisor needs (in the forkserver, before it forks one; what
    cannot be imported, the supervisor says in its log)."""
    from ._posix import import_quietly

    import_quietly(PRELOAD)


def spare(conn_fd: int, ahead: int = 0) -> NoReturn:
    """A supervisor forked ahead of need by the kernel's forkserver (the warm start): it
    leaves the server's session and parentage, forks ``ahead`` ranks (``_launch.pool``: as
    many as the kernel's last detached run had), then waits on ``conn_fd`` (its link to the
    server) for its run -- a :class:`~notebook_launcher._wire.forkserver.Supervise` and
    the fds the kernel sent (the handshake pipe, the log, the listener) -- and runs it.
    The server gone first (its kernel ended): it exits, and its blank ranks with it. Never
    returns."""
    from ._launch.pool import RankPool
    from ._posix import quiet_fork
    from ._wire.forkserver import Spare, Taken, recv_request, send

    code = 1
    pool = RankPool(close_in_child=(conn_fd,))
    try:
        os.setsid()  # out of the kernel's session and process group (Jupyter's interrupt)
        if quiet_fork():
            os._exit(0)  # the forkserver reaps this one; init adopts the supervisor
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's handler: not ours
        link = socket.socket(fileno=conn_fd)
        try:
            send(link, Spare(os.getpid()))  # (the server kills a spare that stops answering)
            pool.prefork(ahead)
        except OSError:  # (no process to spare: its ranks are forked when it runs)
            pass
        try:
            order, fds = recv_request(link)
            send(link, Taken())  # (the server kills a spare that does not say it in time)
        except (EOFError, OSError):
            pool.close()
            os._exit(0)  # no run came: the server (and its kernel) ended
        link.close()
        pool.close_in_child = ()  # (its number may name another fd now: a restart's blank)
        null = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((null, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(src, dst)
            os.close(src)
        print("supervisor: forked by the kernel's forkserver (warm)", file=sys.stderr)
        _supervise(order.run_dir, fds[3] if order.has_listen else -1, pool=pool, go=fds[2])
        code = 0
    except BaseException:  # noqa: BLE001 - into its log, as a fresh interpreter would
        import traceback

        traceback.print_exc()
    finally:
        try:
            pool.close()
            import atexit

            atexit._run_exitfuncs()  # as an interpreter that ends (its own forkserver...)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _supervise(
    run_dir: str,
    listen_fd: int,
    handshake: bool = True,
    pool: RankPool | None = None,
    go: int = -1,
    key: bytes = b"",
    job: Scheduler | None = None,
) -> None:
    """The supervisor, from its handshake (``handshake``: the kernel waits for its pid on
    fd 1, then sends the run's key on ``go``; else ``key`` is given) to its run's record of
    the end. ``pool``: its ranks, forked ahead (a spare's); ``job``: the scheduler's job it
    runs in (:func:`in_job`)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the kernel ignored it
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from ._launch import detach
    from ._posix import start_time

    meta = detach.read_meta(run_dir)
    meta.pid, meta.pid_start, meta.state = os.getpid(), start_time(os.getpid()), detach.RUNNING
    meta.host = detach.this_host()  # (in a job of its own: its first node)
    if job is not None:  # in its own job
        meta.cluster = job.describe()
    detach.write_meta(run_dir, meta)
    detach.beat(run_dir)  # (a kernel on another host judges it alive by this file)
    if handshake:
        os.write(1, f"{os.getpid()}\n".encode())
        os.dup2(2, 1)  # the handshake is over: stdout joins stderr, in supervisor.log
        if pool is not None:
            pool.ask()  # (its ranks forked ahead answer while the kernel sends the go)
        key = _wait_for_go(go)
        if not key:  # the kernel gave up on the run (Ctrl-C, or its end) before its go
            if pool is not None:
                pool.close()
            detach.remove(run_dir)
            print("supervisor: no go from the kernel: nothing ran", file=sys.stderr)
            return
    if meta.kind == "session":  # a session's calls, served until it is stopped
        from .detached_session import serve
        from .session import start

        if pool is not None:
            pool.close()
        serve(run_dir, meta, key, start)
        return
    import threading

    # room for the end, should the run fill the disk (in a thread: not the start's business)
    reserving = threading.Thread(target=detach.reserve, args=(run_dir,), daemon=True)
    reserving.start()
    outcome = _why_terminated(_run(run_dir, listen_fd, key, own_job=job, pool=pool), job)
    reserving.join()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run has ended: record it whole
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    meta = detach.read_meta(run_dir)  # as the run left it (a cluster's job named)
    meta.ended = time.time()
    if isinstance(outcome, KeyboardInterrupt):
        meta.state = detach.STOPPED
    elif isinstance(outcome, BaseException):
        meta.state = detach.FAILED
    else:
        meta.state = detach.OK
    meta.summary = _summary(outcome)
    if _recording_stopped:
        meta.note = _recording_stopped[0]
    result = detach.encode_result(outcome)
    del outcome
    if not detach.write_end(run_dir, meta, result):  # a full disk: held for a kernel
        _say(f"supervisor: {meta.note or 'the record could not be written'}")
        if not detach.hold(run_dir, meta, result, detach.retention()):
            _say("supervisor: no kernel took the run's result in time: it is lost")


def _say(line: str) -> None:
    """A line in the supervisor's log, if the disk still takes one."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


#: why the run's log stopped being written (a full disk), once it did
_recording_stopped: list[str] = []


def _wait_for_go(go: int) -> bytes:
    """The run's key, once the kernel sends it on ``go`` (empty: the pipe ended first)."""
    from ._launch.detach import KEY_BYTES

    key = b""
    try:
        while len(key) < KEY_BYTES and (chunk := os.read(go, KEY_BYTES - len(key))):
            key += chunk
    finally:
        os.close(go)
    return key if len(key) == KEY_BYTES else b""


#: the supervisor got SIGTERM (``kill``, a shutdown; in its job: its scheduler ending it,
#: e.g. a cancel, the time limit): said in the outcome, which otherwise reads as a stop()
_terminated: list[bool] = []
#: the cluster's agents said whatever started them is ending them (``Ending.TERMINATED``,
#: typed: ``Cluster.told_to_end``), noted at the run's end
_agents_told_to_end: list[bool] = []

#: seconds a supervisor in its job waits for its own SIGTERM once a node said the
#: scheduler is ending the job: a cancel and the time limit signal every process of the job
#: at about the same time, and the agents' word can come first (the ranks stopped by it are
#: not the cause)
JOB_END_WAIT = 3.0


def _interrupt(signum: int, frame: Any) -> None:
    _terminated.append(True)
    raise KeyboardInterrupt


def _noted(signum: int, frame: Any) -> None:
    """SIGTERM once the run has ended (its cluster closing, its end recorded): noted only."""
    _terminated.append(True)


def _why_terminated(outcome: Any, job: Scheduler | None) -> Any:
    """The outcome, said as the job's end when that is what it was: this supervisor got
    SIGTERM, or (in its job) its agents said the scheduler was ending them -- typed
    (``_agents_told_to_end``), not read from the outcome's text."""
    ended_by_job = (
        job is not None
        and bool(_agents_told_to_end)
        and isinstance(outcome, BaseException)
        and not isinstance(outcome, KeyboardInterrupt)
    )
    if ended_by_job and not _terminated:
        signal.signal(signal.SIGTERM, _noted)
        deadline = time.monotonic() + JOB_END_WAIT
        while not _terminated and time.monotonic() < deadline:
            time.sleep(0.02)
    if not _terminated or not (ended_by_job or isinstance(outcome, KeyboardInterrupt)):
        return outcome
    if job is not None:
        who = job.terminated()
    else:
        who = f"the run's supervisor (pid {os.getpid()}) got SIGTERM (kill, or a shutdown)"
    if ended_by_job:  # its agents heard it first: their ranks stopped, none of them failed
        return KeyboardInterrupt(f"{who}; the job's agents got it too and stopped the ranks")
    return KeyboardInterrupt(f"{who}; {outcome}")


def _summary(outcome: Any) -> str:
    if isinstance(outcome, BaseException):
        first = str(outcome).strip().splitlines()
        return f"{type(outcome).__name__}: {first[0] if first else ''}"[:200]
    return f"{len(outcome)} rank(s) returned"


def _run(
    run_dir: str,
    listen_fd: int,
    key: bytes,
    own_job: Scheduler | None = None,
    pool: RankPool | None = None,
) -> Any:
    """The launch, to its end: the per-rank values or the exception to raise (``key``: the
    run's, which its task must carry: ``_launch.detach.read_task``). ``own_job``: the run's
    own job it runs in, whose scheduler's variables (the allocation the cluster starts its
    agents in) stand over the kernel's. ``pool``: ranks forked ahead, used when they are
    enough and the task is small (``_launch.pool``)."""
    import pickle
    import socket

    from ._launch import detach

    listen = socket.socket(fileno=listen_fd) if listen_fd >= 0 else None
    try:
        from . import _serialization
        from ._launch.handover import LaunchJob
        from ._launch.plan import prepare_task
        from ._wire.supervisor import HandedOver
        from .errors import LaunchError
        from .launcher import _Launch
        from .ui import view_for

        handed = pickle.loads(detach.read_task(run_dir, key))  # (then removed from the record)
        if not isinstance(handed, HandedOver) or handed.job is None:
            raise LaunchError(f"the task in {run_dir} is not a launch's hand-over")
        detach.take_on(handed.kernel, own_job.environment if own_job else "")  # ranks inherit it
        job = _serialization.loads(handed.job)
        del handed
        if not isinstance(job, LaunchJob):
            raise LaunchError(f"the task in {run_dir} is not a launch's hand-over")
        if job.cluster is not None:
            if pool is not None:
                pool.close()  # (its ranks are the nodes' agents')
            return _run_on_cluster(run_dir, job)
        plan = job.plan
        assert plan is not None
        plan.listen, listen = listen, None
        task = job.task
        # pooled: each rank unpickles the task (and imports what it needs) in parallel;
        # else, forked here: the ranks inherit the objects themselves
        if not _pooled(plan, task, pool) and plan.start_method == "fork":
            function, args, kwargs = _serialization.loads(task)
            task = prepare_task(function, args, kwargs, "fork")
        writer = detach.EventWriter(run_dir, detach.DIGEST_INTERVAL)
        view = view_for(_Recording(writer, run_dir))
        launch = _Launch(plan, task, view, job.policy, job.line_prefix, job.child_failed_name)
        launch.watch.stall_after = job.stall_after
        del task, job
        outcome = launch.run_to_end()
        launch._release()
        writer.close()
        return outcome
    except BaseException as exc:  # noqa: BLE001 - the task could not load, Ctrl-C...: said
        return exc
    finally:
        if listen is not None:
            listen.close()


def _pooled(plan: Any, task: bytes, pool: RankPool | None) -> bool:
    """Whether ``plan`` starts its ranks from ``pool`` (then set so): its ranks are forked
    here, enough of them were forked ahead and the task is small. Its specs then carry the environment whole (the
    kernel's: a blank was forked before this process took it on). The blanks it does not
    take are ended now. (A function of a module of the user's is then imported by each
    rank, at once, rather than here before the forks: 1.4-1.6x an attached start against
    2.2-2.5x, ``bench/detach.py`` with the function imported from a module.)"""
    import dataclasses

    from ._launch.pool import MAX_TASK

    if pool is None:
        return False
    pool.keep_answering()  # (one that did not answer -- stopped, stuck -- is not used)
    usable = plan.start_method == "fork" and len(task) <= MAX_TASK
    if not usable or not pool.covers(len(plan.specs)):
        pool.close()
        return False
    pool.trim(len(plan.specs))
    plan.pool = pool
    plan.specs = [
        dataclasses.replace(s, env={**os.environ, **s.env}, replace_environ=True)
        for s in plan.specs
    ]
    return True


def _run_on_cluster(run_dir: str, job: LaunchJob) -> Any:
    """A cluster run: this supervisor starts the cluster (submits its job, holds its hub
    and store: the agents connect here), runs the launch as a kernel would
    (``launcher._cluster_launch``), and ends the job when the run ends. Killed, it ends
    the job too: its agents leave when their connection to the hub drops."""
    from ._launch import detach
    from .launcher import _cluster_launch
    from .ui import view_for

    cluster = job.cluster
    writer = detach.EventWriter(run_dir, detach.DIGEST_INTERVAL)
    view = view_for(_Recording(writer, run_dir))
    try:
        launch = _cluster_launch(
            cluster, job.task, view, job.num_processes, dict(job.options), job.policy,
            job.line_prefix, job.child_failed_name,
        )  # fmt: skip
        meta = detach.read_meta(run_dir)
        meta.cluster = meta.cluster or cluster.describe()  # (in its job: named already)
        detach.write_meta(run_dir, meta)
        launch.watch.stall_after = job.stall_after
        del job
        outcome = launch.run_to_end()
        if cluster.told_to_end():  # (typed: what the agents said, before the cluster closes)
            _agents_told_to_end.append(True)
        launch._release()
        return outcome
    finally:
        # the run has ended (or could not start): nothing may stop the job's end half way
        # (the scheduler's SIGTERM now is noted: the outcome says the job was ended)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _noted)
        try:
            cluster.close()
        finally:
            writer.close()


class _Recording:
    """A view that appends every event to the run's log (``_launch.detach.EventWriter``);
    its ticks (at least twice a second) beat the run's heartbeat and take a stop asked
    for from another host (``_launch.detach.beat``) as Ctrl-C."""

    def __init__(self, writer: Any, run_dir: str) -> None:
        self.writer, self.run_dir = writer, run_dir
        self.beaten = time.monotonic()
        self.stopping = False

    def handle(self, event: Any) -> None:
        """Into the log -- until the disk is full: then the log stops there (said once,
        and in the record's end), and the run goes on, beating and taking stops."""
        if _recording_stopped:
            return
        from ._launch import detach

        try:
            self.writer.write(event)
        except detach.RecordFull as exc:
            when = time.strftime("%H:%M:%S")
            _recording_stopped.append(f"Its log stops at {when}, where the disk became full: {exc}")
            _say(f"supervisor: recording stopped at {when}: {exc}")

    def tick(self) -> None:
        from ._launch import detach

        now = time.monotonic()
        if now - self.beaten < detach.HEARTBEAT_INTERVAL:
            return
        self.beaten = now
        try:
            asked = detach.beat(self.run_dir)
        except OSError:  # (the record is the kernel's to remove: nothing to beat)
            return
        if asked and not self.stopping:
            self.stopping = True
            print("supervisor: a stop was asked for from another host", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGINT)  # as stop() from this host: Ctrl-C

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
