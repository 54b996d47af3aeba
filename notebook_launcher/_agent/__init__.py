"""Node side: the agent that runs one node's ranks for a kernel on another machine.

Started once per node by a scheduler (``_launch.scheduler``: a batch job's step, a Ray
actor) or by hand
(``python -m notebook_launcher agent --connect HOST:PORT --secret-file F --job ID``). It
connects to the kernel's hub, proves the job's secret (:mod:`notebook_launcher._wire.agent`),
and then starts and stops this node's ranks when told, with the same machinery a local
launch uses (:class:`~notebook_launcher._launch.group.WorkerGroup`: fork, pipes, pidfds,
process groups), relaying every event, output line, result and failure. It lives until the
kernel says ``Leave`` or goes away (its connection ends: the agent stops its ranks and
exits, and what started it ends with it).
"""
