"""The README's first screen and its test command (issue 26).

The first screen says what the kit does and gives two commands: the demo and where the tests
are. The test command (``.ci/run`` evals it verbatim) installs Chromium, slurm-wlm, munge and
faketime where ``apt-get`` can, and runs the tests where it cannot (no root, not Debian): the
browser, Slurm and clock-skew tests then skip, naming what they lack; under ``CI`` they fail, as CI runs every tier.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from .helpers import ROOT, SlurmTestCluster, require_system

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(30)]

README = (ROOT / "README.md").read_text()


def test_command() -> str:
    """The command between the markers, as ``.ci/run`` extracts it."""
    block = README.split("<!-- test-command -->\n", 1)[1].split("<!-- /test-command -->", 1)[0]
    return "\n".join(line for line in block.splitlines() if not line.startswith("```"))


test_command.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def test_the_first_screen_says_what_it_is_and_gives_the_two_commands() -> None:
    first_screen = "\n".join(README.splitlines()[:15])
    assert "distributed execution kit for PyTorch" in first_screen
    assert "Linux" in first_screen  # the platforms, before anything is installed
    commands = re.findall(r"```bash\n(.*?)\n```", first_screen, re.S)
    assert len(commands) == 1 and commands[0].endswith("python -m notebook_launcher demo")
    assert "[Development](#development)" in first_screen  # where the test command is
    assert "apt-get" not in first_screen
    assert README.index("## Use it in Jupyter") < README.index("## Development")
    assert README.index("## Development") < README.index("<!-- test-command -->")


def _run_with(
    tmp_path: Path, apt_get: str, installed: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """The test command, on a PATH of stand-ins: python3/pip/python that only say they ran,
    of Chromium, Slurm and munge only the commands ``installed``, and ``apt-get`` as given (a
    shell body)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {
        "python3": '/bin/mkdir -p .venv/bin && : > .venv/bin/activate && echo "ran python3 $*"',
        "pip": 'echo "ran pip $*"',
        "python": 'echo "ran python $*"',
        "apt-get": apt_get,
        **{name: "exit 0" for name in installed},
    }
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    command = test_command().replace("/usr/bin/chromium", str(bin_ / "chromium"))
    return subprocess.run(
        ["/bin/bash", "-c", command],
        cwd=tmp_path,
        env={"PATH": str(bin_), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_the_test_command_runs_the_tests_where_apt_get_cannot_install(tmp_path: Path) -> None:
    done = _run_with(tmp_path, 'echo "E: Permission denied, are you root?" >&2; exit 100')
    assert done.returncode == 0, done.stdout + done.stderr
    assert "could not install chromium, slurm-wlm, munge and faketime" in done.stdout
    assert "the browser, Slurm and clock-skew tests will skip" in done.stdout
    assert done.stdout.splitlines()[-1] == "ran python -m pytest -n 3 --dist loadfile --durations=25"


@pytest.mark.parametrize(
    "installed", [(), ("chromium", "slurmctld")], ids=["nothing", "all-but-munge"]
)
def test_the_test_command_installs_what_every_tier_needs_where_it_can(
    tmp_path: Path, installed: tuple[str, ...]
) -> None:
    done = _run_with(tmp_path, 'echo "ran apt-get $*"', installed)  # root on Debian, as CI is
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ran apt-get install -y -qq chromium slurm-wlm munge faketime" in done.stdout
    assert "could not install" not in done.stdout
    assert done.stdout.splitlines()[-1] == "ran python -m pytest -n 3 --dist loadfile --durations=25"


def test_a_system_package_not_installed_skips_saying_what_but_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"the browser test needs /usr/bin/chromium"):
        require_system("the browser test", ["/usr/bin/chromium (apt-get install -y chromium)"])
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI runs every tier"):
        require_system("the browser test", ["/usr/bin/chromium (apt-get install -y chromium)"])
    require_system("the browser test", [])  # nothing lacking: the test runs


def test_the_slurm_tests_skip_without_slurm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root with an ``apt-get`` that cannot install (offline, another distribution)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "apt-get").write_text("#!/bin/sh\nexit 100\n")
    (bin_ / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"a test Slurm cluster needs .*slurmctld"):
        SlurmTestCluster.start(tmp_path / "cluster")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_is_a_tour_and_every_link_to_the_docs_resolves() -> None:
    """Issue 33, item 8: the README is the two commands, a one-screen tour and where to go
    next (<= 300 lines), the rest in docs/ pages it links; every relative link of the README
    and of those pages names a file that exists, and a heading there when it has an anchor."""
    assert len(README.splitlines()) <= 300
    pages = {"README.md": README} | {
        f"docs/{p.name}": p.read_text() for p in (ROOT / "docs").glob("*.md")
    }
    linked = set()
    for name, text in pages.items():
        here = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", text):
            path, anchor = target
            if path.startswith(("http://", "https://")):
                continue
            file = (here / path).resolve() if path else (ROOT / name).resolve()
            assert file.exists(), f"{name} links to {path}, which does not exist"
            linked.add(file.relative_to(ROOT).as_posix())
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                assert anchor[1:] in {_slug(h) for h in headings}, f"{name}: {path}{anchor}"
    assert {f for f in pages if f.startswith("docs/")} <= linked  # no page left unlinked
