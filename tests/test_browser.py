"""The dashboard in a real browser: JupyterLab on 127.0.0.1, headless Chromium via Playwright.

Runs ``tests/notebooks_for_tests/dashboard.ipynb`` (2 ranks, an epoch bar and a step bar
each, a barrier per epoch; then a launch whose rank 1 raises) with "Run All", samples the
rendered bars while the first launch runs, waits until the bars show completion, and
saves screenshots to ``artifacts/browser/`` (override with ``NOTEBOOK_LAUNCHER_ARTIFACTS``).

Needs ``apt-get install -y chromium`` and ``pip install jupyterlab playwright`` (never
``playwright install``: Debian's Chromium is driven by Playwright's bundled driver).
Without Chromium (where the README's test command could not install it) the tests skip,
saying so; under ``CI`` they fail. A missing pip piece fails them (``.[test]`` installs it);
set ``NOTEBOOK_LAUNCHER_SKIP_BROWSER=1`` to skip them on purpose.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nbformat
import pytest

import notebook_launcher

from .helpers import SlurmTestCluster, free_port, kernel_env, require_system

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOTEBOOK = HERE / "notebooks_for_tests" / "dashboard.ipynb"
SESSION_NOTEBOOK = HERE / "notebooks_for_tests" / "session.ipynb"
PACKAGE_PARENT = str(Path(notebook_launcher.__file__).resolve().parents[1])
ARTIFACTS = Path(os.environ.get("NOTEBOOK_LAUNCHER_ARTIFACTS", ROOT / "artifacts")) / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

if os.environ.get("NOTEBOOK_LAUNCHER_SKIP_BROWSER") == "1":
    pytest.skip("NOTEBOOK_LAUNCHER_SKIP_BROWSER=1", allow_module_level=True)


def _requirements() -> Any:
    if not os.path.exists(CHROMIUM):
        require_system("the browser test", [f"{CHROMIUM} (apt-get install -y chromium)"])
    missing = []
    if shutil.which("jupyter-lab", path=str(Path(sys.executable).parent)) is None:
        missing.append("jupyter-lab (pip install jupyterlab)")
    try:
        import playwright.sync_api as api
    except ImportError:
        api = None
        missing.append("playwright (pip install playwright; never `playwright install`)")
    if missing:
        pytest.fail(
            "the browser test needs: "
            + "; ".join(missing)
            + ". Set NOTEBOOK_LAUNCHER_SKIP_BROWSER=1 "
            "to skip it on purpose.",
            pytrace=False,
        )
    return api


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _requirements()
    base = tmp_path_factory.mktemp("lab")
    root, settings, workspaces, runtime = (
        base / d for d in ("root", "settings", "workspaces", "runtime")
    )
    for d in (root, workspaces, runtime):
        d.mkdir()
    for notebook in (NOTEBOOK, SESSION_NOTEBOOK):  # JupyterLab autosaves: never the committed file
        shutil.copy(notebook, root / notebook.name)
    notif = settings / "@jupyterlab" / "apputils-extension"
    notif.mkdir(parents=True)
    (notif / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    # every cell in the DOM (no windowing), so outputs scrolled out of view can be read
    tracker = settings / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port, token = free_port(), secrets.token_hex(16)
    env = kernel_env()
    env["JUPYTER_RUNTIME_DIR"] = str(runtime)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    cmd = [
        str(Path(sys.executable).with_name("jupyter-lab")),
        "--allow-root",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={workspaces}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log_path = base / "jupyter-lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"jupyter lab exited: {log_path.read_text()[-3000:]}")
                try:
                    urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=1)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("jupyter lab did not come up in 30 s") from None
                    time.sleep(0.1)
            yield {"url": url, "token": token, "log": log_path, "root": root}
        finally:
            proc.terminate()  # the server shuts its kernels (and so the workers) down
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


WAIT_NOTEBOOK_READY = """async () => {
    const app = window.jupyterapp;
    await app.restored;
    let w = null;
    for (let i = 0; i < 600; i++) {
        w = app.shell.currentWidget;
        if (w && w.sessionContext && w.content) break;
        await new Promise(r => setTimeout(r, 100));
    }
    await w.context.ready;
    await w.sessionContext.ready;
    for (let i = 0; i < 600 && w.sessionContext.session?.kernel?.status !== 'idle'; i++)
        await new Promise(r => setTimeout(r, 100));
    if (app.shell.leftCollapsed) await app.commands.execute('filebrowser:activate');
    return {kernel: w.sessionContext.session?.kernel?.name,
            status: w.sessionContext.session?.kernel?.status, sidebar: !app.shell.leftCollapsed};
}"""

#: Each dashboard on the page (live or the final snapshot): its rows, bars and log.
DASHBOARDS = """() => Array.from(document.querySelectorAll(
        '.jp-OutputArea-output .nl-dashboard:not(.nl-dashboard .nl-dashboard)')).map(d => {
    const box = d.querySelector('.nl-log');
    const seen = [];
    if (box) {
        const r = box.getBoundingClientRect();
        for (const l of box.querySelectorAll('.nl-l')) {
            const b = l.getBoundingClientRect();
            if (b.height > 0 && b.bottom > r.top + 2 && b.top < r.bottom - 2) seen.push(l.textContent);
        }
    }
    return {
        live: !d.classList.contains('nl-snapshot'),
        rows: Array.from(d.querySelectorAll('.nl-row')).filter(r => r.offsetParent).map(row => ({
            rank: row.dataset.rank, status: row.dataset.status,
            text: row.querySelector('.nl-status')?.textContent ?? '',
            statusHeight: row.querySelector('.nl-status')?.getBoundingClientRect().height ?? 0,
            statusCut: (e => e ? e.scrollWidth > e.clientWidth + 1 : false)(
                row.querySelector('.nl-status')),
            message: row.querySelector('.nl-msg')?.textContent ?? '',
            messageCut: (e => e ? e.scrollWidth > e.clientWidth + 1 : false)(
                row.querySelector('.nl-msg')),
            bars: Array.from(row.querySelectorAll('.nl-bar')).map(b => ({
                desc: b.dataset.desc, style: b.dataset.style,
                width: b.querySelector('.nl-fill').style.width,
                height: b.getBoundingClientRect().height})),
        })),
        logTop: box ? box.scrollTop : null, seen,
    };
})"""


#: The live log of the first dashboard: scroll offset (0 = at the bottom: column-reverse),
#: the first and last line in view, the newest line, how many lines it holds.
LOG_STATE = """() => {
    const box = document.querySelector('.jp-OutputArea-output .nl-dashboard .nl-log');
    if (!box) return null;
    const r = box.getBoundingClientRect();
    const lines = Array.from(box.querySelectorAll('.nl-l')).filter(l => l.offsetParent)
        .map(l => [l.getBoundingClientRect(), l.textContent]).sort((a, b) => a[0].top - b[0].top);
    const seen = lines.filter(([b]) => b.bottom > r.top + 2 && b.top < r.bottom - 2);
    return {top: box.scrollTop, count: lines.length,
            first: seen.length ? seen[0][1] : null, last: seen.length ? seen.at(-1)[1] : null,
            newest: lines.length ? lines.at(-1)[1] : null};
}"""

#: Counts the kernel subshells JupyterLab asks for (one per widget comm target that has
#: open comms), from now on.
COUNT_SUBSHELL_REQUESTS = """() => {
    window.__subshells = 0;
    window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.anyMessage.connect(
        (_, a) => { if (a.direction === 'send' && a.msg.header.msg_type === 'create_subshell_request')
                        window.__subshells += 1; });
}"""

#: The status bar's kernel item: "Python 3 (ipykernel) | Busy".
STATUS_BAR_KERNEL = """() => Array.from(document.querySelectorAll('.jp-StatusBar-Item'))
    .map(e => e.innerText.trim()).find(t => / \\| (Idle|Busy|Starting|Unknown)/.test(t)) ?? ''"""

#: Elements whose text must stay on one line (cut with an ellipsis instead), taller than that.
WRAPPED = """() => Array.from(document.querySelectorAll(
        '.nl-bar, .nl-status, .nl-head > span, .nl-spread')).filter(e => e.offsetParent)
    .filter(e => e.getBoundingClientRect().height > 24).map(e => e.textContent)"""


def _shot(page: Any, name: str, locator: Any = None) -> None:
    page.wait_for_timeout(150)  # JupyterLab paints cells scrolled into view a moment later
    if locator is not None:
        locator.scroll_into_view_if_needed()
        locator.screenshot(path=str(ARTIFACTS / name))
    else:
        page.screenshot(path=str(ARTIFACTS / name))


#: The third dashboard's rows and log lines in view (its rank 13 picked).
PICKED_IN_THIRD = """() => { const d = document.querySelectorAll(
        '.jp-OutputArea-output .nl-dashboard')[2];
    return {rows: Array.from(d.querySelectorAll('.nl-row'))
                .filter(r => r.offsetParent).map(r => r.dataset.rank),
            lines: Array.from(d.querySelectorAll('.nl-l'))
                .filter(l => l.offsetParent).map(l => l.innerText)}; }"""


def _wait(page: Any, seconds: float) -> None:
    page.wait_for_timeout(int(seconds * 1000))


def _check_log_follows_the_tail(page: Any, look: Any) -> dict[str, Any]:
    """While ranks print: at the bottom the newest line is in view; scrolled up, the same
    lines stay in view as more arrive; back at the bottom it follows again. ``look()``
    runs between the steps (on a slow machine the launch may move on meanwhile)."""
    out: dict[str, Any] = {"start": page.evaluate(LOG_STATE)}
    _wait(page, 0.6)
    look()
    following = page.evaluate(LOG_STATE)
    out["following"] = following
    page.evaluate(
        "() => { document.querySelector('.jp-OutputArea-output .nl-log').scrollTop = -90; }"
    )
    _wait(page, 0.15)
    out["up"] = page.evaluate(LOG_STATE)
    _wait(page, 0.9)
    out["still_up"] = page.evaluate(LOG_STATE)
    look()
    page.evaluate(
        "() => { document.querySelector('.jp-OutputArea-output .nl-log').scrollTop = 0; }"
    )
    _wait(page, 0.7)
    out["back"] = page.evaluate(LOG_STATE)
    look()
    return out


@contextlib.contextmanager
def _notebook_page(lab: dict[str, Any], notebook: Path) -> Iterator[tuple[Any, list[str], Any]]:
    """Chromium at 1280x800 with ``notebook`` open in the lab, its kernel idle: the page,
    the page's JavaScript errors (a list that fills as they come) and the kernel's info."""
    api = _requirements()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(60_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{lab['url']}/lab/tree/{notebook.name}?token={lab['token']}&reset")
            page.wait_for_function("window.jupyterapp !== undefined")
            yield page, errors, page.evaluate(WAIT_NOTEBOOK_READY)
        finally:
            browser.close()


@pytest.mark.timeout(60)
def test_bar_labels_and_counts_are_not_cut_in_a_1280px_window() -> None:
    """Two ranks with an epoch and a step bar each, drawn as the dashboard draws them, at
    the width of a notebook's output in a 1280 px JupyterLab (file browser open: 850 px;
    closed: 1150 px): no bar's label or counts is cut (issue 26: the status column took
    24em and the bars a fixed share, so "training epoch 1/3 ... 40/100 [40%..." was cut)."""
    from notebook_launcher._events import LaunchStarted, ProgressUpdate, WorkerStarted
    from notebook_launcher.ui import html as H
    from notebook_launcher.ui.model import LaunchModel

    api = _requirements()
    m = LaunchModel()
    m.apply(LaunchStarted(2, 2, 0, 1, "fork", "cpu only", "127.0.0.1", 29500, "gloo", (0, 1), 0.0))
    for rank in range(2):
        m.apply(WorkerStarted(rank, rank, 100 + rank, "cpu", 0.0))
        for level, desc in enumerate(["training epoch 1/3", ""]):  # "": the Trainer's bar
            m.apply(
                ProgressUpdate(rank, level, desc, 40, 100, rate=12.3, elapsed=3.2, level=level,
                               postfix="loss=0.123" if level else "", time=1.0)
            )  # fmt: skip
    shown = H.snapshot(m, 5.0)
    with api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 400})
            for width in (850, 1150):
                page.set_content(
                    f"<body style='font:13px sans-serif;margin:0'><div style='width:{width}px'>"
                    f"{shown}</div></body>"
                )
                cut = page.evaluate(
                    """() => [...document.querySelectorAll('.nl-bar > span:not(.nl-track)')]
                        .filter(s => s.scrollWidth > s.clientWidth).map(s => s.textContent)"""
                )
                assert cut == [], f"cut at {width} px: {cut}"
        finally:
            browser.close()


@pytest.mark.timeout(180)
def test_dashboard_in_jupyterlab(lab: dict[str, Any]) -> None:
    with _notebook_page(lab, NOTEBOOK) as (page, errors, info):
        assert info == {"kernel": "python3", "status": "idle", "sidebar": True}, info
        page.evaluate(COUNT_SUBSHELL_REQUESTS)
        # do not await: the command's promise resolves only when every cell ran
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        done = page.locator(".jp-OutputArea-output", has_text="ALL DONE")
        dashboards = page.locator(".jp-OutputArea-output .nl-dashboard")
        samples: list[Any] = []
        log_check: dict[str, Any] = {}
        wrapped: list[str] = []
        picked: dict[str, Any] = {}
        shots: set[str] = set()

        def look() -> list[Any]:
            """Sample the dashboards; a rank shown waiting at a barrier: its shot."""
            views = page.evaluate(DASHBOARDS)
            samples.append(views)
            first = views[0] if views else {}
            if "waiting" not in shots and any(
                "waiting at" in row["text"] for row in first.get("rows", [])
            ):
                _shot(page, "dashboard_waiting.png", dashboards.first)
                shots.add("waiting")
            return views

        t0 = time.monotonic()
        while done.count() == 0 and time.monotonic() - t0 < 120:
            views = look()
            first = views[0] if views else {}
            widths = [b["width"] for row in first.get("rows", []) for b in row["bars"]]
            if (
                "live" not in shots
                and first.get("live")
                and any(w not in ("0%", "100%") for w in widths)
                and len(first.get("seen", [])) > 10
            ):
                dashboards.first.scroll_into_view_if_needed()
                _shot(page, "lab_live_1280x800_sidebar.png")
                _shot(page, "dashboard_live.png", dashboards.first)
                wrapped += page.evaluate(WRAPPED)
                shots.add("live")
                log_check = _check_log_follows_the_tail(page, look)
                _shot(page, "dashboard_live_after_scroll.png", dashboards.first)
            if "many" not in shots and len(views) == 3 and views[2]["live"]:
                kernel_status = page.evaluate(STATUS_BAR_KERNEL)  # the third dashboard runs
                many = dashboards.nth(2)
                _wait(page, 0.8)  # the replay runs about 2 s, then holds its live view 3 s
                _shot(page, "dashboard_many_live.png", many)
                # the live grid's cells are filled by a <style> of their own (the cells stay
                # put while the ranks step): each shows its rank's progress in its colour
                grid_fills = many.locator(".nl-cell .nl-fill").evaluate_all(
                    "els => els.map(e => [getComputedStyle(e).width, "
                    "getComputedStyle(e).backgroundColor])"
                )
                assert len(grid_fills) == 24, grid_fills
                assert all(w != "0px" and c != "rgba(0, 0, 0, 0)" for w, c in grid_fills), (
                    grid_fills
                )
                # any rank one click away: its cell picks its output and its row
                # (the grid is redrawn several times a second while the ranks step: a click
                # that lands as its cell is replaced is lost -- once in a loaded run -- and
                # a user clicks again; so does this test, up to three times)
                for _ in range(3):
                    many.locator(".nl-cell-13").click()
                    deadline = time.monotonic() + 3
                    while True:
                        _wait(page, 0.1)
                        picked = page.evaluate(PICKED_IN_THIRD)
                        lines = picked["lines"]
                        if (lines and all(t.startswith("rank 13 ") for t in lines)) or (
                            time.monotonic() > deadline
                        ):
                            break
                    if lines and all(t.startswith("rank 13 ") for t in lines):
                        break
                _shot(page, "dashboard_many_rank13_picked.png", many)
                shots.add("many")
            _wait(page, 0.05)
        assert done.count() == 1, f"the notebook did not finish; server log: {lab['log']}"
        assert shots == {"live", "waiting", "many"}, shots
        # JupyterLab makes a kernel subshell for widget messages when it first sees a widget,
        # and its status bar reads "Idle" while the request that makes it is answered (its
        # bug, see the README). Our dashboards keep that subshell (they made one each, and
        # every launch read "Idle"): one for the three of them, and "Busy" in the third.
        assert page.evaluate("() => window.__subshells") == 1
        assert kernel_status.endswith("| Busy"), kernel_status

        # -- while it ran --------------------------------------------------------
        start, following = log_check["start"], log_check["following"]
        assert following["count"] > start["count"], log_check  # lines kept coming
        assert following["top"] == 0 and following["last"] == following["newest"], log_check
        up, still_up, back = log_check["up"], log_check["still_up"], log_check["back"]
        assert up["top"] < 0 and still_up["count"] > up["count"], log_check
        assert still_up["first"] == up["first"], log_check  # the reader's place is kept
        assert back["top"] == 0 and back["last"] == back["newest"], log_check
        assert back["newest"] != up["newest"], log_check
        step_widths = {
            b["width"]
            for views in samples
            for row in (views[0]["rows"] if views else [])
            for b in row["bars"]
            if b["desc"] == "step"
        }
        assert len(step_widths - {"0%", "100%"}) >= 2, sorted(step_widths)  # bars moved
        infos = {row["text"] for views in samples for row in (views[0]["rows"] if views else [])}
        assert any(i.startswith("● waiting at In[1]:") for i in infos), sorted(infos)
        assert "13" in picked["rows"], picked
        assert picked["lines"] and all(t.startswith("rank 13 ") for t in picked["lines"]), picked

        # -- the end: every dashboard became its static snapshot ------------------
        views = page.evaluate(DASHBOARDS)
        assert [v["live"] for v in views] == [False, False, False], views
        ok, failed, many_end = views
        assert [(r["rank"], r["status"]) for r in ok["rows"]] == [("0", "done"), ("1", "done")]
        for row in ok["rows"]:
            assert [(b["desc"], b["width"], b["style"]) for b in row["bars"]] == [
                ("epoch", "100%", "success"),
                ("step", "100%", "success"),
            ]
        assert [
            [(b["desc"], b["width"], b["style"]) for b in row["bars"]] for row in failed["rows"]
        ] == [[("work", "100%", "success")], [("work", "50%", "danger")]]
        # the row's status stays short; the message has a line of its own, whole (at 1280 px
        # it was cut: "raised ValueError: rank 1 h...")
        assert failed["rows"][1]["text"] == "● raised ValueError", failed["rows"][1]
        assert failed["rows"][1]["message"] == "ValueError: rank 1 broke", failed["rows"][1]
        rows = [r for v in views for r in v["rows"]]
        cut = [r for r in rows if r["messageCut"] or (r["status"] == "failed" and r["statusCut"])]
        assert not cut, cut
        plot = page.locator(".jp-OutputArea-output img").first  # the loss curve (PNG)
        assert plot.bounding_box()["width"] > 300
        snaps = page.locator(".nl-snapshot")
        pane = snaps.nth(1).locator(".nl-pane-1")
        assert pane.is_visible() and "ValueError: rank 1 broke" in pane.inner_text()
        assert "1 failed" in snaps.nth(2).locator(".nl-spread").inner_text()
        for i, name in enumerate(("ok", "failed", "many")):
            _shot(page, f"dashboard_{name}.png", snaps.nth(i))
        wrapped += page.evaluate(WRAPPED)
        snaps.first.scroll_into_view_if_needed()
        _shot(page, "lab_1280x800_sidebar.png")
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        page.set_viewport_size({"width": 1920, "height": 1080})
        snaps.first.scroll_into_view_if_needed()
        _shot(page, "lab_1920_full_width.png")
        page.set_viewport_size({"width": 400, "height": 900})
        _shot(page, "dashboard_ok_narrow.png", snaps.first)
        _shot(page, "dashboard_failed_narrow.png", snaps.nth(1))
        wrapped += page.evaluate(WRAPPED)
        assert not wrapped, wrapped  # cut with an ellipsis, never wrapped

        # -- the saved notebook, opened untrusted (as GitHub/nbviewer would show it) -
        page.set_viewport_size({"width": 1280, "height": 800})
        page.evaluate(
            "async () => { await window.jupyterapp.commands.execute('docmanager:save'); }"
        )
        nb = nbformat.read(lab["root"] / NOTEBOOK.name, as_version=4)
        nb.metadata["saved_copy"] = True  # another content: not in the trust database
        nbformat.write(nb, lab["root"] / "saved.ipynb")
        page.evaluate(
            "async () => { await window.jupyterapp.commands.execute("
            "'docmanager:open', {path: 'saved.ipynb'}); }"
        )
        saved = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .nl-snapshot")
        saved.first.wait_for()
        assert saved.count() == 3
        assert page.evaluate(
            "() => !window.jupyterapp.shell.currentWidget.content.model.cells.get(2).trusted"
        )
        fills = page.evaluate(
            """() => Array.from(document.querySelectorAll(
                '.jp-NotebookPanel:not(.lm-mod-hidden) .nl-snapshot .nl-fill'))
                .map(e => [e.style.width, getComputedStyle(e).backgroundColor])"""
        )
        assert fills[:4] == [["100%", "rgb(67, 160, 71)"]] * 4, fills  # styles kept
        _shot(page, "saved_untrusted_failed.png", saved.nth(1))
        _shot(page, "saved_untrusted_ok.png", saved.first)
        assert not errors, errors


#: The text of every cell's outputs in the open notebook (index = cell).
CELL_OUTPUTS = """() => window.jupyterapp.shell.currentWidget.content.widgets.map(
    w => w.outputArea ? w.outputArea.node.innerText : '')"""

#: Run one cell of the open notebook (the notebook's own command, as a click on ▶ does).
RUN_CELL = """async (i) => {
    const app = window.jupyterapp;
    app.shell.currentWidget.content.activeCellIndex = i;
    await app.commands.execute('notebook:run-cell');
}"""


def _cells_notebook(
    lab: dict[str, Any], name: str, cells: Sequence[str], runs: Path, release: Path
) -> Path:
    """A notebook in Lab's root of ``cells`` (``{runs}``, ``{release}`` filled in) on the
    plain Python 3 kernel; its path."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(c.format(runs=str(runs), release=str(release))) for c in cells
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    path = Path(lab["root"]) / name
    nbformat.write(notebook, path)
    return path


