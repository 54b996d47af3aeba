"""The dashboard in a real browser: JupyterLab on 127.0.0.1, headless Chromium via Playwright.

Runs ``tests/notebooks_for_tests/dashboard.ipynb`` (2 ranks, an epoch bar and a step bar
each, a barrier per epoch; then a launch whose rank 1 raises) with "Run All", samples the
rendered bars while the first launch runs, waits until the bars show completion, and
saves screenshots to ``artifacts/browser/`` (override with ``NOTEBOOK_LAUNCHER_ARTIFACTS``).

Needs ``apt-get install -y chromium`` and ``pip install jupyterlab playwright`` (never
``playwright install``: Debian's Chromium is driven by Playwright's bundled driver).
Missing pieces FAIL the test; set ``NOTEBOOK_LAUNCHER_SKIP_BROWSER=1`` to skip it on purpose.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import notebook_launcher

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOTEBOOK = HERE / "notebooks_for_tests" / "dashboard.ipynb"
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
    missing = []
    if not os.path.exists(CHROMIUM):
        missing.append(f"{CHROMIUM} (apt-get install -y chromium)")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _requirements()
    base = tmp_path_factory.mktemp("lab")
    root, settings, workspaces, runtime = (
        base / d for d in ("root", "settings", "workspaces", "runtime")
    )
    for d in (root, workspaces, runtime):
        d.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)  # JupyterLab autosaves: never the committed file
    notif = settings / "@jupyterlab" / "apputils-extension"
    notif.mkdir(parents=True)
    (notif / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
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
            yield {"url": url, "token": token, "log": log_path}
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
    return {kernel: w.sessionContext.session?.kernel?.name,
            status: w.sessionContext.session?.kernel?.status};
}"""

DASHBOARDS = """() => Array.from(document.querySelectorAll('.nl-dashboard')).map(d =>
    Array.from(d.querySelectorAll('.nl-rank')).map(row => ({
        info: row.querySelector('.nl-info')?.textContent ?? '',
        bars: Array.from(row.querySelectorAll('.widget-hprogress')).map(e => {
            const bar = e.querySelector('.progress-bar'), lab = e.querySelector('.widget-label');
            return {label: lab ? lab.textContent.trim() : '', width: bar ? bar.style.width : '',
                    success: !!bar && bar.classList.contains('progress-bar-success'),
                    danger: !!bar && bar.classList.contains('progress-bar-danger')};
        }),
    })))"""


@pytest.mark.timeout(90)
def test_dashboard_renders_live_in_jupyterlab(lab: dict[str, Any]) -> None:
    api = _requirements()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(60_000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{lab['url']}/lab/tree/{NOTEBOOK.name}?token={lab['token']}&reset")
            page.wait_for_function("window.jupyterapp !== undefined")
            info = page.evaluate(WAIT_NOTEBOOK_READY)
            assert info == {"kernel": "python3", "status": "idle"}, info
            # do not await: the command's promise resolves only when every cell ran
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            done = page.locator(".jp-OutputArea-output", has_text="ALL DONE")
            samples: list[Any] = []
            t0 = time.monotonic()
            mid_shot = waiting_shot = False
            while done.count() == 0 and time.monotonic() - t0 < 60:
                sample = (page.evaluate(DASHBOARDS) or [[]])[0]  # the first launch's rows
                samples.append(sample)
                widths = [b["width"] for row in sample for b in row["bars"]]
                if not mid_shot and any(w not in ("0%", "100%", "") for w in widths):
                    page.locator(".nl-dashboard").screenshot(
                        path=str(ARTIFACTS / "dashboard_live.png")
                    )
                    mid_shot = True
                if not waiting_shot and any("waiting at" in row["info"] for row in sample):
                    page.locator(".nl-dashboard").screenshot(
                        path=str(ARTIFACTS / "dashboard_waiting.png")
                    )
                    waiting_shot = True
                time.sleep(0.05)
            assert done.count() == 1, f"the notebook did not finish; server log: {lab['log']}"

            ok_view, failed_view = page.locator(".nl-dashboard").all()
            ok_view.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "lab_page.png"))
            ok_view.screenshot(path=str(ARTIFACTS / "dashboard.png"))
            failed_view.scroll_into_view_if_needed()
            failed_view.screenshot(path=str(ARTIFACTS / "dashboard_failed.png"))

            ok_rows, failed_rows = page.evaluate(DASHBOARDS)
            assert len(ok_rows) == 2
            for rank, row in enumerate(ok_rows):
                assert row["info"].startswith(f"rank {rank} · pid ") and "● done" in row["info"]
                assert [(b["label"], b["width"], b["success"]) for b in row["bars"]] == [
                    ("epoch", "100%", True),
                    ("↳ step", "100%", True),
                ]
            summary = ok_view.locator(".nl-summary").inner_text()
            assert summary.startswith("✔ 2 ranks, ") and summary.endswith(": ok"), summary
            barriers = ok_view.locator(".nl-barriers").inner_text()
            assert barriers.count("wait_for_everyone") == 2 and barriers.count("passed") == 2

            # the failed launch: red where it broke, the failing rank's pane open
            assert [
                [(b["label"], b["width"], b["success"], b["danger"]) for b in row["bars"]]
                for row in failed_rows
            ] == [
                [("work", "100%", True, False)],
                [("work", "50%", False, True)],
            ]
            summary = failed_view.locator(".nl-summary").inner_text()
            assert summary.startswith("✘ 2 ranks, ") and summary.endswith(
                "failed: rank 1 raised ValueError: rank 1 broke"
            ), summary
            assert (
                "rank 1 raised ValueError while rank(s) 0 waited"
                in failed_view.locator(".nl-alerts").inner_text()
            )
            pane = failed_view.locator(".nl-pane-1")
            assert pane.is_visible() and "ValueError: rank 1 broke" in pane.inner_text()
            assert not failed_view.locator(".nl-pane-0").is_visible()

            assert (
                page.locator(".jp-OutputArea-output", has_text="Error displaying widget").count()
                == 0
            )
            # nothing but the dashboards: no tqdm text, no rank lines, no error output
            assert page.locator("[data-mime-type='application/vnd.jupyter.stderr']").count() == 0
            assert not errors, errors

            # the bars moved while the cell ran: intermediate widths were rendered
            widths = {
                b["width"]
                for sample in samples
                for row in sample
                for b in row["bars"]
                if b["label"] == "↳ step"
            }
            partial = widths - {"0%", "100%", ""}
            assert len(partial) >= 2, sorted(widths)
            # rank 1 is slower: rank 0 was seen waiting at the barrier, with its location
            infos = {row["info"] for sample in samples for row in sample}
            assert any("● waiting at In[1]:14 for " in i for i in infos), sorted(infos)
        finally:
            browser.close()
