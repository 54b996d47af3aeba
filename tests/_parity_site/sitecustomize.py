"""On ``PYTHONPATH`` only in the child pytest of ``test_parity_accelerate_unit.py`` (mode
"ours"): every interpreter that run starts answers ``import accelerate`` with
notebook_launcher, as the child pytest itself does (``tests/_parity_unit_plugin.py``).

Their ``debug_launcher`` calls start ranks with our launcher. A forked rank inherits the
shim; a forkserver or spawned rank is a fresh interpreter, and without this imports the real
Accelerate installed next to us. The launcher picks the forkserver once the calling process's
torch thread pool runs, which any of their earlier tests may start (``nested_tensor`` in
``test_pad_across_processes`` does): ``test_gradient_sync_cpu_noop`` then measured the real
Accelerate in the rank (which calls a one-process gloo group distributed) instead of ours.
"""

import os

if os.environ.get("NOTEBOOK_LAUNCHER_PARITY") == "ours":
    from pathlib import Path

    from tests import _parity_shim

    _parity_shim.install(
        Path(os.environ["NOTEBOOK_LAUNCHER_PARITY_SOURCES"]), stand_in_accelerate_only=True
    )