def _wait_for_output(page: Any, cell: int, text: str, seconds: float = 60) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        outputs = page.evaluate(CELL_OUTPUTS)
        if text in outputs[cell] or time.monotonic() > deadline:
            return outputs
        _wait(page, 0.1)


@pytest.mark.timeout(150)
def test_a_session_in_jupyterlab(lab: dict[str, Any]) -> None:
    """``tests/notebooks_for_tests/session.ipynb`` in JupyterLab: ``%dist start``, a
    ``%%distributed`` cell long enough to show its live dashboard, then each rank's value; a
    ``%%rank 1`` cell; a failing ``%%rank 1`` cell (Run All stops there, as on any error);
    then, run by hand as a person would, a cell showing that every rank's variables
    survived, a silent cell (its live dashboard shows no empty log box, no output picker),
    and ``%dist stop``."""
    with _notebook_page(lab, SESSION_NOTEBOOK) as (page, errors, info):
        assert info["kernel"] == "python3" and info["status"] == "idle", info
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        live = page.locator(".jp-OutputArea-output .nl-dashboard:not(.nl-snapshot)")
        live.first.wait_for(timeout=60_000)  # the long cell shows its dashboard
        _wait(page, 0.4)
        live_rows = page.evaluate(DASHBOARDS)[0]["rows"]
        head = live.first.locator(".nl-head").get_attribute("title") or ""
        _shot(page, "session_live.png", live.first)
        # a task's header names the task (it said "fork: run_cell", the start method's place)
        assert " · session task 1: run_cell · 2 of 2 ranks · " in head, head
        outputs = _wait_for_output(page, 4, "ValueError")
        started, counted, secret, failed = outputs[1:5]
        assert "session: ready, 2 ranks" in started, outputs
        assert "[rank0] 40" in counted and "[rank1] 80" in counted, outputs
        assert secret.strip().endswith("[rank1] 800"), outputs
        assert "ValueError: bad batch on rank 1" in failed, outputs
        assert "Raised on rank 1 of 2" in failed and "The session lives on" in failed
        assert "secret: int = 800" in failed, outputs  # the failing frame's variables
        assert "tqdm: type" not in failed and "_: int" not in failed, outputs  # its data
        _shot(page, "session_failed_cell.png", page.locator(".jp-Cell").nth(4))

        page.evaluate(RUN_CELL, 5)  # after the failure: the same ranks, the same values
        outputs = _wait_for_output(page, 5, "[rank1]")
        assert "[rank0] (40, 2)" in outputs[5] and "[rank1] (80, 2)" in outputs[5], outputs
        page.evaluate(f"() => {{ ({RUN_CELL})(6); }}")  # not awaited: look while it runs
        silent = page.locator(".jp-Cell").nth(6).locator(".nl-dashboard:not(.nl-snapshot)")
        silent.wait_for(timeout=30_000)
        _wait(page, 0.3)
        quiet = silent.evaluate(
            """d => ({rows: d.querySelectorAll('.nl-row').length,
                      log: !!d.querySelector('.nl-log')?.offsetParent,
                      picker: !!d.querySelector('.nl-pick')?.offsetParent})"""
        )
        _shot(page, "session_silent_live.png", silent)
        assert quiet == {"rows": 2, "log": False, "picker": False}, quiet
        page.evaluate(RUN_CELL, 7)
        outputs = _wait_for_output(page, 7, "SESSION DONE")
        assert "SESSION DONE" in outputs[7], outputs
        assert "[rank" not in outputs[6], outputs  # silent: nothing printed, no values
        assert "nl-log" not in page.locator(".jp-Cell").nth(6).inner_html()  # nor at the end
        page.locator(".jp-Cell").nth(2).scroll_into_view_if_needed()
        _shot(page, "session_lab_1280x800.png")
        final = page.evaluate(DASHBOARDS)
        assert [v["live"] for v in final] == [False, False], final  # snapshots, once done
        assert [(r["rank"], r["status"]) for r in final[0]["rows"]] == [
            ("0", "done"),
            ("1", "done"),
        ], final
        assert [r["rank"] for r in live_rows] == ["0", "1"], live_rows
        assert not page.evaluate(WRAPPED)
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        page.set_viewport_size({"width": 1920, "height": 1080})
        page.locator(".jp-Cell").nth(2).scroll_into_view_if_needed()
        _shot(page, "session_lab_1920_full_width.png")
        assert not page.evaluate(WRAPPED)
        assert not errors, errors


