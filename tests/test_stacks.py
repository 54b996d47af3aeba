"""Where each rank is, as data and words (issue 19), without starting a process.

A real fault handler's dump parsed; the odd rank out named for each kind of hang (a table);
a rank's own frames; the text and HTML of a report; the model, text view and widget that
show it; the stall watch's clock; the flight recorder's summary; values compared across
ranks; the messages of mismatched collectives.
"""

from __future__ import annotations

import faulthandler
import io
import linecache
import os
import sysconfig
import tempfile
import threading
from typing import Any

import pytest

from notebook_launcher import _stacks
from notebook_launcher._events import (
    LaunchFinished,
    LaunchStarted,
    RankStacks,
    StackFrame,
    StacksTaken,
    StallOver,
    ThreadStack,
)
from notebook_launcher._launch import compare as values
from notebook_launcher._launch import stall
from notebook_launcher._worker import collectives
from notebook_launcher.errors import PreflightError
from notebook_launcher.ui import TextView
from notebook_launcher.ui.html import snapshot
from notebook_launcher.ui.model import LaunchModel
from notebook_launcher.ui.stall import Stacks, stall_html

pytestmark = pytest.mark.unit

SITE = sysconfig.get_paths()["purelib"]
C10D = os.path.join(SITE, "torch", "distributed", "distributed_c10d.py")
AUTOGRAD = os.path.join(SITE, "torch", "autograd", "__init__.py")
OURS = os.path.dirname(os.path.abspath(_stacks.__file__))
ENTRY = os.path.join(OURS, "_worker", "entry.py")
SESSION = os.path.join(OURS, "_worker", "session.py")
THREADING = threading.__file__
TRAIN = "/tmp/nl-test-user/train.py"
SOURCE = [
    "def train():\n",  # 1
    "    x = ones(4)\n",  # 2
    "    time.sleep(60)\n",  # 3
    "    dist.all_reduce(x)\n",  # 4
    "    dist.broadcast(x, 0)\n",  # 5
    "    loss.backward()\n",  # 6
]
linecache.cache[TRAIN] = (1, None, SOURCE, TRAIN)


def frame(filename: str, lineno: int, function: str) -> StackFrame:
    return StackFrame(filename, lineno, function, linecache.getline(filename, lineno).strip())


def user(line: int) -> StackFrame:
    return frame(TRAIN, line, "train")


def main(*frames: StackFrame) -> ThreadStack:
    return ThreadStack("0x1", (frame(ENTRY, 200, "_serve"), *frames), main=True)


def rank(r: int, *frames: StackFrame, **kw: Any) -> RankStacks:
    return RankStacks(r, 100 + r, (_stacks.own_frames(main(*frames)),), **kw)


SLEEPS = (user(3),)
REDUCES = (user(4), frame(C10D, 3252, "all_reduce"))
BROADCASTS = (user(5), frame(C10D, 2800, "broadcast"))
BACKWARD = (user(6), frame(AUTOGRAD, 395, "backward"))


# --- a real dump ----------------------------------------------------------------------------


def test_a_real_fault_handler_dump_is_parsed() -> None:
    release = threading.Event()

    def helper_target() -> None:
        release.wait(10)

    helper = threading.Thread(target=helper_target, daemon=True)
    helper.start()
    try:
        with tempfile.TemporaryFile() as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            text = f.read().decode()
    finally:
        release.set()
        helper.join()
    me = f"0x{threading.get_ident():016x}"
    threads = _stacks.parse_dump(text, me)
    assert threads[0].main and threads[0].ident == me
    here = threads[0].frames[-1]
    assert here.function == "test_a_real_fault_handler_dump_is_parsed"
    assert here.source == "faulthandler.dump_traceback(f, all_threads=True)"  # read here
    other = next(t for t in threads if helper.ident and int(t.ident, 16) == helper.ident)
    assert _stacks.thread_label(other) == f"thread {other.ident} (helper_target)"
    assert [f.function for f in other.frames][-3:] == ["helper_target", "wait", "wait"]


