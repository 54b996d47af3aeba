"""Rank side: code that runs in the processes the launcher starts (ranks, forkserver).

* :mod:`.entry` -- every rank's entry: environment, process group, run, report;
* :mod:`.runtime` -- the one place rank code sends events from (a no-op elsewhere);
* :mod:`.progress` -- tqdm bars become progress events;
* :mod:`.barriers` -- barrier telemetry for ``wait_for_everyone`` and friends;
* :mod:`.forkserver` -- the forkserver process (imports torch once, forks ranks);
* :mod:`.script` -- what ``python -m notebook_launcher run`` runs in a rank (a script, a
  module, a ``module:function``);
* ``python -m notebook_launcher._worker`` -- a spawned rank (``__main__``).

Imports the bottom layer only (``_events``, ``_spec``, ``_posix``, ``_wire``,
``_serialization``, ``errors``); never ``_launch``, ``launcher`` or ``ui``. The worker-side
API (``state``, ``accelerator``, ...) imports ``runtime`` and ``barriers`` from here.
"""