#: Open ``path`` in the lab (no kernel needed), wait for it, insert a cell, save it.
OPEN_EDIT_SAVE = """async (path) => {
    const app = window.jupyterapp;
    const w = await app.commands.execute('docmanager:open', {path});
    await w.context.ready;
    app.shell.activateById(w.id);
    await app.commands.execute('notebook:insert-cell-below');
    await w.context.save();
    return w.context.path;
}"""


@pytest.mark.timeout(120)
def test_saving_a_lesson_in_jupyterlab_changes_no_source(lab: dict[str, Any]) -> None:
    """The lessons as a clone has them (``notebooks/`` with its configuration, the repository's
    ``pyproject.toml`` above it), in this JupyterLab, which runs jupytext's contents manager
    (the test extras install jupytext): a reader who edits and saves a lesson writes its
    ``.ipynb`` alone, and a new notebook there gets no ``.py`` twin. With the old
    ``jupytext.toml`` pairing the folder, both saves wrote ``.py`` files."""
    clone = lab["root"] / "clone"
    lessons = clone / "notebooks"
    lessons.mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", clone / "pyproject.toml")
    for path in (ROOT / "notebooks").iterdir():
        if path.is_file() and (path.suffix != ".ipynb" or path.name == "01_quickstart.ipynb"):
            shutil.copy(path, lessons / path.name)
    nb = nbformat.read(lessons / "01_quickstart.ipynb", as_version=4)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)"}
    nbformat.write(nb, lessons / "01_quickstart.ipynb")  # no kernel picker in the way
    before = {p.name: p.read_bytes() for p in lessons.iterdir()}
    with _notebook_page(lab, NOTEBOOK) as (page, errors, _info):
        page.evaluate(OPEN_EDIT_SAVE, "clone/notebooks/01_quickstart.ipynb")
        created = page.evaluate(
            """async () => (await window.jupyterapp.commands.execute('docmanager:new-untitled',
                {path: 'clone/notebooks', type: 'notebook'})).path"""
        )
        page.evaluate(OPEN_EDIT_SAVE, created)
        assert not errors, errors
    after = {p.name: p.read_bytes() for p in lessons.iterdir() if p.is_file()}
    new = Path(created).name
    assert set(after) == set(before) | {new}, sorted(set(after) ^ set(before))
    changed = sorted(name for name in before if after[name] != before[name])
    assert changed == ["01_quickstart.ipynb"], changed  # the edit is saved, no source changed
    assert len(nbformat.read(lessons / "01_quickstart.ipynb", 4).cells) == len(nb.cells) + 1