# --- the odd rank out -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "finding", "odd"),
    [
        (  # one rank sleeps, the others wait for it
            [rank(0, *REDUCES), rank(1, *SLEEPS), rank(2, *REDUCES), rank(3, *REDUCES)],
            "rank 1 is in `time.sleep(60)` at train.py:3; ranks 0, 2, 3 wait in `all_reduce` "
            "at line 4",
            (1,),
        ),
        (  # the example: one rank in backward (DDP's all-reduce in C++)
            [rank(0, *REDUCES), rank(1, *BACKWARD), rank(2, *REDUCES)],
            "rank 1 is in `loss.backward()` at train.py:6; ranks 0, 2 wait in `all_reduce` "
            "at line 4",
            (1,),
        ),
        (  # every rank waits, in different collectives: the minority is odd
            [rank(0, *REDUCES), rank(1, *BROADCASTS), rank(2, *REDUCES)],
            "rank 1 waits in `broadcast` at train.py:5; ranks 0, 2 wait in `all_reduce` at line 4",
            (1,),
        ),
        (  # all in the same place
            [rank(0, *REDUCES), rank(1, *REDUCES)],
            "every rank waits in `all_reduce` at train.py:4",
            (),
        ),
        (  # one each: no majority, the ones not waiting are odd
            [rank(0, *REDUCES), rank(1, *SLEEPS)],
            "rank 1 is in `time.sleep(60)` at train.py:3; rank 0 waits in `all_reduce` at line 4",
            (1,),
        ),
        (  # a rank that does not answer, and idle ranks of a session
            [
                rank(0, *REDUCES),
                RankStacks(1, 101, error="did not answer within 0.5s"),
                rank(2, frame(SESSION, 111, "serve")),
            ],
            "rank 1 did not answer within 0.5s; rank 2 is idle (waits for the next task); "
            "rank 0 waits in `all_reduce` at train.py:4",
            (1, 2),
        ),
        (  # eight ranks, one behind: ranges
            [rank(r, *(SLEEPS if r == 7 else REDUCES)) for r in range(8)],
            "rank 7 is in `time.sleep(60)` at train.py:3; ranks 0-6 wait in `all_reduce` at line 4",
            (7,),
        ),
    ],
    ids=["sleeper", "backward", "mismatch", "same", "two", "no-answer-idle", "eight"],
)
def test_the_odd_rank_out_is_named(
    ranks: list[RankStacks], finding: str, odd: tuple[int, ...]
) -> None:
    assert _stacks.findings(ranks) == ((finding,), odd)


def test_an_import_is_named_by_its_module() -> None:
    importing = (
        user(2),
        frame(os.path.join(SITE, "torch", "nn", "__init__.py"), 3, "<module>"),
        frame("<frozen importlib._bootstrap>", 241, "_call_with_frames_removed"),
        frame(os.path.join(SITE, "sympy", "core", "basic.py"), 9, "<module>"),
    )
    place = _stacks.place_of(rank(0, *importing))
    assert place.what == "import torch.nn" and place.frame == user(2)


def test_a_ranks_own_frames_start_below_its_entry() -> None:
    kernel = frame("/tmp/ipykernel_1/99.py", 3, "<module>")  # a forked rank's inheritance
    thread = ThreadStack(
        "0x1",
        (kernel, frame(ENTRY, 176, "run"), frame(ENTRY, 240, "_serve"),
         frame(SESSION, 111, "serve"), frame(SESSION, 145, "_run_task"), user(3)),
        main=True,
    )  # fmt: skip
    assert _stacks.own_frames(thread).frames == (user(3),)


# --- as text and HTML ---------------------------------------------------------------------


def report(*ranks: RankStacks, reason: str = "stall") -> StacksTaken:
    findings, odd = _stacks.findings(ranks)
    return StacksTaken(reason, 31.0, tuple(ranks), findings, odd, 1.0, ((1, "last #3"),))


