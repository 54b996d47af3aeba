"""A spawned rank: ``python -m notebook_launcher._worker CONN OUT ERR LISTEN|- PARENT_PID``.

Runs as ``__main__`` of a module the package never imports, so runpy does not warn
about re-running a module already in ``sys.modules``.
"""

from notebook_launcher._worker.entry import main

if __name__ == "__main__":
    main()
