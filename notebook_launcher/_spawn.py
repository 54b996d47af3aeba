"""Entry of a spawned worker: ``python -m notebook_launcher._spawn ...``.

A module of its own, which the package never imports, so that running it as
``__main__`` does not re-run a module already in ``sys.modules`` (runpy warns then).
"""

from notebook_launcher._worker import main

if __name__ == "__main__":
    main()