def test_the_report_as_text() -> None:
    machinery = ThreadStack(
        "0x2", (frame(THREADING, 1002, "_bootstrap"), frame(os.path.join(OURS, "_worker", "barriers.py"), 155, "_run"))
    )  # fmt: skip
    deep = ThreadStack("0x3", (user(2),), truncated=True)
    r0 = RankStacks(0, 100, (main(*REDUCES), machinery))
    r1 = RankStacks(1, 101, (_stacks.own_frames(main(*SLEEPS)), deep), ((555, (main(user(3)),)),))
    r2 = RankStacks(2, 102, (main(*REDUCES), machinery))
    text = _stacks.format_report(report(r0, r1, r2))
    assert text.startswith(
        "no rank made progress for 31s; where each rank is:\n"
        "  rank 1 is in `time.sleep(60)` at train.py:3; ranks 0, 2 wait in `all_reduce` at "
        "line 4\n  rank 1 flight recorder: last #3\n--- ranks 0, 2 (pid 100, 102) (the same "
        "stacks)\n main thread:\n"
    ), text
    assert '  File "/tmp/nl-test-user/train.py", line 4, in train\n    dist.all_reduce(x)\n' in text
    assert " (1 thread of notebook_launcher not shown)\n" in text
    assert "--- rank 1 (pid 101) <- the odd one out\n" in text
    assert "[deeper than 100 frames: the outermost are not shown]" in text
    assert " child process 555, main thread:\n" in text
    interrupted = _stacks.format_report(report(r0, r1, reason="interrupt"))
    assert interrupted.startswith("where each rank was when it was interrupted:\n")


def test_the_report_as_html_and_in_the_model_and_snapshot() -> None:
    found = report(rank(0, *REDUCES), rank(1, *SLEEPS), rank(2, *REDUCES))
    html = stall_html(found)
    assert html.count("data-ranks=") == 2  # ranks 0 and 2 share a column
    assert "nl-stall-col nl-stall-odd' data-ranks='1'" in html
    assert "refreshed while it lasts" in html and "time.sleep(60)" in html
    assert "&lt;" not in stall_html(None) and stall_html(None) == ""
    shown = Stacks(found)
    assert str(shown).startswith("no rank made progress") and shown.odd == (1,)
    assert "refreshed" not in shown._repr_html_()  # taken once, not live

    m = LaunchModel()
    assert m.apply(StacksTaken("request", 0.0, (), (), (), 1.0)) == frozenset()  # on demand
    assert m.apply(found) == frozenset({("stall",)}) and m.stall is found
    started = LaunchStarted(3, 3, 0, 1, "fork", "", "127.0.0.1", 1, "gloo", (0, 1, 2), 0.0)
    m.apply(started)
    assert "nl-stall" in snapshot(m, 2.0)  # a saved notebook keeps where the ranks were
    assert m.apply(StallOver(2.0, 3.0)) == frozenset({("stall",)}) and m.stall is None
    assert "nl-stall" not in snapshot(m, 3.0)


def test_the_text_view_prints_a_stall_once_per_change_and_its_end() -> None:
    out = io.StringIO()
    view = TextView(out)
    view.handle(StallOver(1.0, 1.0))  # no stall shown: nothing to say
    found = report(rank(0, *REDUCES), rank(1, *SLEEPS))
    view.handle(found)
    view.handle(found)  # looked at again: the same places
    view.handle(report(rank(0, *REDUCES), rank(1, *SLEEPS), reason="request"))
    moved = report(rank(0, *REDUCES), rank(1, *BACKWARD))
    view.handle(moved)  # other places: said once they hold for two looks
    assert "still no progress" not in out.getvalue()
    view.handle(moved)
    assert out.getvalue().endswith(
        "notebook_launcher: still no progress (31.0s): rank 1 is in `loss.backward()` at "
        "train.py:6; rank 0 waits in `all_reduce` at line 4\n"
    )
    view.handle(StallOver(12.5, 2.0))
    view.handle(LaunchFinished(True, "ok", None, 1.0, 3.0))
    text = out.getvalue()
    assert text.count("where each rank is") == 1
    assert text.startswith("notebook_launcher: no rank made progress for 31s; where each rank")
    assert "notebook_launcher: progress again (the stall lasted 12.5s)\n" in text


