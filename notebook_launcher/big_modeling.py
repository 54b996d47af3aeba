"""Accelerate's ``accelerate.big_modeling`` is not part of notebook_launcher: importing this
module raises :class:`~notebook_launcher._accelerate_only.AccelerateOnlyError`, which says to
use Accelerate itself for big-model inference (it runs unchanged inside our ranks)."""

from ._accelerate_only import error_for

raise error_for("big_modeling")
