"""Run Accelerate's own test scripts against notebook_launcher (used by test_parity_accelerate).

Three pieces, each usable on its own:

* :func:`accelerate_sources` fetches the ``accelerate==1.15.0`` source distribution with
  ``pip download --no-deps --no-binary=:all:`` into a cache outside the repository
  (``$NOTEBOOK_LAUNCHER_CACHE`` or ``~/.cache/notebook_launcher``) and unpacks only
  ``src/accelerate/test_utils/`` (their test scripts and helpers) and ``tests/`` (their unit
  tests): never installed, never vendored.
* :class:`AccelerateShim`, an import hook named ``accelerate``: ``accelerate``,
  ``accelerate.utils.operations`` and the other modules Accelerate's scripts import resolve to
  notebook_launcher's own modules (the same objects), ``accelerate.test_utils.*`` to the
  unpacked files, the modules this package leaves to Accelerate (``accelerate.hooks``...) to
  its ``AccelerateOnlyError`` (or stand-ins raising it when used), and anything else raises ``ModuleNotFoundError`` naming the module, so a
  missing piece shows as such. It is installed only inside the processes that run the scripts
  (the ranks, or a child acting as the notebook kernel), never in the pytest process, where
  the real ``accelerate`` stays importable.
* :func:`run_cases`, the rank side: installs the shim, imports one script and runs its test
  functions one by one, each from a fresh state, writing each outcome (passed, failed with
  its traceback, skipped with its reason) to a JSON-lines file as soon as it is known, so the
  kernel side still knows what ran when a case takes the launch down.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import unittest
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ACCELERATE_VERSION = "1.15.0"

#: accelerate module -> ours. Everything their scripts import must resolve through this.
ALIASES = {
    "accelerate": "notebook_launcher",
    "accelerate.accelerator": "notebook_launcher.accelerator",
    "accelerate.checkpointing": "notebook_launcher.checkpointing",
    "accelerate.data_loader": "notebook_launcher.data_loader",
    "accelerate.launchers": "notebook_launcher.launchers",
    "accelerate.local_sgd": "notebook_launcher.local_sgd",
    "accelerate.logging": "notebook_launcher.logging",
    "accelerate.tracking": "notebook_launcher.tracking",
    "accelerate.optimizer": "notebook_launcher.optimizer",
    "accelerate.scheduler": "notebook_launcher.scheduler",
    "accelerate.state": "notebook_launcher.state",
    "accelerate.utils": "notebook_launcher.utils",
    "accelerate.utils.constants": "notebook_launcher.utils.constants",
    "accelerate.utils.dataclasses": "notebook_launcher.utils.dataclasses",
    "accelerate.utils.environment": "notebook_launcher.utils.environment",
    "accelerate.utils.memory": "notebook_launcher.utils.memory",
    "accelerate.utils.modeling": "notebook_launcher.utils.modeling",
    "accelerate.utils.other": "notebook_launcher.utils.other",
    "accelerate.utils.imports": "notebook_launcher.utils.imports",
    "accelerate.utils.operations": "notebook_launcher.utils.operations",
    "accelerate.utils.random": "notebook_launcher.utils.random",
}
_HELPERS = "accelerate.test_utils"


# ------------------------------------------------------------------------------ the sources


def cache_dir() -> Path:
    root = os.environ.get("NOTEBOOK_LAUNCHER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "notebook_launcher"
    )
    return Path(root) / f"accelerate-{ACCELERATE_VERSION}-sdist"


def accelerate_sources() -> Path:
    """Directory holding ``accelerate/test_utils/`` and ``tests/`` of the released source
    distribution (fetched once): their test scripts and helpers, and their unit tests."""
    root = cache_dir()
    if (root / "accelerate" / "test_utils" / "scripts" / "test_ops.py").is_file() and (
        root / "tests" / "test_accelerator.py"
    ).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                f"accelerate=={ACCELERATE_VERSION}",
            ],
            check=True,
            timeout=300,
            capture_output=True,
        )
        (sdist,) = Path(tmp).glob("accelerate-*.tar.gz")
        unpacked = Path(tmp) / "unpacked"
        top = f"accelerate-{ACCELERATE_VERSION}/"
        wanted = {
            top + "src/accelerate/test_utils/": "accelerate/test_utils/",
            top + "tests/": "tests/",
        }
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                for prefix, target in wanted.items():
                    if member.isfile() and member.name.startswith(prefix):
                        dest = unpacked / target / member.name[len(prefix) :]
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        source = archive.extractfile(member)
                        assert source is not None
                        dest.write_bytes(source.read())
        try:
            os.replace(unpacked, root)  # atomic: a half-unpacked cache never looks complete
        except OSError:
            if not root.is_dir():  # a concurrent run won the race otherwise
                raise
    return root


# ------------------------------------------------------------------------------ the shim


#: Accelerate's modules that notebook_launcher deliberately leaves to Accelerate itself (see
#: notebook_launcher/_accelerate_only.py): importing them raises its AccelerateOnlyError, or,
#: with ``stand_in_accelerate_only``, gives a stand-in module (see :func:`install`).
ACCELERATE_ONLY_MODULES = {
    "accelerate.big_modeling": "big_modeling",
    "accelerate.hooks": "hooks",
    "accelerate.inference": "inference",
    "accelerate.commands": "commands",
    "accelerate.commands.merge": "commands",
    "accelerate.utils.launch": "launch",
}


def _stand_in(name: str, fallback: str) -> Callable[..., Any]:
    """A stand-in for an Accelerate-only name: raises the package's error when used."""
    from notebook_launcher._accelerate_only import ACCELERATE_ONLY, error_for

    key = name if name in ACCELERATE_ONLY else fallback

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise error_for(key)

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


