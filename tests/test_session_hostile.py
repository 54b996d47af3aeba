"""Sessions under hostile but ordinary use (issue 17), each provoked for real on 2 gloo
ranks, under fork and forkserver.

* Any number of interrupts, at any moment, while a rank waits in a collective (a barrier,
  a DDP backward, our ``gather``) ends the cell interrupted -- never a hang -- and the
  session goes on: a sweep over the gap between the presses (SIGINT to this process, as
  the notebook's stop button does to a kernel).
* Ctrl-C while a large value is pushed: an interrupted push, and the session goes on.
* ``cancel()`` from two threads at once, with the ranks in Python or in a collective.
* A done-callback that itself runs a task, or closes the session.
* Values come back in the order of the ranks asked for.
* Ctrl-C while ``start()`` / ``restart()`` bring their ranks up: nothing left open, and a
  session whose restart was interrupted says so.
* A session on a busy port says it moved; a cell with a syntax error or IPython syntax is
  refused before it runs; a handle's repr follows its state; a 200 MB exception is kept
  once; a daemon a rank started (setsid) does not outlive the session.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import notebook_launcher
from notebook_launcher import LaunchError, Session
from notebook_launcher._launch import forkserver
from notebook_launcher._worker import session as rank_side

from .conftest import child_pids

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

METHODS = ["fork", "forkserver"]


def start(method: str = "fork", **options: Any) -> Session:
    options.setdefault("dashboard", False)
    return notebook_launcher.start(num_processes=2, start_method=method, **options)


@pytest.fixture(scope="module", params=METHODS)
def session(request: pytest.FixtureRequest) -> Iterator[Session]:
    s = start(request.param)
    yield s
    s.close()


def group_works(session: Session) -> None:
    assert session.run_cell("_t = torch.ones(1) * (rank + 1); dist.all_reduce(_t); _t.item()") == [
        "3.0",
        "3.0",
    ]


class Presser(threading.Thread):
    """Presses Ctrl-C (SIGINT to this process) at ``offsets`` seconds after ``ready()``
    holds, while the session's task runs: the press and the check hold the session's
    lock, so no press can land after the task ended (outside the call under test)."""

    def __init__(self, session: Session, ready: Callable[[], bool], offsets: list[float]) -> None:
        super().__init__(daemon=True)
        self.session, self.ready, self.offsets = session, ready, offsets
        self.sent: list[float] = []

    def run(self) -> None:
        deadline = time.monotonic() + 30
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.monotonic()
        for offset in self.offsets:
            time.sleep(max(0.0, t0 + offset - time.monotonic()))
            core = self.session.core
            with core._lock:
                if core.task is None:
                    return
                os.kill(os.getpid(), signal.SIGINT)
                self.sent.append(time.monotonic())


def interrupted_cell(
    session: Session, cell: str, marker: Path, offsets: list[float]
) -> tuple[BaseException, float]:
    """Run ``cell`` (rank 0 touches ``marker`` just before its collective) with Ctrl-C
    pressed at ``offsets`` after that: what it raised, and how long after the last press
    it returned."""
    marker.unlink(missing_ok=True)
    presser = Presser(session, marker.exists, offsets)
    presser.start()
    with pytest.raises(KeyboardInterrupt) as info:
        session.run_cell(cell.replace("MARKER", str(marker)))
    ended = time.monotonic()
    presser.join(30)
    assert presser.sent, "no press landed while the task ran"
    return info.value, ended - presser.sent[-1]


TOUCH = "open('MARKER', 'w').close()"
BARRIER = f"import time\nif rank == 0:\n    {TOUCH}\n    dist.barrier()\nelse:\n    time.sleep(30)"
GATHER = (
    "import time\nfrom notebook_launcher.utils import gather\nif rank == 0:\n"
    f"    {TOUCH}\n    gather(torch.ones(2))\nelse:\n    time.sleep(30)"
)
DDP_MODEL = (
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\nddp = DDP(torch.nn.Linear(4, 4))"
)
DDP_BACKWARD = (
    "import time\nif rank == 0:\n"
    f"    {TOUCH}\n    ddp(torch.ones(2, 4)).sum().backward()\nelse:\n    time.sleep(30)"
)

#: (collective, presses as offsets from the moment rank 0 enters it)
SWEEP = [
    ("barrier", [0.0, 0.0]),
    ("barrier", [0.02, 0.12]),
    ("barrier", [0.02, 0.3]),  # the second press while the group re-forms
    ("barrier", [0.02, 0.1, 0.2]),  # a third one
    ("ddp", [0.05, 0.15]),
    ("ddp", [0.05, 1.0]),  # in the window where a rank seen nowhere is given time
    ("gather", [0.05, 0.15]),
    ("gather", [0.05, 0.8]),
]


@pytest.mark.parametrize(
    ("collective", "offsets"), SWEEP, ids=[f"{c}-{'-'.join(map(str, o))}" for c, o in SWEEP]
)
def test_any_number_of_interrupts_ends_interrupted(
    session: Session, tmp_path: Path, collective: str, offsets: list[float]
) -> None:
    session.run_cell("kept = rank + 1")
    if collective == "ddp":
        session.run_cell(DDP_MODEL)  # (re-)built on the current group by both ranks
    cell = {"barrier": BARRIER, "gather": GATHER, "ddp": DDP_BACKWARD}[collective]
    error, after = interrupted_cell(session, cell, tmp_path / "in-collective", offsets)
    assert str(error) == "interrupted: ranks [0, 1] stopped their task"
    assert after < 5.0, f"{after:.1f} s after the last press"  # never a hang (~0.3-2 s)
    assert session.status().state == "ready"
    assert session.pull("kept") == [1, 2]
    group_works(session)


def test_ctrl_c_while_a_large_value_is_pushed(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C pressed while the value is being sent to the ranks (the session's lock is
    held then, so a press from another thread could only land after the sending: here the
    press comes as the first rank's copy goes out)."""
    big = b"x" * (120 << 20)
    group = session.core.group
    send = group.send
    pressed: list[int] = []

    def send_and_press(proc: Any, message: Any) -> bool:
        if not pressed:
            pressed.append(proc.rank)
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, mid-push
        return send(proc, message)

    monkeypatch.setattr(group, "send", send_and_press)
    with pytest.raises(KeyboardInterrupt, match="interrupted: ranks \\[0, 1\\] stopped"):
        session.push(big=big)
    monkeypatch.undo()
    assert pressed == [0]
    del big
    assert session.status().state == "ready"  # not "task 1 is still running"
    session.push(small=3)
    assert session.pull("small") == [3, 3]
    group_works(session)


