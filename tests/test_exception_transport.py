"""A rank's exception on its way to the kernel, and what the user then reads: no process.

The rank side (:func:`exception_to_failure`, :func:`dump_exception`) and the kernel side
(:func:`rebuild_exception`, :func:`exception_for`) run here in one process, as a table of
exceptions that are hard to carry: a ``__str__`` that raises, a 20 MB message, an
``__init__`` with required arguments, an attribute that cannot be pickled, a chain. The
crash table (``test_crash_table.py``) proves the same with real ranks.
"""

from __future__ import annotations

import enum
import io
import json
import os
import sys
import sysconfig
import threading
import traceback
from typing import Any

import cloudpickle
import pytest

from notebook_launcher import RankFailedError
from notebook_launcher._launch.diagnosis import diagnose, exception_for
from notebook_launcher._serialization import (
    RECORD_CHARS,
    dump_exception,
    dumps,
    exception_to_failure,
    loads,
    rebuild_exception,
    safe_str,
    share_class_identities,
)
from notebook_launcher.errors import LaunchFailure, RankFailure, format_remote_traceback

pytestmark = pytest.mark.unit  # the tier: see tests/conftest.py


def caught(fn: Any, *args: Any) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the object under test
        return exc
    raise AssertionError("did not raise")


def through_the_pipe(exc: BaseException, rank: int = 1) -> BaseException:
    """What the user catches when rank ``rank`` raised ``exc`` (record, ship, rebuild)."""
    failure = exception_to_failure(exc, rank, 4242, 1.0)
    return exception_for(diagnose([failure], {}), 2, {rank: dump_exception(exc)})


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class NeedsTwo(Exception):
    def __init__(self, a: int, b: str) -> None:
        super().__init__(f"{a} and {b}")
        self.a, self.b = a, b


class HoldsLock(Exception):
    def __init__(self) -> None:
        super().__init__("carries a lock")
        self.lock = threading.Lock()


class ReduceRaises(Exception):
    def __reduce__(self) -> Any:
        raise RuntimeError("this class refuses to be pickled")


class NewNeedsKeyword(Exception):
    def __new__(cls, *args: Any, key: str) -> NewNeedsKeyword:
        return super().__new__(cls, *args)

    def __init__(self, *args: Any, key: str) -> None:
        super().__init__(*args)


def raise_needs_two() -> None:
    raise NeedsTwo(3, "x")


# --- item 11: exceptions that are hard to carry ---------------------------------------------


def test_a_str_that_raises_is_reported_as_raised_with_its_type() -> None:
    exc = caught(lambda: (_ for _ in ()).throw(BadStr()))
    failure = exception_to_failure(exc, 1, 4242, 1.0)
    assert failure.kind == "raised" and failure.exc_type == f"{__name__}.BadStr"
    assert "str() failed" in failure.message
    got = through_the_pipe(exc)
    assert type(got) is BadStr
    assert "rank 1 raised tests.test_exception_transport.BadStr" in "".join(got.__notes__)


def test_a_huge_message_stays_on_the_exception_and_out_of_the_summaries() -> None:
    message = "x" * (20 * 2**20)
    exc = caught(lambda: (_ for _ in ()).throw(ValueError(message)))
    failure = exception_to_failure(exc, 1, 4242, 1.0)
    assert len(failure.message) < RECORD_CHARS + 100 and "more characters]" in failure.message
    assert len(failure.traceback) < 2 * RECORD_CHARS
    got = through_the_pipe(exc)
    assert str(got) == message  # the exception keeps all of it
    notes = "\n".join(got.__notes__)
    assert len(notes) < 2000 and "more characters]" in notes
    assert len(got.launch_failure.summary()) < 2000  # type: ignore[attr-defined]


def test_required_init_arguments_are_rebuilt_from_args_and_dict() -> None:
    got = through_the_pipe(caught(raise_needs_two))
    assert type(got) is NeedsTwo
    assert (got.a, got.b, got.args) == (3, "x", ("3 and x",))  # type: ignore[attr-defined]


# name: (the rank's exception, phrases the fallback RankFailedError must say)
NOT_REBUILT: dict[str, tuple[BaseException, list[str]]] = {
    "unpicklable attribute": (
        HoldsLock(),
        [
            "raised tests.test_exception_transport.HoldsLock: carries a lock",
            "its attribute 'lock' holds a _thread.lock, which cannot be pickled",
        ],
    ),
    "own __reduce__ raises": (
        ReduceRaises("boom"),
        ["ReduceRaises: boom", "this class refuses to be pickled", "its own pickling"],
    ),
    "__new__ needs a keyword": (
        NewNeedsKeyword("k", key="v"),
        ["NewNeedsKeyword: k", "missing 1 required keyword", "nor from its args and __dict__"],
    ),
}