#: Modules (by ``__name__``) whose own imports of Accelerate-only names raise as without
#: stand-ins (see :func:`install`).
_STRICT_IMPORTERS: set[str] = set()


def _importer_is_strict() -> bool:
    """Whether the code importing now is one of :data:`_STRICT_IMPORTERS`: the first frame
    outside the import machinery and this file."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith("<frozen importlib") or filename == __file__):
            return frame.f_globals.get("__name__") in _STRICT_IMPORTERS
        frame = frame.f_back  # type: ignore[assignment]
    return False


class _StandInModule(ModuleType):
    def __init__(self, name: str, key: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: its submodules are stand-ins too
        self._key = key

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _stand_in(attr, self._key)


class AccelerateShim(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import accelerate...`` answered by notebook_launcher (see the module docstring)."""

    def __init__(self, sources: Path, stand_in_accelerate_only: bool = False) -> None:
        self.sources = sources
        self.stand_in = stand_in_accelerate_only
        self._specs: dict[str, Any] = {}
        #: the package's names get their stand-ins on the first ``import accelerate...``
        #: (:func:`_stand_in_package_names` imports the package, and with it torch: ~2 s
        #: that an interpreter of the run which never imports accelerate -- one torch
        #: starts to test a compiled library -- would pay at start-up for nothing)
        self._names_pending = stand_in_accelerate_only

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "accelerate" and not fullname.startswith("accelerate."):
            return None
        if fullname in ALIASES or fullname in ACCELERATE_ONLY_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        if fullname == _HELPERS or fullname.startswith(_HELPERS + "."):
            base = self.sources.joinpath(*fullname.split("."))
            if base.is_dir():
                return importlib.util.spec_from_file_location(
                    fullname, base / "__init__.py", submodule_search_locations=[str(base)]
                )
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        raise ModuleNotFoundError(
            f"{fullname} has no counterpart in notebook_launcher (the accelerate shim maps "
            f"{', '.join(sorted(ALIASES))} and accelerate.test_utils)",
            name=fullname,
        )

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if spec.name in ACCELERATE_ONLY_MODULES:
            key = ACCELERATE_ONLY_MODULES[spec.name]
            if self.stand_in and not _importer_is_strict():
                return _StandInModule(spec.name, key)
            from notebook_launcher._accelerate_only import error_for

            raise error_for(key)
        if self._names_pending:
            self._names_pending = False
            _stand_in_package_names()
        module = importlib.import_module(ALIASES[spec.name])
        self._specs[spec.name] = module.__spec__  # the import system overwrites it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        if isinstance(module, _StandInModule):
            return
        # Our module is already executed; give it back its own spec.
        module.__spec__ = self._specs.pop(module.__spec__.name)  # type: ignore[union-attr]