def test_two_cancels_at_once(session: Session) -> None:
    session.run_cell("kept = rank * 2")
    for cell in (
        "import time\ntime.sleep(30)",
        "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(30)",
    ):
        handle = session.submit(rank_side.run_cell, cell, "<cancel>")
        deadline = time.monotonic() + 10
        while session.core.task is None or session.core.task.started != {0, 1}:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)
        results: list[bool] = []
        cancels = [threading.Thread(target=_cancel, args=(handle, results)) for _ in "ab"]
        for t in cancels:
            t.start()
        for t in cancels:
            t.join(20)
        assert results == [True, True] and handle.cancelled()
        assert session.status().state == "ready", session.status()
    assert session.pull("kept") == [0, 2]


def test_a_done_callback_may_run_tasks_and_close_the_session() -> None:
    s = start()
    chained: list[Any] = []
    done = threading.Event()

    def chain(handle: cf.Future) -> None:
        chained.append(handle.result())
        chained.append(s.run(os.getpid))  # waits on a task of the same session
        s.close()  # and closes it, from the callback
        done.set()

    handle = s.submit(time.sleep, 0.2)
    handle.add_done_callback(chain)
    assert done.wait(20), "the callback's own task never ran: the session deadlocked"
    assert chained[0] == [None, None] and len(chained[1]) == 2
    assert s.status().state == "closed"


@pytest.mark.parametrize("ranks", [[1, 0], [0, 1], [1]])
def test_values_come_back_in_the_order_asked(session: Session, ranks: list[int]) -> None:
    assert session.run_cell("rank * 10", ranks=ranks) == [str(r * 10) for r in ranks]
    assert session.run(os.getenv, "RANK", ranks=ranks) == [str(r) for r in ranks]
    session.run_cell("mine = rank")
    assert session.pull("mine", ranks=ranks) == ranks
    with pytest.raises(ValueError, match="different ranks"):
        session.run(os.getpid, ranks=[1, 1])


def test_a_handle_says_how_its_task_ended(session: Session) -> None:
    handle = session.submit(time.sleep, 0.3)
    assert repr(handle) == "<TaskHandle sleep: running>"
    handle.result(timeout=30)
    assert repr(handle) == "<TaskHandle sleep: finished: [None, None]>"
    failing = session.submit(rank_side.run_cell, "1/0", "<c>")
    assert cf.wait([failing], timeout=30).done == {failing}
    assert repr(failing).startswith("<TaskHandle run_cell: raised ZeroDivisionError: division")


def test_a_cell_that_is_not_python_is_refused_before_it_runs(session: Session) -> None:
    tasks = session.status().tasks_run
    with pytest.raises(SyntaxError) as info:
        session.run_cell("x = 1\nx = = 2")
    assert info.value.lineno == 2
    with pytest.raises(SyntaxError, match=r"IPython syntax \(%time y = 2\) does not run on"):
        session.run_cell("x = 1\n%time y = 2")
    with pytest.raises(SyntaxError, match=r"IPython syntax \(!ls\)"):
        session.run_cell("!ls")
    assert session.status().tasks_run == tasks  # no rank ran any of them
    # A failure before any code of the user's ran: no "variables" of the launcher's.
    with pytest.raises(ValueError, match="invalid literal") as info:
        session.run(int, "x", ranks=[1])
    assert not any("Variables" in note for note in info.value.__notes__), info.value.__notes__
    with pytest.raises(RuntimeError, match="before any of your code ran"):
        session.post_mortem(1, "1")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("method", METHODS)