def test_the_widget_shows_the_stall_while_it_lasts() -> None:
    pytest.importorskip("ipywidgets")
    from notebook_launcher.ui.widgets import WidgetView

    clock = [0.0]
    view = WidgetView(display=False, clock=lambda: clock[0])
    view.handle(report(rank(0, *REDUCES), rank(1, *SLEEPS)))
    clock[0] += 1
    view.tick()
    assert "nl-stall-odd" in view.stall.value and "time.sleep(60)" in view.stall.value
    view.handle(StallOver(2.0, 1.0))
    clock[0] += 1
    view.tick()
    assert view.stall.value == ""
    view.close()


# --- the watch ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_looks_after_stall_after_refreshes_and_clears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looks: list[tuple[str, float]] = []

    def fake(procs: Any, reason: str, quiet: float = 0.0, timeout: float = 0.5) -> StacksTaken:
        looks.append((reason, quiet))
        return report(rank(0, *REDUCES), rank(1, *SLEEPS), reason=reason)

    monkeypatch.setattr(stall, "report", fake)
    clock, shown = Clock(), []
    watch = stall.StallWatch(30.0, shown.append, lambda: {0: (1, None)}, clock)
    assert watch.timeout(0.5) == 0.5  # nothing due soon
    clock.now += 29.8
    assert watch.timeout(0.5) == pytest.approx(0.2)  # the pump wakes when it is due
    watch.tick()
    assert not shown
    clock.now += 0.2
    watch.tick()
    assert [type(e).__name__ for e in shown] == ["StacksTaken"] and looks == [("stall", 30.0)]
    watch.tick()  # not again at once...
    clock.now += stall.REFRESH
    watch.tick()  # ...but every REFRESH seconds while it lasts
    assert len(shown) == 2
    watch.saw(object())  # progress
    assert isinstance(shown[-1], StallOver) and shown[-1].lasted == pytest.approx(35.0)
    off = stall.StallWatch(None, shown.append, lambda: {0: (1, None)}, clock)
    clock.now += 1000
    off.tick()
    assert off.timeout(0.5) == 0.5 and len(shown) == 3
    assert off.take().reason == "request"  # on demand even when off


def test_an_interrupt_takes_the_stacks_only_when_the_ranks_were_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stall, "report", lambda *a, **k: report(rank(0, *REDUCES), reason=a[1]))
    clock = Clock()
    watch = stall.StallWatch(None, lambda e: None, lambda: {0: (1, None)}, clock)
    assert watch.on_interrupt() is None  # busy a moment ago
    clock.now += stall.INTERRUPT_QUIET
    found = watch.on_interrupt()
    assert found is not None and found.reason == "interrupt"
    assert (stall.note(found) or "").startswith("where each rank was when it was interrupted:")


def test_a_look_that_finds_only_starting_ranks_shows_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starting = RankStacks(0, 1, error=stall.STARTING)
    monkeypatch.setattr(stall, "report", lambda *a, **k: report(starting))
    clock, shown = Clock(), []
    watch = stall.StallWatch(1.0, shown.append, lambda: {0: (1, None)}, clock)
    clock.now += 2
    watch.tick()
    watch.saw(object())
    assert shown == []  # neither a report nor its end


@pytest.mark.parametrize("bad", [0, -1, "30", True, float("nan")])
def test_stall_after_must_be_seconds_or_none(bad: Any) -> None:
    with pytest.raises(PreflightError, match="stall_after must be a number of seconds > 0"):
        stall.check_stall_after(bad)
    assert stall.check_stall_after(None) is None and stall.check_stall_after(5) == 5.0


# --- the flight recorder --------------------------------------------------------------------


def test_the_flight_recorder_names_the_rank_behind() -> None:
    def entry(seq: int, state: str = "scheduled") -> dict[str, Any]:
        return {"collective_seq_id": seq, "profiling_name": "nccl:all_reduce",
                "input_sizes": [[4]], "state": state, "is_p2p": False}  # fmt: skip

    lines = dict(
        stall.flight_findings(
            {0: [entry(11, "completed"), entry(12, "started")], 1: [entry(11, "completed")], 2: []}
        )
    )
    assert lines[0] == "last collective #12 all_reduce [4] (started)"
    assert (
        lines[1] == "last collective #11 all_reduce [4] (completed), behind: the others are at #12"
    )
    assert lines[2] == "no collective recorded"
    assert stall.flight_findings({0: [], 1: []}) == []


