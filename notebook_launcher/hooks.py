"""Accelerate's ``accelerate.hooks`` is not part of notebook_launcher: importing this module
raises :class:`~notebook_launcher._accelerate_only.AccelerateOnlyError`, which says to use
Accelerate itself for model hooks and offloading (it runs unchanged inside our ranks)."""

from ._accelerate_only import error_for

raise error_for("hooks")