#: The stall view of the live dashboard: its findings, and each column's ranks and oddness.
STALL_VIEW = """() => {
    const s = document.querySelector('.jp-OutputArea-output .nl-dashboard .nl-stall');
    if (!s || !s.offsetParent) return null;
    const area = s.closest('.jp-OutputArea-output').getBoundingClientRect();
    return {findings: Array.from(s.querySelectorAll('.nl-stall-finding')).map(f => f.textContent),
            columns: Array.from(s.querySelectorAll('.nl-stall-col')).map(c => ({
                ranks: c.dataset.ranks, odd: c.classList.contains('nl-stall-odd'),
                text: c.querySelector('pre').textContent,
                width: c.getBoundingClientRect().width,
                inside: c.getBoundingClientRect().right <= area.right + 1}))};
}"""

STALL_CELLS = [
    "from notebook_launcher import notebook_launcher\n"
    "\n"
    "def train():\n"
    "    import time\n"
    "    import torch.distributed as dist\n"
    "    if dist.get_rank() == 1:\n"
    "        time.sleep(12)  # rank 1 is late\n"
    "    dist.barrier()\n"
    "    return dist.get_rank()\n"
    "\n"
    "notebook_launcher(train, num_processes=3, stall_after=1.5)",
    "print('STALL DONE')",
]


