"""Settings shared by the kernel side (preflight, launcher) and the ranks (state, Accelerator).

Defined once, here, in a module that imports no torch: the kernel checks a launch's arguments
before torch is loaded, and the ranks check the same values with the same words.

Example::

    from notebook_launcher.utils.constants import parse_mixed_precision
    parse_mixed_precision("BF16", source="mixed_precision=")   # "bf16"
"""

from __future__ import annotations

import enum


class PrecisionType(str, enum.Enum):
    """The mixed-precision modes this package runs: ``"no"``, ``"fp16"``, ``"bf16"``.

    Example::

        PrecisionType.list()   # ["no", "fp16", "bf16"]
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


#: Every accepted ``mixed_precision`` value, in the order error messages list them.
MIXED_PRECISION_MODES: tuple[str, ...] = tuple(PrecisionType.list())

#: Values Accelerate knows that this package refuses, with the reason given to the user.
UNSUPPORTED_MIXED_PRECISION: dict[str, str] = {
    "fp8": (
        "mixed_precision='fp8' is not supported by notebook_launcher: fp8 training needs "
        "Transformer Engine, MS-AMP or torchao wired into the Accelerator, which this package "
        "does not do. Use mixed_precision='bf16' (or 'fp16' on a GPU)."
    ),
}

#: Warned once per process when fp16 is asked for on a CPU (Accelerate accepts it silently).
FP16_ON_CPU_WARNING = (
    "mixed_precision='fp16' on CPU: there is no fp16 autocast on CPU, so this trains in fp32, "
    "as Accelerate does. Use mixed_precision='bf16' for mixed precision on CPU."
)


def parse_mixed_precision(value: object, source: str) -> str:
    """Normalise a ``mixed_precision`` setting (``None``: not set, ``"no"``).

    Raises ``ValueError`` naming ``source`` (where the value came from) for an unknown or
    unsupported value -- ``""`` included, as Accelerate's ``Accelerator`` refuses it
    (``Unknown mixed_precision mode``); whether the machine can run it is the caller's
    question.
    """
    mode = "no" if value is None else str(value).strip().lower()
    if mode in UNSUPPORTED_MIXED_PRECISION:
        raise ValueError(f"{UNSUPPORTED_MIXED_PRECISION[mode]} (from {source})")
    if mode not in MIXED_PRECISION_MODES:
        raise ValueError(
            f"Unknown mixed_precision {value!r} ({source}); choose one of "
            f"{', '.join(repr(m) for m in MIXED_PRECISION_MODES)}."
        )
    return mode


__all__ = [
    "FP16_ON_CPU_WARNING",
    "MIXED_PRECISION_MODES",
    "PrecisionType",
    "UNSUPPORTED_MIXED_PRECISION",
    "parse_mixed_precision",
]
