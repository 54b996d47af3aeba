"""On ``PYTHONPATH`` only for the CUDA emulation tier (``cuda_emulation.environment()``): in
every interpreter of that process tree (the pretend kernel, its forkserver, supervisors,
agents, spawned ranks, probes), torch is made to behave as a CUDA build once it is imported
(``cuda_emulation.install``). Nothing is imported before torch is."""

import os
import sys

if os.environ.get("NL_EMULATE_CUDA") == "1":
    import importlib.abc
    import importlib.util

    class _AfterTorch(importlib.abc.MetaPathFinder):
        """Wraps torch's loader: torch runs as usual, then the emulation is installed."""

        def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                import cuda_emulation

                cuda_emulation.install(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _AfterTorch())