@pytest.mark.parametrize("name", list(NOT_REBUILT))
def test_an_exception_that_cannot_travel_names_its_type_and_why(name: str) -> None:
    exc, phrases = NOT_REBUILT[name]
    got = through_the_pipe(exc)
    assert type(got) is RankFailedError
    text = str(got)
    for phrase in phrases:
        assert phrase in text, (phrase, text)
    assert "could not be rebuilt in the kernel" in text
    assert got.launch_failure.root_cause.rank == 1  # type: ignore[attr-defined]


# --- item 3: the rank's frames, as a local error's ------------------------------------------


def user_function() -> None:
    json.loads("{not json")  # the standard library raises, three frames down


def test_the_ranks_frames_are_the_exceptions_traceback() -> None:
    got = through_the_pipe(caught(user_function))
    assert type(got) is json.JSONDecodeError and got.__cause__ is None
    frames = traceback.extract_tb(got.__traceback__)
    names = [f.name for f in frames]
    assert "user_function" in names and names[-1] == "raw_decode"
    user = frames[names.index("user_function")]
    assert (user.filename, user.line) == (
        __file__,
        'json.loads("{not json")  # the ' + ("standard library raises, three frames down"),
    )
    # library frames are marked for IPython and pytest to fold; the user's are not
    tb, hidden = got.__traceback__, []
    while tb is not None:
        hidden.append(bool(tb.tb_frame.f_locals.get("__tracebackhide__")))
        tb = tb.tb_next
    assert hidden[names.index("user_function")] is False and all(hidden[-2:])
    text = "".join(traceback.format_exception(got))
    assert "^^^" not in text  # no carets under characters the stand-in code does not have
    # Raising it puts the caller's frames in front, as for a local error.
    try:
        raise got
    except json.JSONDecodeError as again:
        first = traceback.extract_tb(again.__traceback__)[0]
    assert first.name == "test_the_ranks_frames_are_the_exceptions_traceback"


def chained() -> None:
    try:
        {}["missing"]
    except KeyError as inner:
        raise RuntimeError("outer") from inner


def test_a_chain_comes_back_as_a_chain() -> None:
    got = through_the_pipe(caught(chained))
    assert type(got) is RuntimeError and type(got.__cause__) is KeyError
    assert got.__suppress_context__
    assert traceback.extract_tb(got.__cause__.__traceback__)[-1].name == "chained"


def test_a_record_that_cannot_be_read_still_names_the_type() -> None:
    failure = exception_to_failure(caught(raise_needs_two), 1, 4242, 1.0)
    got = exception_for(diagnose([failure], {}), 2, {1: b"not a pickle"})
    assert type(got) is RankFailedError
    assert "rank 1 raised tests.test_exception_transport.NeedsTwo: 3 and x" in str(got)
    assert "its record could not be read" in str(got)
    assert rebuild_exception(None).reason


# --- every rank's traceback from the exception -----------------------------------------------

SITE = sysconfig.get_paths()["purelib"]
TORCH_TB = (
    "Traceback (most recent call last):\n"
    '  File "/tmp/ipykernel_1/42.py", line 4, in train\n'
    "    dist.all_reduce(t)\n"
    f'  File "{SITE}/torch/distributed/c10d_logger.py", line 83, in wrapper\n'
    "    return func(*args, **kwargs)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^\n"
    f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 3000, in all_reduce\n'
    "    work = group.allreduce([tensor], opts)\n"
    f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n'
    "    work.wait()\n"
    "RuntimeError: Connection closed by peer\n"
)


class FakeShell:
    class compile:
        @staticmethod
        def format_code_name(name: str) -> tuple[str, str] | None:
            return ("Cell", "In[7]") if name.startswith("/tmp/ipykernel_") else None


class FakeIPython:
    @staticmethod
    def get_ipython() -> FakeShell:
        return FakeShell()


