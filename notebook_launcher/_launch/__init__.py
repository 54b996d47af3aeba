"""Kernel side: code that runs in the notebook's own process.

* :mod:`.preflight` -- small named checks before anything starts;
* :mod:`.group` -- the worker group: start ranks, pump their channels, stop in stages;
* :mod:`.forkserver` -- the client of the CUDA-safe forkserver;
* :mod:`.record` -- what one run's ranks reported, folded into per-rank records;
* :mod:`.diagnosis` -- pure functions from those records to the root cause, the
  exception the user catches, and whether a failed attempt restarts;
* :mod:`.rendezvous` -- nodes meeting as one job on torch's rendezvous, and the job's
  store protocol (bell, reports, decisions, heartbeats);
* :mod:`.nodes` -- this node's side of each attempt of such a job;
* :mod:`.remote` -- one kernel driving other nodes: the agents' hub, and a group whose ranks
  live on those nodes (``RemoteGroup``), planned here (``plan_cluster``);
* :mod:`.scheduler` -- what starts a cluster's agents, behind one small interface; one
  module per scheduler beside it (each the one place that knows its scheduler's names).

Imports the bottom layer only (and, for ``fork``, the rank entry the child runs); never
``ui``: :mod:`notebook_launcher.launcher` is where the process side meets the views.
"""