def _stand_in_package_names() -> None:
    """``from accelerate import init_empty_weights`` binds a stand-in instead of raising
    (our packages' ``__getattr__`` raise AccelerateOnlyError for those names)."""
    from notebook_launcher._accelerate_only import (
        AccelerateOnlyAttributeError,
        AccelerateOnlyError,
        lookup_error,
    )

    for name in (
        "notebook_launcher",
        "notebook_launcher.utils",
        "notebook_launcher.utils.modeling",
    ):
        module = importlib.import_module(name)
        original = module.__getattr__

        def lookup(attr: str, original: Callable[[str], Any] = original) -> Any:
            try:
                return original(attr)
            except (AccelerateOnlyError, AccelerateOnlyAttributeError):
                if _importer_is_strict():
                    # the kind (ImportError or AttributeError) is the real caller's, not ours
                    raise lookup_error(attr, sys._getframe(1)) from None
                return _stand_in(attr, attr)

        module.__getattr__ = lookup  # type: ignore[method-assign]


def install(
    sources: Path,
    stand_in_accelerate_only: bool = False,
    strict_importers: Sequence[str] = (),
) -> AccelerateShim:
    """Make ``import accelerate`` mean notebook_launcher in this process (for good).

    ``stand_in_accelerate_only``: the names and modules notebook_launcher leaves to Accelerate
    (big-model inference, FSDP/DeepSpeed, the command line) import as stand-ins that raise the
    package's AccelerateOnlyError when used, instead of at the import. For their unit-test
    files, which import such names at the top next to the training API: the tests that use
    them fail at that error, the others run.
    ``strict_importers``: modules (``__name__``, e.g. ``"__main__"`` for a script run by
    ``runpy``) whose own imports get no stand-ins: they raise at the import, as a user's code
    would, while libraries they use (Transformers imports ``dispatch_model``...) get them.
    """
    for finder in sys.meta_path:
        if isinstance(finder, AccelerateShim) and finder.stand_in == stand_in_accelerate_only:
            _STRICT_IMPORTERS.update(strict_importers)
            return finder  # installed at start-up already (tests/_parity_site/sitecustomize.py)
    for name in [n for n in sys.modules if n == "accelerate" or n.startswith("accelerate.")]:
        del sys.modules[name]  # a real Accelerate imported earlier (a forked rank inherits it)
    _STRICT_IMPORTERS.update(strict_importers)
    shim = AccelerateShim(sources, stand_in_accelerate_only)
    sys.meta_path.insert(0, shim)  # (the stand-ins of names: on the first accelerate import)
    return shim


# ------------------------------------------------------------------------------ rank side


@dataclass
class Case:
    """One of their test functions, called as their ``main()`` calls it.

    ``call(module, env)`` runs it: ``module`` is their script, ``env`` what the script's
    preamble made (an ``accelerator``, a ``state``...).
    """

    name: str
    call: Callable[[ModuleType, dict[str, Any]], Any]
    needs: tuple[str, ...] = ()
    cuda: str | None = None
    differs: str | None = None
    raises: str | None = None
    processes: int = 2
    timeout: float = 60.0