def test_ctrl_c_while_the_ranks_come_up_leaks_nothing(method: str) -> None:
    start(method).close()  # the forkserver (if any) is up: its fds are not a leak
    before = _fd_count()
    interrupted = 0
    for delay in (0.0, 0.005, 0.02, 0.05):
        kids = _ranks_here()
        s = _run_with_press(lambda: start(method), _new_child_since(kids), delay)
        interrupted += s is None
        if s is not None:  # the press came once it was up
            s.close()
    assert interrupted, "no press landed while the ranks came up"
    assert _fd_count() == before
    s = start(method)
    try:
        s.run_cell("x = 1")
        for delay in (0.0, 0.02):
            old = set(s.status().pids)  # none when the last restart was interrupted
            ready = _one_gone(old) if old else _new_child_since(_ranks_here())
            _run_with_press(s.restart, ready, delay)
            status = s.status()
            if status.state == "down":
                assert "restart was interrupted" in str(status)
                with pytest.raises(LaunchError, match="no ranks: its restart was interrupted"):
                    s.run(os.getpid)
        s.restart()
        assert s.run_cell("'x' in dir()") == ["False", "False"]
    finally:
        s.close()
    assert _fd_count() == before


def _cancel(handle: cf.Future, results: list[bool]) -> None:
    results.append(handle.cancel())


def _ranks_here() -> set[int]:
    """Processes started by us, or by our forkserver (where ranks are its children)."""
    server = forkserver.pid()
    return child_pids() | (child_pids(server) if server else set())


def _new_child_since(kids: set[int]) -> Callable[[], bool]:
    return lambda: bool(_ranks_here() - kids)


def _one_gone(pids: set[int]) -> Callable[[], bool]:
    return lambda: not pids <= _ranks_here()


def _run_with_press(fn: Callable[[], Any], ready: Callable[[], bool], delay: float) -> Any:
    """``fn()`` with Ctrl-C pressed ``delay`` seconds after ``ready()``; its value, or None
    when it was interrupted."""
    presser = threading.Thread(target=_press_when, args=(ready, delay), daemon=True)
    presser.start()
    result = None
    try:
        result = fn()
    except KeyboardInterrupt:
        result = None
    finally:
        _absorb(presser)
    return result


def _press_when(ready: Callable[[], bool], delay: float) -> None:
    deadline = time.monotonic() + 20
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(delay)
    os.kill(os.getpid(), signal.SIGINT)


def _absorb(presser: threading.Thread) -> None:
    """Wait for a presser whose press may come after the call it aimed at returned."""
    while presser.is_alive():
        try:
            presser.join(0.05)
        except KeyboardInterrupt:
            continue


def test_a_session_on_a_busy_port_says_it_moved(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with start(use_port=port) as s:
            note = f"port {port} is busy, using "
            assert note in capsys.readouterr().err
            assert note in str(s.status())
            assert s.run_cell("rank") == ["0", "1"]


def test_a_large_exception_is_kept_once(session: Session) -> None:
    """The failure's pickled bytes, the record and the rebuilt exception: once (~3 copies
    before: the stand-in frames kept the kernel's stack alive)."""
    size = 60 << 20
    with pytest.raises(ValueError) as info:
        session.run_cell(f"raise ValueError('x' * {size})", ranks=[1])
    error = info.value
    del info
    gc.collect()
    holders = [o for o in gc.get_objects() if type(o) in (dict, list, tuple)]
    copies = sum(
        1
        for holder in holders
        for v in (holder.values() if type(holder) is dict else holder)
        if type(v) in (bytes, str) and len(v) >= size
    )
    assert copies <= 1, f"{copies} copies of the {size >> 20} MB exception are kept"
    assert len(error.args[0]) == size


@pytest.mark.parametrize("method", METHODS)
def test_a_daemon_a_rank_started_ends_with_the_ranks(method: str) -> None:
    tag = f"{os.getpid()}{int(time.time() * 1000) % 100000}"
    with start(method) as s:
        s.run_cell(
            "import subprocess\n"
            f"subprocess.run(['sh', '-c', 'setsid sleep 1{tag} </dev/null >/dev/null 2>&1 &'])\n"
            f"subprocess.Popen(['setsid', '-f', 'sleep', '2{tag}'])"
        )
        deadline = time.monotonic() + 10
        while len(_daemons(tag)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_daemons(tag)) == 4  # two per rank, outside the rank's process group
    deadline = time.monotonic() + 10
    while _daemons(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _daemons(tag), "a setsid daemon outlived the session"


def _daemons(tag: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"sleep [12]{tag}"], capture_output=True, text=True)
    return found.stdout.split()
