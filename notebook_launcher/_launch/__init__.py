"""Kernel side: code that runs in the notebook's own process.

* :mod:`.preflight` -- small named checks before anything starts;
* :mod:`.group` -- the worker group: start ranks, pump their channels, stop in stages;
* :mod:`.forkserver` -- the client of the CUDA-safe forkserver;
* :mod:`.record` -- what one run's ranks reported, folded into per-rank records;
* :mod:`.diagnosis` -- pure functions from those records to the root cause and the
  exception the user catches.

Imports the bottom layer only (and, for ``fork``, the rank entry the child runs); never
``ui``: :mod:`notebook_launcher.launcher` is where the process side meets the views.
"""