def _fresh_state() -> None:
    """Forget every shared state (the process group stays): each case starts as a new run."""
    state = importlib.import_module("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


def _watchdog(case: Case) -> threading.Timer:
    """Ends this rank (stacks on stderr) if ``case`` outlives its timeout: a case stuck in a
    collective cannot be interrupted, and the kernel side resumes with the next case.

    (``faulthandler.dump_traceback_later`` would do, but deadlocks in a rank forked from a
    pytest that uses it for ``faulthandler_timeout``.)
    """

    def expire() -> None:
        sys.stderr.write(f"case {case.name} ran over {case.timeout:.0f}s; stacks:\n")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(case.timeout, expire)
    timer.daemon = True
    timer.start()
    return timer


class _Alarm:
    """The kernel side's watchdog: SIGALRM, not a thread. A thread running in the kernel
    would make the launcher choose a forkserver over fork (a lock it holds could hang a
    forked rank), and their functions are written for fork: they pass a
    ``multiprocessing.Queue`` that only fork can hand over."""

    def __init__(self, case: Case) -> None:
        def expire(signum: int, frame: Any) -> None:
            sys.stderr.write(f"case {case.name} ran over {case.timeout:.0f}s; stacks:\n")
            faulthandler.dump_traceback(all_threads=True)
            sys.stderr.flush()
            os._exit(3)

        self._before = signal.signal(signal.SIGALRM, expire)
        signal.alarm(max(1, int(case.timeout)))

    def cancel(self) -> None:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self._before)


def _outcome(
    case: Case,
    module: ModuleType,
    preamble: Callable[..., dict[str, Any]],
    watchdog_for: Callable[[Case], Any] = _watchdog,
) -> dict:
    start = time.monotonic()
    watchdog = watchdog_for(case)
    try:
        _fresh_state()
        case.call(module, preamble(module))
        status, detail = "passed", ""
    except unittest.SkipTest as exc:
        status, detail = "skipped", str(exc)
    except BaseException as exc:
        if type(exc).__name__ == "Skipped":  # pytest.skip() inside their function
            status, detail = "skipped", str(exc)
        elif isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        else:
            status = "failed"
            detail = "".join(traceback.format_exception(exc))
    finally:
        watchdog.cancel()
    return {
        "case": case.name,
        "status": status,
        "detail": detail,
        "seconds": round(time.monotonic() - start, 3),
    }


def run_cases(
    sources: str,
    script: str,
    preamble: Callable[[ModuleType], dict[str, Any]],
    cases: list[Case],
    workdir: str,
    out_dir: str,
) -> None:
    """Rank side: run ``cases`` of ``accelerate.test_utils.scripts.<script>``, record each."""
    install(Path(sources))
    # Their scripts record warnings with catch_warnings(record=True) and expect the default
    # filters; a rank forked from pytest would otherwise inherit its "error" filter.
    warnings.resetwarnings()
    os.chdir(workdir)  # their scripts write files into the working directory
    rank = int(os.environ.get("RANK", "0"))
    module = importlib.import_module(f"accelerate.test_utils.scripts.{script}")
    with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") as out:
        for case in cases:
            record = _outcome(case, module, preamble)
            out.write(json.dumps(record) + "\n")
            out.flush()


def read_outcomes(out_dir: str) -> dict[int, dict[str, dict]]:
    """rank -> case name -> outcome record, from the files :func:`run_cases` wrote."""
    found: dict[int, dict[str, dict]] = {}
    for path in Path(out_dir).glob("rank*.jsonl"):
        rank = int(path.stem[4:])
        with open(path) as f:
            found[rank] = {r["case"]: r for r in map(json.loads, f)}
    return found


def run_kernel_cases(sources: str, script: str, names: list[str], out_file: str) -> None:
    """Kernel side: their functions that call ``notebook_launcher`` themselves (test_notebook)
    run here, in a child process standing in for the notebook kernel."""
    install(Path(sources))
    warnings.resetwarnings()
    module = importlib.import_module(f"accelerate.test_utils.scripts.{script}")
    with open(out_file, "a") as out:
        for name in names:
            case = Case(name, lambda m, env, name=name: getattr(m, name)(), timeout=120.0)
            record = _outcome(case, module, lambda m: {}, _Alarm)
            out.write(json.dumps(record) + "\n")
            out.flush()


if __name__ == "__main__":
    # python -m tests._parity_shim SOURCES SCRIPT OUT_FILE NAME...
    run_kernel_cases(sys.argv[1], sys.argv[2], sys.argv[4:], sys.argv[3])