def test_the_kernel_finds_a_ranks_stack_files_and_asks_its_helper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 33, item 9: a rank's stack files are memory files (no temporary directory to
    probe, nothing to rename on every rank's start) and its helper's request pipe is named
    by the answer file (fd and inode); the kernel finds both among the rank's open files
    and asks. Where memory files are refused, a temporary file of the same name is found
    the same way."""
    import time

    from notebook_launcher._stacks import FILE_PREFIX, PYSTACKS_PREFIX
    from notebook_launcher._worker import stacks as rank_stacks

    me = os.getpid()
    fds = rank_stacks._serve_requests(PYSTACKS_PREFIX, me, lambda: b"every stack\n")
    answer = None
    try:
        found = stall._find(me, f"{PYSTACKS_PREFIX}out-")
        assert found is not None and found[0].startswith(f"/proc/{me}/fd/")
        assert os.readlink(found[0]).startswith(f"/memfd:{PYSTACKS_PREFIX}out-{me}-")
        answer = stall.ask_through_pipe(me, PYSTACKS_PREFIX)
        assert answer is not None
        deadline = time.monotonic() + 10
        while os.pread(answer, 64, 0) != b"every stack\n" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.pread(answer, 64, 0) == b"every stack\n"
    finally:
        for fd in (*fds, *([answer] if answer is not None else [])):
            os.close(fd)  # (the helper's read fails: it ends)

    def refused(name: str, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refused)
    fd = rank_stacks._named_file(f"{FILE_PREFIX}7f-{me}")
    try:
        found = stall._find(me, FILE_PREFIX)
        assert found is not None and found[1] == f"7f-{me}"
        assert os.readlink(found[0]).endswith(f"/{FILE_PREFIX}7f-{me} (deleted)")
    finally:
        os.close(fd)


# --- values compared across ranks -----------------------------------------------------------


def test_values_compared_digest_first_then_details() -> None:
    np = pytest.importorskip("numpy")
    rows = {
        0: {"model": [("w", "float32 [2, 2]", "aa"), ("b", "float32 [2]", "bb")], "lr": [("(value)", "0.1", "x")]},
        1: {"model": [("w", "float32 [2, 2]", "ab"), ("b", "float32 [2]", "bb")], "lr": [("(value)", "0.1", "x")]},
        2: {"model": [("w", "float32 [2, 2]", "aa"), ("b", "float32 [2]", "bb")], "lr": [("(value)", "0.1", "x")]},
    }  # fmt: skip
    found = values.compare(rows, ["model", "lr"])
    assert values.wanted(found) == {"model": ["w"]}  # only what differs travels
    ref = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    drifted = ref.copy()
    drifted[1, 0] = 3.5
    values.details(found, {0: {"model": {"w": ref}}, 1: {"model": {"w": drifted}}, 2: {}})
    assert str(found).splitlines() == [
        "model: ranks differ in 1 of 2 entries (1 identical)",
        "  w (float32 [2, 2]): rank 1 differs from ranks 0, 2 in 1 of 4 elements; largest "
        "|difference| 0.5 at [1, 0] (3.5 vs 3)",
        "lr: identical on ranks 0, 1, 2 (1 entry)",
    ]
    assert not found.identical
    assert values.describe_difference(np.zeros(2), np.zeros(3)) == "in shape: [2] vs [3]"
    assert values.describe_difference(0.1, 0.2) == "(0.2 vs 0.1)"


def test_a_large_value_is_compared_whole_whatever_the_order_of_its_entries() -> None:
    """More than 10,000 entries: group digests over every entry (not the first 10,000),
    the same whatever order the entries come in; the differing group is asked for entry by
    entry, and the entry is named."""
    from notebook_launcher._worker import compare as rank_compare

    mine = {f"k{i}": i for i in range(12_000)}
    theirs = dict(reversed(list(mine.items())))  # the same entries, in another order
    rows = {0: {"d": rank_compare._rows(mine, None)}, 1: {"d": rank_compare._rows(theirs, None)}}
    assert {p[: len(values.GROUP)] for p, _, _ in rows[0]["d"]} == {values.GROUP}
    same = values.compare(rows, ["d"])
    assert str(same) == "d: identical on ranks 0, 1 (12,000 entries)"
    assert values.groups_wanted(same) == {}

    theirs["k11999"] = -1
    rows[1] = {"d": rank_compare._rows(theirs, None)}
    found = values.compare(rows, ["d"])
    assert not found.identical
    groups = values.groups_wanted(found)
    assert groups == {"d": [rank_compare.group_of("k11999")]}
    only = set(groups["d"])
    values.expand(
        found,
        {0: {"d": rank_compare._rows(mine, only)}, 1: {"d": rank_compare._rows(theirs, only)}},
    )
    assert values.wanted(found) == {"d": ["k11999"]}
    values.details(found, {0: {"d": {"k11999": 11999}}, 1: {"d": {"k11999": -1}}})
    assert str(found).splitlines() == [
        "d: ranks differ in 1 of 12,000 entries (11,999 identical)",
        "  k11999 (11999): rank 1 differs from rank 0 (-1 vs 11999)",
    ]


def test_a_values_entries_are_named_as_they_always_were() -> None:
    """Issue 33, item 9: a dict's or a list's scalars are walked in runs (loops in C), the
    rest one by one; the paths are the same either way, and in the same order: keys that
    end in a dot or are empty, keys of other types, short tuples kept whole, dataclasses."""
    import dataclasses

    torch = pytest.importorskip("torch")
    from notebook_launcher._worker import compare as rank_compare

    @dataclasses.dataclass
    class Settings:
        lr: float = 0.1
        steps: list[Any] = dataclasses.field(default_factory=lambda: [1, "two"])

    value = {
        "a.": 1, "a": 2, "": 3, 1: "x", "1": b"y", 2.5: None,
        "nested": {"k": 1.5, "t": (1, 2), "deep": {"": None, "x.": 1j}},
        "lst": [1, [2, 3], {"z": True}, "s."],
        "long": tuple(range(18)),
        "tensor": torch.ones(2),
        "dc": Settings(),
        "mixed": {"p": 1, "q": torch.zeros(1), "r": 2, "s": [3]},
    }  # fmt: skip
    found = list(rank_compare.entries(value))
    assert [path for path, _ in found] == [
        "a", "a", "(value)", "1", "1", "2.5", "nested.k", "nested.t", "nested.deep",
        "nested.deep.x", "lst.0", "lst.1", "lst.2.z", "lst.3",
        *(f"long.{i}" for i in range(18)),
        "tensor", "dc.lr", "dc.steps", "mixed.p", "mixed.q", "mixed.r", "mixed.s",
    ]  # fmt: skip
    assert [type(leaf).__name__ for _, leaf in found][:14] == [
        "int", "int", "int", "str", "bytes", "NoneType", "float", "tuple", "NoneType",
        "complex", "int", "list", "bool", "str",
    ]  # fmt: skip
    assert [path for path, _ in rank_compare.entries({"": {"": 1}})] == ["(value)"]


def test_a_large_values_groups_tell_apart_what_its_entries_digests_do() -> None:
    """Issue 33, item 9: a large value's groups are digested in bulk (its entries' bytes,
    sorted), not entry by entry: equal values are equal however they were built (in
    another order, strings shared or not, two keys that read alike), and one entry that
    differs -- in its type only, in the sign of a zero, in a tensor's element -- makes its
    group differ still, and is named."""
    torch = pytest.importorskip("torch")
    from notebook_launcher._worker import compare as rank_compare

    def build(backwards: bool) -> dict[Any, Any]:
        word = "".join(["w", "ord"])
        out: dict[Any, Any] = {}
        for i in reversed(range(12_000)) if backwards else range(12_000):
            out[f"k{i}"] = i
            # one string object shared by every entry on one rank, one each on the other
            out[f"s{i % 50}"] = "".join(["w", "ord"]) if backwards else word
        key = "".join(["sa", "me"])  # a value that is its own key's object on one rank
        out[key] = "".join(["s", "ame"]) if backwards else key
        out.update({"zero": 0.0, "t": {"x": torch.arange(4.0)}})
        out.update({"1": "a str key", 1: "an int key"} if backwards else {1: "an int key"})
        out["1"] = "a str key"
        return out

    def compared(mine: dict[Any, Any], theirs: dict[Any, Any]) -> values.Comparison:
        """The rounds of ``Session.compare``: the wholes, their groups, their entries."""
        rows = {
            0: {"d": rank_compare._rows(mine, None, whole=True)},
            1: {"d": rank_compare._rows(theirs, None, whole=True)},
        }
        assert [p for p, _, _ in rows[0]["d"]] == [values.WHOLE]
        found = values.compare(rows, ["d"])
        if values.wholes_wanted(found) == ["d"]:
            values.expand(
                found,
                {
                    0: {"d": rank_compare._rows(mine, None)},
                    1: {"d": rank_compare._rows(theirs, None)},
                },
            )
        only = set(values.groups_wanted(found).get("d", ()))
        if only:
            values.expand(
                found,
                {
                    0: {"d": rank_compare._rows(mine, only)},
                    1: {"d": rank_compare._rows(theirs, only)},
                },
            )
        return found

    mine, theirs = build(False), build(True)
    rows = {0: {"d": rank_compare._rows(mine, None)}, 1: {"d": rank_compare._rows(theirs, None)}}
    assert values.groups_wanted(values.compare(rows, ["d"])) == {}  # (no group differs)
    assert str(compared(mine, theirs)) == "d: identical on ranks 0, 1 (12,055 entries)"
    # in the same order, the wholes alone say so (one round); in another, the groups do
    same = {r: {"d": rank_compare._rows(build(False), None, whole=True)} for r in (0, 1)}
    assert values.wholes_wanted(values.compare(same, ["d"])) == []
    other = {0: same[0], 1: {"d": rank_compare._rows(theirs, None, whole=True)}}
    assert values.wholes_wanted(values.compare(other, ["d"])) == ["d"]
    for path, other in [
        ("k1", True),  # == 1, and hashes alike
        ("k7", 7.0),
        ("zero", -0.0),
        ("s3", b"word"),
        ("t.x", torch.tensor([0.0, 1.0, 2.0, 3.5])),
    ]:
        changed = build(True)
        if path == "t.x":
            changed["t"] = {"x": other}
        else:
            changed[path] = other
        found = compared(mine, changed)
        assert values.wanted(found) == {"d": [path]}, (path, str(found))
        assert str(found).startswith("d: ranks differ in 1 of 12,055 entries (12,054 identical)")


# --- collectives: what a check compares and says ----------------------------------------------


def test_a_collectives_fingerprint_and_the_mismatch_message() -> None:
    class T:
        def __init__(self, *shape: int) -> None:
            self.shape, self.dtype = shape, "torch.float32"

    params = ["tensor", "src", "group", "async_op"]
    assert collectives.fingerprint("broadcast", params, (T(4),), {"src": 0}) == "float32 [4], src=0"
    assert collectives.fingerprint(
        "all_gather", ["tensor_list", "tensor"], ([T(2), T(2)], T(2)), {}
    ) == ("[float32 [2], float32 [2]], float32 [2]")
    message = collectives.mismatch_message(
        [
            ("all_reduce", "all_reduce(float32 [4])", "a.py:3"),
            ("broadcast", "broadcast()", "a.py:5"),
        ]
    )
    assert message.splitlines() == [
        "The ranks called different collective operations at the same point: process 0: "
        "all_reduce, process 1: broadcast",
        "",
        "Inputs:",
        "  - Process 0: all_reduce(float32 [4])",
        "  - Process 1: broadcast()",
        "Called at:",
        "  - Process 0: a.py:3",
        "  - Process 1: a.py:5",
    ]