def test_library_frames_fold_into_one_line_and_cells_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "IPython", FakeIPython)  # type: ignore[arg-type]
    assert format_remote_traceback(TORCH_TB) == (
        "Traceback (most recent call last):\n"
        "  Cell In[7], line 4, in train\n"
        "    dist.all_reduce(t)\n"
        "  [... 2 frames in torch.distributed]\n"
        f'  File "{SITE}/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n'
        "    work.wait()\n"
        "RuntimeError: Connection closed by peer\n"
    )
    full = format_remote_traceback(TORCH_TB, collapse=False)
    assert "c10d_logger.py" in full and "Cell In[7], line 4, in train" in full


def test_every_ranks_traceback_is_reachable_from_the_exception() -> None:
    own = RankFailure(1, "raised", 11, "ValueError", "bad", TORCH_TB.replace("Runtime", "Value"))
    peer = RankFailure(0, "raised", 10, "RuntimeError", "gloo", TORCH_TB, collateral=True)
    report = LaunchFailure(own, [own, peer, RankFailure(2, "stopped")], 3)
    assert set(report.tracebacks) == {0, 1}
    assert "[... 2 frames in torch.distributed]" in report.tracebacks[0]
    out = io.StringIO()
    report.print_traceback(file=out)  # the root cause's
    assert out.getvalue().rstrip().endswith("ValueError: Connection closed by peer")
    out = io.StringIO()
    report.print_traceback(0, full=True, file=out)
    assert "c10d_logger.py" in out.getvalue()
    assert report.format_traceback(2) == "rank 2 was stopped by the launcher"
    with pytest.raises(KeyError):
        report.format_traceback(5)


def test_the_note_points_at_the_other_ranks_tracebacks() -> None:
    own = exception_to_failure(caught(raise_needs_two), 1, 11, 1.0)
    peer = RankFailure(0, "raised", 10, "RuntimeError", "gloo", TORCH_TB, collateral=True, time=2)
    exc = exception_for(diagnose([own, peer], {}), 2, {1: dump_exception(caught(raise_needs_two))})
    notes = "\n".join(exc.__notes__)
    assert "Tracebacks of ranks [0] too: exc.launch_failure.print_traceback(rank)" in notes


# --- item 1: classes the kernel already has stay as they are -------------------------------

SCALE = 1


def make_classes() -> tuple[type, type]:
    class Local:
        def scaled(self) -> int:
            return SCALE * 2

    class Color(enum.Enum):
        RED = 1

    return Local, Color


def test_a_known_class_comes_back_itself_with_its_own_methods() -> None:
    global SCALE
    local, color = make_classes()
    method = local.scaled
    obj, red = loads(dumps((local(), color.RED)))  # cloudpickle ships both by value
    assert type(obj) is local and red is color.RED
    # cloudpickle would have replaced the method by a copy bound to a globals snapshot
    assert local.scaled is method
    SCALE = 5
    try:
        assert obj.scaled() == 10
    finally:
        SCALE = 1


def test_share_class_identities_tracks_the_notebook_classes_a_function_reaches() -> None:
    local, color = make_classes()

    class Outer:
        class Inner(Exception):
            pass

    def train() -> tuple[Any, ...]:
        return local, color, Outer

    tracked = cloudpickle.cloudpickle._DYNAMIC_CLASS_TRACKER_BY_CLASS
    assert share_class_identities(train) >= 4
    for cls in (local, color, Outer, Outer.Inner):
        assert cls in tracked, cls
    assert ValueError not in tracked and os.PathLike not in tracked  # importable: by reference


def test_safe_str() -> None:
    assert safe_str(ValueError("x")) == "x"
    assert "BadStr" in safe_str(BadStr())


def test_shipped_code_keeps_its_file_name_and_lines() -> None:
    """cloudpickle 3.1.3 renames every code object it rebuilds ``<dynamic-code>``: a
    function shipped by value must keep the cell's name (``Cell In[n]``, its source lines
    from ``linecache``), down to its inner functions and comprehensions."""
    cell = "/tmp/ipykernel_1/2840163514.py"  # how IPython names a cell's code
    source = (
        "def train(n):\n    square = lambda x: x * x\n    return [square(i) for i in range(n)]\n"
    )
    space: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, cell, "exec"), space)  # a notebook-defined function: shipped by value
    shipped = loads(dumps(space["train"]))
    assert shipped is not space["train"] and shipped(3) == [0, 1, 4]
    codes = [shipped.__code__]
    while codes:
        code = codes.pop()
        assert code.co_filename == cell, code
        codes.extend(c for c in code.co_consts if hasattr(c, "co_filename"))
    assert shipped.__code__.co_firstlineno == 1
    assert cloudpickle.__version__  # the newest release the range allows (CI installs fresh)
