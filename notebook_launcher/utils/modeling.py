"""``accelerate.utils.modeling``'s training-side name: :func:`load_checkpoint_in_model`.

The rest of Accelerate's module (device maps, offloading, ``get_state_dict_from_offload``...)
is big-model inference, which this package leaves to Accelerate itself: those names raise
:class:`~notebook_launcher._accelerate_only.AccelerateOnlyError`.

Example::

    from notebook_launcher.utils.modeling import load_checkpoint_in_model

    load_checkpoint_in_model(model, "out")   # what accelerator.save_model(model, "out") wrote
"""

from __future__ import annotations

import sys
from typing import Any

from .._accelerate_only import ACCELERATE_ONLY, lookup_error
from ..checkpointing import load_checkpoint_in_model


def __getattr__(name: str) -> Any:
    if name in ACCELERATE_ONLY:
        raise lookup_error(name, sys._getframe(1))
    raise AttributeError(f"module 'notebook_launcher.utils.modeling' has no attribute {name!r}")


__all__ = ["load_checkpoint_in_model"]