@pytest.mark.timeout(150)
def test_the_stall_view_in_jupyterlab(lab: dict[str, Any]) -> None:
    """A launch whose rank 1 is late while ranks 0 and 2 wait in a barrier: the live
    dashboard shows the stall view (rank 1 named, its column marked, ranks 0 and 2 in one
    column side by side with it, the cell's line), and it is gone once the launch ends."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(c) for c in STALL_CELLS]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    path = Path(lab["root"]) / "stall.ipynb"
    nbformat.write(notebook, path)
    with _notebook_page(lab, path) as (page, errors, info):
        assert info["kernel"] == "python3" and info["status"] == "idle", info
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        page.wait_for_function(STALL_VIEW, timeout=60_000)
        view = page.evaluate(STALL_VIEW)
        stall = page.locator(".jp-OutputArea-output .nl-dashboard .nl-stall").first
        _shot(page, "stall_view_1280x800.png", stall)
        assert view["findings"] == [
            "rank 1 is in `time.sleep(12)  # rank 1 is late` at Cell In[1], line 7; "
            "ranks 0, 2 wait in `barrier` at line 8"
        ], view
        assert [(c["ranks"], c["odd"]) for c in view["columns"]] == [("0,2", False), ("1", True)]
        assert "Cell In[1], line 7, in train" in view["columns"][1]["text"], view
        # side by side, readable, and inside the cell's output (not cut at its edge)
        assert all(c["width"] > 200 and c["inside"] for c in view["columns"]), view
        outputs = _wait_for_output(page, 1, "STALL DONE")
        assert "STALL DONE" in outputs[1], outputs
        final = page.evaluate(DASHBOARDS)
        assert [v["live"] for v in final] == [False], final
        assert page.evaluate(STALL_VIEW) is None  # it resolved: no stall view is kept
        assert not errors, errors


CLUSTER_CELLS = [
    "import os\n"
    "os.environ['SLURM_CONF'] = {conf!r}  # the tests' loopback Slurm cluster\n"
    "from notebook_launcher import SlurmCluster, notebook_launcher\n"
    "cluster = SlurmCluster(nodes=2)",
    "def train(steps):\n"
    "    import os, time\n"
    "    import torch.distributed as dist\n"
    "    from tqdm.auto import tqdm\n"
    "    for step in tqdm(range(steps), desc='step'):\n"
    "        time.sleep(0.15)\n"
    "        if step % 10 == 0:\n"
    "            print(f'step {step}', flush=True)\n"
    "    dist.barrier()\n"
    "    return dist.get_rank()\n"
    "\n"
    "notebook_launcher(train, args=(40,), num_processes=4, cluster=cluster)",
    "cluster.close()\nprint('CLUSTER DONE')",
]

#: Each visible dashboard row's rank and the host it names.
ROW_HOSTS = """() => Array.from(document.querySelectorAll(
        '.jp-OutputArea-output .nl-dashboard .nl-row')).filter(r => r.offsetParent)
    .map(r => [r.dataset.rank, r.querySelector('.nl-host')?.textContent ?? ''])"""


@pytest.mark.timeout(180)
def test_a_cluster_launch_in_jupyterlab(lab: dict[str, Any], slurm: SlurmTestCluster) -> None:
    """One cell drives a 2-node Slurm job of the tests' loopback cluster: the live dashboard
    has a row per rank of both nodes, each naming its node, bars that move, output labelled
    with node and rank; it ends "done" and the job ends with ``cluster.close()``."""
    notebook = nbformat.v4.new_notebook()
    cells = [CLUSTER_CELLS[0].format(conf=slurm.conf), *CLUSTER_CELLS[1:]]
    notebook.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    path = Path(lab["root"]) / "cluster.ipynb"
    nbformat.write(notebook, path)
    with _notebook_page(lab, path) as (page, errors, info):
        assert info["kernel"] == "python3" and info["status"] == "idle", info
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        page.wait_for_function(
            "() => document.querySelectorAll('.nl-dashboard:not(.nl-snapshot) .nl-bar').length >= 4",
            timeout=120_000,
        )
        _wait(page, 1.0)
        live = page.evaluate(DASHBOARDS)[-1]
        hosts = page.evaluate(ROW_HOSTS)
        page.locator(".jp-Cell").nth(1).scroll_into_view_if_needed()
        _shot(page, "cluster_lab_live_1280x800_sidebar.png")
        assert live["live"] and [r["rank"] for r in live["rows"]] == ["0", "1", "2", "3"], live
        assert all(r["status"] == "running" for r in live["rows"]), live
        assert all(b["desc"] == "step" for r in live["rows"] for b in r["bars"]), live
        by_rank = dict(hosts)
        # two ranks on each of two of the cluster's nodes, named in their rows
        assert by_rank["0"] == by_rank["1"] != by_rank["2"] == by_rank["3"], hosts
        assert {by_rank["0"], by_rank["2"]} <= {"n1", "n2", "n3"}, hosts
        outputs = _wait_for_output(page, 2, "CLUSTER DONE", seconds=90)
        assert "CLUSTER DONE" in outputs[2], outputs
        assert f"[{by_rank['2']}:rank2] step 0" in outputs[1], outputs[1]
        final = page.evaluate(DASHBOARDS)[-1]
        assert not final["live"] and {r["status"] for r in final["rows"]} == {"done"}, final
        assert not page.evaluate(WRAPPED)
        page.locator(".jp-Cell").nth(1).scroll_into_view_if_needed()
        _shot(page, "cluster_lab_done_1280x800_sidebar.png")
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        page.set_viewport_size({"width": 1920, "height": 1080})
        page.locator(".jp-Cell").nth(1).scroll_into_view_if_needed()
        _shot(page, "cluster_lab_1920_full_width.png")
        assert not page.evaluate(WRAPPED)
        assert not errors, errors


ATTACH_CELLS = [
    "import os\n"
    "os.environ['NOTEBOOK_LAUNCHER_RUNS_DIR'] = {runs!r}\n"
    "from notebook_launcher import notebook_launcher\n"
    "\n"
    "def train(steps):\n"
    "    import os, time\n"
    "    import torch.distributed as dist\n"
    "    from tqdm.auto import tqdm\n"
    "    for step in tqdm(range(steps), desc='step'):\n"
    "        print(f'step {{step}} of rank {{dist.get_rank()}}', flush=True)\n"
    "        while step == 40 and not os.path.exists({release!r}):\n"
    "            time.sleep(0.05)  # held until the test has seen it live\n"
    "        time.sleep(0.1)\n"
    "    return dist.get_rank() * 10\n"
    "\n"
    "handle = notebook_launcher(train, args=(80,), num_processes=2, detach=True)\n"
    "open('run_id.txt', 'w').write(handle.id)",
    "import os\n"
    "os.environ['NOTEBOOK_LAUNCHER_RUNS_DIR'] = {runs!r}\n"
    "%load_ext notebook_launcher\n"
    "handle = %dist attach {{open('run_id.txt').read()}}",
    "print(handle.result(), 'ATTACH DONE')",
]

#: Restart the open notebook's kernel (no dialog) and wait until it is idle again.
RESTART_KERNEL = """async () => {
    const s = window.jupyterapp.shell.currentWidget.sessionContext;
    await s.session.kernel.restart();
    for (let i = 0; i < 600 && s.session?.kernel?.status !== 'idle'; i++)
        await new Promise(r => setTimeout(r, 100));
    return s.session?.kernel?.status;
}"""


@pytest.mark.timeout(150)
def test_attach_after_a_kernel_restart_in_jupyterlab(lab: dict[str, Any]) -> None:
    """A detached run started in a notebook, the kernel restarted mid-run, then
    ``%dist attach ID`` in the new kernel: the dashboard shows the run's history from
    before the restart, follows it live, and ends "done"; ``result()`` gives the values."""
    from notebook_launcher._launch import detach as record

    runs = Path(lab["root"]).parent / "runs"
    release = Path(lab["root"]).parent / "release"
    path = _cells_notebook(lab, "attach.ipynb", ATTACH_CELLS, runs, release)
    try:
        with _notebook_page(lab, path) as (page, errors, info):
            assert info["kernel"] == "python3" and info["status"] == "idle", info
            page.evaluate(RUN_CELL, 0)
            outputs = _wait_for_output(page, 0, "detached")
            assert "it goes on without this kernel" in outputs[0], outputs
            _wait_for_output(page, 0, "step 15 of rank", 30)
            assert page.evaluate(RESTART_KERNEL) == "idle"
            page.evaluate(f"() => {{ ({RUN_CELL})(1); }}")
            live = page.locator(".jp-Cell").nth(1).locator(".nl-dashboard:not(.nl-snapshot)")
            live.wait_for(timeout=30_000)
            _wait(page, 0.5)
            _shot(page, "attach_live.png", live)
            history = page.locator(".jp-Cell").nth(1).inner_html()
            release.touch()  # the run waits at step 40 until now: a slow machine cannot end it first
            page.evaluate(RUN_CELL, 2)
            outputs = _wait_for_output(page, 2, "ATTACH DONE", 60)
            assert "[0, 10] ATTACH DONE" in outputs[2], outputs
            done = page.locator(".jp-Cell").nth(1).locator(".nl-dashboard.nl-snapshot")
            done.wait_for(timeout=10_000)
            _shot(page, "attach_done.png", done)
            final = page.evaluate(DASHBOARDS)[-1]
            assert [(r["rank"], r["status"]) for r in final["rows"]] == [
                ("0", "done"),
                ("1", "done"),
            ], final
            ended = page.locator(".jp-Cell").nth(1).inner_html()
            assert not page.evaluate(WRAPPED)
            page.locator(".jp-Cell").nth(1).scroll_into_view_if_needed()
            _shot(page, "attach_lab_1280x800_sidebar.png")
            page.evaluate(
                "() => window.jupyterapp.commands.execute('application:toggle-left-area')"
            )
            page.set_viewport_size({"width": 1920, "height": 1080})
            page.locator(".jp-Cell").nth(1).scroll_into_view_if_needed()
            _shot(page, "attach_lab_1920_full_width.png")
            assert not page.evaluate(WRAPPED)
            # the history from before the restart at once, then the lines that came after
            assert "step 0 of rank 0" in history and "step 0 of rank 1" in history
            assert "step 79 of rank 1" in ended and ended.count("80 line(s)") == 2, ended
            assert not errors, errors
    finally:
        for run_dir in runs.iterdir() if runs.exists() else ():  # a failed test's run
            meta = record.read_meta(str(run_dir))
            if meta.pid is not None and record.supervisor_alive(meta):
                os.kill(meta.pid, 9)


LEFT_BEHIND_CELLS = [
    "import os\n"
    "os.environ['NOTEBOOK_LAUNCHER_RUNS_DIR'] = {runs!r}\n"
    "from notebook_launcher import notebook_launcher\n"
    "\n"
    "def train(steps):\n"
    "    import os, time\n"
    "    import torch.distributed as dist\n"
    "    from tqdm.auto import tqdm\n"
    "    for step in tqdm(range(steps), desc='step'):\n"
    "        print(f'step {{step}} of rank {{dist.get_rank()}}', flush=True)\n"
    "        while step == 30 and not os.path.exists({release!r}):\n"
    "            time.sleep(0.05)  # held until the test is done with it\n"
    "        time.sleep(0.05)\n"
    "    return dist.get_rank()\n"
    "\n"
    "handle = notebook_launcher(train, args=(40,), num_processes=2, detach=True)\n"
    "open('run_id.txt', 'w').write(handle.id)",
    "import os\n"
    "os.environ['NOTEBOOK_LAUNCHER_RUNS_DIR'] = {runs!r}\n"
    "from notebook_launcher import notebook_launcher\n"
    "handle = notebook_launcher.attach(open('run_id.txt').read())",
    "handle.result()",
    "handle.stop()\nprint('LEFT BEHIND DONE')",
]

#: What each dashboard of the open notebook shows as text, by cell (what a reader sees).
VIEWS_BY_CELL = """() => window.jupyterapp.shell.currentWidget.content.widgets.map(
    w => Array.from(w.node.querySelectorAll('.jp-OutputArea-output .nl-dashboard'))
        .filter(d => !d.parentElement.closest('.nl-dashboard'))
        .map(d => ({live: !d.classList.contains('nl-snapshot'), text: d.innerText,
                    icons: Array.from(d.querySelectorAll('*')).concat([d]).filter(
                        e => (s => s.content.includes('\\uf127') && s.display !== 'none')(
                            getComputedStyle(e, '::before'))).length})))"""


@pytest.mark.timeout(180)
def test_a_view_left_behind_says_what_it_is_in_jupyterlab(lab: dict[str, Any]) -> None:
    """A dashboard that stopped following a run must not read "running" (issue 33, item 4):
    a detached run's launch cell after a kernel restart (the widgets' last state, their
    kernel gone: JupyterLab drew a broken-link icon on each), and the cell of ``attach``
    after Ctrl-C in ``result()`` (its static copy froze at "running 32.0s"). Each says
    "detached run ID · this view stopped following at HH:MM:SS · attach('ID')"."""
    from notebook_launcher._launch import detach as record

    runs = Path(lab["root"]).parent / "runs-left-behind"
    release = Path(lab["root"]).parent / "release-left-behind"
    path = _cells_notebook(lab, "left_behind.ipynb", LEFT_BEHIND_CELLS, runs, release)
    try:
        with _notebook_page(lab, path) as (page, errors, info):
            assert info["kernel"] == "python3" and info["status"] == "idle", info
            page.evaluate(RUN_CELL, 0)
            outputs = _wait_for_output(page, 0, "step 20 of rank")
            run_id = (Path(lab["root"]) / "run_id.txt").read_text()
            assert page.evaluate(RESTART_KERNEL) == "idle"
            _wait(page, 1.0)
            restarted = page.evaluate(VIEWS_BY_CELL)[0]
            cell0 = page.locator(".jp-Cell").nth(0)
            _shot(page, "left_behind_restart.png", cell0)
            cell0.scroll_into_view_if_needed()
            _shot(page, "left_behind_restart_lab_1280x800_sidebar.png")

            page.evaluate(RUN_CELL, 1)
            page.evaluate(f"() => {{ ({RUN_CELL})(2); }}")  # result(): waits, not awaited
            live = page.locator(".jp-Cell").nth(1).locator(".nl-dashboard:not(.nl-snapshot)")
            live.wait_for(timeout=30_000)
            _wait(page, 1.0)
            page.evaluate(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                ".interrupt()"
            )
            outputs = _wait_for_output(page, 2, "KeyboardInterrupt", 30)
            assert f"detached from run {run_id}" in outputs[2], outputs
            stopped = page.locator(".jp-Cell").nth(1).locator(".nl-dashboard.nl-snapshot")
            stopped.wait_for(timeout=10_000)
            interrupted = page.evaluate(VIEWS_BY_CELL)[1]
            cell1 = page.locator(".jp-Cell").nth(1)
            _shot(page, "left_behind_interrupted.png", cell1)
            cell1.scroll_into_view_if_needed()
            _shot(page, "left_behind_interrupted_lab_1280x800_sidebar.png")
            page.evaluate(
                "() => window.jupyterapp.commands.execute('application:toggle-left-area')"
            )
            page.set_viewport_size({"width": 1920, "height": 1080})
            cell0.scroll_into_view_if_needed()
            _shot(page, "left_behind_lab_1920_full_width.png")
            release.touch()
            page.evaluate(RUN_CELL, 3)
            outputs = _wait_for_output(page, 3, "LEFT BEHIND DONE", 30)
            assert "LEFT BEHIND DONE" in outputs[3], outputs
            # the notebook saved now and opened again (another copy: not trusted, no kernel
            # of its own yet), as a colleague or GitHub would see it
            page.set_viewport_size({"width": 1280, "height": 800})
            page.evaluate(
                "async () => { await window.jupyterapp.commands.execute('docmanager:save'); }"
            )
            nb = nbformat.read(path, as_version=4)
            nb.metadata["saved_copy"] = True
            nbformat.write(nb, path.with_name("left_behind_saved.ipynb"))
            page.evaluate(
                "async () => { await window.jupyterapp.commands.execute("
                "'docmanager:open', {path: 'left_behind_saved.ipynb'}); }"
            )
            page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .nl-snapshot").first.wait_for()
            saved_views, saved_text = page.evaluate(VIEWS_BY_CELL), page.evaluate(CELL_OUTPUTS)
            saved_cell0 = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").nth(0)
            _shot(page, "left_behind_saved_copy.png", saved_cell0)
            said = f"detached run {run_id} · this view stopped following at "
            for name, views in (("restart", restarted), ("interrupt", interrupted)):
                assert len(views) == 1, (name, views)
                text = views[0]["text"]
                assert said in text and f"attach('{run_id}')" in text, (name, text)
                assert "running" not in text.replace("● running", ""), (name, text)
                assert views[0]["icons"] == 0, (name, views)  # no broken-link icons
            # saved: the live view's output is its fixed text (nothing of it says running),
            # the attach cell's its static copy, saying what it is
            assert "running" not in saved_text[0], saved_text[0]
            assert said in saved_views[1][0]["text"], saved_views
            assert not errors, errors
    finally:
        release.touch()
        for run_dir in runs.iterdir() if runs.exists() else ():  # a failed test's run
            meta = record.read_meta(str(run_dir))
            if meta.pid is not None and record.supervisor_alive(meta):
                os.kill(meta.pid, 9)
